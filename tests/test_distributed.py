"""The scale stage: DDP and FSDP2 on real gloo process groups, started by train.py itself or by torchrun."""

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.checkpoints import model_tensors
from helpers.processes import run_process
from helpers.runs import ROOT, TINY_GPT, Run, losses_by_step, start, train, wait_for, wait_for_log

from trainflow.conf import CONFIG_DIR
from trainflow.config.schema import RunConfig
from trainflow.models.gpt import GPT

# Random tokens: nothing to learn, but every parity comparison is as strict as on text, and no corpus to read.
SMALL = [*TINY_GPT, "data=synthetic", "data.num_samples=4096", "trainer.eval_steps=2", "trainer.max_steps=4"]
# The baseline MLP (experiment=seed_mlp): a model without `blocks`.
MLP_SMALL = ["experiment=seed_mlp", "logger=none", "trainer.max_steps=4", "trainer.excluded_steps=0",
             "trainer.log_every=1", "data.num_samples=4096"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TOLERANCE = 1e-4


class FailingGPT(GPT):
    """A GPT whose forward raises on rank TEST_FAIL_RANK at call TEST_FAIL_AT_CALL (first attempt only).

    Call 1 is the task's probe of two samples, call 2 the memory estimate on the meta device (whose failure only
    skips the estimate), call 3 the first training step."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if (os.environ.get("RANK") == os.environ.get("TEST_FAIL_RANK")
                and self.calls == int(os.environ.get("TEST_FAIL_AT_CALL", "3"))
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            raise RuntimeError(f"injected failure on rank {os.environ['RANK']}")
        return super().forward(idx)


class RankSkewedGPT(GPT):
    """A GPT whose rank 1 starts from weights 1% larger than rank 0's: the ranks no longer train one model."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if os.environ.get("RANK") == "1":
            with torch.no_grad():
                for param in self.parameters():
                    param.mul_(1.01)


def _env(**extra: str) -> dict[str, str]:
    """Let workers import this module (FailingGPT) by name."""
    path = os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, **extra}


def _run_in(cwd: Path, command: list[str], env: dict | None = None, timeout: float = 300
            ) -> subprocess.CompletedProcess:
    """Run without hydra.run.dir, so the run directory is the one trainflow agrees on under ./outputs."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    return run_process(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def _the_one_run_dir(cwd: Path) -> Run:
    dirs = [p.parent for p in (cwd / "outputs").glob("*/*/.hydra")]
    made = sorted(str(p.relative_to(cwd)) for p in (cwd / "outputs").glob("*/*"))
    assert len(dirs) == 1 and len(made) == 1, made
    assert len(list(cwd.rglob("summary.json"))) == 1
    return Run(0, "", "", dirs[0])


def _check(run: Run, world_size: int) -> dict:
    """The run's own parity check against one process passed, with numbers, having compared every tensor of the
    model: the parameters within TOLERANCE of what training moved them (and so of the weights too)."""
    summary = run.summary
    par = summary["parallelism"]
    check = par["check"]
    assert check["passed"] is True, check
    assert check["loss_rel_diff"] <= TOLERANCE and check["update_rel_diff"] <= TOLERANCE, check
    assert check["param_rel_diff"] <= check["update_rel_diff"], check  # a few steps move the weights by far less
    assert check["tensors"] == check["model_tensors"] == model_tensors(run.run_dir) > 0, check
    assert check["steps"] == 3 and len(check["losses"]) == 3
    assert par["world_size"] == summary["world_size"] == world_size
    assert par["global_batch"] == summary["global_batch"] == par["per_rank_batch"] * world_size * par["grad_accum"]
    assert par["samples_per_sec_per_rank"] == pytest.approx(par["samples_per_sec_total"] / world_size)
    assert par["samples_per_sec_total"] == pytest.approx(summary["steady_state"]["samples_per_sec"])
    return par


def _grad_norms(run: Run) -> list[float]:
    return [m["train/grad_norm"] for m in run.metrics() if "train/grad_norm" in m]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- parity, accumulation, one run directory -------------------------------------------------------------------


def test_self_launched_ddp_with_accumulation_equals_one_process_on_the_whole_batch(tmp_path: Path) -> None:
    """`python train.py parallelism=ddp` starts 2 workers itself; 2 ranks x 4 x 2 micro-steps == 1 process x 16.

    Plain SGD (no momentum, no clipping) and the gradient norm compared: AdamW normalises the update and
    clipping caps it, so either would hide micro-step gradients summed instead of averaged (twice the norm).
    """
    plain_sgd = ["optim=sgd", "optim.momentum=0", "trainer.grad_clip=0"]
    launched = _run_in(tmp_path, [sys.executable, str(ROOT / "train.py"), *SMALL, *plain_sgd, "parallelism=ddp",
                                  "parallelism.nproc_per_node=2", "parallelism.check=true", "trainer.batch_size=4",
                                  "trainer.grad_accum=2"])
    assert launched.returncode == 0, launched.stderr
    ddp = _the_one_run_dir(tmp_path)
    par = _check(ddp, 2)
    assert (par["strategy"], par["per_rank_batch"], par["grad_accum"], par["global_batch"]) == ("ddp", 4, 2, 16)
    log = (ddp.run_dir / "train.log").read_text()
    assert log.count("step 1/4") == 1 and "starting 2 ddp workers" in log  # rank 0 speaks, once

    single = train(tmp_path / "single", *SMALL, *plain_sgd, "trainer.batch_size=16")
    assert single.returncode == 0, single.stderr
    ddp_norms, single_norms = (_grad_norms(r) for r in (ddp, single))
    assert len(ddp_norms) == len(single_norms) == 4
    for a, b in zip(ddp_norms, single_norms, strict=True):  # step 1 already: the same weights, the same batch
        assert abs(a - b) <= TOLERANCE * abs(b), (ddp_norms, single_norms)
    assert len(ddp.losses()) == len(single.losses()) == 4
    for a, b in zip(ddp.losses(), single.losses(), strict=True):
        assert abs(a - b) <= TOLERANCE * abs(b)


@pytest.mark.parametrize(("preset", "strategy"), [("single", "single"), ("ddp", "ddp"), ("fsdp", "fsdp"),
                                                  ("hsdp", "hsdp"), ("auto", "ddp")])
def test_every_preset_trains_on_a_read_only_config(run_dir: Path, preset: str, strategy: str) -> None:
    """The loop gets its config read-only (check_config, then run.assemble): a write into it anywhere fails the run.
    The run's decisions are in the config it reports: the per-rank batch, parallelism=auto's choice."""
    ranks = [] if preset == "single" else ["parallelism.nproc_per_node=2"]
    run = train(run_dir, *MLP_SMALL, f"parallelism={preset}", *ranks, "parallelism.global_batch=32")
    assert run.returncode == 0, run.stderr
    assert run.summary["steps"] == 4 and run.summary["parallelism"]["strategy"] == strategy
    config = run.summary["config"]
    assert config["parallelism"]["strategy"] == strategy
    assert config["trainer"]["batch_size"] == run.summary["parallelism"]["per_rank_batch"] == 32 // (1 + bool(ranks))


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [("ddp", ["parallelism.global_batch=24"]),  # 24 / 3 ranks: trainer.batch_size becomes 8
     ("fsdp", ["trainer.batch_size=4", "trainer.grad_accum=2", "parallelism.activation_checkpointing=full"])],
    ids=["ddp", "fsdp-accum-checkpointing"],
)
def test_three_ranks_match_one_process(run_dir: Path, strategy: str, extra: list[str]) -> None:
    run = train(run_dir, *SMALL, f"parallelism={strategy}", "parallelism.nproc_per_node=3", "parallelism.check=true",
                *extra)
    assert run.returncode == 0, run.stderr
    par = _check(run, 3)
    assert par["strategy"] == strategy and par["global_batch"] == 24
    assert run.summary["config"]["trainer"]["batch_size"] == par["per_rank_batch"] == 24 // 3 // par["grad_accum"]


def test_torchrun_fsdp_shares_one_run_directory(tmp_path: Path) -> None:
    proc = _run_in(tmp_path, [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"), *SMALL,
                              "parallelism=fsdp", "parallelism.check=true"])
    assert proc.returncode == 0, proc.stderr
    run = _the_one_run_dir(tmp_path)
    par = _check(run, 2)
    assert par["strategy"] == "fsdp" and par["nodes"] == 1
    assert (run.run_dir / ".hydra" / "config.yaml").exists() and (run.run_dir / "config.yaml").exists()
    log = (run.run_dir / "train.log").read_text()
    assert log.count("step 1/4") == 1 and "fsdp: 2 shard units + root over 2 ranks" in log
    assert proc.stdout.count("step 1/4") == 1  # the other rank stays quiet on the console too


def test_two_nodes_rendezvous_on_loopback(tmp_path: Path) -> None:
    """Two torchrun agents (one per simulated node) meet through a c10d rendezvous and train as one job."""
    port = _free_port()
    node = [*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=two-nodes-{port}", str(ROOT / "train.py"), *SMALL,
            "parallelism=ddp", "parallelism.check=true"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen(node, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    run = _the_one_run_dir(tmp_path)
    par = _check(run, 2)
    assert par["nodes"] == 2


def test_parity_check_fails_on_a_skewed_rank(run_dir: Path) -> None:
    """FSDP2 keeps each rank's own shard of its initial weights: rank 1's skew reaches the sharded model, and the
    parity check against rank 0's one-process reference must fail and say so, with numbers above its tolerance."""
    run = train(run_dir, *SMALL, "parallelism=fsdp", "parallelism.nproc_per_node=2", "parallelism.check=true",
                "model._target_=test_distributed.RankSkewedGPT", env=_env())
    assert run.returncode == 0, run.stderr[-3000:]  # a failed check is reported, the run itself completes
    check = run.summary["parallelism"]["check"]
    assert check["passed"] is False and check["steps"] == 3 and check["tolerance"] == TOLERANCE
    # random tokens keep the logits near uniform: the loss moves less (7e-5 measured) than the parameters (7e-3)
    assert check["param_rel_diff"] > 10 * TOLERANCE and check["loss_rel_diff"] > 0, check
    log = (run_dir / "train.log").read_text()
    tensors = model_tensors(run_dir)
    assert f"parity check FAILED: fsdp on 2 ranks vs one process after 3 steps, {tensors} of the model's {tensors} " \
           "tensors compared: loss rel diff" in log


# --- failures ----------------------------------------------------------------------------------------------------


def test_a_failing_rank_is_named_with_its_traceback(run_dir: Path) -> None:
    run = train(run_dir, *SMALL, "parallelism=ddp", "parallelism.nproc_per_node=2",
                "model._target_=test_distributed.FailingGPT", env=_env(TEST_FAIL_RANK="1"), timeout=120)
    assert run.returncode == 1  # a crash, not a usage error (2)
    lines = run.stderr.strip().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("Error:"))
    assert lines[first] == ("Error: rank 1 failed: RuntimeError: injected failure on rank 1; "
                            "the other ranks were stopped")
    assert lines[first + 1] == "--- traceback of rank 1 ---"
    traceback = "\n".join(lines[first + 1:])
    assert "in forward" in traceback and 'raise RuntimeError(f"injected failure' in traceback
    assert not (run_dir / "summary.json").exists()


def _children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_killed_by_a_signal_is_named_not_the_rank_that_lost_it(run_dir: Path, strategy: str) -> None:
    """SIGKILL of rank 1 (as an OOM kill does): rank 0's collective fails with a connection error, yet the line
    names rank 1 and its signal, the step rank 0 noticed it in, no traceback; committed checkpoints stay whole."""
    cmd = [sys.executable, str(ROOT / "train.py"), *SMALL, "trainer.max_steps=100000", f"parallelism={strategy}",
           "parallelism.nproc_per_node=2", "checkpoint=dcp", "checkpoint.every_steps=2", f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_log(run_dir, "checkpoint step 4 committed", proc, timeout=120)
    workers = sorted(_children(proc.pid))  # the agent forks rank 0, then rank 1
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    killed_at = time.monotonic()
    _, stderr = proc.communicate(timeout=120)
    assert time.monotonic() - killed_at < 60  # a connection reset, not a collective timeout (300 s)
    assert proc.returncode == 1
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0] == lines[-1], stderr[-3000:]
    assert errors[0].startswith(f"Error: rank 1 (pid {workers[1]}) was lost: killed by signal SIGKILL (rank 0 lost "
                                "its connection to it in step "), errors[0]
    assert errors[0].endswith("the same command resumes from the newest")
    assert "Traceback" not in stderr and "rank 0 failed" not in stderr
    noticed = int(errors[0].split("in step ")[1].split(")")[0])
    committed = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*"))
    assert committed and max(committed) < noticed and all(step % 2 == 0 for step in committed)


def _hang(run_dir: Path, stop: Callable[[subprocess.Popen], int], *run: str, env: dict | None = None
          ) -> tuple[subprocess.Popen, str, float]:
    """A 2-rank DDP run whose rank 1 `stop` makes hang after step 3; its stderr and how long it took to end."""
    cmd = [sys.executable, str(ROOT / "train.py"), *(run or SMALL), "trainer.max_steps=100000", "parallelism=ddp",
           "parallelism.nproc_per_node=2", "parallelism.timeout_s=6", "parallelism.watchdog.min_s=2",
           f"hydra.run.dir={run_dir}"]
    full_env = {**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"},
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_log(run_dir, "step 3/100000: loss ", proc, timeout=120)
    rank1 = stop(proc)
    stopped_at = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank1, signal.SIGKILL)
    return proc, stderr, time.monotonic() - stopped_at


def _default_group(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    """The collectives of the default group in the flight record `rank` dumped when its watchdog spoke."""
    record = json.loads((run_dir / "hang" / f"rank_{rank}.collectives.json").read_text())
    return [entry for entry in record["entries"] if entry["process_group"] == ["0", "default_pg"]]


def _one_error(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


@pytest.mark.serial
def test_a_rank_that_stops_answering_is_named_when_the_collective_times_out(run_dir: Path) -> None:
    """SIGSTOP of rank 1: its watchdog beat stops, rank 0's watchdog names it after watchdog.min_s, and rank 0's
    collective ends the run at parallelism.timeout_s in one line with exit 124 (a hang, not a crash)."""
    def sigstop(proc: subprocess.Popen) -> int:
        rank1 = sorted(_children(proc.pid))[1]
        os.kill(rank1, signal.SIGSTOP)
        return rank1

    proc, stderr, took = _hang(run_dir, sigstop)
    # timeout, linger, and slack for 2 busy cores: the stopped rank is killed at once, not after the agent's 30 s
    assert took < 6 + 2 + 20, took
    assert proc.returncode == 124, stderr[-3000:]
    error = _one_error(stderr)
    assert error.startswith("Error: rank 0 waited parallelism.timeout_s in a collective in step "), error
    assert "and another rank never arrived (RuntimeError: Timed out waiting 6000ms" in error
    assert "; hang: no step for " in error and "rank 1 stopped answering (last beat " in error, error
    assert f"every rank's stacks: {run_dir / 'hang'}" in error
    assert "Thread" in (run_dir / "hang" / "rank_0.stacks.txt").read_text()  # faulthandler's dump of every thread
    assert "hang: no step for " in (run_dir / "train.log").read_text()  # said when it happened, too
    # the last collective rank 0 entered, from its flight record; the stopped rank wrote none
    entered = _default_group(run_dir, 0)
    assert [entry["collective_seq_id"] for entry in entered] == list(range(1, len(entered) + 1))  # none lost yet
    assert {entry["state"] for entry in entered} == {"scheduled"}  # torch tracks no completion on gloo
    last = entered[-1]
    assert f"; last collective: rank 0 entered {last['profiling_name'].removeprefix('gloo:')} " \
           f"#{last['collective_seq_id']} of the default group (rank 1 left no record); " in error, error
    assert not (run_dir / "hang" / "rank_1.collectives.json").exists()


class BlockingSet(torch.utils.data.Dataset):
    """A dataset whose rank 1 blocks in __getitem__ once the file TEST_BLOCK_FILE exists (a dead mount, say)."""

    def __init__(self, inner: torch.utils.data.Dataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index):
        if os.environ.get("RANK") == "1" and os.path.exists(os.environ.get("TEST_BLOCK_FILE", "/nonexistent")):
            time.sleep(3600)  # BLOCKED HERE
        return self.inner[index]


def blocking_digits(val_fraction: float = 0.2, split_seed: int = 0) -> tuple[BlockingSet, Any]:
    from trainflow.data.digits import digits

    train_set, val_set = digits(val_fraction, split_seed)
    return BlockingSet(train_set), val_set


@pytest.mark.serial
def test_a_rank_blocked_in_the_users_dataset_is_named_with_its_file_and_line(run_dir: Path, tmp_path: Path) -> None:
    block = tmp_path / "block"

    def block_rank1(proc: subprocess.Popen) -> int:
        block.touch()
        return sorted(_children(proc.pid))[1]

    digits = ["experiment=digits", "data._target_=test_distributed.blocking_digits", "trainer.log_every=1",
              "trainer.eval_every=0", "trainer.batch_size=8", "logger=none"]
    proc, stderr, took = _hang(run_dir, block_rank1, *digits, env=_env(TEST_BLOCK_FILE=str(block)))
    assert proc.returncode == 124 and took < 6 + 2 + 5 + 30, stderr[-3000:]
    line = next(n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "# BLOCKED HERE" in text)
    error = _one_error(stderr)
    assert "rank 1 is stuck in step " in error and f"at {Path(__file__)}:{line} in __getitem__" in error, error
    assert "rank 0 waiting at " in error and "/trainflow/loop/step.py:" in error, error
    # rank 0 entered the step's gradient all_reduce, the blocked rank 1 did not: both flight records say so
    found = re.search(r"; last collective: rank 0 entered all_reduce #(\d+) of the default group, rank 1 did not "
                      r"\(its last: #(\d+)\); every rank's stacks: ", error)
    assert found, error
    ahead, behind = _default_group(run_dir, 0), _default_group(run_dir, 1)
    assert ahead[-1]["collective_seq_id"] == int(found[1]) and behind[-1]["collective_seq_id"] == int(found[2])
    assert int(found[2]) < int(found[1]) and ahead[-1]["profiling_name"] == "gloo:all_reduce"
    assert [entry["profiling_name"] for entry in ahead[:len(behind)]] == [e["profiling_name"] for e in behind]
    assert {entry["state"] for entry in ahead + behind} == {"scheduled"}  # torch tracks no completion on gloo


def test_ranks_that_composed_different_configs_are_refused_before_any_work(tmp_path: Path) -> None:
    """Under torchrun each rank composes its own config: one that depends on the rank (here through an environment
    variable) is refused at start in one line naming the key and each rank's value; no step is taken."""
    proc = _run_in(tmp_path, [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"), *SMALL,
                              "parallelism=ddp", "trainer.seed=${oc.env:RANK}"])
    assert proc.returncode == 1, proc.stderr[-3000:]  # torchrun's own code for a failed worker (each exits 2)
    errors = {line for line in proc.stderr.splitlines() if line.startswith("Error:")}
    assert errors == {"Error: trainer.seed: 0 on rank 0; 1 on rank 1: the ranks composed different configs; every "
                      "rank must compose the same config: look for an environment variable, a config folder or an "
                      "override that differs between nodes or ranks (the run's config.yaml is rank 0's)"}, errors
    assert not list(tmp_path.rglob("metrics.jsonl")) and not list(tmp_path.rglob("summary.json"))


def test_a_self_launched_group_says_who_is_there(run_dir: Path) -> None:
    run = train(run_dir, *SMALL, "trainer.max_steps=1", "parallelism=ddp", "parallelism.nproc_per_node=2")
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(line for line in (run_dir / "train.log").read_text().splitlines() if "] - ranks: " in line)
    assert f"ranks: 2 on 1 host(s) ({socket.gethostname()}), cpu; torch {torch.__version__}, trainflow " in line
    assert "least free memory " in line


def test_torchrun_restart_rejoins_the_group_and_the_run_directory(tmp_path: Path) -> None:
    """Rank 1 dies in the first attempt; torchrun restarts both ranks, the new group forms, the run completes."""
    proc = _run_in(tmp_path, [*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1",
                              str(ROOT / "train.py"), *SMALL, "parallelism=ddp",
                              "model._target_=test_distributed.FailingGPT"], env=_env(TEST_FAIL_RANK="1"))
    assert proc.returncode == 0, proc.stderr
    assert "injected failure on rank 1" in proc.stderr  # the first attempt really failed
    run = _the_one_run_dir(tmp_path)
    assert run.summary["steps"] == 4 and run.summary["world_size"] == 2


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_stop_signal_to_a_self_launched_run_reaches_the_workers(run_dir: Path, sig: signal.Signals) -> None:
    """A stop signal to `python train.py`: its agent passes it on, the ranks save and stop, the exit code says
    resume (SIGUSR1, which the agent did not pass on, ended the launching process alone, its workers orphaned)."""
    cmd = [sys.executable, str(ROOT / "train.py"), *SMALL, "trainer.max_steps=100000", "parallelism=ddp",
           "parallelism.nproc_per_node=2", "checkpoint=dcp", f"hydra.run.dir={run_dir}"]
    grace = 90  # the agent's wait for the workers after passing a signal on (torch's default: 30 s); 2 busy cores
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(grace)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_log(run_dir, "step 1/100000: loss ", proc, timeout=120)
    proc.send_signal(sig)
    sent = time.monotonic()
    _, stderr = proc.communicate(timeout=grace + 60)
    assert proc.returncode == 75, stderr  # saved and stopped: run the same command to resume
    # The workers left as soon as they had saved, on the agent's mark: not by a timer of their own, nor killed at
    # the end of the agent's grace (it takes 1.3 s here; 20 leaves room for a loaded machine).
    assert time.monotonic() - sent < 20
    summary = json.loads((run_dir / "summary.json").read_text())
    step = summary["steps"]
    assert summary["checkpoint"]["stopped_by"] == sig.name and 0 < step < 100000
    assert (run_dir / "checkpoints" / f"step_{step:08d}" / "manifest.json").exists()


def _live_children(pid: int) -> list[int]:
    """The processes whose parent is `pid` and that have not exited (a zombie awaits only its parent's wait)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(stat.parent.name))
    return found


def test_finished_workers_wait_for_an_agent_that_reads_them_late(run_dir: Path) -> None:
    """The agent (`python train.py` itself) is frozen while its two ranks finish: they wait for it however long it
    takes, and the run ends when it wakes. A worker that left by itself while registered as a waiter of the agent's
    multiprocessing event hung the agent forever in the event's `set` (seen under load, agent 8 s late)."""
    proc = start(run_dir, *SMALL, "trainer.max_steps=6", "parallelism=ddp", "parallelism.nproc_per_node=2")
    wait_for_log(run_dir, "step 1/6: loss ", proc, timeout=120)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        workers = _live_children(proc.pid)
        assert len(workers) == 2
        wait_for(lambda: (run_dir / "summary.json").exists(), proc, "rank 0 wrote its summary", timeout=120)
        time.sleep(6)  # longer than a worker ever waited before leaving by itself (5 s, the hang CI met)
        assert sorted(_live_children(proc.pid)) == sorted(workers)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(timeout=120) == 0
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is one rank per GPU here")
def test_headline_command_runs_unchanged_on_a_machine_without_gpus(run_dir: Path) -> None:
    """The design's headline command, `python train.py parallelism=fsdp compile.dynamic=true`, with only
    trainer.max_steps lowered (time): auto starts 2 CPU ranks on gloo and says why once; the compile scope follows
    FSDP to the blocks, so no warning asks the user to set it. Its shapes never change: asked for (the opt-in
    compile.measure_static=true), at the end both ranks compile the blocks static (collective passes, no deadlock) and
    the run says what dynamic=true cost."""
    run = train(run_dir, "parallelism=fsdp", "compile.dynamic=true", "compile.measure_static=true",
                "trainer.max_steps=8", timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = run.summary
    assert summary["world_size"] == 2 and summary["steps"] == 8
    assert summary["parallelism"]["strategy"] == "fsdp"
    report = summary["compile"]
    assert report["scope"] == "blocks" and report["dynamic"] is True
    assert report["graphs"] >= 1 and report["eager_frames"] == []
    log = (run_dir / "train.log").read_text()
    note = "parallelism.nproc_per_node=auto: no GPU is visible, so fsdp runs on 2 CPU processes over gloo"
    assert log.count(note) == 1 and (run.stdout + run.stderr).count(note) == 1
    assert "compile.scope" not in log and "WARNING" not in run.stderr
    cost = report["dynamic_cost"]
    assert report["input_shapes"] == [cost["shape"]] and len(cost["shape"][0]) == 3  # the first block's input
    assert cost["skipped"] is None and cost["dynamic_compile_s"] > 0 and cost["static_compile_s"] > 0
    shape = " x ".join(map(str, cost["shape"][0]))  # batch x tokens x width
    assert log.count(f"compile: dynamic=true compiled for one input shape ({shape}) that never changed: its "
                     f"compile took {cost['dynamic_compile_s']:.1f} s against {cost['static_compile_s']:.1f} s") == 1


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    run = train(tmp_path_factory.mktemp("single") / "run", *SMALL)
    assert run.returncode == 0, run.stderr[-3000:]
    return losses_by_step(run.run_dir)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp", "hsdp"])
def test_one_rank_of_ddp_fsdp_or_hsdp_trains_in_a_group_of_one_as_one_process_does(
        run_dir: Path, strategy: str, one_process: dict[int, float]) -> None:
    """What `parallelism=fsdp` does on a one-GPU machine (auto: one rank per GPU), here with one CPU rank: the
    strategy's code path (a process group of one, FSDP2's mesh of one, DDP's reducer) in this process, said in one
    line, training as one process does; its checkpoint resumes on two ranks."""
    extra = ["compile=default", "compile.backend=aot_eager", "compile.dynamic=true"] if strategy == "fsdp" else []
    run = train(run_dir, *SMALL, f"parallelism={strategy}", "parallelism.nproc_per_node=1", "checkpoint=dcp", *extra)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = run.summary
    assert summary["world_size"] == 1 and summary["parallelism"]["strategy"] == strategy
    assert summary["parallelism"]["backend"] == "gloo"
    line = f"parallelism={strategy} on one process (one was asked for): a process group of one rank"
    assert (run.stdout + run.stderr).count(line) == 1
    losses = losses_by_step(run_dir)
    assert losses.keys() == one_process.keys()
    for step, loss in one_process.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), step
    if strategy == "fsdp":
        assert summary["compile"]["dynamic"] is True and summary["compile"]["scope"] == "blocks"
        more = train(run_dir, *SMALL, "parallelism=fsdp", "parallelism.nproc_per_node=2", "trainer.max_steps=6",
                     "checkpoint=dcp")
        assert more.returncode == 0, more.stderr[-3000:]
        assert more.summary["world_size"] == 2 and more.summary["resumed_from_step"] == 4


@pytest.mark.parametrize(("strategy", "nproc", "gpus", "ranks"), [
    ("ddp", "auto", 0, 2), ("fsdp", "auto", 0, 2), ("hsdp", "auto", 0, 2),  # a group needs 2: CPU ranks
    ("single", "auto", 0, 1), ("auto", "auto", 0, 1),  # one process unless memory asks for more
    ("fsdp", "auto", 8, 8), ("ddp", "auto", 1, 1),  # one per GPU (1 GPU: a group of one rank)
    ("ddp", 3, 0, 3), ("ddp", 3, 8, 3),  # a number is taken as given
])
def test_ranks_per_node_auto(strategy: str, nproc: object, gpus: int, ranks: int) -> None:
    from trainflow.distributed.mesh import local_ranks

    assert local_ranks(strategy, nproc, gpus) == ranks


# --- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["parallelism.nproc_per_node=2"], "parallelism.nproc_per_node: parallelism=single runs one process; got 2: "
         "use parallelism=ddp or parallelism=fsdp for 2 processes"),
        (["parallelism.check=true"], "parallelism.check: compares ddp/fsdp with one process, so parallelism=single "
         "has nothing to compare; set it to false"),
        (["parallelism=fsdp", "parallelism.nproc_per_node=2", "parallelism.fsdp.cpu_offload=true"],
         "parallelism.fsdp.cpu_offload: the run is on CPU already, so there is nothing to offload to; set it to false"),
        (["parallelism=ddp", "parallelism.nproc_per_node=0"],
         "parallelism.nproc_per_node: must be a positive integer or auto; got 0"),
    ],
    ids=["single-two-processes", "check-single", "cpu-offload-on-cpu", "zero-processes"],
)
def test_bad_parallel_values_are_refused_before_any_worker_starts(overrides: list[str], expected: str) -> None:
    """The same checks the launching process runs before it starts workers, on a composed config, in process."""
    from hydra import compose, initialize_config_dir

    from trainflow.config.checks import check_config
    from trainflow.distributed.process_group import _preflight, resolve_nproc
    from trainflow.errors import ConfigError

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*SMALL, *overrides])
    with pytest.raises(ConfigError) as error:
        check_config(cfg)
        cpu = torch.device("cpu")
        nproc = resolve_nproc(cfg.parallelism, cpu)
        _preflight(cfg, cpu, nproc, nproc, "trainflow")
    assert str(error.value) == expected


def test_checkpointing_needs_blocks() -> None:
    from trainflow.distributed.parallelism import checkpoint_blocks
    from trainflow.errors import ConfigError
    from trainflow.models.mlp import MLP

    with pytest.raises(ConfigError, match=r"^parallelism.activation_checkpointing: full recomputes each module of "
                                          r"model.blocks, and MLP has no `blocks` list; set it to off$"):
        checkpoint_blocks(MLP())


def test_more_processes_than_gpus_is_refused() -> None:
    """The GPU count is an argument here: this machine has none to run out of."""
    from trainflow.distributed.process_group import check_nproc
    from trainflow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^parallelism.nproc_per_node: 3 processes need 3 GPUs, but 2 are "
                                          r"visible; set parallelism.nproc_per_node=2 \(or auto\)$"):
        check_nproc(3, "cuda", 2)
    check_nproc(2, "cuda", 2)
    check_nproc(8, "cpu", 0)  # gloo processes on CPU need no GPU


def _cfg(**parallelism) -> RunConfig:
    """A typed run config of a GPT, the schema's defaults and `parallelism`."""
    from trainflow.config.schema import typed_run

    return typed_run({"model": {"_target_": "trainflow.models.gpt.GPT"}, "data": {}, "task": {}, "optim": {},
                      "logger": {}, "parallelism": parallelism})


def test_bf16_on_a_cpu_without_native_bf16_warns_with_the_measured_slowdown() -> None:
    from trainflow.distributed.process_group import bf16_warning

    cfg = _cfg(strategy="fsdp", fsdp={"param_dtype": "bf16"})
    cfg.trainer.precision = "bf16"
    message = bf16_warning(cfg, torch.device("cpu"), flags=frozenset({"avx2"}))
    assert message.startswith("trainer.precision, parallelism.fsdp.param_dtype=bf16: this CPU has no native bf16")
    ratio = float(message.split("measured ")[1].split("x the time")[0])
    assert ratio > 0  # a real measurement (this machine may well have native bf16: then it is fast)
    assert bf16_warning(cfg, torch.device("cpu"), flags=frozenset({"avx2", "avx512_bf16"})) is None
    cfg.trainer.precision, cfg.parallelism.fsdp.param_dtype = "fp32", None
    assert bf16_warning(cfg, torch.device("cpu"), flags=frozenset()) is None


def test_bf16_warning_matches_this_cpu(run_dir: Path) -> None:
    from trainflow.util.device import cpu_flags

    run = train(run_dir, *SMALL, "trainer.precision=bf16", "trainer.max_steps=1", "trainer.excluded_steps=0")
    assert run.returncode == 0, run.stderr
    native = bool((cpu_flags() or frozenset()) & {"avx512_bf16", "amx_bf16"})
    warned = "this CPU has no native bf16" in run.stdout + run.stderr
    assert warned is not native


# --- pieces, in process ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_shards_are_disjoint_and_cover_the_one_process_stream(world_size: int) -> None:
    """Across an epoch boundary too: each epoch is reshuffled (the sampler's set_epoch is its position)."""
    from trainflow.data import StreamSampler

    n, b, micro_steps = 50, 4, 13  # at least 13 x 4 x 2 = 104 samples: more than two epochs of 50
    one = iter(StreamSampler(n, b * world_size, 0, 1, seed=5))
    ranks = [iter(StreamSampler(n, b, r, world_size, seed=5)) for r in range(world_size)]
    seen = []
    for _ in range(micro_steps):
        shards = [next(it).tolist() for it in ranks]
        assert sum(shards, []) == next(one).tolist()  # rank r holds the r-th slice of the global micro-batch
        seen.extend(sum(shards, []))
    for epoch in range(2):
        assert sorted(seen[epoch * n:(epoch + 1) * n]) == list(range(n))  # each epoch: every sample once
    assert seen[:n] != seen[n:2 * n]  # and reshuffled


def test_activation_checkpointing_recomputes_blocks_with_equal_gradients() -> None:
    from trainflow.distributed.parallelism import checkpoint_blocks

    def grads_and_forward_calls(checkpointed: bool) -> tuple[list[torch.Tensor], int]:
        torch.manual_seed(0)
        model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
        if checkpointed:
            checkpoint_blocks(model)
        calls = []
        for block in model.blocks:
            block.mlp[0].register_forward_hook(lambda *_: calls.append(1))  # (recomputation stops after mlp[2])
        idx = torch.randint(64, (4, 16))
        torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        return [p.grad for p in model.parameters()], len(calls)

    plain, plain_calls = grads_and_forward_calls(False)
    ckpt, ckpt_calls = grads_and_forward_calls(True)
    assert (plain_calls, ckpt_calls) == (2, 4)  # each block's forward ran again in backward
    for a, b in zip(plain, ckpt, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    names = list(model.state_dict())
    checkpoint_blocks(model)
    assert list(model.state_dict()) == names  # checkpoints do not notice it


@pytest.mark.parametrize(("mode", "every", "gelu", "attention"), [
    ("off", 1, 2, 2), ("full", 1, 4, 4), ("selective", 1, 4, 2), ("full", 2, 3, 3), ("selective", 2, 3, 2)])
def test_activation_checkpointing_modes_recompute_what_they_say(mode: str, every: int, gelu: int,
                                                                attention: int) -> None:
    """Ops run in one forward and backward of a 2-block GPT: full reruns each checkpointed block's forward in
    backward, selective its cheap ops only (the GELU again, the attention kept), every 2nd block only block 0; the
    gradients stay those of no checkpointing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainflow.config.choices import ActivationCheckpointing
    from trainflow.config.schema import ParallelismConfig
    from trainflow.distributed.parallelism import checkpoint_activations

    counts: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            counts[func.__name__] = counts.get(func.__name__, 0) + 1
            return func(*args, **(kwargs or {}))

    def grads(mode: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
        checkpoint_activations(model, ParallelismConfig(activation_checkpointing=ActivationCheckpointing(mode),
                                                        activation_checkpointing_every=every, activation_budget=1.0))
        idx = torch.randint(64, (4, 16))
        with Count():
            torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        return [p.grad for p in model.parameters()]

    checkpointed = grads(mode)
    sdpa = next(name for name in counts if name.startswith("_scaled_dot_product") and "backward" not in name)
    assert (counts["gelu.default"], counts[sdpa]) == (gelu, attention), counts
    for a, b in zip(grads("off"), checkpointed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_size_wrapping_for_models_without_blocks() -> None:
    from trainflow.distributed.parallelism import shard_units
    from trainflow.models.mlp import MLP

    mlp = MLP()  # Linear(100, 256): 25856 parameters, Linear(256, 10): 2570
    assert shard_units(mlp, "size", 2000) == [mlp.net[0], mlp.net[2]]
    assert shard_units(mlp, "auto", 10_000) == [mlp.net[0]]
    assert shard_units(mlp, "size", 1_000_000) == []  # the root alone
    gpt = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    assert shard_units(gpt, "auto", 1) == list(gpt.blocks)
    # >= 1000 parameters: each block's qkv (3168), proj (1056), mlp.0 (4224), mlp.2 (4128). tok_emb (2048) is
    # tied to head, so it stays with the root.
    expected = [m for b in gpt.blocks for m in (b.attn.qkv, b.attn.proj, b.mlp[0], b.mlp[2])]
    assert shard_units(gpt, "size", 1000) == expected


def test_fsdp_size_wrapped_user_model_matches_one_process(run_dir: Path) -> None:
    run = train(run_dir, *MLP_SMALL, "parallelism=fsdp", "parallelism.nproc_per_node=2",
                "parallelism.fsdp.min_params=2000", "parallelism.fsdp.reshard_after_forward=false",
                "parallelism.check=true")
    assert run.returncode == 0, run.stderr
    _check(run, 2)
    assert "fsdp: 2 shard units + root over 2 ranks" in (run_dir / "train.log").read_text()
    assert json.loads(json.dumps(run.summary["config"]["parallelism"]["fsdp"]))["min_params"] == 2000
