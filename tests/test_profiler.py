"""The profile stage: scheduled traces that load, an ops table, and a verdict that names the right bottleneck."""

from __future__ import annotations

import gzip
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers.runs import train
from omegaconf import OmegaConf
from torch import nn
from torch.profiler import record_function

from trainflow.conf import CONFIG_DIR
from trainflow.config.schema import ProfilerConfig
from trainflow.distributed import DistEnv
from trainflow.errors import ConfigError
from trainflow.metrics.regions import CHECKPOINT
from trainflow.metrics.verdict import DATA, FWD_BWD, OPTIMIZER, SHARES
from trainflow.profile.profiler import Profiler

CPU_ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # on a busy 2-core machine, waits at intra-op barriers would swell tiny ops


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def profiler_cfg(**overrides: object) -> ProfilerConfig:
    return ProfilerConfig(**{"enabled": True, **overrides})


def mlp(*widths: int) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def drive(profiler: Profiler, model: nn.Module, batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
          steps: int, optimizer: torch.optim.Optimizer | None = None) -> dict | None:
    """The training loop's shape (its annotations, one profiler.step() per step) around any model and batch source."""
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=1e-3)
    with profiler:
        for _ in range(steps):
            with record_function(DATA):
                inputs, targets = batch()
            with record_function(FWD_BWD):
                nn.functional.cross_entropy(model(inputs), targets).backward()
            with record_function(OPTIMIZER):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            profiler.step()
    return profiler.summary()


def load_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def test_train_py_profile_writes_loadable_trace_ops_table_and_overhead_verdict(run_dir: Path) -> None:
    # A GPT of width 16 at batch 1: every operator is a few microseconds, so dispatch overhead bounds the step.
    run = train(run_dir, "model=gpt_tiny", "model.n_layer=2", "model.n_embd=16", "model.n_head=2",
                "model.block_size=8", "trainer.batch_size=1", "data=synthetic", "trainer.max_steps=12",
                "trainer.excluded_steps=2", "trainer.log_every=4", "trainer.eval_steps=1", "logger=none",
                "trainer.progress=log", "compile=off", "profiler=schedule", env=ONE_THREAD)
    assert run.returncode == 0, run.stderr
    prof = run.summary["profiler"]
    assert prof["schedule"] == {"skip_first": 2, "wait": 5, "warmup": 2, "active": 3, "repeat": 1}
    assert prof["windows"] == {"0": [[10, 12]]}  # after the 2 warm-up steps: wait 3-7, warm up 8-9, record 10-12
    assert prof["traces"] == ["profile/rank0.10.pt.trace.json"]

    trace = load_trace(run_dir / prof["traces"][0])
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"ProfilerStep#10", "ProfilerStep#11", "ProfilerStep#12", DATA, FWD_BWD, OPTIMIZER} <= names
    assert {"aten::addmm", "aten::native_layer_norm", "aten::scaled_dot_product_attention", "AddmmBackward0",
            "aten::nll_loss_backward", "Optimizer.step#AdamW.step"} <= names  # forward, backward, optimizer
    assert "ProfilerStep#9" not in names and "ProfilerStep#13" not in names

    table = (run_dir / "profile" / "ops_rank0.txt").read_text()
    assert "steps 10-12, sorted by self_cpu_time_total" in table and "aten::addmm" in table
    assert prof["ops_tables"] == ["profile/ops_rank0.txt"]
    assert 1 <= len(prof["top_ops"]) <= 5
    assert all(op["self_ms_per_step"] > 0 and op["calls_per_step"] > 0 for op in prof["top_ops"])

    v = prof["verdict"]
    assert v["bound"] == "cpu-overhead-bound", v
    assert v["rank"] == 0 and v["profiled_steps"] == 3 and v["timeline"] == "cpu"
    assert sum(v["shares"].values()) == pytest.approx(1.0, abs=1e-3)
    assert v["groups"]["cpu-overhead-bound"] > 3 * v["groups"]["compute-bound"]  # a busy machine's stalls: "other"
    assert v["shares"]["communication"] == 0 and v["shares"]["compile"] == 0
    assert "trainer.batch_size" in v["action"]
    assert run.stdout.count("profiler verdict (rank 0, steps 10-12") == 1  # printed once, at the end
    assert run.stdout.index("profiler verdict") > run.stdout.index("step 12/12")
    assert "USDT" not in run.stdout + run.stderr  # torch's profiler_start/stop lines stay off the console
    # no pipeline, no bubble: its share is named, at 0% (a pipeline run's is its measured share: test_pipeline.py)
    (shares,) = [line for line in run.stdout.splitlines() if line.startswith("  shares of step time: ")]
    assert v["shares"]["pipeline_bubble"] == 0 and " | pipeline bubble 0% | " in shares, shares


def test_ddp_on_gloo_shows_the_communication_share_on_every_rank(run_dir: Path) -> None:
    # 8.4M parameters (a 33 MB all-reduce per step) against one sample per rank: the collective dominates.
    run = train(run_dir, "parallelism=ddp", "parallelism.nproc_per_node=2", "model=mlp", "model.in_features=1024",
                "model.hidden=4096", "model.out_features=1024", "data=synthetic", "trainer.batch_size=1",
                "optim=sgd", "optim.momentum=0", "optim.weight_decay=0", "trainer.grad_clip=0", "compile=off",
                "logger=none", "trainer.max_steps=12", "trainer.excluded_steps=2", "trainer.log_every=4",
                "trainer.eval_steps=1", "profiler=schedule", "profiler.ranks=all")
    assert run.returncode == 0, run.stderr
    prof = run.summary["profiler"]
    assert prof["ranks"] == [0, 1] and prof["windows"] == {"0": [[10, 12]], "1": [[10, 12]]}
    assert prof["ops_tables"] == ["profile/ops_rank0.txt", "profile/ops_rank1.txt"]
    for rank in (0, 1):
        events = load_trace(run_dir / "profile" / f"rank{rank}.10.pt.trace.json")["traceEvents"]
        allreduces = [e for e in events if e.get("name") == "gloo:all_reduce"]
        assert len(allreduces) >= 3 and sum(e["dur"] for e in allreduces) > 0  # at least one bucket per step
        assert prof["per_rank"][str(rank)]["shares"]["communication"] > 0.15, prof["per_rank"]
    v = prof["verdict"]
    assert v["covered"]["communication_in_flight"] >= v["shares"]["communication"] > 0.15
    assert run.stdout.count("profiler verdict (rank 0") == 1 and "rank 1: " in run.stdout


@pytest.mark.slow
def test_compiled_run_profiles_compiled_regions_after_the_compile_steps(run_dir: Path) -> None:
    run = train(run_dir, "model=gpt_tiny", "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
                "model.block_size=32", "trainer.batch_size=8", "data=synthetic", "compile=default", "logger=none",
                "trainer.excluded_steps=2", "trainer.max_steps=20", "trainer.log_every=5", "trainer.eval_steps=1",
                "profiler=schedule")
    assert run.returncode == 0, run.stderr
    summary = run.summary
    prof = summary["profiler"]
    skip = summary["steady_state"]["excluded_steps"]
    assert skip > 2 and prof["schedule"]["skip_first"] == skip  # warm-up plus the compiling steps
    first = skip + 5 + 2 + 1
    assert prof["windows"] == {"0": [[first, first + 2]]}
    names = {e.get("name", "") for e in load_trace(run_dir / prof["traces"][0])["traceEvents"]}
    assert any(n.startswith("Torch-Compiled Region") for n in names) and "CompiledFunction" in names
    assert prof["verdict"]["shares"]["compile"] == 0 and "cause" not in prof["verdict"]  # no compiling in the window


def test_checkpoint_traffic_is_not_counted_as_communication(tmp_path: Path) -> None:
    """Real gloo groups of 2 ranks, rank 1 played by a thread: the training all-reduces inside forward/backward
    (rank 1 joins after 5 ms); the checkpoint stage, in its annotation and on a gloo group of its own, all-reduces
    too (rank 1 joins after 250 ms: a save's planning, its stop-flag poll). Only the training's collective is
    communication; counting the stage's would make the step look communication-bound. (The save's wait is long
    beside the training's: on a loaded machine the 5 ms wait stretched to 85 ms, and 30 ms no longer outweighed it.)"""
    import queue
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    store, groups = dist.HashStore(), {}

    def join(name: str, rank: int) -> None:
        groups[name, rank] = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, 2, timedelta(seconds=60))

    joining = [threading.Thread(target=join, args=(n, r)) for n in ("train", "save") for r in (0, 1)]
    for t in joining:
        t.start()
    for t in joining:
        t.join()
    calls: queue.Queue = queue.Queue()

    def rank1() -> None:
        while (call := calls.get()) is not None:
            name, delay = call
            time.sleep(delay)
            groups[name, 1].allreduce([torch.zeros(4)]).wait()

    def all_reduce(name: str, delay: float) -> None:
        calls.put((name, delay))
        groups[name, 0].allreduce([torch.zeros(4)]).wait()

    peer = threading.Thread(target=rank1)
    peer.start()
    try:
        p = Profiler(profiler_cfg(skip_first=0, wait=0, warmup=1, active=3), CPU_ENV, tmp_path, max_steps=4)
        with p:
            for _ in range(4):
                with record_function(DATA):
                    inputs = torch.randn(8, 16)
                with record_function(FWD_BWD):
                    mlp(16, 16, 4)(inputs).sum().backward()
                    all_reduce("train", 0.005)  # the training's communication
                with record_function(OPTIMIZER):
                    pass
                with record_function(CHECKPOINT):
                    all_reduce("save", 0.25)  # the checkpoint stage's own
                p.step()
        v = p.summary()["verdict"]
    finally:
        calls.put(None)
        peer.join()
        groups.clear()
    covered, shares = v["covered"], v["shares"]  # fractions of the step time
    assert 0 < shares["communication"] <= covered["communication_in_flight"] <= covered["forward_backward"], v
    assert shares["communication"] < 0.4 and shares["other"] > 0.5, v  # the stage's turn is the loop's "other"


def test_sleeping_loader_is_data_bound(tmp_path: Path) -> None:
    def slow_batch() -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.03)
        return torch.randn(8, 32), torch.randint(4, (8,))

    p = Profiler(profiler_cfg(skip_first=0, wait=1, warmup=1, active=3), CPU_ENV, tmp_path, max_steps=5)
    v = drive(p, mlp(32, 64, 4), slow_batch, steps=5)["verdict"]
    assert v["bound"] == "data-bound", v
    assert v["shares"]["data_wait"] > 0.6
    assert v["covered"]["data"] == pytest.approx(v["shares"]["data_wait"], abs=1e-3)
    assert "data.num_workers" in v["action"] and "pin_memory" in v["action"] and "prefetch" in v["action"]


def test_large_matmul_model_is_compute_bound(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(128, 512), torch.randint(512, (128,))
    p = Profiler(profiler_cfg(skip_first=0, wait=0, warmup=1, active=2), CPU_ENV, tmp_path, max_steps=3)
    v = drive(p, mlp(512, 2048, 512), lambda: (x, y), steps=3)["verdict"]
    assert v["bound"] == "compute-bound", v
    assert v["shares"]["forward_backward_compute"] > 0.6
    assert v["shares"]["forward_backward_compute"] + v["shares"]["optimizer_compute"] > 3 * v["shares"]["overhead"]


def test_tiny_ops_at_batch_one_are_overhead_bound_with_adamw(tmp_path: Path) -> None:
    model = mlp(16, 32, 32, 4)
    x, y = torch.randn(1, 16), torch.randint(4, (1,))
    p = Profiler(profiler_cfg(skip_first=1, wait=1, warmup=1, active=3), CPU_ENV, tmp_path, max_steps=6)
    v = drive(p, model, lambda: (x, y), steps=6, optimizer=torch.optim.AdamW(model.parameters()))["verdict"]
    assert v["bound"] == "cpu-overhead-bound", v
    assert v["groups"]["cpu-overhead-bound"] > 3 * v["groups"]["compute-bound"]
    assert v["covered"]["optimizer"] > 0.1  # AdamW's per-parameter loop of tiny ops is visible in its own annotation
    assert "compile" in v["action"] and "CUDA graphs" in v["action"]


def test_recompiles_inside_the_window_are_reported_as_retracing(tmp_path: Path) -> None:
    model = torch.compile(mlp(16, 16, 4), backend="eager", dynamic=False)
    sizes = iter([4, 4, 5, 6, 7])  # a new batch size in every recorded step: one recompile each
    p = Profiler(profiler_cfg(skip_first=1, wait=0, warmup=1, active=3), CPU_ENV, tmp_path, max_steps=5)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        n = next(sizes)
        return torch.randn(n, 16), torch.randint(4, (n,))

    v = drive(p, model, batch, steps=5)["verdict"]
    assert v["shares"]["compile"] > 0.3, v
    assert v["bound"] == "cpu-overhead-bound" and v["cause"] == "retracing"
    assert "compile.dynamic=true" in v["action"] and "bucket" in v["action"]
    trace = load_trace(tmp_path / "profile" / "rank0.3.pt.trace.json")
    assert any(str(e.get("name", "")).startswith("Torch-Compiled Region") for e in trace["traceEvents"])


def test_gzip_and_repeat_write_one_gzipped_trace_and_table_section_per_window(tmp_path: Path) -> None:
    x, y = torch.randn(4, 8), torch.randint(2, (4,))
    p = Profiler(profiler_cfg(skip_first=0, wait=1, warmup=0, active=2, repeat=2, gzip=True, row_limit=5,
                              record_shapes=True, with_stack=True, with_flops=True, profile_memory=True),
                 CPU_ENV, tmp_path, max_steps=106, start_step=100)  # a resumed run: names use global steps
    s = drive(p, mlp(8, 8, 2), lambda: (x, y), steps=6)
    assert s["windows"] == {"0": [[102, 103], [105, 106]]}
    assert s["traces"] == ["profile/rank0.102.pt.trace.json.gz", "profile/rank0.105.pt.trace.json.gz"]
    for rel, first in zip(s["traces"], (102, 105), strict=True):
        names = {e.get("name") for e in load_trace(tmp_path / rel)["traceEvents"]}
        assert {f"ProfilerStep#{first}", f"ProfilerStep#{first + 1}", "aten::addmm"} <= names
    table = (tmp_path / "profile" / "ops_rank0.txt").read_text()
    assert table.count("rank 0, steps") == 2 and "steps 105-106" in table
    assert s["verdict"]["profiled_steps"] == 4


def test_run_ending_inside_the_window_saves_the_steps_it_recorded(tmp_path: Path) -> None:
    x, y = torch.randn(4, 8), torch.randint(2, (4,))
    p = Profiler(profiler_cfg(skip_first=0, wait=1, warmup=1, active=3), CPU_ENV, tmp_path, max_steps=100)
    s = drive(p, mlp(8, 2), lambda: (x, y), steps=4)  # stops after 2 of the 3 active steps (3, 4)
    assert s["windows"] == {"0": [[3, 4]]} and s["verdict"]["profiled_steps"] == 2
    names = {e.get("name") for e in load_trace(tmp_path / "profile" / "rank0.3.pt.trace.json")["traceEvents"]}
    assert {"ProfilerStep#3", "ProfilerStep#4", "aten::addmm"} <= names


def test_memory_mode_on_cpu_warns_once_and_still_profiles(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = OmegaConf.merge(OmegaConf.load(CONFIG_DIR / "profiler" / "memory.yaml"), {"skip_first": 0})
    x, y = torch.randn(4, 8), torch.randint(2, (4,))
    with caplog.at_level(logging.WARNING, logger="trainflow"):
        s = drive(Profiler(profiler_cfg(**cfg), CPU_ENV, tmp_path, max_steps=10), mlp(8, 8, 2), lambda: (x, y), 10)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "profiler.memory_snapshot" in warnings[0] and "needs CUDA" in warnings[0]
    assert s["memory_snapshots"] == [] and not list((tmp_path / "profile").glob("memory_*"))
    assert s["traces"] == ["profile/rank0.8.pt.trace.json.gz"] and s["verdict"] is not None


def test_profiler_off_and_unselected_ranks_record_nothing(tmp_path: Path) -> None:
    x, y = torch.randn(4, 8), torch.randint(2, (4,))
    off = Profiler(ProfilerConfig(), CPU_ENV, tmp_path, max_steps=3)
    assert drive(off, mlp(8, 2), lambda: (x, y), 3) is None
    rank1 = DistEnv(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    other = Profiler(profiler_cfg(skip_first=0, wait=0, warmup=1, active=1), rank1, tmp_path, max_steps=3)
    assert not other.enabled
    with other:
        other.step()
    assert not (tmp_path / "profile").exists()
    assert Profiler(profiler_cfg(ranks="all"), rank1, tmp_path, max_steps=100).enabled


def test_window_not_reached_after_resume_warns_instead_of_refusing(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    x, y = torch.randn(4, 8), torch.randint(2, (4,))
    with caplog.at_level(logging.WARNING, logger="trainflow"):
        s = drive(Profiler(profiler_cfg(), CPU_ENV, tmp_path, max_steps=100, skip_first=5, start_step=95),
                  mlp(8, 2), lambda: (x, y), steps=5)
    text = caplog.text
    assert "after resuming at step 95" in text and "before the first profiling window closed" in text
    assert s["verdict"] is None and s["traces"] == []


@pytest.mark.parametrize(("overrides", "expected"), [
    (["profiler.active=0"], "profiler.active: must be a positive number of recorded steps; got 0"),
    (["profiler.wait=-1"], "profiler.wait: must be >= 0; got -1"),
    (["profiler.warmup=-2"], "profiler.warmup: must be >= 0; got -2"),
    (["profiler.repeat=-1"], "profiler.repeat: must be >= 0; got -1"),
    (["profiler.skip_first=-3"], "profiler.skip_first: must be >= 0"),
    (["profiler.ranks=[-1]"], "profiler.ranks: rank -1 does not exist: ranks count from 0"),
    (["profiler.ranks=[]"], "profiler.ranks: must be all or a non-empty list of ranks"),
    (["profiler.ranks=some"], "profiler.ranks: must be all or a non-empty list of ranks"),
    (["profiler.row_limit=0"], "profiler.row_limit: must be > 0; got 0"),
    (["trainer.max_steps=12"], "trainer.max_steps: is 12 but the profiler window ends at step 15 (skip_first 5 + "
                               "1 x (wait 5 + warmup 2 + active 3)); raise trainer.max_steps to >= 15"),
])
def test_bad_profiler_values_are_refused_naming_the_key(overrides: list[str], expected: str) -> None:
    from hydra import compose, initialize_config_dir

    from trainflow.config.checks import check_config

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["profiler=schedule", *overrides])
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert str(err.value).startswith(expected)


@pytest.mark.parametrize("option", ["off", "schedule", "trace", "memory"])
def test_every_profiler_option_composes_and_validates(option: str) -> None:
    from hydra import compose, initialize_config_dir

    from trainflow.config.checks import check_config

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"profiler={option}"])
    check_config(cfg)
    p = cfg.profiler
    assert (p.enabled, p.wait, p.warmup, p.active, p.repeat, list(p.ranks)) == (option != "off", 5, 2, 3, 1, [0])
    assert p.with_stack == (option == "trace") and p.memory_snapshot == (option == "memory")


def test_window_pushed_past_the_end_by_excluded_steps_is_refused(tmp_path: Path) -> None:
    # check_config() counts trainer.excluded_steps; compile steps are only known when the run starts.
    with pytest.raises(ConfigError, match=r"^trainer.max_steps: the profiler window ends at step 22 .* raise "
                                          r"trainer.max_steps to >= 22"):
        Profiler(profiler_cfg(), CPU_ENV, tmp_path, max_steps=20, skip_first=12)


def test_ranks_beyond_the_world_are_refused_where_the_world_size_is_known(tmp_path: Path) -> None:
    two = DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError) as err:
        Profiler(profiler_cfg(ranks=[0, 2]), two, tmp_path, max_steps=100)
    assert str(err.value) == ("profiler.ranks: rank 2 does not exist in a world of 2 rank(s) (0..1); use ranks "
                              "within it or profiler.ranks=all")


def test_shares_partition_the_step(tmp_path: Path) -> None:
    x, y = torch.randn(16, 64), torch.randint(8, (16,))
    p = Profiler(profiler_cfg(skip_first=0, wait=0, warmup=1, active=2), CPU_ENV, tmp_path, max_steps=3)
    v = drive(p, mlp(64, 128, 8), lambda: (x, y), steps=3)["verdict"]
    assert set(v["shares"]) == set(SHARES)
    assert all(0 <= s <= 1 for s in v["shares"].values())
    assert sum(v["shares"].values()) == pytest.approx(1.0, abs=1e-3)
    assert v["groups"][v["bound"]] == max(v["groups"].values())
