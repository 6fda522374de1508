"""The workflow ladder: baseline -> compile -> profile -> scale -> checkpoint as one sweep, each rung gated.

`python train.py -m experiment=ladder` runs one job per rung (conf/ladder/), each
in a fresh process, on the same model, data and global batch. After the sweep
the report callback (trainflow.report.runs) reads every job's summary.json and
metrics.jsonl and evaluates the gates here. A gate compares numbers and says
PASS, FAIL or WARN with them; a gate whose rung did not run or did not finish
says "not evaluated" and why. Any FAIL makes the sweep's exit code non-zero.

Gates:
- baseline.learns: the baseline ran and its loss went down.
- compile.numerics: compile.check (compiled vs eager loss and gradients, one batch, same weights) passed.
- compile.loss_parity: the compiled run's loss at every step is within ladder.loss_rtol of the baseline's.
- compile.graph_breaks: 0 breaks passes; breaks only warn (at each, a compiled graph ends early).
- compile.recompiles: the recompile limit was not hit (beyond it dynamo silently runs eager).
- profile.next_step: the profiler recorded a verdict; its recommended action is the next step.
- scale.ddp / scale.fsdp: the parity check against a one-process reference passed, and the loss curve
  matches the baseline's within ladder.loss_rtol.
- checkpoint.restore: the first save read back equal, and a fresh process resumed from the half-way save with
  the uninterrupted run's first logged loss after it (within ladder.resume_atol: 0 on CPU, where runs repeat
  bit for bit; CUDA's atomics-based backward kernels do not).
- checkpoint.resume_losses: the resumed losses equal the uninterrupted run's (within ladder.resume_atol).
- fp8.loss_parity / fp8.speedup (only when the fp8 rung is in the sweep, on a GPU): the fp8 rung's loss at every
  step within ladder.fp8_rtol of the compile rung's in bf16, and its steady-state step faster than bf16's (a
  speedup of 1 or less FAILs and says to stay in bf16: float8 casts cost more than they save on small matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from trainflow.config.choices import LadderRung
from trainflow.config.schema import LadderConfig
from trainflow.util.tolerance import TOLERANCE

PASS, FAIL, WARN, NOT_EVALUATED = "PASS", "FAIL", "WARN", "NOT EVALUATED"


def half(steps: int) -> int:
    """Where the checkpoint rung saves and the resume rung restarts: half-way, at least step 1."""
    return max(int(steps) // 2, 1)


def step_dir(checkpoint_dir: str, step: int) -> str:
    """The folder of a committed checkpoint, named as trainflow.checkpoint names it."""
    return f"{checkpoint_dir}/step_{int(step):08d}"


LOG_POINTS = 10  # loss figures per rung by default: enough for the curve gates, few host syncs


def log_interval(log_every: int | None, steps: int) -> int:
    """trainer.log_every of a rung: ladder.log_every, or (null) about LOG_POINTS logs a run at a divisor of the
    half-way step. Each log is a host sync, so no rung logs every step unless asked; the logged loss is the mean
    of its interval, and the resume gate compares those means exactly, so the resumed run's intervals must start
    where the uninterrupted run's do: at the half-way step."""
    if log_every is not None:
        return int(log_every)
    target, middle = max(int(steps) // LOG_POINTS, 1), half(steps)
    return max(k for k in range(1, target + 1) if middle % k == 0)


def register_resolvers() -> None:
    """`${trainflow_half:N}`, `${trainflow_step_dir:DIR,STEP}` and `${trainflow_ladder_log_every:EVERY,N}`, used by
    conf/ladder/ and conf/experiment/ladder.yaml."""
    for name, fn in (("trainflow_half", half), ("trainflow_step_dir", step_dir),
                     ("trainflow_ladder_log_every", log_interval)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


@dataclass
class Gate:
    name: str
    status: str
    detail: str  # one line with the numbers
    numbers: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "numbers": self.numbers}


@dataclass
class Rung:
    """What the gates need of one ladder job."""

    kind: str  # which rung of the ladder it is (baseline, compile, ...)
    name: str
    summary: dict[str, Any] | None  # None: the job did not finish
    losses: dict[int, float]  # train loss by step
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.summary is not None


def evaluate(rungs: list[Rung], settings: LadderConfig, precision: str) -> list[Gate]:
    """Every gate of the ladder, in rung order, from the jobs of one sweep; `precision`: the matmuls' arithmetic."""
    by_rung: dict[str, Rung] = {}
    for r in rungs:
        by_rung.setdefault(r.kind, r)
    rtol = settings.loss_rtol or TOLERANCE["ladder.loss_rtol"].get(precision, TOLERANCE["ladder.loss_rtol"]["fp32"])
    gates = _LadderGates(by_rung, rtol, settings.resume_atol)
    fp8_rtol = settings.fp8_rtol or TOLERANCE["ladder.fp8_rtol"]["bf16"]
    return [
        gates.baseline_gate(),
        *gates.compile_gates(),
        gates.profile_gate(),
        gates.scale_gate("ddp"),
        gates.scale_gate("fsdp"),
        *gates.checkpoint_gates(),
        *(gates.fp8_gates(fp8_rtol) if "fp8" in by_rung else []),
    ]


def max_rel_diff(losses: dict[int, float], reference: dict[int, float]) -> tuple[float, int | None, int]:
    """Largest |a - b| / |b| over the steps both curves have: (difference, at step, steps compared)."""
    worst, at = 0.0, None
    common = sorted(set(losses) & set(reference))
    for step in common:
        diff = abs(losses[step] - reference[step]) / max(abs(reference[step]), 1e-12)
        if at is None or diff > worst:
            worst, at = diff, step
    return worst, at, len(common)


class _LadderGates:
    """The gates of one sweep: its rungs by name and the tolerances they are judged with."""

    def __init__(self, by_rung: dict[str, Rung], rtol: float, resume_atol: float) -> None:
        self.by_rung = by_rung
        self.rtol = rtol
        self.resume_atol = resume_atol

    def _missing(self, name: str, *rungs: str) -> Gate | None:
        """Why a gate cannot pass on its rungs: absent (not evaluated), failed (FAIL), or no baseline to compare."""
        for rung_name in rungs:
            rung = self.by_rung.get(rung_name)
            if rung is None:
                return Gate(name, NOT_EVALUATED, f"not evaluated: the {rung_name} rung is not in this sweep "
                            f"(add it: ladder={','.join(LadderRung)})")
            if not rung.finished:
                why = rung.error or "it wrote no summary.json (still running, or killed)"
                if rung_name == "baseline" and name != "baseline.learns":  # the baseline's own gate fails for it
                    return Gate(name, NOT_EVALUATED, f"not evaluated: no baseline to compare with ({why})")
                return Gate(name, FAIL, f"the {rung_name} rung ({rung.name}) failed: {why}")
        return None

    def baseline_gate(self) -> Gate:
        missing = self._missing("baseline.learns", "baseline")
        if missing:
            return missing
        s = self.by_rung["baseline"].summary
        first, last = s["train_loss"]["first"], s["train_loss"]["last"]
        steady = s.get("steady_state") or {}
        speed = (f"{steady['samples_per_sec']:.1f} samples/s ({steady['step_time_s'] * 1e3:.1f} ms/step)"
                 if steady else "steady state not reached")
        ok = first is not None and last is not None and last < first
        return Gate("baseline.learns", PASS if ok else FAIL,
                    f"{s['steps']} steps, {speed}; loss {first:.4f} -> {last:.4f}"
                    + ("" if ok else ": it did not decrease; check optim.lr and the data"),
                    {"steps": s["steps"], "loss_first": first, "loss_last": last,
                     "samples_per_sec": steady.get("samples_per_sec")})

    def _parity(self, rung: str) -> tuple[float, int | None, int]:
        return max_rel_diff(self.by_rung[rung].losses, self.by_rung["baseline"].losses)

    def compile_gates(self) -> list[Gate]:
        gates = []
        missing = self._missing("compile.numerics", "compile")
        if missing:
            gates.append(missing)
        else:
            check = (self.by_rung["compile"].summary.get("compile") or {}).get("check")
            if not check:
                gates.append(Gate("compile.numerics", NOT_EVALUATED,
                                  "not evaluated: the compile rung ran without compile.check=true"))
            else:
                ok = bool(check["passed"])
                gates.append(Gate("compile.numerics", PASS if ok else FAIL,
                                  f"compiled vs eager on one batch: loss rel. error {check['loss_rel_error']:.1e}, "
                                  f"worst gradient ({check['worst_grad']}) rel. error {check['grad_rel_error_max']:.1e}"
                                  f"; tolerance {check['tolerance']:.0e}",
                                  {k: check[k] for k in ("loss_rel_error", "grad_rel_error_max", "tolerance")}))
        missing = self._missing("compile.loss_parity", "compile", "baseline")
        if missing:
            gates.append(missing)
        else:
            diff, at, n = self._parity("compile")
            gates.append(self._curve_gate("compile.loss_parity", "compiled", diff, at, n))
        missing = self._missing("compile.graph_breaks", "compile")
        report = None if missing else self.by_rung["compile"].summary.get("compile") or {}
        if missing:
            gates.append(missing)
            gates.append(self._missing("compile.recompiles", "compile"))
            return gates
        breaks = report["graph_breaks"]["count"]
        first = report["graph_breaks"]["breaks"][0] if breaks else None
        where = f"; first: {first['reason']} at {first['location']}" if first else ""
        gates.append(Gate("compile.graph_breaks", PASS if breaks == 0 else WARN,
                          f"{report['graphs']} graph(s), {breaks} graph break(s){where}",
                          {"graphs": report["graphs"], "graph_breaks": breaks}))
        hit = bool(report["recompile_limit_hit"])
        gates.append(Gate("compile.recompiles", FAIL if hit else PASS,
                          f"{report['recompiles']['count']} recompile(s); limit {report['recompile_limit']} "
                          + ("HIT: functions beyond it run eager" if hit else "not hit")
                          + f"; compile time {report['compile_time_s']:.1f} s",
                          {"recompiles": report["recompiles"]["count"], "limit_hit": hit,
                           "compile_time_s": report["compile_time_s"]}))
        return gates

    def _curve_gate(self, name: str, what: str, diff: float, at: int | None, n: int) -> Gate:
        numbers = {"max_rel_diff": diff, "at_step": at, "steps_compared": n, "tolerance": self.rtol}
        if n == 0:
            return Gate(name, FAIL, f"no common steps between the {what} and the baseline loss curves "
                        "(metrics.jsonl missing or empty)", numbers)
        return Gate(name, PASS if diff <= self.rtol else FAIL,
                    f"{what} vs baseline loss over {n} steps: max rel. difference {diff:.1e} at step {at}; "
                    f"tolerance {self.rtol:.0e}", numbers)

    def profile_gate(self) -> Gate:
        missing = self._missing("profile.next_step", "profile")
        if missing:
            return missing
        prof = self.by_rung["profile"].summary.get("profiler") or {}
        v = prof.get("verdict")
        if not v:
            return Gate("profile.next_step", FAIL, "the profiler recorded no verdict: its window did not close "
                        "before the run ended; raise trainer.max_steps")
        shares = sorted(v["shares"].items(), key=lambda kv: kv[1], reverse=True)[:3]
        top = ", ".join(f"{k.replace('_', ' ')} {s * 100:.0f}%" for k, s in shares)
        return Gate("profile.next_step", PASS,
                    f"{v['bound']} ({v['step_time_ms']:.1f} ms/step over {v['profiled_steps']} profiled steps: "
                    f"{top}); next: {v['action']}",
                    {"bound": v["bound"], "step_time_ms": v["step_time_ms"], "shares": v["shares"],
                     "action": v["action"]})

    def scale_gate(self, rung: str) -> Gate:
        name = f"scale.{rung}"
        missing = self._missing(name, rung, "baseline")
        if missing:
            return missing
        par = self.by_rung[rung].summary.get("parallelism") or {}
        check = par.get("check") or {}
        diff, at, n = self._parity(rung)
        numbers = {"world_size": par.get("world_size"), "max_rel_diff": diff, "at_step": at, "steps_compared": n,
                   "tolerance": self.rtol}
        curve = (f"loss vs baseline over {n} steps: max rel. difference {diff:.1e} at step {at} "
                 f"(tolerance {self.rtol:.0e})")
        if "passed" not in check:
            why = check.get("skipped", "parallelism.check was off")
            return Gate(name, FAIL if diff > self.rtol or n == 0 else WARN,
                        f"{par.get('world_size')} ranks; parity check not run ({why}); {curve}", numbers)
        numbers.update({k: check[k] for k in ("loss_rel_diff", "param_rel_diff")})
        ok = check["passed"] and n > 0 and diff <= self.rtol
        return Gate(name, PASS if ok else FAIL,
                    f"{par.get('world_size')} ranks vs one process after {check['steps']} steps: loss rel. diff "
                    f"{check['loss_rel_diff']:.1e}, parameter rel. diff {check['param_rel_diff']:.1e} "
                    f"(tolerance {check['tolerance']:.0e}); {curve}", numbers)

    def fp8_gates(self, rtol: float) -> list[Gate]:
        """The fp8 rung against the compile rung in bf16: the loss curve, then the speed."""
        names = ("fp8.loss_parity", "fp8.speedup")
        missing = self._missing(names[0], "fp8", "compile")
        if missing:
            return [missing, self._missing(names[1], "fp8", "compile")]
        reference = self.by_rung["compile"].summary
        if reference.get("matmul_math") != "bf16":
            why = (f"not evaluated: the compile rung ran in {reference.get('matmul_math')}, and fp8 is judged "
                   "against bf16; run the ladder with trainer.precision=bf16")
            return [Gate(name, NOT_EVALUATED, why) for name in names]
        diff, at, n = max_rel_diff(self.by_rung["fp8"].losses, self.by_rung["compile"].losses)
        numbers = {"max_rel_diff": diff, "at_step": at, "steps_compared": n, "tolerance": rtol}
        parity = Gate(names[0], PASS if n and diff <= rtol else FAIL,
                      f"fp8 vs bf16 (both compiled) loss over {n} steps: max rel. difference {diff:.1e} at step "
                      f"{at}; tolerance {rtol:.0e}", numbers)
        fast, slow = ((s.get("steady_state") or {}).get("step_time_s")
                      for s in (self.by_rung["fp8"].summary, reference))
        if not fast or not slow:
            return [parity, Gate(names[1], NOT_EVALUATED, "not evaluated: a rung reached no steady state; raise "
                                 "trainer.max_steps")]
        speedup = slow / fast
        speed = Gate(names[1], PASS if speedup > 1 else FAIL,
                     f"fp8 {fast * 1e3:.1f} ms/step vs bf16 {slow * 1e3:.1f} ms/step: {speedup:.2f}x"
                     + ("" if speedup > 1 else "; stay in bf16 (trainer.precision=bf16): float8's casts cost more "
                        "than its matmuls save at this size"),
                     {"speedup": speedup, "fp8_step_time_s": fast, "bf16_step_time_s": slow,
                      "fp8_mfu": self.by_rung["fp8"].summary.get("mfu"), "bf16_mfu": reference.get("mfu")})
        return [parity, speed]

    def checkpoint_gates(self) -> list[Gate]:
        restore = self._missing("checkpoint.restore", "checkpoint", "resume")
        if restore:
            return [restore, self._missing("checkpoint.resume_losses", "checkpoint", "resume")]
        saved, resumed = self.by_rung["checkpoint"], self.by_rung["resume"]
        ck = saved.summary.get("checkpoint") or {}
        at = resumed.summary.get("resumed_from_step")
        steps = saved.summary["steps"]
        expected = half(steps)
        first = min((s for s in saved.losses if s > expected), default=expected + 1)  # the first log after it
        first_diff = (abs(resumed.losses[first] - saved.losses[first])
                      if first in resumed.losses and first in saved.losses else None)
        same_first = first_diff is not None and first_diff <= self.resume_atol
        ok = bool(ck.get("verified")) and at == expected and same_first
        restore = Gate("checkpoint.restore", PASS if ok else FAIL,
                       f"{ck.get('saves', 0)} save(s) at steps {ck.get('steps_saved')}, first save read back "
                       f"{'equal' if ck.get('verified') else 'NOT verified'}; a fresh process resumed from step "
                       f"{at} (expected {expected}); its first logged loss (step {first}) "
                       + ("equals" if first_diff == 0 else f"is within {self.resume_atol:g} of" if same_first
                          else "DIFFERS from") + " the uninterrupted one"
                       + (f" (|diff| {first_diff:.3g})" if first_diff else ""),
                       {"verified": bool(ck.get("verified")), "resumed_from_step": at, "expected_step": expected,
                        "first_step_equal": same_first, "first_step_abs_diff": first_diff})
        later = {s: v for s, v in saved.losses.items() if s > expected}
        common = sorted(set(later) & set(resumed.losses))
        worst = max((abs(resumed.losses[s] - later[s]) for s in common), default=0.0)
        missing_steps = sorted(set(later) - set(resumed.losses))
        ok = bool(common) and not missing_steps and worst <= self.resume_atol
        losses = Gate("checkpoint.resume_losses", PASS if ok else FAIL,
                      f"steps {expected + 1}-{steps}: {len(common)} resumed losses vs uninterrupted, max |diff| "
                      f"{worst:.3g} (tolerance {self.resume_atol:g})"
                      + (f"; {len(missing_steps)} step(s) missing from the resumed run" if missing_steps else ""),
                      {"steps_compared": len(common), "max_abs_diff": worst, "tolerance": self.resume_atol,
                       "missing_steps": len(missing_steps)})
        return [restore, losses]
