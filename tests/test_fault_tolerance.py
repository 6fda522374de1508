"""Training through a lost replica group (parallelism.fault_tolerance=torchft): two groups of one rank, of 2 DDP
ranks or of 2 FSDP ranks (HSDP across the groups), real processes on gloo; one is SIGKILLed at a known step and
started again while the other trains on; the lighthouse (lighthouse=auto) outlives whichever group started it; a
SIGKILLed lighthouse stops one group with its checkpoint committed and leaves the other training alone."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.processes import left_behind, start_process
from helpers.runs import ROOT, wait_for, wait_for_log

from trainflow.checkpoint import EXIT_STOPPED, list_committed
from trainflow.config.schema import ParallelismConfig
from trainflow.distributed import DistEnv
from trainflow.guards.fault_tolerance import data_share

MAX_STEPS = 200
KILL_AFTER = 5  # the killed replica group is killed once it logged this step (or a later one)
IDLE_S = 3  # the lighthouse ends once no group has talked to it this long
# digits: a map-style set (its position comes with the peer's state); a stream: an iterable dataset of one pass longer
# than the run (8192 items, 256 micro-batches a group), whose share a healed group skips to the step it took
DATA = {"digits": ["experiment=digits", "data._target_=test_fault_tolerance.paced_digits"],
        "stream": [f"hydra.searchpath=[file://{ROOT}/tests/conf]", "model=mlp", "data=vector_stream",
                   "data._target_=test_fault_tolerance.paced_stream", "data.size=8192", "task=classify"]}
GROUP = ["trainer.batch_size=16", "trainer.log_every=1", "trainer.excluded_steps=2", "logger=none",
         "trainer.eval_every=0", "checkpoint=dcp", "checkpoint.every_steps=1000", "checkpoint.verify=false",
         "checkpoint.export=true",
         "parallelism.fault_tolerance=torchft", "parallelism.ft.timeout_s=20", "parallelism.ft.heartbeat_timeout_s=2",
         f"parallelism.ft.lighthouse_idle_s={IDLE_S}"]
PACE_S = 0.01  # a read (16 a step): the survivor's pace while the other group is away, so it cannot finish first


class PacedSet(torch.utils.data.Dataset):
    """Every read sleeps PACE_S while the file TEST_FT_PACE exists (the test removes it once the group is back)."""

    def __init__(self, inner: torch.utils.data.Dataset) -> None:
        self.inner = inner
        self.pace_file = os.environ.get("TEST_FT_PACE")

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index):
        if self.pace_file and os.path.exists(self.pace_file):
            time.sleep(PACE_S)
        return self.inner[index]


class PacedStream(torch.utils.data.IterableDataset):
    """Every item read sleeps PACE_S / 2 while the file TEST_FT_PACE exists (each group reads the whole stream and
    keeps half)."""

    def __init__(self, inner: torch.utils.data.IterableDataset) -> None:
        self.inner = inner
        self.pace_file = os.environ.get("TEST_FT_PACE")

    def __iter__(self):
        for item in self.inner:
            if self.pace_file and os.path.exists(self.pace_file):
                time.sleep(PACE_S / 2)
            yield item


def paced_stream(size: int, seed: int = 0, stateful: bool = False) -> dict[str, Any]:
    from streams import vector_stream

    data = vector_stream(size, seed=seed, stateful=stateful)
    return {"train": PacedStream(data["train"]), "val": data["val"]}


def paced_digits(val_fraction: float = 0.2, split_seed: int = 0) -> tuple[PacedSet, Any]:
    from trainflow.data.digits import digits

    train_set, val_set = digits(val_fraction, split_seed)
    return PacedSet(train_set), val_set


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_group_reads_its_own_share_of_the_stream() -> None:
    """Group g of G, rank r of n: place g * n + r of G * n; without fault tolerance the ranks' own places."""
    p = ParallelismConfig(fault_tolerance="torchft")
    p.ft.replica_groups, p.ft.replica_id = 3, 2
    env = DistEnv(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    assert data_share(p, env) == (5, 6)
    assert data_share(ParallelismConfig(), env) == (1, 2)


def start_group(run_dir: Path, replica: int, port: int, ranks: int, strategy: str, data: str,
                pace: Path | None = None, *overrides: str):
    """One replica group: a trainflow run of its own (of `ranks` ranks of `strategy`, which it starts itself, with
    `overrides` last), one thread a rank (two groups share this machine's cores); a process group of its own, to be
    killed whole."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p),
           **({"TEST_FT_PACE": str(pace)} if pace else {})}
    env.pop("HYDRA_FULL_ERROR", None)
    ddp = [f"parallelism={strategy}", f"parallelism.nproc_per_node={ranks}"] if ranks > 1 else []
    return start_process([sys.executable, str(ROOT / "train.py"), *DATA[data], *GROUP, *ddp,
                          f"trainer.max_steps={MAX_STEPS}", f"parallelism.ft.replica_id={replica}",
                          f"parallelism.ft.lighthouse_port={port}", *overrides, f"hydra.run.dir={run_dir}"],
                         ROOT, env, run_dir.parent / f"{run_dir.name}.out", new_session=True)


def console_steps(run_dir: Path) -> list[int]:
    """The steps train.log reports done (it may start past 1: a group that joined late took a peer's state)."""
    log = run_dir / "train.log"
    return [int(m) for m in re.findall(rf"step (\d+)/{MAX_STEPS}:", log.read_text())] if log.exists() else []


def logged_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "train/loss" in json.loads(line)]


def lighthouse_lines(*run_dirs: Path) -> str:
    """What the lighthouse wrote (to lighthouse.log in the run directory of the group that started it)."""
    return "".join((d / "lighthouse.log").read_text() for d in run_dirs if (d / "lighthouse.log").exists())


@pytest.mark.parametrize(("ranks", "strategy", "killed_id", "data", "killed_first"),
                         [(1, "single", 0, "stream", True), (2, "ddp", 1, "digits", False),
                          pytest.param(2, "fsdp", 0, "digits", False, marks=pytest.mark.slow)],  # as ddp, sharded
                         ids=["groups-of-1-stream-kill-0", "groups-of-2-ddp-kill-1", "groups-of-2-fsdp-kill-0"])
def test_a_killed_group_rejoins_from_its_peer_while_the_other_trains_on(tmp_path: Path, ranks: int, strategy: str,
                                                                        killed_id: int, data: str,
                                                                        killed_first: bool) -> None:
    """One group (every rank of it) is SIGKILLed after its step 5 and started again (a fresh run directory: nothing
    on disk to resume from); the other never stops: it trains alone, with half the global batch, until the killed
    group is back; that group takes the survivor's live state and both end at the same step with the same weights.
    Every step is accounted. With `killed_first` the group to be killed starts first, alone: it starts the lighthouse
    and trains until the other joins (taking its state); its loss shows the lighthouse outlives the group that
    started it. The lighthouse ends on its own once both groups are done. An iterable stream's share continues where
    it would be had the group trained the steps it took."""
    port, pace = free_port(), tmp_path / "pace"
    pace.touch()
    survivor_dir, killed_dir, rejoined_dir = tmp_path / "survivor", tmp_path / "killed", tmp_path / "rejoined"
    survivor = None if killed_first else start_group(survivor_dir, 1 - killed_id, port, ranks, strategy, data, pace)
    killed = start_group(killed_dir, killed_id, port, ranks, strategy, data, pace)
    rejoined = None
    try:
        if killed_first:
            wait_for(lambda: "listening on port" in lighthouse_lines(killed_dir), killed, "its lighthouse listened",
                     timeout=120)
            survivor = start_group(survivor_dir, 1 - killed_id, port, ranks, strategy, data, pace)
            wait_for(lambda: console_steps(survivor_dir), survivor, "the survivor logged a step", timeout=120)
        assert survivor is not None
        kill_after = max([KILL_AFTER, *console_steps(survivor_dir)])  # a step both groups took
        wait_for(lambda: max(console_steps(killed_dir), default=0) >= kill_after, killed,
                 f"group {killed_id} logged step {kill_after}", timeout=120)
        alone = "1 of 2 replica groups train from step"
        alone_before = (survivor_dir / "train.log").read_text().count(alone)  # the survivor may have started alone
        os.killpg(killed.pid, signal.SIGKILL)
        killed_at = time.time()
        assert killed.wait() == -signal.SIGKILL
        last_killed = max(console_steps(killed_dir))
        # the killed group comes back once the survivor trains alone: started from the warm interpreter, it came
        # back within the lighthouse's heartbeat timeout once, the survivor's quorum never shrank, and nothing was
        # left to assert about training alone
        wait_for(lambda: (survivor_dir / "train.log").read_text().count(alone) > alone_before, survivor,
                 "the survivor trained alone", timeout=120)
        rejoined = start_group(rejoined_dir, killed_id, port, ranks, strategy, data)
        wait_for_log(rejoined_dir, "took the live state", rejoined, timeout=120)
        assert survivor.poll() is None  # it trained on all along
        pace.unlink()
        assert rejoined.wait(timeout=120) == 0 and survivor.wait(timeout=120) == 0
        # the lighthouse ends on its own once no group talks to it
        deadline = time.monotonic() + IDLE_S + 30
        while "stopped" not in lighthouse_lines(survivor_dir, killed_dir):
            assert time.monotonic() < deadline, "the lighthouse did not stop on its own"
            time.sleep(0.05)
    finally:
        for proc in (survivor, killed, rejoined):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for pid in re.findall(r"\(pid (\d+)\)", lighthouse_lines(survivor_dir, killed_dir, rejoined_dir)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    # one lighthouse served both groups, started by one of them (by the killed one, when it came first); no other
    assert lighthouse_lines(survivor_dir, killed_dir, rejoined_dir).count("listening on port") == 1
    assert not killed_first or "listening on port" in lighthouse_lines(killed_dir)
    ours = json.loads((survivor_dir / "summary.json").read_text())
    theirs = json.loads((rejoined_dir / "summary.json").read_text())
    ft, back = ours["fault_tolerance"], theirs["fault_tolerance"]
    assert ft["replica_id"] == 1 - killed_id and back["replica_id"] == killed_id
    # the survivor took every step once from the step it joined at, none lost to a restart: step 0, or, when the other
    # group reached the first quorum before it (killed_first, or a slower start), the step it healed to from step 0
    joined = ft["healed"]["to_step"] if ft["healed"] else 0
    assert ft["healed"] is None or ft["healed"]["from_step"] == 0, ft["healed"]
    assert ours["steps"] == MAX_STEPS and ours["steps_this_run"] == MAX_STEPS - joined
    assert logged_steps(survivor_dir) == list(range(joined + 1, MAX_STEPS + 1))
    # its quorum shrank to itself after the kill and grew again when the killed group came back
    changes = [c for c in ft["quorum_changes"] if c["time"] > killed_at]
    assert [c["groups"] for c in changes] == [1, 2], ft
    alone_from, back_at = changes[0]["step"], changes[1]["step"]
    assert last_killed <= alone_from <= last_killed + 2 and back_at > alone_from, (last_killed, ft)
    # the steps trained alone: half the global batch each, counted and said
    shrunk = back_at - alone_from
    assert ft["shrunk_steps"] >= shrunk and ft["missed_samples"] == ft["shrunk_steps"] * 16 * ranks, ft
    assert set(ft["uncommitted_steps"]) <= {alone_from}, ft  # at most the step the other group died in
    assert "1 of 2 replica groups train from step" in (survivor_dir / "train.log").read_text()
    # the killed group fetched the live state of the step the survivor had reached, and took the rest of the steps
    assert back["healed"]["from_step"] == 0 and back["healed"]["to_step"] == back_at, back
    assert theirs["steps"] == MAX_STEPS and theirs["steps_this_run"] == MAX_STEPS - back_at
    assert logged_steps(rejoined_dir) == list(range(back_at + 1, MAX_STEPS + 1))
    # the killed group's steps: those before the kill, those after its return; lost: the ones between
    lost = back_at - last_killed
    assert last_killed + theirs["steps_this_run"] + lost == MAX_STEPS
    if data == "stream":  # it read (and dropped) its share's micro-batches of the steps taken: both end at step 200
        assert back["healed"]["skipped_micro_batches"] == back_at, back
        for run_dir in (survivor_dir, rejoined_dir):
            position = json.loads((run_dir / "checkpoints" / f"step_{MAX_STEPS:08d}" / "data_rank00000.json")
                                  .read_text())
            assert position["loader"]["_num_yielded"] == MAX_STEPS, (run_dir.name, position)
    # the same weights, bit for bit
    a = torch.load(survivor_dir / "model.pt", weights_only=True)
    b = torch.load(rejoined_dir / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    figures = {"kill_to_alone_s": round(changes[0]["time"] - killed_at, 2),
               "kill_to_rejoin_s": round(changes[1]["time"] - killed_at, 2), "heal_s": back["healed"]["seconds"],
               "steps_lost_by_killed_group": lost, "steps_trained_alone": shrunk,
               "uncommitted_steps": len(ft["uncommitted_steps"])}
    print(f"fault tolerance, {strategy} groups of {ranks}, group {killed_id} killed:", json.dumps(figures),
          file=sys.stderr)


NO_QUORUM_S = 8  # the lighthouse test's ft.timeout_s: how long a group's quorum waits for the lost lighthouse


def test_a_lost_lighthouse_stops_one_group_with_its_checkpoint_and_leaves_the_other_training_alone(
        tmp_path: Path) -> None:
    """The lighthouse (lighthouse=auto, started by group 0) is SIGKILLed while both groups train together. Their
    next quorum gets no answer: after ft.timeout_s each group says so in one line, without a traceback, at the same
    step. Group 0 (ft.no_quorum=stop, the default) stops with that step committed, exit 75; the same command resumes
    it from there to the end (the lost lighthouse is not found again: the group starts one of its own). Group 1
    (ft.no_quorum=alone) trains on alone to the end, exit 0. Nothing is left running."""
    port, pace = free_port(), tmp_path / "pace"
    pace.touch()  # until the kill: group 0 must not finish alone while group 1 starts
    stop_dir, alone_dir = tmp_path / "stop", tmp_path / "alone"
    fast = (f"parallelism.ft.timeout_s={NO_QUORUM_S}", "parallelism.ft.join_timeout_s=2")
    procs = []
    with left_behind() as leftovers:
        try:
            procs.append(stopper := start_group(stop_dir, 0, port, 1, "single", "digits", pace, *fast))
            wait_for(lambda: "listening on port" in lighthouse_lines(stop_dir), stopper, "its lighthouse listened",
                     timeout=120)
            procs.append(loner := start_group(alone_dir, 1, port, 1, "single", "digits", pace, *fast,
                                              "parallelism.ft.no_quorum=alone"))
            # both train in one quorum once group 1 logged a step (it took group 0's state at its first quorum)
            wait_for(lambda: console_steps(alone_dir), loner, "group 1 logged a step", timeout=120)
            lighthouse = int(re.search(r"\(pid (\d+)\)", lighthouse_lines(stop_dir))[1])
            os.kill(lighthouse, signal.SIGKILL)
            killed_at = time.time()
            assert stopper.wait(timeout=NO_QUORUM_S + 60) == EXIT_STOPPED
            stopped_s = time.time() - killed_at
            first = json.loads((stop_dir / "summary.json").read_text())
            pace.unlink()
            assert loner.wait(timeout=120) == 0
            # the same command again: it resumes from the committed step, with a lighthouse of its own
            procs.append(resumed := start_group(stop_dir, 0, port, 1, "single", "digits", pace, *fast))
            assert resumed.wait(timeout=120) == 0
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        left = leftovers(IDLE_S + 15)  # the resumed group's lighthouse ends once idle
    assert left == {}, left
    stopped_out, alone_out = (d.parent / f"{d.name}.out" for d in (stop_dir, alone_dir))
    stopped = json.loads((stop_dir / "summary.json").read_text())  # the resumed run's
    alone = json.loads((alone_dir / "summary.json").read_text())
    lost = alone["fault_tolerance"]["no_quorum"]
    step = lost["step"]  # the last step both groups took together
    cause = (f"no quorum for step {step + 1} within parallelism.ft.timeout_s ({NO_QUORUM_S} s): the lighthouse at "
             f"http://localhost:{port} does not answer")
    # group 0: one line, then the stop at that step (its checkpoint committed), exit 75; resumed from it to the end
    assert first["checkpoint"]["stopped_by"] == "fault tolerance (no quorum)", first["checkpoint"]
    assert first["steps"] == step and first["fault_tolerance"]["no_quorum"]["then"] == "stop", first
    stop_lines = [line for line in stopped_out.read_text().splitlines() if "no quorum for" in line]
    assert len(stop_lines) == 1 and cause in stop_lines[0], stop_lines
    assert f"replica group 0 stops at step {step} with its checkpoint committed" in stop_lines[0]
    assert "run the same command to resume, with a new lighthouse" in stop_lines[0]
    assert "Traceback" not in stopped_out.read_text()
    assert stopped["resumed_from_step"] == step and stopped["steps"] == MAX_STEPS
    assert stopped["steps_this_run"] == MAX_STEPS - step
    assert step in [c.step for c in list_committed(stop_dir / "checkpoints")]
    assert stopped["fault_tolerance"]["no_quorum"] is None  # the resumed run had its quorums
    # group 1: one line at the same step, then alone to the end, every step logged once
    alone_lines = [line for line in alone_out.read_text().splitlines() if "no quorum for" in line]
    assert len(alone_lines) == 1 and cause in alone_lines[0], alone_lines
    assert f"replica group 1 trains on alone from step {step + 1} (parallelism.ft.no_quorum=alone)" in alone_lines[0]
    assert "a global batch of 16, not 32" in alone_lines[0] and "no longer synchronised" in alone_lines[0]
    assert "Traceback" not in alone_out.read_text()
    assert lost["lighthouse_answers"] is False and lost["then"] == "alone", lost
    assert alone["steps"] == MAX_STEPS and alone["fault_tolerance"]["alone_steps"] == MAX_STEPS - step
    joined = logged_steps(alone_dir)[0] - 1  # the step group 1 healed to at its first quorum
    assert logged_steps(alone_dir) == list(range(joined + 1, MAX_STEPS + 1)) and joined < step
    # each group decided once the quorum's timeout passed, not before; group 0 ended soon after
    assert NO_QUORUM_S - 1 < lost["time"] - killed_at < NO_QUORUM_S + 30, lost["time"] - killed_at
    assert stopped_s < NO_QUORUM_S + 30, stopped_s
    # one lighthouse each: the one killed, the one the resumed group started
    assert lighthouse_lines(stop_dir, alone_dir).count("listening on port") == 2
    print("lost lighthouse:", json.dumps({"kill_to_decision_s": round(lost["time"] - killed_at, 2),
                                          "kill_to_group0_exit_s": round(stopped_s, 2), "step": step}),
          file=sys.stderr)


def test_trainflow_lighthouse_serves_groups_and_ends_once_idle(tmp_path: Path) -> None:
    """`trainflow lighthouse` (a lighthouse on a host of the user's choosing) answers on its port, counts a group
    that heartbeats, and with --idle-s ends by itself, exit 0, once no group has talked to it that long."""
    from datetime import timedelta

    from torchft.coordination import LighthouseClient

    from trainflow.guards.fault_tolerance import lighthouse_ages

    port, out = free_port(), tmp_path / "lighthouse.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "trainflow"), "lighthouse", f"--port={port}",
                                 "--idle-s=1"], stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "listening on port" in out.read_text(), proc, "the lighthouse listened", timeout=60)
        assert lighthouse_ages(f"http://localhost:{port}") == []  # no group yet
        LighthouseClient(f"http://localhost:{port}", timedelta(seconds=5)).heartbeat("trainflow_0")
        ages = lighthouse_ages(f"http://localhost:{port}")
        assert ages is not None and len(ages) == 1 and ages[0] < 1, ages
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    quiet = re.search(r"no replica group talked to it for ([0-9.]+) s \(--idle-s 1\): stopped", out.read_text())
    assert quiet and 1 <= float(quiet[1]) < 5, out.read_text()
    assert lighthouse_ages(f"http://localhost:{port}") is None
