"""torch.compile applied on purpose, with a report of what it did (graphs, breaks, recompiles).

Compiling is only worth it when it is measured and understood: this module
compiles the model (or each of its `blocks`), keeps the compile steps out of the
steady-state figures, checks the compiled numerics against eager when asked,
and reports from dynamo's own records (`counters`, `graph_break_reasons`,
`get_compilation_metrics`) what was compiled, where the graph broke and why it
recompiled. torch._dynamo and inductor are imported only when compile is on.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from trainflow.compile.diagnostics import (
    eager_frames,
    first_line,
    function_name,
    graph_breaks,
    reason_hint,
    reason_label,
    recompile_limit,
    source_location,
    user_frame,
)
from trainflow.compile.static_cost import Passes
from trainflow.config.schema import CompileConfig, TrainerConfig
from trainflow.data.loaders import cut, to_device
from trainflow.distributed import DistEnv
from trainflow.distributed.parallelism import local_loss, loss_context, unwrap
from trainflow.distributed.pipeline import StageParts
from trainflow.errors import ConfigError, home_note, unwritable_reason
from trainflow.loop.stages import Phase, Stage, StageContext
from trainflow.loop.state import LoopState
from trainflow.models import model_blocks
from trainflow.tasks import Task
from trainflow.util.activity import Activity, ended, started
from trainflow.util.device import autocast_for, matmul_math
from trainflow.util.files import cannot_write, write_atomic
from trainflow.util.rundir import results_begin
from trainflow.util.tolerance import TOLERANCE, relative_error

log = logging.getLogger(__name__)

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_DYNAMIC_FIX = "set compile.dynamic=true, or use fewer distinct input shapes (e.g. data.seq_lens with few lengths)"
_MAX_LISTED = 20  # reasons kept per kind in compile_report.json
_FSDP_HINT = "with parallelism=fsdp compile each block: compile.scope=blocks"
_STATIC_PASSES = 5  # steady passes of each kind when a static compile is measured against a dynamic one

Shapes = tuple[tuple[int, ...], ...]  # the shapes of one call's tensor arguments


def effective_mode(mode: str | None, world_size: int) -> str | None:
    """inductor's mode for this run: max-autotune turns CUDA graphs on, which DDP and FSDP break (open upstream
    bugs since torch 2.5), so several ranks get its variant without them."""
    if mode == "max-autotune" and world_size > 1:
        return "max-autotune-no-cudagraphs"
    return mode


def default_scope(model: nn.Module) -> str:
    """compile.scope=null: blocks on an FSDP-sharded model with blocks (its forward cannot trace into sharded
    blocks, so compiling the model would leave it eager) and on a pipeline's stages (their forward is the
    schedule's), else the whole model."""
    sharded = _is_fsdp(model) or isinstance(model, StageParts)
    return "blocks" if sharded and model_blocks(unwrap(model)) is not None else "model"


class Compiler(Stage):
    """Compiles the model when `compile.enabled`; reports after the warm-up steps."""

    phase = Phase.OBSERVE
    summary_key = "compile"

    def __init__(self, cfg: CompileConfig, trainer: TrainerConfig, seq_lens: Sequence[int] | None, env: DistEnv,
                 run_dir: Path) -> None:
        """`seq_lens`: data.seq_lens, the micro-batches' lengths (each a shape that compiles); None: one shape."""
        self.cfg = cfg
        self.env = env
        self.run_dir = run_dir
        self.enabled = cfg.enabled
        self.precision = matmul_math(env.device, trainer.precision)
        # Every distinct input shape compiles (or recompiles) once: the steps until each was seen are compile steps.
        self._compile_steps = math.ceil(len(seq_lens) / trainer.grad_accum) if seq_lens else 1
        self._excluded_total = trainer.excluded_steps + self._compile_steps
        self._step_times: list[float] = []
        self._compiles: dict[tuple[str, bool], dict[str, Any]] = {}
        self._check: dict[str, Any] | None = None
        self._logged = False
        self._warned_limit = False
        self._hint: str | None = None  # a fix that fits this setup better than dynamo's generic hint
        self.scope = self.cfg.scope  # null resolved in `apply`, from the model it compiles
        self.cache_dir: str | None = None
        self.mode = effective_mode(self.cfg.mode, env.world_size)
        # an example batch and the task: compile.check's, and what a static compile is measured on
        self._example: tuple[Any, Task] | None = None
        self._seq_lens = seq_lens
        self._model: nn.Module | None = None
        self._compiled: list[nn.Module] = []
        self._shapes: set[Shapes] = set()  # the input shapes the first compiled module was called with
        if self.enabled:
            self.cache_dir = _configure_cache(self.cfg.cache_dir, self.cfg.backend)
            self.backend = _resolve_backend(self.cfg.backend)
            if self.mode != self.cfg.mode and env.is_main:
                log.info("compile.mode: %s without CUDA graphs (%s) on %d ranks: CUDA graphs break under DDP/FSDP",
                         self.cfg.mode, self.mode, env.world_size)

    @classmethod
    def build(cls, ctx: StageContext) -> Compiler:
        seq_lens = ctx.cfg.data.seq_lens
        compiler = cls(ctx.cfg.compile, ctx.cfg.trainer, list(seq_lens) if seq_lens else None,
                       ctx.env, ctx.run_dir)
        compiler._example = (ctx.example, ctx.task)
        return compiler

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return self.apply(model, *(self._example or ()))

    def apply(self, model: nn.Module, example: Any = None, task: Task | None = None) -> nn.Module:
        """Compile in place (parameter names stay as they are); run `compile.check` on `example` if asked (a
        static compile is measured on it too, at the end of a dynamic=true run on one input shape)."""
        if not self.enabled:
            return model
        if example is not None and task is not None:
            self._example = (example, task)
        self.scope = self.cfg.scope or default_scope(model)
        if self.scope == "model" and _is_fsdp(model):
            self._hint = _FSDP_HINT
            if self.env.is_main:
                log.warning("compile.scope=model on an FSDP-sharded model: dynamo cannot trace the calls into "
                            "sharded blocks, so the model's own forward runs eager and only the blocks compile; %s",
                            _FSDP_HINT)
        _declare_compiles()
        self._model, self._compiled = model, self._targets(model)
        for i, module in enumerate(self._compiled):
            self._compile(module, record_shapes=i == 0)  # the others' inputs follow the first's
        if self.cfg.check:
            if example is None or task is None:
                raise ConfigError("compile.check: needs an example batch and a task to compare; set it to false")
            self._check = self._run_check(model, example, task)
        return model

    def excluded_steps(self) -> int:
        """trainer.excluded_steps and then the steps that compile: out of the steady-state figures."""
        return self._excluded_total if self.enabled else 0

    def after_step(self, state: LoopState) -> bool:
        """Keeps the excluded steps' synced wall times; reports once they are done."""
        if state.step_time_s is not None:
            self._step_times.append(state.step_time_s)
            self._poll()
            if len(self._step_times) >= self._excluded_total and not self._logged:
                self._log_report(self.report())
        return False

    def summary(self, steady: dict[str, Any] | None = None) -> dict[str, Any]:
        """The compile report (also written to compile_report.json) with the steady-state step time; with
        dynamic=true on one input shape, what that cost against a static compile (every rank measures it)."""
        if not self.enabled:
            return {"enabled": False}
        report = self.report()  # the run's own, before the measurement compiles anything
        report["dynamic_cost"] = self._dynamic_cost()
        report["steady_step_time_s"] = steady["step_time_s"] if steady else None
        if not self._logged:
            self._log_report(report)
        self._warn_if_limit_hit(report)  # it can be hit after the warm-up too (a new shape late in training)
        if self.env.is_main:
            self._write(report)
        return report

    # --- compiling -------------------------------------------------------------------------------

    def _targets(self, model: nn.Module) -> list[nn.Module]:
        """The whole model, or each block. Under DDP its wrapper's forward stays eager (it breaks the graph by design);
        the module inside still compiles with DDP's bucketed graph splitting, as it runs inside DDP's forward."""
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        if self.scope == "model":
            return [inner]
        inner = unwrap(inner)
        blocks = model_blocks(inner)
        if blocks is None:
            raise ConfigError(
                f"compile.scope: blocks compiles each module of `model.blocks`, but {type(inner).__name__} has "
                "no `blocks` list of modules; use compile.scope=model (or give the model an nn.ModuleList `blocks`)"
            )
        return list(blocks)

    def _compile(self, module: nn.Module, record_shapes: bool) -> None:
        """What `nn.Module.compile` does, plus one-line errors for graph breaks under fullgraph; `record_shapes`:
        the shapes of its tensor arguments are kept (a set of tuples: a microsecond a call)."""
        c = self.cfg
        compiled = self._torch_compile(module, c.dynamic)

        def call(*args: Any, **kwargs: Any) -> Any:
            if record_shapes:
                self._shapes.add(_shapes(args, kwargs))
            try:
                return compiled(*args, **kwargs)
            except Exception as exc:
                error = _explain_compile_failure(exc, c.backend, self._hint)
                if error is None:
                    raise
                if self.env.is_main:
                    self._write(self.report())
                raise error from exc

        module._compiled_call_impl = call  # nn.Module.__call__ runs this instead of its own _call_impl

    def _torch_compile(self, module: nn.Module, dynamic: bool | None) -> Callable[..., Any]:
        return torch.compile(module._call_impl, backend=self.backend, mode=self.mode, fullgraph=self.cfg.fullgraph,
                             dynamic=dynamic)

    def _run_check(self, model: nn.Module, batch: Any, task: Task) -> dict[str, Any]:
        """One batch through the compiled and the eager model, same weights: compare the loss and every gradient."""
        batch = to_device(batch, self.env.device)
        autocast = autocast_for(self.env.device, self.precision)
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

        device = self.env.device
        rng_devices = [device.index or 0] if device.type == "cuda" else []

        def loss_and_grads() -> tuple[float, dict[str, torch.Tensor]]:
            # the same random numbers both times, and the training's random stream untouched
            with loss_context(model):
                with torch.random.fork_rng(devices=rng_devices, device_type=device.type), autocast:
                    torch.manual_seed(0)
                    loss, _ = task(model, batch)
                loss = local_loss(loss)
                loss.backward()
            grads = {n: _local(p.grad).detach().float().clone() for n, p in params if p.grad is not None}
            model.zero_grad(set_to_none=True)
            return float(loss.detach()), grads

        start = time.perf_counter()
        compiled_loss, compiled_grads = loss_and_grads()
        compiled_s = time.perf_counter() - start
        with torch.compiler.set_stance("force_eager"):
            eager_loss, eager_grads = loss_and_grads()
        tolerance = TOLERANCE["compile.check"][self.precision]
        loss_err = abs(compiled_loss - eager_loss) / max(abs(eager_loss), 1e-12)
        worst_name, worst_err = None, 0.0
        for name, ref in eager_grads.items():
            got = compiled_grads.get(name)
            err = math.inf if got is None else relative_error(got, ref)
            if err > worst_err or worst_name is None:
                worst_name, worst_err = name, err
        result = {
            "passed": loss_err <= tolerance and worst_err <= tolerance,
            "precision": self.precision,
            "tolerance": tolerance,
            "loss_eager": eager_loss,
            "loss_compiled": compiled_loss,
            "loss_rel_error": loss_err,
            "grad_rel_error_max": worst_err,
            "worst_grad": worst_name,
            "grads_compared": len(eager_grads),
            "compiled_pass_s": compiled_s,
        }
        if self.env.is_main:
            log.info("compile.check: %s (loss rel. error %.1e, worst gradient %s rel. error %.1e; tolerance %.0e)",
                     "passed" if result["passed"] else "FAILED", loss_err, worst_name, worst_err, tolerance)
        if not result["passed"]:
            self._check = result
            if self.env.is_main:
                results_begin()  # the check's finding is a result: its report stays in the run directory
                self._write(self.report())
            raise ConfigError(
                f"compile.check: compiled and eager results differ beyond the {self.precision} tolerance "
                f"{tolerance:.0e} (loss rel. error {loss_err:.1e}, gradient of {worst_name} rel. error "
                f"{worst_err:.1e}); compile.backend={self.cfg.backend} computes this model differently: try "
                "compile.backend=aot_eager to find the stage at fault, compile.mode=null, or compile=off"
            )
        return result

    # --- reporting -------------------------------------------------------------------------------

    def _poll(self) -> None:
        """Copy dynamo's compilation records (a ring of the last 64) before they roll over."""
        self._compiles.update(self._new_compiles())

    def _new_compiles(self) -> dict[tuple[str, bool], dict[str, Any]]:
        """dynamo's compilation records not yet copied, by (compile id, forward)."""
        # lazy: torch._dynamo costs ~0.4 s at start; only compiled runs need it
        from torch._dynamo.utils import get_compilation_metrics

        new = {}
        for m in get_compilation_metrics():
            key = (m.compile_id or "", bool(m.is_forward))
            if key in self._compiles:
                continue
            seconds = m.entire_frame_compile_time_s
            if not m.is_forward and m.backward_cumulative_compile_time_us is not None:
                seconds = m.backward_cumulative_compile_time_us / 1e6
            new[key] = {
                "function": function_name(m.co_name),
                "location": source_location(m.co_filename, m.co_firstlineno) if m.co_filename else None,
                "seconds": seconds or 0.0,
                "recompile_reason": first_line(m.recompile_reason.split(": ", 1)[-1]) if m.recompile_reason else None,
                "failure": first_line(m.fail_reason) if m.fail_reason else None,
            }
        return new

    def report(self) -> dict[str, Any]:
        """Dynamo's view of this process so far: graphs, breaks, recompiles, the limit, compile time, cache."""
        # lazy: torch._dynamo costs ~0.4 s at start; only compiled runs need it
        from torch._dynamo.utils import counters

        self._poll()
        breaks = graph_breaks()
        recompiles = [c for c in self._compiles.values() if c["recompile_reason"]]
        reasons = Counter(f"{c['function']}: {c['recompile_reason']}" for c in recompiles)
        limit_hit = any(first_line(k).startswith("Dynamo recompile limit exceeded") for k in counters["unimplemented"])
        hits, misses = _cache_counts()
        first = self._step_times[0] if self._step_times else None
        return {
            "enabled": True,
            "backend": self.cfg.backend,
            "mode": self.mode,
            "fullgraph": self.cfg.fullgraph,
            "dynamic": self.cfg.dynamic,
            "scope": self.scope,
            "graphs": counters["stats"]["unique_graphs"],
            "frames_compiled": len({k[0].split("/")[0] for k, c in self._compiles.items() if not c["failure"]}),
            "eager_frames": eager_frames(self._compiles.values(), _MAX_LISTED),
            "graph_breaks": {"count": len(breaks), "breaks": breaks[:_MAX_LISTED]},
            "recompiles": {
                "count": len(recompiles),
                "reasons": [{"reason": r, "count": n} for r, n in reasons.most_common(_MAX_LISTED)],
            },
            "recompile_limit_hit": limit_hit,
            "recompile_limit": recompile_limit(),
            "compile_time_s": sum(c["seconds"] for c in self._compiles.values()),
            "first_step_s": first,
            "excluded_step_times_s": list(self._step_times),
            "compile_steps_excluded": self._compile_steps,
            "cache": {"dir": self.cache_dir, "state": _cache_state(hits, misses), "hits": hits, "misses": misses},
            "check": self._check,
            "input_shapes": [[list(s) for s in shapes] for shapes in sorted(self._shapes)[:_MAX_LISTED]],
            "dynamic_cost": None,  # measured at the end of the run (summary)
        }

    # --- what dynamic=true cost --------------------------------------------------------------------

    def _dynamic_cost(self) -> dict[str, Any] | None:
        """dynamic=true on a run whose input shape never changed, on any rank: what its compile took (the run's own
        records) against a static compile of the same model, measured now, and the steady forward and backward of
        both; said in one line. None when dynamic is false or null, or the shapes changed. Every rank takes part:
        under DDP/FSDP the passes are collective, so the ranks decide together."""
        if self.cfg.dynamic is not True or self._model is None:
            return None
        shapes = sorted(set().union(*self._everyone(self._shapes)))
        if len(shapes) != 1:
            return None
        firsts = {cid for (cid, forward), c in self._compiles.items()
                  if forward and not c["recompile_reason"] and not c["failure"]}  # not evaluation's recompile
        cost: dict[str, Any] = {
            "shape": [list(s) for s in shapes[0]],
            "dynamic_compile_s": sum(c["seconds"] for (cid, _), c in self._compiles.items() if cid in firsts),
            "static_compile_s": None, "compile_ratio": None, "static_first_pass_s": None, "static_cache": None,
            "dynamic_pass_ms": None, "static_pass_ms": None, "pass_ratio": None, "passes": _STATIC_PASSES,
            "skipped": self._why_not_measured(),
        }
        if cost["skipped"] is None:
            try:
                cost.update(self._measure_static())
            except Exception as exc:  # a finished run keeps its summary: the measurement only reports
                cause = getattr(exc, "inner_exception", None) or exc  # a backend's own error, inside dynamo's
                cost["skipped"] = f"the static compile failed ({type(cause).__name__}: {first_line(str(cause))})"
        if cost["static_compile_s"]:
            cost["compile_ratio"] = cost["dynamic_compile_s"] / cost["static_compile_s"]
            cost["pass_ratio"] = cost["dynamic_pass_ms"] / cost["static_pass_ms"]
        if self.env.is_main:
            log.info("%s", _dynamic_cost_line(cost))
        return cost

    def _why_not_measured(self) -> str | None:
        if not self.cfg.measure_static:
            return NOT_ASKED
        if isinstance(self._model, StageParts):
            return "a pipeline's stages run by its schedule, not by one forward"
        if self._example is None:
            return "no example batch"
        return None

    def _measure_static(self) -> dict[str, Any]:
        """The same model compiled static on the example batch (cut as data.seq_lens cuts it), against the run's
        dynamic graphs: the static compile's records and first pass, then alternating steady passes of both."""
        # lazy: torch._dynamo costs ~0.4 s at start; only compiled runs need it
        from torch._dynamo import config as dynamo_config

        example, task = self._example
        batch = to_device(example, self.env.device)
        if self._seq_lens and len(set(self._seq_lens)) == 1:
            batch = cut(batch, self._seq_lens[0])
        static = [self._torch_compile(m, dynamic=False) for m in self._compiled]
        seen = set(self._shapes)
        with Passes(self._model, self._compiled, task, batch, self.env.device, self.precision) as passes:
            passes.run(passes.own_calls)  # the run's graphs: compiled already for this shape
            same, self._shapes = self._shapes == seen, seen
            if not all(self._everyone(same)):
                return {"skipped": "the example batch (the data's first items) is not of the run's input shape"}
            self._poll()  # what that pass compiled (nothing, normally) is not the static compile's
            cache_before = _cache_counts()
            with dynamo_config.patch(recompile_limit=recompile_limit() + 1):  # one more graph per frame
                first_s = passes.run(static)
            records = self._new_compiles().values()
            hits, misses = (now - then for now, then in zip(_cache_counts(), cache_before, strict=True))
            dynamic_ms, static_ms = passes.steady_ms(passes.own_calls, static, _STATIC_PASSES)
        return {"static_compile_s": sum(c["seconds"] for c in records), "static_first_pass_s": first_s,
                "static_cache": _cache_state(hits, misses), "dynamic_pass_ms": dynamic_ms, "static_pass_ms": static_ms}

    def _everyone(self, mine: Any) -> list[Any]:
        """Every rank's `mine` (this rank's alone without a process group)."""
        if not self.env.distributed:
            return [mine]
        everyone: list[Any] = [None] * self.env.world_size
        torch.distributed.all_gather_object(everyone, mine)
        return everyone

    def _warn_if_limit_hit(self, r: dict[str, Any]) -> None:
        if r["recompile_limit_hit"] and not self._warned_limit and self.env.is_main:
            self._warned_limit = True
            log.warning("compile: the recompile limit (torch._dynamo.config.recompile_limit=%s) was hit: the "
                        "functions that hit it now run EAGER, uncompiled, for new shapes; fix: %s",
                        r["recompile_limit"], _DYNAMIC_FIX)

    def _log_report(self, r: dict[str, Any]) -> None:
        """The short block, once, on rank 0."""
        self._logged = True
        self._warn_if_limit_hit(r)
        if not self.env.is_main:
            return
        lines = [
            f"compile report (backend {r['backend']}, mode {r['mode'] or 'default'}, scope {r['scope']}, "
            f"dynamic {_yaml(r['dynamic'])}, fullgraph {_yaml(r['fullgraph'])}):",
            f"  graphs {r['graphs']}, graph breaks {r['graph_breaks']['count']}, recompiles {r['recompiles']['count']}"
            f", compile time {r['compile_time_s']:.1f} s, first step "
            + (f"{r['first_step_s']:.2f} s" if r["first_step_s"] is not None else "n/a")
            + f" (inductor cache {r['cache']['state']}: {r['cache']['dir']})",
        ]
        lines += [f"  break: {b['reason']} at {b['location']}" + (f": {b['code']}" if b["code"] else "")
                  for b in r["graph_breaks"]["breaks"][:5]]
        lines += [f"  recompile x{x['count']}: {x['reason']}" for x in r["recompiles"]["reasons"][:5]]
        lines += [f"  not compiled (runs eager): {f['function']} at {f['location']}: {f['reason']}"
                  for f in r["eager_frames"][:5]]
        log.info("\n".join(lines))

    def _write(self, report: dict[str, Any]) -> None:
        write_atomic(self.run_dir / "compile_report.json", json.dumps(report, indent=2, default=str))


def _shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Shapes:
    """The shapes of a call's tensor arguments, positional then named."""
    return (*(a.shape for a in args if isinstance(a, torch.Tensor)),
            *(v.shape for v in kwargs.values() if isinstance(v, torch.Tensor)))


# why the static compile was not timed, by default: what it would tell, and how to ask for it
NOT_ASKED = ("compile.measure_static=true times a static compile of the same model against this one at the end of "
             "the run, one more compile")


def _dynamic_cost_line(cost: dict[str, Any]) -> str:
    shape = ", ".join(" x ".join(map(str, s)) for s in cost["shape"])
    line = f"compile: dynamic=true compiled for one input shape ({shape}) that never changed"
    if cost["skipped"]:
        line += f" (its cost against a static compile was not measured: {cost['skipped']})"
    else:
        line += (f": its compile took {cost['dynamic_compile_s']:.1f} s against {cost['static_compile_s']:.1f} s "
                 f"static, a forward+backward {cost['dynamic_pass_ms']:.1f} ms against {cost['static_pass_ms']:.1f} "
                 "ms (measured at the end of this run)")
    return line + "; set compile.dynamic=false (or null) for fixed shapes"


def _cache_counts() -> tuple[int, int]:
    """Hits and misses of inductor's and AOTAutograd's caches in this process so far."""
    from torch._dynamo.utils import counters  # lazy: torch._dynamo costs ~0.4 s at start; only compiled runs need it

    return (counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"],
            counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"])


def _cache_state(hits: int, misses: int) -> str:
    return "warm" if hits and not misses else "cold" if misses and not hits else "partial" if hits else "unused"


def _is_fsdp(model: nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    return isinstance(model, FSDPModule)


def _configure_cache(cache_dir: str | None, backend: str) -> str:
    """Point inductor's persistent cache at `compile.cache_dir` before inductor is imported (null: torch's own).

    The folder is made and written to once here: an unwritable cache would otherwise fail the first compile and
    read as a failing backend.
    """
    if cache_dir:
        os.environ[CACHE_ENV] = str(Path(cache_dir).expanduser().resolve())  # inherited by ranks started from here
    elif backend != "inductor":
        return os.environ.get(CACHE_ENV) or "torch default (/tmp/torchinductor_<user>)"
    # lazy: torch._inductor costs ~0.4 s at start; only compiled runs need it
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    try:
        path = inductor_cache_dir()  # the env var or torch's default, made if missing
    except OSError as exc:
        raise _unwritable_cache(Path(os.environ[CACHE_ENV]), cache_dir, exc) from None
    if (exc := cannot_write(path)) is not None:
        raise _unwritable_cache(Path(os.environ[CACHE_ENV]), cache_dir, exc)
    return path


def _unwritable_cache(path: Path, configured: str | None, exc: OSError) -> ConfigError:
    return ConfigError(f"compile.cache_dir: cannot write the inductor cache in {path}{home_note(configured or '')} "
                       f"({unwritable_reason(path, exc)}); point compile.cache_dir at a writable folder")


def _resolve_backend(name: str) -> str | Callable[..., Any]:
    """A registered dynamo backend by name, or a backend function by dotted path (`pkg.module.fn`)."""
    from torch._dynamo import list_backends  # lazy: torch._dynamo costs ~0.4 s at start; only compiled runs need it

    known = list_backends(exclude_tags=())
    if name in known:
        return name
    module, _, attr = name.rpartition(".")
    if module:
        try:
            backend = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            backend = None
        if callable(backend):
            return backend
    raise ConfigError(f"compile.backend: unknown backend {name!r}; use one of {', '.join(sorted(known))} "
                      "or a dotted path to a backend function (pkg.module.fn)")


def _explain_compile_failure(exc: Exception, backend: str, hint: str | None = None) -> ConfigError | None:
    """A one-line ConfigError for compile failures a user can act on; None for anything else."""
    from torch._dynamo import exc as dynamo_exc  # lazy: torch._dynamo costs ~0.4 s at start; only compiled runs need it

    if isinstance(exc, getattr(dynamo_exc, "FailOnRecompileLimitHit", ())):
        return ConfigError(f"compile.fullgraph: the recompile limit ({recompile_limit()}) was hit, which fullgraph "
                           f"forbids; {_DYNAMIC_FIX}")
    if isinstance(exc, dynamo_exc.Unsupported):
        label = reason_label(exc.gb_type or str(exc))
        frame = user_frame(getattr(exc, "real_stack", None) or [])
        where = f" at {source_location(frame.filename, frame.lineno)}" if frame else ""
        code = f" (`{frame.line.strip()}`)" if frame and frame.line else ""
        fix = hint or reason_hint(str(exc), label)
        return ConfigError(f"compile.fullgraph: graph break{where}{code}: {label}; fix: {fix}, "
                           "or set compile.fullgraph=false to let it break and see compile_report.json")
    if isinstance(exc, dynamo_exc.BackendCompilerFailed) and isinstance(exc.inner_exception, OSError):
        cache = os.environ.get(CACHE_ENV)  # a cache made unwritable after the check at start, or a full disk
        if cache and exc.inner_exception.filename and str(exc.inner_exception.filename).startswith(cache):
            return _unwritable_cache(Path(cache), None, exc.inner_exception)
    if isinstance(exc, dynamo_exc.BackendCompilerFailed):
        return ConfigError(f"compile.backend: the {backend} backend failed to compile the model "
                           f"({first_line(str(exc.inner_exception))}); try compile.backend=aot_eager, or compile=off")
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 gradients), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value).lower()


def _compile_started(_: object) -> None:
    started(Activity.COMPILING)


def _compile_ended(_: object) -> None:
    ended(Activity.COMPILING)


def _declare_compiles() -> None:
    """From now on, a compile (the first, and every recompile, on whichever step) declares itself to the watchdog,
    through dynamo's own compile callbacks: it makes no step for a while and is not a hang. Registered again when
    they are gone: `torch._dynamo.reset()` (a user's, or a test's) clears every callback."""
    # lazy: torch._dynamo costs ~0.4 s at start; only compiled runs need it
    from torch._dynamo.callback import callback_handler

    if _compile_started not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_compile_started)
    if _compile_ended not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(_compile_ended)
