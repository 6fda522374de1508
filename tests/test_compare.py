"""Fingerprints, the ledger and `trainflow compare` on real runs: real `python train.py` processes, real checkpoints,
real concurrent writers, real replays. The honesty tests (the same command twice, compile, a wider model, a busy
machine) are in test_compare_honesty.py, which runs alone."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.processes import left_behind, run_process
from helpers.runs import ROOT, Run, losses_by_step, ok, train, trainflow, wait_for

from trainflow.record import ledger
from trainflow.record.fingerprint import config_hash
from trainflow.report.compare import NOT_JUDGED_BUSY
from trainflow.util.shown import shell_quoted

# a small MLP on synthetic data: the cheapest real run
MLP = ["model=mlp", "model.hidden=32", "data=synthetic", "logger=none", "compile=off", "trainer.max_steps=12",
       "trainer.log_every=2", "trainer.excluded_steps=2", "trainer.eval_every=0", "trainer.eval_steps=2"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Run]]:
    """Two MLP runs beside each other (one ledger beside them): the same model at two learning rates, the second
    priced."""
    folder = tmp_path_factory.mktemp("runs")
    shared = f"metrics.ledger={folder / 'ledger.jsonl'}"
    runs = [ok(train(folder / "slow", *MLP, "optim.lr=1e-3", shared)),
            ok(train(folder / "fast", *MLP, "optim.lr=1e-2", "trainer.cost_per_hour=3.0", shared))]
    return folder, runs


def test_every_run_leaves_a_fingerprint_and_a_ledger_line(two_runs: tuple[Path, list[Run]]) -> None:
    folder, (slow, fast) = two_runs
    fp = fast.summary["fingerprint"]
    import torch

    import trainflow as package

    assert (fp["trainflow"], fp["torch"], fp["cuda"], fp["driver"]) == (package.__version__, torch.__version__,
                                                                          None, None)
    assert fp["device"]["type"] == "cpu" and fp["device"]["count"] == 1 and fp["cpu_cores"] == os.cpu_count()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert fp["code"]["commit"] == head and isinstance(fp["code"]["dirty"], bool)
    assert fp["config_hash"] == config_hash(fast.summary["config"]) != slow.summary["fingerprint"]["config_hash"]
    assert fp["model_hash"] == slow.summary["fingerprint"]["model_hash"]  # the same shapes at another lr
    load = fp["load"]
    assert load["cpu_cores"] == os.cpu_count() and load["other_cores"] >= 0 and isinstance(load["busy"], bool)
    band = fp["step_time"]
    assert band["n"] == 5  # intervals ending at steps 4..12: the first (steps 1-2) holds the warm-up
    assert band["p10"] <= band["median"] <= band["p90"]
    # the steps' device time (the process's CPU time on CPU): each steady interval's mean, and the steady state's
    steady = fast.summary["steady_state"]
    device = [m["perf/step_time_device_s"] for m in fast.metrics() if m["step"] > 2 and "perf/step_time_s" in m]
    assert len(device) == 5 and all(value > 0 for value in device)
    assert steady["step_time_device_of"] == "process CPU time"
    assert steady["step_time_device_s"] == pytest.approx(sum(device) / 5)  # two steps an interval, none paused
    assert "perf/step_time_device_s" not in fast.metrics()[0]  # steps 1-2: excluded, not timed
    assert 0 < steady["step_time_p10_s"] <= steady["step_time_s"] * 1.5
    assert fp["replay"]["args"][:3] == ["-m", "trainflow", "train"] and "optim.lr=1e-2" in fp["replay"]["args"]
    assert fp["replay"]["cwd"] == str(ROOT) and fp["replay"]["env"]["OMP_NUM_THREADS"] == "1"
    # energy: absent on a CPU, with the reason; money: from trainer.cost_per_hour
    cost = fast.summary["cost"]
    assert cost["energy"] == {"absent": "the device is a CPU: trainflow reads energy from NVIDIA GPUs' own counters "
                                        "(NVML) only"}
    sps = fast.summary["steady_state"]["samples_per_sec"]
    assert cost["money"]["per_hour"] == 3.0 and cost["money"]["devices"] == 1
    assert cost["money"]["per_million_samples"] == pytest.approx(3.0 / 3600 / sps * 1e6)
    assert cost["money"]["per_million_tokens"] is None and cost["money"]["run"] > 0  # an MLP has no tokens
    assert slow.summary["cost"]["money"] == {"absent": "trainer.cost_per_hour is not set (the price of one device "
                                                       "for an hour)"}
    lines, skipped = ledger.read(folder / "ledger.jsonl")
    assert skipped == 0 and [line["run"] for line in lines] == ["slow", "fast"]
    line = lines[1]
    assert line["fingerprint"] == fp and line["status"] == "finished" and line["model"] == "trainflow.models.mlp.MLP"
    assert line["figures"]["step_time_s"] == fast.summary["steady_state"]["step_time_s"]
    assert line["figures"]["step_time_device_s"] == fast.summary["steady_state"]["step_time_device_s"]
    assert line["figures"]["validation"] == fast.summary["validation"] and "optim.lr=1e-2" in line["overrides"]


def test_where_the_ledger_goes(tmp_path: Path) -> None:
    """auto: outputs/ledger.jsonl under the working folder for runs inside it; nowhere for a run in a folder of the
    user's elsewhere (trainflow writes only into folders it owns), which the log says; off: nowhere."""
    project = tmp_path / "project"
    project.mkdir()
    for name, extra in (("a", []), ("b", ["metrics.ledger=off"])):
        proc = run_process([sys.executable, str(ROOT / "train.py"), *MLP, "trainer.max_steps=4", *extra,
                            f"hydra.run.dir=outputs/{name}"], project)
        assert proc.returncode == 0, proc.stderr[-3000:]
    (line,), _ = ledger.read(project / "outputs" / "ledger.jsonl")  # b's: off
    assert line["run"] == "a" and line["run_dir"] == str((project / "outputs" / "a").resolve())
    elsewhere = ok(train(tmp_path / "mine" / "run", *MLP, "trainer.max_steps=4"))
    assert not (tmp_path / "mine" / "ledger.jsonl").exists() and not (elsewhere.run_dir / "ledger.jsonl").exists()
    assert "ledger: none written: the run directory lies outside the working folder" in (
        elsewhere.run_dir / "train.log").read_text()


WRITER = """
import sys, time
from pathlib import Path
from trainflow.record.ledger import VERSION, append
path, name, n, go = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
(go.parent / f"ready-{name}").touch()
while not go.exists():  # both writers start together
    time.sleep(0.001)
line = {"ledger": VERSION, "run_dir": "", "time": "", "status": "finished", "model": "", "overrides": [],
        "fingerprint": None, "figures": {}, "config": {}}  # the fields of every line (ledger.LINE)
for i in range(n):
    append(path, {**line, "run": f"{name}-{i}", "pad": "x" * 6000})
"""


def test_concurrent_writers_lose_no_line(tmp_path: Path) -> None:
    """Two runs finishing at once and two writers of 300 lines of 6 KB each (larger than a pipe's atomic write)
    append to one ledger together: every line is there once, whole."""
    shared, go = tmp_path / "ledger.jsonl", tmp_path / "go"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(shared), name, "300", str(go)])
               for name in ("w1", "w2")]
    for writer, name in zip(writers, ("w1", "w2"), strict=True):
        wait_for(lambda n=name: (tmp_path / f"ready-{n}").exists(), writer, f"writer {name} to import")
    go.touch()
    runs = [subprocess.Popen([sys.executable, str(ROOT / "train.py"), *MLP, "trainer.max_steps=6",
                              f"metrics.ledger={shared}", f"hydra.run.dir={tmp_path / name}"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for name in ("r1", "r2")]
    for proc in [*writers, *runs]:
        assert proc.wait(timeout=300) == 0
    lines, skipped = ledger.read(shared)
    names = [line["run"] for line in lines]
    assert skipped == 0 and len(names) == 602
    expected = {f"{w}-{i}" for w in ("w1", "w2") for i in range(300)} | {"r1", "r2"}  # runs: beside the ledger
    assert sorted(names) == sorted(expected)
    assert all(line["pad"] == "x" * 6000 for line in lines if "pad" in line)


APPEND_ONE = """
import json, sys
from pathlib import Path
from trainflow.record.ledger import append
append(Path(sys.argv[1]), json.loads(sys.argv[2]))
"""


def waits_for_a_lock(pid: int) -> bool:
    """Whether process `pid` waits for a flock (a blocked request is listed with `->` in /proc/locks)."""
    return any(line.split()[1:2] == ["->"] and str(pid) in line.split()
               for line in Path("/proc/locks").read_text().splitlines())


def test_an_append_waits_for_a_writer_inside_its_line(tmp_path: Path) -> None:
    """Why an append holds the ledger's lock, though one O_APPEND write is atomic on a local disk: a writer may be
    inside its line (a short write on a filling disk goes on with the rest, a failed one is taken back), and another
    writer must not end that line as a cut one and append between. This test is that writer: it holds the lock with
    half its line written while a real appender starts; the appender waits for the lock (seen in /proc/locks), and
    both lines are whole. Without the lock, the half line is taken for a cut one: the first line is lost."""
    path = tmp_path / "ledger.jsonl"
    whole = {"ledger": ledger.VERSION, "run_dir": "", "time": "", "status": "finished", "model": "", "overrides": [],
             "fingerprint": None, "figures": {}, "config": {}}
    first = (json.dumps({**whole, "run": "first"}) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, first[:len(first) // 2])
        appender = subprocess.Popen([sys.executable, "-c", APPEND_ONE, str(path), json.dumps({**whole, "run": "next"})])
        deadline = time.monotonic() + 120
        while appender.poll() is None and not waits_for_a_lock(appender.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.write(fd, first[len(first) // 2:])
    finally:
        os.close(fd)  # the lock goes with the descriptor
    assert appender.wait(timeout=120) == 0
    lines, skipped = ledger.read(path)
    assert [line["run"] for line in lines] == ["first", "next"] and skipped == 0


def test_trainflow_ledger_lists_and_filters(two_runs: tuple[Path, list[Run]], tmp_path: Path) -> None:
    folder, (slow, fast) = two_runs
    copy = tmp_path / "ledger.jsonl"
    lines = ledger.read(folder / "ledger.jsonl")[0]
    older = json.loads(json.dumps(lines[0]))
    older["time"], older["run"] = "2026-01-01T10:00:00+00:00", "older"
    ledger.append(copy, older)
    for line in lines:
        ledger.append(copy, line)
    with open(copy, "ab") as f:
        f.write(b'{"ledger": 1, "run": "cut off')  # a writer killed inside its line
    proc = trainflow("ledger", copy)
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.splitlines()
    assert table[0].split()[:4] == ["time", "(UTC)", "run", "model"]
    assert [row.split()[2] for row in table[1:4]] == ["older", "slow", "fast"]
    assert "3 of 3 run(s)" in proc.stdout
    assert f"WARNING {copy}: 1 line(s) did not parse and were left out" in proc.stdout
    slow_hash = slow.summary["fingerprint"]["config_hash"]
    proc = trainflow("ledger", copy, "--config", folder / "slow", "--json")  # a run folder stands for its config
    assert [json.loads(line)["run"] for line in proc.stdout.splitlines() if line.startswith("{")] == ["older", "slow"]
    proc = trainflow("ledger", copy, "--config", slow_hash[:6], "--since", "2026-01-02", "--json")
    assert [json.loads(line)["run"] for line in proc.stdout.splitlines() if line.startswith("{")] == ["slow"]
    proc = trainflow("ledger", copy, "--until", "2026-01-01", "--json")
    assert [json.loads(line)["run"] for line in proc.stdout.splitlines() if line.startswith("{")] == ["older"]
    proc = trainflow("ledger", copy, "--model", "mlp", "--device", "cpu", "--last", "1")
    assert "fast" in proc.stdout and "slow" not in proc.stdout and "1 of 3 run(s)" in proc.stdout


def test_compare_two_runs_writes_its_pages_from_any_folder(two_runs: tuple[Path, list[Run]], tmp_path: Path) -> None:
    """Another learning rate: the config note names it, the loss curves part at the first step the learning rate
    changed the weights, and the gates on the loss figures decide by their numbers (which are deterministic)."""
    folder, (slow, fast) = two_runs
    proc = trainflow("compare", folder / "slow", folder / "fast", "--out", tmp_path / "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    (pair,) = report["pairs"]
    assert pair["a"] == ["slow"] and pair["b"] == ["fast"]
    assert pair["notes"][0] == {"kind": "config", "text": "another config: optim.lr: 0.001 -> 0.01",
                                "speed_only": False, "cause": True}
    rows = {row["figure"]: row for row in pair["figures"]}
    assert (rows["loss"]["a"], rows["loss"]["b"]) == (slow.summary["train_loss"]["last"],
                                                      fast.summary["train_loss"]["last"])
    assert rows["val_loss"]["diff"] == pytest.approx(fast.summary["validation"]["loss"] -
                                                     slow.summary["validation"]["loss"])
    assert rows["val_loss"]["verdict"] in ("higher", "lower") and rows["val_loss"]["likely_cause"].startswith(
        "another config: optim.lr")
    # the runs' own figures, as their summaries and `done:` lines give them; on a busy machine their device time
    busy = any(r.summary["fingerprint"]["load"]["busy"] for r in (slow, fast))
    judged_on = "step_time_device" if busy else "step_time"
    assert rows["step_time"]["a_samples"] == 5 and rows["step_time"]["judged_on"] == judged_on
    assert rows["step_time"]["a"] == slow.summary["steady_state"][f"{judged_on}_s"]
    assert (rows["step_time_device"]["a"], rows["step_time_device"]["b"]) == (
        slow.summary["steady_state"]["step_time_device_s"], fast.summary["steady_state"]["step_time_device_s"])
    curve = next(c for c in pair["curves"] if c["curve"] == "train/loss")
    a_loss, b_loss = (losses_by_step(run.run_dir) for run in (slow, fast))
    apart = [s for s in sorted(a_loss) if abs(b_loss[s] - a_loss[s]) > 1e-3 * abs(a_loss[s])]  # fp32's tolerance
    assert curve["steps"] == 6 and curve["apart_from_step"] == apart[0] > 2  # the warm-up's small steps first
    assert curve["final_diff"] == b_loss[12] - a_loss[12] and curve["max_abs_diff"] == max(
        abs(b_loss[s] - a_loss[s]) for s in a_loss)
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "| final train loss |" in md and "another config: optim.lr: 0.001 -> 0.01" in md
    assert (tmp_path / "out" / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "validation loss" in proc.stdout and f"wrote {tmp_path / 'out' / 'compare.md'}" in proc.stdout
    # a gate on a deterministic figure: the worse side fails it, the better one passes
    worse, better = (("slow", "fast") if rows["val_loss"]["diff"] < 0 else ("fast", "slow"))
    gap = abs(rows["val_loss"]["diff"])
    failing = trainflow("compare", folder / better, folder / worse, "--out", tmp_path / "g1",
                        "--fail-on", f"val_loss=+{gap / 2:.6f}")
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert f"GATE FAIL val_loss=+{gap / 2:.6f} ({better} -> {worse}): validation loss +" in failing.stdout
    passing = trainflow("compare", folder / better, folder / worse, "--out", tmp_path / "g2",
                        "--fail-on", f"val_loss=+{gap * 2:.6f}")
    assert passing.returncode == 0 and "GATE PASS" in passing.stdout


def test_compare_a_ledger_selection_with_a_run(two_runs: tuple[Path, list[Run]], tmp_path: Path) -> None:
    folder, (slow, fast) = two_runs
    selection = f"ledger:config={slow.summary['fingerprint']['config_hash']},ledger={folder / 'ledger.jsonl'}"
    proc = trainflow("compare", selection, folder / "fast", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "compare.json").read_text())
    assert report["a"] == {"text": selection, "kind": "ledger", "runs": ["slow"]}
    rows = {row["figure"]: row for row in report["pairs"][0]["figures"]}
    judged_on = rows["step_time"]["judged_on"]
    assert rows["step_time"]["a"] == slow.summary["steady_state"][f"{judged_on}_s"]  # a ledger line: its headline
    assert rows["step_time"]["b_samples"] == 5


def test_compare_two_sweeps_pairs_their_jobs(tmp_path: Path) -> None:
    """The same two-job sweep, the second with one more override for every job: the jobs pair by the values swept."""
    for name, extra in (("first", []), ("second", ["optim.weight_decay=0.05"])):
        proc = run_process([sys.executable, str(ROOT / "train.py"), "-m", *MLP, "trainer.max_steps=6",
                            "optim.lr=1e-3,1e-2", *extra, f"hydra.sweep.dir={tmp_path / name}"], ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
    proc = trainflow("compare", tmp_path / "first", tmp_path / "second", "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert [(p["a"], p["b"]) for p in report["pairs"]] == [(["0"], ["0"]), (["1"], ["1"])]
    assert all(p["notes"][0]["text"] == "another config: optim.weight_decay: 0.1 -> 0.05" for p in report["pairs"])
    one = trainflow("compare", tmp_path / "first", tmp_path / "second" / "0", "--out", tmp_path / "out")
    assert one.returncode == 2 and one.stderr.startswith(f"Error: {tmp_path / 'first'} is a sweep of 2 run(s)")


# --- checkpoints and --bisect -----------------------------------------------------------------------------------

NET = '''import torch
from torch import nn


class Net(nn.Module):
    """A two-layer MLP that counts its training calls in a buffer (saved in checkpoints)."""

    def __init__(self, in_features: int = 100, hidden: int = 32, out_features: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out_features))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        scale = 1.0
        return self.net(x * scale)
'''
CHANGED = ("        scale = 1.0\n", "        scale = 1.0 if self.calls <= 6 else 2.0\n")  # from the 7th step on
# 12 steps, a checkpoint every 4: steps 4, 8, 12
DRIFT = ["model=custom", "model._target_=drift_net.Net", "data=synthetic", "logger=none", "compile=off",
         "trainer.max_steps=12", "trainer.log_every=2", "trainer.excluded_steps=1", "trainer.eval_every=0",
         "trainer.eval_steps=2", "parallelism.global_batch=16", "checkpoint=dcp", "checkpoint.every_steps=4"]


@pytest.fixture(scope="module")
def drift(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Runs of one config whose model code differs in one line (on two PYTHONPATH folders): `a`, `b`, and `a2`,
    the code of `a` on 2 DDP ranks (the same global batch)."""
    root = tmp_path_factory.mktemp("drift")
    for name, text in (("code_a", NET), ("code_b", NET.replace(*CHANGED))):
        (root / name).mkdir()
        (root / name / "drift_net.py").write_text(text)
    assert NET.replace(*CHANGED) != NET
    ok(train(root / "a", *DRIFT, env={"PYTHONPATH": str(root / "code_a")}))
    ok(train(root / "b", *DRIFT, env={"PYTHONPATH": str(root / "code_b")}))
    ok(train(root / "a2", *DRIFT, "parallelism=ddp", "parallelism.nproc_per_node=2",
             env={"PYTHONPATH": str(root / "code_a")}))
    return root


def test_equal_checkpoints_are_equal_by_their_checksums(drift: Path, tmp_path: Path) -> None:
    proc = trainflow("compare", drift / "a" / "checkpoints" / "step_00000004",
                     drift / "b" / "checkpoints" / "step_00000004", "--out", tmp_path, "--fail-on", "tensors=1e-5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "compare.json").read_text())
    assert report["verdict"] == "equal" and report["tensors"] == report["equal_by_checksum"] == 17
    assert report["read"] == 0 and report["differing"] == 0
    assert (report["a"]["step"], report["a"]["samples_seen"]) == (4, 64)
    assert "equal: 17 tensors compared (17 equal by checksum, 0 read), 0 differ beyond 1e-05" in proc.stdout


def test_checkpoints_that_differ_name_the_first_and_largest_tensors(drift: Path, tmp_path: Path) -> None:
    proc = trainflow("compare", drift / "a" / "checkpoints", drift / "b" / "checkpoints" / "step_00000012",
                     "--out", tmp_path, "--fail-on", "tensors=1e-5")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "compare.json").read_text())
    assert report["a"]["step"] == 12 and report["verdict"] == "differ"  # a checkpoint dir: its newest
    assert report["read"] == 17 and report["differing"] == 12  # the call counter and Adam's step counts agree
    assert report["first"]["tensor"] == "app.model.net.0.weight" and report["first"]["rel"] > 1e-5
    assert report["largest"]["rel"] == max(r["rel"] for r in report["rows"])
    assert report["gates"][0]["status"] == "FAIL"
    assert "| `app.model.net.0.weight` |" in (tmp_path / "compare.md").read_text()


def test_a_checkpoint_of_two_ranks_compares_with_one_of_one(drift: Path, tmp_path: Path) -> None:
    """DCP reads either in this one process: the same global batch on 2 DDP ranks sums its gradients in another
    order, so the tensors are read and agree within the tolerance, not bit for bit."""
    proc = trainflow("compare", drift / "a" / "checkpoints", drift / "a2" / "checkpoints", "--out", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "compare.json").read_text())
    assert (report["a"]["world_size"], report["b"]["world_size"]) == (1, 2)
    assert report["verdict"] in ("equal", "equal within the tolerance") and report["differing"] == 0
    assert report["read"] > 0  # other files, other records: nothing to take from the checksums


def test_bisect_names_the_step_and_tensor_where_one_changed_line_parts_two_runs(drift: Path, tmp_path: Path) -> None:
    """The runs agree at step 4 and differ at step 8; each is replayed from step 4 with the PYTHONPATH the user names
    for it, a checkpoint a step, and the first step that differs is 7, the first the changed line acts on. The runs'
    model is code of their own (model._target_): replayed only with --trust-targets, and each replay's command is
    printed before it runs."""
    refused = trainflow("compare", "--bisect", drift / "a", drift / "b", "--out", tmp_path, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert refused.stderr.strip() == (f"Error: --bisect A: {drift / 'a' / '.hydra' / 'overrides.yaml'}: "
                                      "model._target_=drift_net.Net names code to import and call (a _target_); "
                                      "bisect runs it only when you trust the run: add --trust-targets")
    assert list(tmp_path.iterdir()) == []  # nothing written
    began = time.monotonic()
    proc = trainflow("compare", "--bisect", drift / "a", drift / "b", "--out", tmp_path, "--trust-targets",
                     "--pythonpath-a", drift / "code_a", "--pythonpath-b", drift / "code_b", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - began < 300
    report = json.loads((tmp_path / "compare.json").read_text())
    assert (report["last_equal"], report["first_apart"], report["first_step"]) == (4, 8, 7)
    assert report["first_tensor"] == "app.model.net.0.weight"
    assert [s["differing"] > 0 for s in report["steps"]] == [False, False, True, True]  # steps 5, 6, 7, 8
    assert report["faithful"]["a"]["same"] and report["faithful"]["b"]["same"]  # the replays reproduce the runs
    assert report["replays"]["b"]["pythonpath"] == str(drift / "code_b")
    assert report["replays"]["a"]["saved"][:4] == [5, 6, 7, 8]
    replay_a, replay_b, conclusion = proc.stdout.splitlines()[:3]
    assert conclusion.startswith("A and B part at step 7: first tensor app.model.net.0.weight")
    for line, name, code in ((replay_a, "a", "code_a"), (replay_b, "b", "code_b")):
        out = tmp_path / "bisect" / name
        pythonpath = os.pathsep.join([str(drift / code), *filter(None, [os.environ.get("PYTHONPATH")])])
        assert line == (f"replay {name.upper()}: {shell_quoted('cd', tmp_path / 'bisect')} && " + shell_quoted(
            "env", f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}", f"PYTHONPATH={pythonpath}", sys.executable,
            "-P", "-m", "trainflow", "train", *(o for o in DRIFT if not o.startswith(("logger=", "checkpoint"))),
            f"hydra.run.dir={out}", "checkpoint=dcp",
            f"checkpoint.dir={out / 'checkpoints'}", "checkpoint.every_steps=1", "checkpoint.keep_last=8",
            f"checkpoint.resume={drift / name / 'checkpoints' / 'step_00000004'}", "logger=none",
            "metrics.ledger=off"))
        assert report["replays"][name]["shown"] == line.split(": ", 1)[1]
    md = (tmp_path / "compare.md").read_text()
    assert "**A and B part at step 7" in md and f"with PYTHONPATH={drift / 'code_b'}" in md


def test_a_stop_signal_ends_a_bisect_and_its_replay(drift: Path, tmp_path: Path) -> None:
    """SIGTERM to `trainflow compare --bisect` once its first replay has started training: one line, exit 143, and
    the replay (in a process group of its own) ends with it."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    with left_behind() as leftovers:
        command = [str(Path(sys.executable).parent / "trainflow"), "compare", "--bisect", str(drift / "a"),
                   str(drift / "b"), "--out", str(out), "--trust-targets"]
        proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        wait_for(lambda: (out / "bisect" / "a" / "train.log").exists(), proc, "the first replay to start")
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert time.monotonic() - began < 30
        assert leftovers(2) == {}  # killed and reaped before the command ended (left alone, it trains on)
    assert proc.returncode == 143, stderr
    assert stderr.strip().splitlines() == ["Interrupted: trainflow compare stopped by SIGTERM; a --bisect replay it "
                                           "started is stopped with it"]


def test_bisect_needs_checkpointed_runs(two_runs: tuple[Path, list[Run]], tmp_path: Path) -> None:
    folder, _ = two_runs
    proc = trainflow("compare", "--bisect", folder / "slow", folder / "fast", "--out", tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"Error: --bisect A: {folder / 'slow'} has no committed checkpoint; bisect runs "
                                   "saved with checkpoint=dcp (checkpoint.every_steps sets how finely the search "
                                   "starts)")


def test_the_report_of_runs_shows_their_energy_and_cost(two_runs: tuple[Path, list[Run]], tmp_path: Path) -> None:
    """`trainflow report` (the ladder's and every sweep's page): the energy a CPU does not report, said once with
    the reason, and the priced run's cost."""
    folder, (slow, fast) = two_runs
    proc = trainflow("report", folder, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "report.md").read_text()
    section = md.split("## Energy and cost\n", 1)[1].split("\n\n!", 1)[0]
    assert "- Energy: absent on every run: the device is a CPU: trainflow reads energy from NVIDIA GPUs' own " \
           "counters (NVML) only." in section
    money = fast.summary["cost"]["money"]
    assert f"| fast | - | - | - | {money['run']:.4g} | - | {money['per_million_samples']:.4g} |" in section
    assert "| slow |" not in section  # neither figure: nothing to show but the reason above
    rows = {r["name"]: r for r in json.loads((tmp_path / "report.json").read_text())["runs"]}
    assert rows["fast"]["cost"] == fast.summary["cost"]


def test_the_fingerprints_name_another_torch_device_and_host(two_runs: tuple[Path, list[Run]],
                                                            tmp_path: Path) -> None:
    """One run's folder twice, the second's fingerprint saying it ran with another torch, on another device and host
    (this machine has one of each): the notes name them, and with the same numbers no verdict needs a cause."""
    folder, (slow, _) = two_runs
    for name in ("a", "b"):
        shutil.copytree(slow.run_dir, tmp_path / name)
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    fp = summary["fingerprint"]
    fp["torch"], fp["device"]["name"], fp["host"] = "2.12.0", "Other CPU", "elsewhere"
    (tmp_path / "b" / "summary.json").write_text(json.dumps(summary))
    proc = trainflow("compare", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    (pair,) = json.loads((tmp_path / "out" / "compare.json").read_text())["pairs"]
    torch_version = slow.summary["fingerprint"]["torch"]
    assert [(n["kind"], n["text"]) for n in pair["notes"] if n["kind"] != "machine load"] == [  # this one: any
        ("environment", f"another torch: {torch_version} -> 2.12.0"),
        ("device", f"another device: 1 x {slow.summary['fingerprint']['device']['name']} (cpu) -> 1 x Other CPU (cpu)"),
        ("host", f"another host: {slow.summary['fingerprint']['host']} -> elsewhere")]
    # the wall-time figures of a busy machine are not judged at all (trainflow.report.compare: NOT_JUDGED_BUSY)
    assert all(row["verdict"] in ("same", NOT_JUDGED_BUSY) and row["likely_cause"] is None for row in pair["figures"])
    assert {row["figure"] for row in pair["figures"] if row["verdict"] == "same"} >= {"step_time", "loss", "val_loss"}


def test_two_profiled_runs_compare_their_verdicts_and_operators(tmp_path: Path) -> None:
    """A wider MLP, both profiled: the verdicts' shares side by side (B's less A's, in points) and the operators
    whose self time per step changed most, the matmuls first. The wide model's matmuls take milliseconds a step
    (batch 256, 4096 hidden units: 128x the narrow one's FLOPs), and four steps are profiled: a preemption on a busy
    machine stretches whichever operator runs, by a millisecond or so a step over the window, never by that much."""
    window = ["profiler=schedule", "profiler.wait=1", "profiler.warmup=1", "profiler.active=4",
              "trainer.batch_size=256"]
    narrow = ok(train(tmp_path / "narrow", *MLP, *window))
    wide = ok(train(tmp_path / "wide", *MLP, *window, "model.hidden=4096"))
    proc = trainflow("compare", narrow.run_dir, wide.run_dir, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    profiler = json.loads((tmp_path / "out" / "compare.json").read_text())["pairs"][0]["profiler"]
    va, vb = (run.summary["profiler"]["verdict"] for run in (narrow, wide))
    assert profiler["bound"] == [va["bound"], vb["bound"]]
    for name, share in profiler["shares"].items():
        assert share == {"a": va["shares"][name], "b": vb["shares"][name],
                         "points": round(vb["shares"][name] - va["shares"][name], 4)}
    ops = profiler["ops"]
    assert [abs(o["change_ms"]) for o in ops] == sorted((abs(o["change_ms"]) for o in ops), reverse=True)
    top_a = {o["name"]: o["self_ms_per_step"] for o in narrow.summary["profiler"]["top_ops"]}
    top_b = {o["name"]: o["self_ms_per_step"] for o in wide.summary["profiler"]["top_ops"]}
    first = ops[0]
    assert first["change_ms"] == pytest.approx((top_b.get(first["name"]) or 0) - (top_a.get(first["name"]) or 0))
    assert first["name"] in ("aten::addmm", "aten::mm") and first["change_ms"] > 0
    assert "| `aten::" in (tmp_path / "out" / "compare.md").read_text()
