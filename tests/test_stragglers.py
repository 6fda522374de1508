"""Stragglers (per-rank step times gathered at log steps, a slow rank named), the start-up word on more ranks than
cores, and the one way every account of ranks names them."""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

import torch
from helpers.runs import ROOT, TINY_GPT, train

from trainflow.config.schema import StragglerConfig
from trainflow.distributed import DistEnv
from trainflow.distributed.process_group import oversubscription_warning
from trainflow.guards.stragglers import Stragglers
from trainflow.metrics.verdict import verdict
from trainflow.util.failures import rank_list

DDP = ["parallelism=ddp", "parallelism.nproc_per_node=2"]
SLOW_READ_S = 0.005  # per item: 8 items a step, 40 ms a step on rank 1 (the step computes in ~5-20 ms here)


def test_every_account_names_ranks_alike() -> None:
    """The health check, the hang report, the lost-rank line and the straggler line share one wording."""
    assert rank_list([3]) == "rank 3"
    assert rank_list([0, 2]) == "ranks 0, 2"
    assert rank_list(list(range(8))) == "ranks 0, 1, 2, 3, 4, 5, 6, 7"
    assert rank_list(list(range(64))) == "ranks 0, 1, 2, 3, 4, 5, 6, 7, ..."
    assert rank_list(list(range(5)), limit=2) == "ranks 0, 1, ..."


class SlowSet(torch.utils.data.Dataset):
    """A dataset whose rank TEST_SLOW_RANK sleeps TEST_SLOW_S in every read: a slow disk or a slow node's data path."""

    def __init__(self, inner: torch.utils.data.Dataset) -> None:
        self.inner = inner
        slow = os.environ.get("RANK") == os.environ.get("TEST_SLOW_RANK")
        self.sleep_s = float(os.environ.get("TEST_SLOW_S", "0")) if slow else 0.0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index):
        time.sleep(self.sleep_s)
        return self.inner[index]


def slow_digits(val_fraction: float = 0.2, split_seed: int = 0) -> tuple[SlowSet, Any]:
    from trainflow.data.digits import digits

    train_set, val_set = digits(val_fraction, split_seed)
    return SlowSet(train_set), val_set


def _env() -> dict[str, str]:
    """Let the workers import this module (slow_digits) by name."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)}


def test_a_rank_slowed_in_its_data_path_is_named_once_with_its_host(run_dir) -> None:
    """Rank 1 sleeps in every read: its own time per step is several times rank 0's, rank 0 waits for it in the
    gradient sync; it is named once, with its host and its data wait; the profiler's verdict on rank 0 gives the
    straggler as the cause of its exposed communication."""
    run = train(run_dir, "experiment=digits", "data._target_=test_stragglers.slow_digits", "trainer.log_every=1",
                "trainer.eval_every=0", "trainer.batch_size=8", "logger=none", "trainer.max_steps=12",
                "trainer.excluded_steps=2", "profiler.enabled=true", *DDP,
                env={**_env(), "TEST_SLOW_RANK": "1", "TEST_SLOW_S": str(SLOW_READ_S)})
    assert run.returncode == 0, run.stderr[-3000:]
    stragglers = run.summary["stragglers"]
    assert [(n["rank"], n["host"]) for n in stragglers["named"]] == [(1, socket.gethostname())], stragglers
    named = stragglers["named"][0]
    # named after straggler.intervals (3) judged intervals in a row: at step 5 at the earliest (steps 3, 4, 5; steps
    # 1-2 are the warm-up), later if the busy machine slowed rank 0 too in one of them
    assert 5 <= named["step"] <= 12 and named["ratio"] >= 1.5, named
    assert named["own_s"] >= 1.5 * named["others_own_s"] and named["data_wait_s"] >= 8 * SLOW_READ_S, named
    last = stragglers["last_interval"]
    assert last["slowest_rank"] == 1 and last["wait_s"][0] > last["wait_s"][1], last  # rank 0 waited for rank 1
    log = (run_dir / "train.log").read_text()
    lines = [line for line in log.splitlines() if "straggler: " in line]
    assert len(lines) == 1 and f"straggler: rank 1 on {socket.gethostname()} took " in lines[0], lines
    assert f"in 3 log intervals in a row, up to step {named['step']}; every other rank waits for it" in lines[0]
    progress = [line for line in log.splitlines() if "] - step 6/12: loss " in line]
    assert len(progress) == 1 and progress[0].endswith(" (rank 1)") and "ranks' own time median " in progress[0]
    logged = [m for m in run.metrics() if "perf/slowest_rank" in m]
    assert len(logged) == 12 and all(m["perf/own_time_max_s"] >= m["perf/own_time_median_s"] for m in logged)
    profiled = run.summary["profiler"]["verdict"]
    assert profiled["rank"] == 0 and profiled["bound"] == "communication-bound", profiled
    assert profiled["cause"] == "a straggler rank" and profiled["action"].startswith(
        f"the collectives wait for rank 1 on {socket.gethostname()}, a straggler ("), profiled


def test_healthy_ranks_name_nobody_and_one_process_measures_nothing(run_dir) -> None:
    run = train(run_dir, *TINY_GPT, "data=synthetic", "data.num_samples=4096", "trainer.eval_every=0",
                "trainer.max_steps=12", "trainer.log_every=2", *DDP)
    assert run.returncode == 0, run.stderr[-3000:]
    stragglers = run.summary["stragglers"]
    assert stragglers["named"] == [] and "straggler: " not in (run_dir / "train.log").read_text(), stragglers
    last = stragglers["last_interval"]
    assert last["step"] == 12 and len(last["own_s"]) == len(last["wait_s"]) == len(last["data_wait_s"]) == 2
    assert last["own_s_max"] == max(last["own_s"]) and min(last["own_s"]) > 0 and min(last["wait_s"]) >= 0
    assert 0 < stragglers["gather_ms"] < 1000  # one all-gather of 3 numbers a rank
    assert [m["step"] for m in run.metrics() if "perf/slowest_rank" in m] == [2, 4, 6, 8, 10, 12]
    cpu = torch.device("cpu")
    alone = Stragglers(StragglerConfig(), DistEnv(0, 1, 0, cpu))
    assert alone.enabled is False and alone.summary(None) is None  # never called: one process pays nothing


def test_the_verdict_blames_a_straggler_only_for_the_ranks_that_wait_for_it() -> None:
    waiting = {"steps": 3, "step_s": 0.3, "step_ms": [100.0] * 3, "covered": {},
               "seconds": {"communication": 0.2, "forward_backward_compute": 0.1}}
    straggler = {"rank": 1, "host": "node7", "ratio": 3.2}
    assert verdict(waiting, "cpu", True, straggler, rank=0)["cause"] == "a straggler rank"
    assert "rank 1 on node7, a straggler (3.2x" in verdict(waiting, "cpu", True, straggler, rank=0)["action"]
    assert "cause" not in verdict(waiting, "cpu", True, straggler, rank=1)  # the straggler's own verdict stands
    assert "cause" not in verdict(waiting, "cpu", True, None, rank=0)
    computing = {**waiting, "seconds": {"communication": 0.05, "forward_backward_compute": 0.25}}
    assert "cause" not in verdict(computing, "cpu", True, straggler, rank=0)  # not waiting: not its cause


def test_more_ranks_than_cores_is_said_once_before_start_with_its_cost(run_dir) -> None:
    """2 ranks on the one core this process may use (its affinity, as taskset or a SLURM allocation sets it)."""
    one_core = [sys.executable, "-c", "import os, sys; os.sched_setaffinity(0, {0}); "
                "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])", str(ROOT / "train.py")]
    run = train(run_dir, *TINY_GPT, "data=synthetic", "data.num_samples=4096", "trainer.eval_every=0",
                "trainer.max_steps=1", *DDP, command=one_core)
    assert run.returncode == 0, run.stderr[-3000:]
    said = "parallelism.nproc_per_node: 2 ranks share 1 CPU core, so each runs 0.5 of a core: a step takes at least " \
           "2x as long as with one rank per core, for no more samples per second (fewer: the ranks also wait for " \
           "each other to get a core); use parallelism.nproc_per_node=1 or fewer"
    output = run.stdout + run.stderr
    assert output.count("ranks share ") == 1 and f"[WARNING] - {said}\n" in output, output[-3000:]
    assert output.index(said) < output.index("starting 2 ddp workers")  # before any rank starts
    cpu = torch.device("cpu")
    assert oversubscription_warning(cpu, 64, 2).startswith("parallelism.nproc_per_node: 64 ranks share 2 CPU cores, "
                                                           "so each runs 0.031 of a core: a step takes at least 32x")
    assert oversubscription_warning(cpu, 2, 2) is None and oversubscription_warning(torch.device("cuda"), 64, 2) is None
