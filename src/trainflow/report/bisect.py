"""`trainflow compare --bisect A B`: where two checkpointed runs that should agree (the same config; other code or
another environment) part, found by replaying them, not guessed.

1. Their committed checkpoints of the same steps are compared (trainflow.report.checkpoints), oldest first: the last
   equal one (or the start, when even the first differs) and the first that differs bracket the divergence.
2. Each run is replayed from that last equal checkpoint with its own recorded command, working directory and
   environment (the fingerprint's replay: PYTHONPATH and the threads included), saving a checkpoint every step into
   <out>/bisect/<a|b>; the replay is stopped (SIGTERM: it saves and exits at the next step boundary) once it has
   saved the bracket's last step. The learning-rate schedule and everything else the config decides stay the run's
   own: only where checkpoints go, how often, and where the run resumes from are changed.
3. The replays' checkpoints are compared step by step: the first step with a tensor beyond the tolerance of the
   arithmetic, and that step's first (in the state's order: the model's, then the optimizer's) and largest tensors,
   are the answer. Each replay's last checkpoint is also compared with its run's own, which says whether the replay
   reproduced the run (another commit checked out since, say, would not).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from trainflow.checkpoint.export import Source
from trainflow.checkpoint.store import Committed, list_committed, resolve_dir
from trainflow.errors import CheckpointError
from trainflow.report.checkpoints import compare_sources, default_rtol
from trainflow.report.fingerprint import git_state
from trainflow.report.sides import CompareError
from trainflow.report.summary_file import read_summary
from trainflow.util.rundir import MARKER

REPLAY_TIMEOUT_S = 3600.0
# the keys a replay sets itself: a recorded override of one of them is left out of its command
REPLAYED_KEYS = ("hydra.run.dir", "checkpoint", "checkpoint.enabled", "checkpoint.dir", "checkpoint.every_steps",
                 "checkpoint.keep_last", "checkpoint.resume", "checkpoint.load", "checkpoint.save_final",
                 "checkpoint.export", "logger", "metrics.ledger")


def _run(path: Path, name: str) -> dict[str, Any]:
    """A run's summary and committed checkpoints, or one line saying why it cannot be bisected."""
    summary_path = path / "summary.json"
    if not summary_path.is_file():
        raise CompareError(f"--bisect {name}: {path} holds no summary.json; give the folder of a finished, "
                           "checkpointed run")
    summary = read_summary(summary_path)
    replay = (summary.get("fingerprint") or {}).get("replay")
    if not replay:
        raise CompareError(f"--bisect {name}: {path}'s summary.json records no replay command (a run of an older "
                           "trainflow, or not started by train.py or trainflow train); run it again with this one")
    checkpoint = (summary.get("config") or {}).get("checkpoint") or {}
    committed = list_committed(resolve_dir(checkpoint.get("dir"), path)) if checkpoint.get("enabled") else []
    if not committed:
        raise CompareError(f"--bisect {name}: {path} has no committed checkpoint; bisect runs saved with "
                           "checkpoint=dcp (checkpoint.every_steps sets how finely the search starts)")
    return {"dir": path, "summary": summary, "replay": replay, "committed": {c.step: c for c in committed},
            "code": (summary.get("fingerprint") or {}).get("code") or {}}


def _compare(a: Path, b: Path, rtol: float) -> dict[str, Any]:
    return compare_sources(Source(a), Source(b), rtol)


def replay_command(run: dict[str, Any], out: Path, resume: Committed | None, keep: int) -> list[str]:
    """The run's own command, with checkpoints every step into `out`, resumed from `resume` (None: from the start)."""
    replay = run["replay"]
    own = [a for a in replay["args"][3:] if a.split("=", 1)[0].lstrip("+~") not in REPLAYED_KEYS]
    return [replay["python"], *replay["args"][:3], *own, f"hydra.run.dir={out}", "checkpoint=dcp",
            f"checkpoint.dir={out / 'checkpoints'}", "checkpoint.every_steps=1", f"checkpoint.keep_last={keep}",
            f"checkpoint.resume={resume.path if resume else 'never'}", "logger=none", "metrics.ledger=off"]


def clear(out: Path) -> None:
    """An earlier bisect's replay folder goes (a run directory trainflow made); anything else there is refused."""
    if out.exists() or out.is_symlink():
        if out.is_symlink() or not (out / MARKER).is_file():
            raise CompareError(f"--out: {out} is in the way of a replay and is no replay of trainflow's (no {MARKER} "
                               "inside); nothing was changed: give another --out")
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)


def replay(run: dict[str, Any], out: Path, resume: Committed | None, until: int) -> dict[str, Any]:
    """Run the replay until it has committed step `until` (then SIGTERM: it saves at the next step and stops)."""
    keep = until - (resume.step if resume else 0) + 4  # the steps of the bracket and the few past it
    cmd = replay_command(run, out, resume, keep)
    env = {**os.environ, **{k: v for k, v in run["replay"]["env"].items() if v is not None}}
    for key in [k for k, v in run["replay"]["env"].items() if v is None]:
        env.pop(key, None)
    env.pop("HYDRA_FULL_ERROR", None)
    clear(out)
    log = out.parent / f"{out.name}.log"
    started = time.monotonic()
    with open(log, "w") as output:
        proc = subprocess.Popen(cmd, cwd=run["replay"]["cwd"], env=env, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while proc.poll() is None:
                if any(c.step >= until for c in list_committed(out / "checkpoints")):
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=REPLAY_TIMEOUT_S)
                    break
                if time.monotonic() - started > REPLAY_TIMEOUT_S:
                    raise CompareError(f"--bisect: the replay in {out} ran {REPLAY_TIMEOUT_S:.0f} s without reaching "
                                       f"step {until}; see {log}")
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    saved = {c.step: c for c in list_committed(out / "checkpoints")}
    if until not in saved:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise CompareError(f"--bisect: the replay in {out} ended (exit {proc.returncode}) before saving step {until}: "
                           f"{tail[0]}; see {log}")
    return {"command": cmd, "cwd": run["replay"]["cwd"], "pythonpath": run["replay"]["env"].get("PYTHONPATH"),
            "log": str(log), "saved": saved, "seconds": round(time.monotonic() - started, 1)}


def _code_moved(run: dict[str, Any]) -> str | None:
    """The recorded commit, when the checkout it came from is at another one now (the replay runs today's code)."""
    recorded = run["code"]
    if not recorded.get("commit"):
        return None
    now = git_state(Path(run["replay"]["cwd"]))
    if now.get("commit") != recorded["commit"] or now.get("dirty") != recorded.get("dirty"):
        return (f"{run['dir']} ran at commit {recorded['commit'][:10]}{' (dirty)' if recorded.get('dirty') else ''}; "
                f"its checkout is at {str(now.get('commit'))[:10]}{' (dirty)' if now.get('dirty') else ''} now, and "
                "the replay runs what is there")
    return None


def bisect(a_path: Path, b_path: Path, out: Path, rtol: float | None) -> dict[str, Any]:
    a, b = _run(a_path, "A"), _run(b_path, "B")
    common = sorted(a["committed"].keys() & b["committed"].keys())
    if not common:
        raise CompareError(f"--bisect: A's checkpoints (steps {sorted(a['committed'])}) and B's "
                           f"({sorted(b['committed'])}) share no step; give runs saved at the same steps")
    tolerance = rtol if rtol is not None else default_rtol(Source(a["committed"][common[0]].path))
    last_equal: int | None = None
    first_apart = None
    for step in common:
        try:
            result = _compare(a["committed"][step].path, b["committed"][step].path, tolerance)
        except CheckpointError as exc:
            raise CompareError(f"--bisect: {exc}") from None
        if result["differing"] or result["only_in_a"] or result["only_in_b"]:
            first_apart = step
            break
        last_equal = step
    report: dict[str, Any] = {"kind": "bisect", "written": time.strftime("%Y-%m-%d %H:%M:%S"), "rtol": tolerance,
                              "title": f"--bisect {a_path} -> {b_path}",
                              "a": {"run": str(a_path)}, "b": {"run": str(b_path)}, "common_steps": common,
                              "last_equal": last_equal, "first_apart": first_apart, "steps": [], "replays": {},
                              "warnings": [w for w in (_code_moved(a), _code_moved(b)) if w]}
    if first_apart is None:
        report["conclusion"] = (f"A and B agree at every checkpoint they share (steps {common[0]}..{common[-1]}, "
                                f"within {tolerance:g}): nothing to bisect")
        report["details"] = []
        return report
    resumes = [run["committed"][last_equal] if last_equal is not None else None for run in (a, b)]
    replays = {name: replay(run, out / "bisect" / name, resume, first_apart)
               for name, run, resume in (("a", a, resumes[0]), ("b", b, resumes[1]))}
    start = last_equal or 0
    found = None
    for step in range(start + 1, first_apart + 1):
        result = _compare(replays["a"]["saved"][step].path, replays["b"]["saved"][step].path, tolerance)
        worst = max((r["rel"] for r in result["rows"]), default=0.0)
        report["steps"].append({"step": step, "differing": result["differing"], "first": result["first"],
                                "largest": result["largest"], "largest_rel": worst})
        if found is None and result["differing"]:
            found = (step, result)
    faithful = {name: _reproduces(replays[name]["saved"][first_apart], run["committed"][first_apart], tolerance)
                for name, run in (("a", a), ("b", b))}
    for r in replays.values():
        r["saved"] = sorted(r["saved"])
    report["replays"] = replays
    report["faithful"] = faithful
    since = f"step {last_equal}" if last_equal is not None else "the start"
    details = [f"their checkpoints agree up to {since} and differ at step {first_apart}; both were replayed from "
               f"{since} with a checkpoint every step"]
    if found is None:
        report["conclusion"] = (f"the replays agree up to step {first_apart}, where the runs' own checkpoints differ: "
                                "the runs did not replay as they ran")
    else:
        step, result = found
        first, largest = result["first"], result["largest"]
        report.update(first_step=step, first_tensor=first["tensor"], largest_tensor=largest["tensor"])
        report["conclusion"] = (f"A and B part at step {step}: first tensor {first['tensor']} (relative "
                                f"{first['rel']:.3g}, beyond {tolerance:g}); largest {largest['tensor']} "
                                f"({largest['rel']:.3g})")
    for name in ("a", "b"):
        f = faithful[name]
        details.append(f"the replay of {name.upper()} " + ("reproduces" if f["same"] else "does NOT reproduce")
                       + f" its run's checkpoint of step {first_apart} ({f['how']})")
    report["details"] = details
    return report


def _reproduces(replayed: Committed, original: Committed, rtol: float) -> dict[str, Any]:
    result = _compare(original.path, replayed.path, rtol)
    worst = max((r["rel"] for r in result["rows"]), default=0.0)
    same = not (result["differing"] or result["only_in_a"] or result["only_in_b"])
    how = "bit for bit" if worst == 0.0 and same else f"largest relative difference {worst:.3g}"
    return {"same": same, "how": how, "largest_rel": worst}
