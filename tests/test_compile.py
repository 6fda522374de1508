"""The compile stage: graph-break and recompile reports, fullgraph errors, the numerics gate, the cache.

dynamo logic is tested with the cheap `eager`/`aot_eager` backends; inductor runs end to end once (cold cache).
Models defined here are reached from `python train.py` through `model._target_=test_compile.<Name>`.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.runs import TINY_GPT, Run, one_line_error, train
from torch import nn

from trainflow.compile.compiler import NOT_ASKED
from trainflow.conf import CONFIG_DIR
from trainflow.config.schema import CompileConfig, DataSection, TrainerConfig
from trainflow.data import StreamSampler, SyntheticTokens, make_loader
from trainflow.distributed import DistEnv
from trainflow.errors import ConfigError

CPU_ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
HERE = Path(__file__).resolve().parent
WITH_TEST_MODELS = {"PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
GPT = [o for o in TINY_GPT if not o.startswith("compile=")]  # the tiny GPT, compile left to each test
MLP = ["model=mlp", "data=synthetic", "trainer.batch_size=16", "trainer.log_every=1", "trainer.excluded_steps=1",
       "trainer.eval_steps=2", "logger=none"]


class BranchyMLP(nn.Module):
    """The seed MLP with a Python `if` on a tensor's value: a graph break dynamo cannot trace through."""

    def __init__(self, in_features: int = 100, hidden: int = 256, out_features: int = 10) -> None:
        super().__init__()
        self.hidden = nn.Linear(in_features, hidden)
        self.out = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x).relu()
        if h.mean() > 0:  # data-dependent branch
            h = h * 2
        return self.out(h)


class NormedMLP(nn.Module):
    """An MLP with state beside its weights (batch-norm statistics) and randomness (dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(100, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


_SOURCE, _FIRST_LINE = inspect.getsourcelines(BranchyMLP)
BRANCH_LINE = _FIRST_LINE + next(i for i, line in enumerate(_SOURCE) if "data-dependent branch" in line)
BRANCHY = [*MLP, "model._target_=test_compile.BranchyMLP"]


def scaled_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """A deliberately wrong backend: every graph output comes out 1% too large."""

    def run(*args: torch.Tensor):
        out = gm(*args)
        return type(out)(o * 1.01 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out)

    return run




GRAPHS_SYMBOLIC: list[bool] = []  # what symbolic_recording_backend saw, per graph


def _note_symbolic(gm: torch.fx.GraphModule, example_inputs: list):
    from functorch.compile import make_boxed_func

    GRAPHS_SYMBOLIC.append(any(isinstance(x, torch.SymInt) or isinstance(x, torch.Tensor) and any(
        isinstance(d, torch.SymInt) for d in x.shape) for x in example_inputs))
    return make_boxed_func(gm)


def symbolic_recording_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """aot_eager that notes whether each graph it compiles (forward, then backward) has symbolic (dynamic) shapes."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=_note_symbolic)(gm, example_inputs)


def dynamic_only_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """A backend that compiles dynamic graphs only: a static one fails."""
    if not any(isinstance(x, torch.SymInt) for x in example_inputs):
        raise RuntimeError("no static graphs here")
    return gm


def compile_args(tmp_path: Path, backend: str = "eager") -> list[str]:
    return ["compile=default", f"compile.backend={backend}", f"compile.cache_dir={tmp_path / 'inductor'}"]


def logged(run: Run) -> str:
    return (run.run_dir / "train.log").read_text()


# --- through train.py -----------------------------------------------------------------------------


def test_graph_break_report_names_the_reason_and_the_user_line(tmp_path: Path, run_dir: Path) -> None:
    run = train(run_dir, *BRANCHY, *compile_args(tmp_path), "compile.check=true", "trainer.max_steps=6",
                env=WITH_TEST_MODELS)
    assert run.returncode == 0, run.stderr
    report = run.summary["compile"]
    assert report == json.loads((run_dir / "compile_report.json").read_text())
    assert report["graph_breaks"]["count"] == 1
    brk = report["graph_breaks"]["breaks"][0]
    assert brk["reason"] == "Data-dependent branching"
    assert brk["location"] == f"tests/test_compile.py:{BRANCH_LINE}"
    assert brk["code"] == "if h.mean() > 0:  # data-dependent branch"
    assert "torch.where" in brk["hint"]
    assert report["graphs"] == 4  # before and after the break; for training, then for evaluation (no_grad)
    assert sorted(r["reason"] for r in report["recompiles"]["reasons"]) == [  # evaluation runs under no_grad
        f"forward (resumed after line {BRANCH_LINE}): GLOBAL_STATE changed: grad_mode",
        "forward: GLOBAL_STATE changed: grad_mode"]
    # the compile steps are timed apart and kept out of the steady state
    steady = run.summary["steady_state"]
    assert steady["excluded_steps"] == 1 + report["compile_steps_excluded"] == 2 and steady["steps"] == 4
    assert report["first_step_s"] == report["excluded_step_times_s"][0] > 0
    assert report["compile_time_s"] > 0 and report["steady_step_time_s"] == steady["step_time_s"]
    assert report["check"]["passed"] and report["check"]["grad_rel_error_max"] == 0.0  # eager backend: exact
    assert report["cache"]["state"] == "unused"  # no inductor, nothing cached
    log = logged(run)
    assert log.count("compile report (backend eager") == 1
    assert f"break: Data-dependent branching at tests/test_compile.py:{BRANCH_LINE}" in log


def test_fullgraph_turns_the_first_break_into_one_line(tmp_path: Path, run_dir: Path) -> None:
    run = train(run_dir, *BRANCHY, *compile_args(tmp_path), "compile.fullgraph=true", "trainer.max_steps=3",
                env=WITH_TEST_MODELS)
    line = one_line_error(run, "compile.fullgraph: graph break", f"tests/test_compile.py:{BRANCH_LINE}",
                          "if h.mean() > 0", "Data-dependent branching", "torch.where", "compile.fullgraph=false")
    assert line.startswith("Error: compile.fullgraph:")
    assert not (run_dir / "summary.json").exists()


def test_numerics_check_fails_a_wrong_compiled_function(tmp_path: Path, run_dir: Path) -> None:
    run = train(run_dir, *MLP, *compile_args(tmp_path, "test_compile.scaled_backend"), "compile.check=true",
                "trainer.max_steps=3", env=WITH_TEST_MODELS)
    one_line_error(run, "compile.check: compiled and eager results differ", "fp32 tolerance 1e-04",
                   "compile.backend=aot_eager")
    check = json.loads((run_dir / "compile_report.json").read_text())["check"]
    assert not check["passed"]
    assert check["loss_rel_error"] > check["tolerance"] == 1e-4
    assert 0.005 < check["grad_rel_error_max"] < 0.05  # logits 1% larger: gradients ~1% off
    assert not (run_dir / "summary.json").exists()


@pytest.mark.parametrize(("dynamic", "shape_recompiles", "limit_hit"), [
    ("false", 8, True),
    pytest.param("true", 0, False, marks=pytest.mark.slow),  # in-process tests show dynamic=true's single graph too
])
def test_recompiles_with_varying_lengths(tmp_path: Path, run_dir: Path, dynamic: str, shape_recompiles: int,
                                         limit_hit: bool) -> None:
    lengths = [4, 6, 8, 10, 12, 14, 16, 18, 20, 22]  # ten shapes: more than the recompile limit (8)
    run = train(run_dir, *GPT, *compile_args(tmp_path), f"compile.dynamic={dynamic}", "trainer.max_steps=14",
                f"data.seq_lens=[{','.join(map(str, lengths))}]", "trainer.eval_steps=1")
    assert run.returncode == 0, run.stderr
    report = run.summary["compile"]
    shape = [r for r in report["recompiles"]["reasons"] if "size mismatch" in r["reason"]]
    assert sum(r["count"] for r in shape) == shape_recompiles, report["recompiles"]
    if shape:
        assert shape[0]["reason"].startswith("forward: tensor 'idx' size mismatch at index 1. expected 4, actual ")
    assert report["recompile_limit_hit"] is limit_hit
    assert ("the recompile limit" in logged(run)) is limit_hit
    if limit_hit:
        assert "compile.dynamic=true" in logged(run)
    assert report["compile_steps_excluded"] == len(lengths)
    assert run.summary["steady_state"]["excluded_steps"] == 2 + len(lengths)


@pytest.mark.parametrize(("overrides", "measured"), [
    (["compile.measure_static=true"], True),  # one shape: a static compile measured at the end, and said
    ([], False),  # by default: said, not measured (a second compile is asked for), with how to ask
    (["data.seq_lens=[16,32]"], None),  # two shapes: what dynamic=true is for; nothing measured or said
])
def test_dynamic_true_on_one_input_shape_says_what_it_cost(tmp_path: Path, run_dir: Path, overrides: list[str],
                                                           measured: bool | None) -> None:
    run = train(run_dir, *GPT, *compile_args(tmp_path), "compile.dynamic=true", "trainer.max_steps=4", *overrides)
    assert run.returncode == 0, run.stderr
    report = run.summary["compile"]
    assert report == json.loads((run_dir / "compile_report.json").read_text())
    cost, log = report["dynamic_cost"], logged(run)
    if measured is None:
        assert report["input_shapes"] == [[[8, 16]], [[8, 32]]]  # the batch x tokens the compiled model took
        assert cost is None and "compile: dynamic=true compiled for one input shape" not in log
        return
    assert report["input_shapes"] == [[[8, 32]]] and cost["shape"] == [[8, 32]]
    # the run's first compile (the forward and backward of training; evaluation's no_grad recompile left out)
    assert 0 < cost["dynamic_compile_s"] < report["compile_time_s"]
    said = "compile: dynamic=true compiled for one input shape (8 x 32) that never changed"
    fix = "; set compile.dynamic=false (or null) for fixed shapes"
    if not measured:
        assert cost["skipped"] == NOT_ASKED and cost["static_compile_s"] is None
        assert log.count(f"{said} (its cost against a static compile was not measured: compile.measure_static=true "
                         "times a static compile of the same model against this one at the end of the run, one more "
                         f"compile){fix}") == 1
        return
    assert cost["skipped"] is None and cost["static_compile_s"] > 0 and cost["static_first_pass_s"] > 0
    assert cost["dynamic_pass_ms"] > 0 and cost["static_pass_ms"] > 0 and cost["passes"] == 5
    assert cost["compile_ratio"] == pytest.approx(cost["dynamic_compile_s"] / cost["static_compile_s"])
    assert cost["pass_ratio"] == pytest.approx(cost["dynamic_pass_ms"] / cost["static_pass_ms"])
    assert log.count(f"{said}: its compile took {cost['dynamic_compile_s']:.1f} s against "
                     f"{cost['static_compile_s']:.1f} s static, a forward+backward {cost['dynamic_pass_ms']:.1f} ms "
                     f"against {cost['static_pass_ms']:.1f} ms (measured at the end of this run){fix}") == 1
    # the run's own figures leave the measurement's compile out
    assert report["graphs"] == 2 and [r["reason"] for r in report["recompiles"]["reasons"]] == [
        "forward: GLOBAL_STATE changed: grad_mode"]


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["compile.backend=eager", "compile.mode=max-autotune"], "compile.mode: only the inductor backend takes a mode"),
    (["compile.backend=cudagraphs"], "compile.backend: cudagraphs uses CUDA graphs"),
    (["data.seq_lens=[8,64]"], "data.seq_lens: each length must be in [1, data.seq_len=32]"),
    ([*MLP, "data.seq_lens=[8]"], "data.seq_lens: varies sequence lengths"),
])
def test_validation_names_the_key(overrides: list[str], fragment: str) -> None:
    from hydra import compose, initialize_config_dir

    from trainflow.config.checks import check_config

    base = [] if "model=mlp" in overrides else GPT
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*base, "compile=default", *overrides])
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert str(err.value).startswith(fragment), str(err.value)


def test_inductor_end_to_end_with_a_cold_cache(tmp_path: Path, run_dir: Path) -> None:
    """The one real inductor compile of the suite: a tiny MLP, a fresh cache, the numerics gate on."""
    cache = tmp_path / "inductor"
    run = train(run_dir, *MLP, *compile_args(tmp_path, "inductor"), "compile.fullgraph=true", "compile.check=true",
                "trainer.max_steps=6")
    assert run.returncode == 0, run.stderr
    report = run.summary["compile"]
    assert report["backend"] == "inductor" and report["graph_breaks"]["count"] == 0
    check = report["check"]
    assert check["passed"] and check["loss_rel_error"] < 1e-4 and check["grad_rel_error_max"] < 1e-4
    assert check["grads_compared"] == 4
    assert report["cache"]["dir"] == str(cache) and report["cache"]["state"] == "cold"
    assert report["cache"]["misses"] >= 2  # forward and backward graphs compiled, then stored
    assert any(cache.rglob("*.py")), "inductor wrote no code into the persistent cache"
    # the compile ran inside the check's compiled pass, so it dwarfs a steady step
    assert report["compile_time_s"] > 10 * report["steady_step_time_s"]
    assert check["compiled_pass_s"] >= 0.5 * report["compile_time_s"]


@pytest.mark.slow
def test_warm_cache_makes_the_second_first_step_fast(tmp_path: Path) -> None:
    args = [*MLP, *compile_args(tmp_path, "inductor"), "trainer.max_steps=4"]
    cold = train(tmp_path / "cold", *args).summary["compile"]
    warm = train(tmp_path / "warm", *args).summary["compile"]
    assert cold["cache"]["state"] == "cold" and warm["cache"]["state"] == "warm"
    assert warm["first_step_s"] < 0.5 * cold["first_step_s"]
    assert warm["compile_time_s"] < 0.5 * cold["compile_time_s"]


# --- in process: dynamo logic on the built-in models ----------------------------------------------


@pytest.fixture
def fresh_dynamo(monkeypatch: pytest.MonkeyPatch):
    """dynamo's caches and counters are per process: start each test as a new process would."""
    import torch._dynamo
    from torch._dynamo.utils import clear_compilation_metrics, counters

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # the Compiler sets it; keep it out of other tests

    def reset() -> None:
        torch._dynamo.reset()
        counters.clear()
        clear_compilation_metrics()

    reset()
    yield
    reset()


def make_compiler(tmp_path: Path, **compile_cfg: object):
    from trainflow.compile.compiler import Compiler

    compile_section = CompileConfig(**{"enabled": True, "backend": "eager", "cache_dir": str(tmp_path), **compile_cfg})
    return Compiler(compile_section, TrainerConfig(precision="fp32", grad_accum=1, excluded_steps=0), None, CPU_ENV,
                    tmp_path)


@pytest.mark.parametrize(("scope", "dynamic", "backend", "recompiles"), [
    ("model", False, "eager", 1),  # static: the second length compiles again
    ("model", True, "eager", 0),  # dynamic: one graph for both lengths
    ("blocks", None, "eager", 1),  # automatic dynamic: the second length recompiles once, as dynamic
])
def test_gpt_compiles_with_fullgraph_and_no_breaks(fresh_dynamo: None, tmp_path: Path, scope: str,
                                                   dynamic: bool | None, backend: str, recompiles: int) -> None:
    from trainflow.models.gpt import GPT as GPTModel

    torch.manual_seed(0)
    model = GPTModel(n_layer=3, n_embd=32, n_head=2, block_size=32)
    compiler = make_compiler(tmp_path, fullgraph=True, dynamic=dynamic, scope=scope, backend=backend)
    assert compiler.apply(model) is model
    assert list(dict(model.named_parameters())) == list(dict(GPTModel(n_layer=3, n_embd=32, n_head=2,
                                                                       block_size=32).named_parameters()))
    for length in (16, 32, 16):
        model(torch.randint(256, (2, length))).sum().backward()
    report = compiler.report()
    assert report["graph_breaks"]["count"] == 0
    assert report["recompiles"]["count"] == recompiles, report["recompiles"]
    # blocks share one code object: the three blocks reuse one graph instead of compiling three
    assert report["graphs"] == 1 + recompiles
    assert report["frames_compiled"] == 1


@pytest.mark.parametrize(("compile_cfg", "fragments"), [
    ({"backend": "nosuch"}, ["compile.backend: unknown backend 'nosuch'", "inductor", "aot_eager", "pkg.module.fn"]),
    ({"backend": "no.such.backend"}, ["compile.backend: unknown backend 'no.such.backend'"]),
    ({"scope": "blocks"}, ["compile.scope: blocks", "MLP has no `blocks`", "compile.scope=model"]),
])
def test_unknown_backend_and_a_model_without_blocks_are_refused(fresh_dynamo: None, tmp_path: Path,
                                                                 compile_cfg: dict, fragments: list[str]) -> None:
    from trainflow.models.mlp import MLP as MLPModel

    with pytest.raises(ConfigError) as err:
        make_compiler(tmp_path, **compile_cfg).apply(MLPModel())
    for fragment in fragments:
        assert fragment in str(err.value)


def test_mlp_compiles_with_fullgraph(fresh_dynamo: None, tmp_path: Path) -> None:
    from trainflow.models.mlp import MLP as MLPModel

    model = MLPModel()
    compiler = make_compiler(tmp_path, fullgraph=True, dynamic=True, backend="aot_eager")
    compiler.apply(model)
    for batch in (8, 16):
        model(torch.randn(batch, 100)).sum().backward()
    report = compiler.report()
    assert (report["graphs"], report["graph_breaks"]["count"], report["recompiles"]["count"]) == (1, 0, 0)
    assert report["scope"] == "model"  # compile.scope=null on a model that is not FSDP-sharded: the whole model


def test_measuring_the_static_compile_leaves_the_training_state_as_it_was(fresh_dynamo: None, tmp_path: Path) -> None:
    """The passes at the end of a dynamic=true run: a static graph indeed (dynamo marks the tensors it made dynamic:
    the batch is copied for each pass), and after them the same weights, batch-norm statistics and random stream, no
    gradients left, and the model's own dynamic calls back in place."""
    from trainflow.tasks import Classification

    torch.manual_seed(0)
    model = NormedMLP()
    batch = (torch.randn(16, 100), torch.randint(10, (16,)))
    compiler = make_compiler(tmp_path, dynamic=True, backend="test_compile.symbolic_recording_backend",
                              measure_static=True)
    compiler.apply(model, batch, Classification())
    GRAPHS_SYMBOLIC.clear()
    model(batch[0]).sum().backward()  # a training step's compile, on the example's own tensor
    model.zero_grad(set_to_none=True)
    own_call = model._compiled_call_impl
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    cost = compiler.summary()["dynamic_cost"]
    assert cost["shape"] == [[16, 100]] and cost["static_compile_s"] > 0 and cost["skipped"] is None
    assert GRAPHS_SYMBOLIC == [True, True, False, False]  # the run's dynamic graphs, then the static ones
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in state.items())  # running_mean, num_batches_tracked too
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert model._compiled_call_impl is own_call


def test_a_failing_static_compile_is_reported_and_the_run_keeps_its_summary(fresh_dynamo: None,
                                                                             tmp_path: Path) -> None:
    from trainflow.tasks import Classification

    model = NormedMLP()
    batch = (torch.randn(16, 100), torch.randint(10, (16,)))
    compiler = make_compiler(tmp_path, dynamic=True, backend="test_compile.dynamic_only_backend",
                              measure_static=True)
    compiler.apply(model, batch, Classification())
    model(batch[0]).sum().backward()
    model.zero_grad(set_to_none=True)
    own_call = model._compiled_call_impl
    cost = compiler.summary()["dynamic_cost"]
    assert cost["skipped"] == "the static compile failed (RuntimeError: no static graphs here)"
    assert cost["static_compile_s"] is None
    assert model._compiled_call_impl is own_call and all(p.grad is None for p in model.parameters())
    assert json.loads((tmp_path / "compile_report.json").read_text())["dynamic_cost"] == cost


def test_cache_dir_is_expanded_and_exported_for_inductor(fresh_dynamo: None, tmp_path: Path) -> None:
    target = tmp_path / "nested" / "cache"
    compiler = make_compiler(tmp_path, cache_dir=str(target))
    assert compiler.cache_dir == str(target) and target.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(target)


# --- variable sequence lengths --------------------------------------------------------------------


def test_seq_lens_cut_micro_batches_by_stream_position() -> None:
    data = SyntheticTokens(num_samples=64, vocab_size=256, seq_len=16, seed=0)
    cfg = DataSection(num_workers=0, persistent_workers=False, prefetch_factor=None, seq_lens=[4, 8, 16])
    uncut = replace(cfg, seq_lens=None)
    full = iter(make_loader(data, StreamSampler(64, 4, 0, 2, seed=1), uncut, False))
    cut = iter(make_loader(data, StreamSampler(64, 4, 0, 2, seed=1), cfg, False))
    for k in range(5):
        (x_full, y_full), (x, y) = next(full), next(cut)
        n = (4, 8, 16)[k % 3]
        assert x.shape == y.shape == (4, n) and x.is_contiguous()
        assert torch.equal(x, x_full[:, :n]) and torch.equal(y, y_full[:, :n])  # same samples, in order
    # resuming at stream position 5 micro-batches (4 samples x 2 ranks each) continues the length cycle
    resumed = iter(make_loader(data, StreamSampler(64, 4, 0, 2, seed=1, start=5 * 4 * 2), cfg, False))
    assert [next(resumed)[0].shape[1] for _ in range(3)] == [16, 4, 8]


# --- with the parallel strategies -----------------------------------------------------------------


@pytest.mark.parametrize(("strategy", "scope"), [
    ("fsdp", "blocks"),  # fully_shard per block, then each block compiled in place: hooks stay eager
    pytest.param("ddp", "model", marks=pytest.mark.slow),  # the module inside DDP compiles whole
])
def test_compiled_parallel_training_matches_one_eager_process(tmp_path: Path, run_dir: Path, strategy: str,
                                                              scope: str) -> None:
    run = train(run_dir, *GPT, *compile_args(tmp_path, "aot_eager"), f"compile.scope={scope}",
                "compile.fullgraph=true", f"parallelism={strategy}", "parallelism.nproc_per_node=2",
                "parallelism.check=true", "parallelism.check_steps=3", "trainer.max_steps=4")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = run.summary
    parity = summary["parallelism"]["check"]
    assert parity["passed"] and parity["param_rel_diff"] < 1e-5, parity  # vs an eager single-process reference
    report = summary["compile"]
    assert report["graph_breaks"]["count"] == 0 and report["eager_frames"] == []
    assert report["frames_compiled"] == 1  # the blocks share one compiled frame / the model compiles as one


@pytest.mark.slow
def test_fsdp_with_whole_model_scope_says_what_runs_eager(tmp_path: Path, run_dir: Path) -> None:
    run = train(run_dir, *GPT, *compile_args(tmp_path, "aot_eager"), "parallelism=fsdp", "compile.scope=model",
                "parallelism.nproc_per_node=2", "trainer.max_steps=3")
    assert run.returncode == 0, run.stderr[-3000:]
    report = run.summary["compile"]
    from trainflow.models.gpt import GPT as GPTModel

    forward_line = inspect.getsourcelines(GPTModel.forward)[1]
    assert [f["location"] for f in report["eager_frames"]] == [f"src/trainflow/models/gpt.py:{forward_line}"]
    assert "compile.scope=blocks" in logged(run)
