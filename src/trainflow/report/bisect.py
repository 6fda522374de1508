"""`trainflow compare --bisect A B`: where two checkpointed runs that should agree (the same config; other code or
another environment) part, found by replaying them, not guessed.

1. Their committed checkpoints of the same steps are compared (trainflow.report.checkpoints), oldest first: the last
   equal one (or the start, when even the first differs) and the first that differs bracket the divergence.
2. Each run is replayed from that last equal checkpoint by trainflow's own entry point in this Python
   (`<this python> -P -m trainflow train`), with the run's overrides (<run>/.hydra/overrides.yaml) read as data,
   saving a checkpoint every step into <out>/bisect/<a|b>; the replay is stopped (SIGTERM: it saves and exits at the
   next step boundary) once it has saved the bracket's last step. The learning-rate schedule and everything else the
   config decides stay the run's own: only where checkpoints go, how often, and where the run resumes from are
   changed. The exact command is printed before it runs.
3. The replays' checkpoints are compared step by step: the first step with a tensor beyond the tolerance of the
   arithmetic, and that step's first (in the state's order: the model's, then the optimizer's) and largest tensors,
   are the answer. Each replay's last checkpoint is also compared with its run's own, which says whether the replay
   reproduced the run (another commit checked out since, say, would not).

A run folder may come from someone else, so nothing in it decides what runs: the fingerprint's `replay` (the
interpreter, arguments, working directory and environment the run had) is information, never executed. Each
recorded override must be a plain `key=value` of trainflow's config; one that sets Hydra itself (`hydra.*`,
`hydra/launcher`: what runs and where) is refused, and one that names code (a `_target_`) and the run's own config
folders (`--config-dir`, `hydra.searchpath`: YAML that can name code) only with --trust-targets. The replay runs in
<out>/bisect, in the user's environment; of the run's recorded one only the thread counts (they decide the order of
the arithmetic, hence its last bits) are taken, validated as numbers; the code each side imports besides this
Python's packages is the user's to name (--pythonpath-a, --pythonpath-b).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from trainflow.checkpoint.export import Source
from trainflow.checkpoint.store import Committed, list_committed, resolve_dir
from trainflow.errors import CheckpointError
from trainflow.record.fingerprint import code_state
from trainflow.record.summary_file import read_summary
from trainflow.report.checkpoints import compare_sources, default_rtol
from trainflow.report.sides import CompareError
from trainflow.util.files import read_regular
from trainflow.util.rundir import MARKER
from trainflow.util.shown import shell_quoted, shown

REPLAY_TIMEOUT_S = 3600.0
# the keys a replay sets itself: a recorded override of one of them is left out of its command
REPLAYED_KEYS = ("hydra.run.dir", "checkpoint", "checkpoint.enabled", "checkpoint.dir", "checkpoint.every_steps",
                 "checkpoint.keep_last", "checkpoint.resume", "checkpoint.load", "checkpoint.save_final",
                 "checkpoint.export", "logger", "metrics.ledger")
# The only variables of a run's recorded environment its replay takes: they decide how the arithmetic is threaded
# (and so its last bits), and a value that is not of their form is refused. Nothing else a file holds reaches a
# process: not PYTHONPATH (code: --pythonpath-a/-b name it), not LD_PRELOAD or the like.
THREAD_ENV = {"OMP_NUM_THREADS": re.compile(r"[1-9][0-9]{0,3}"), "MKL_NUM_THREADS": re.compile(r"[1-9][0-9]{0,3}"),
              "CUBLAS_WORKSPACE_CONFIG": re.compile(r"(:[0-9]{1,6}:[0-9]{1,4})+")}
# A plain override of trainflow's config: an optional +, ++ or ~, a dotted key (or a group), `=` and a value of one
# line; nothing that starts with `-` (Hydra's options: --config-dir, -m, --cfg ...).
OVERRIDE = re.compile(r"(\+\+|\+|~)?([A-Za-z_][A-Za-z0-9_.\-/@]*)(=[^\x00-\x1f\x7f]*)?")
# a `_target_` key inside a value ({_target_: ...}, quoted or not): a section that would be called
TARGET_IN_VALUE = re.compile(r"_target_['\"]?\s*:")
TRUST_FLAG = "--trust-targets"


def _refused(name: str, path: Path, what: str) -> CompareError:
    return CompareError(f"--bisect {name}: {shown(path)}: {what}")


def _recorded_args(replay: Any, path: Path, name: str) -> list[str]:
    """The replay record's arguments, checked to be what trainflow records (a list of strings)."""
    args = replay.get("args") if isinstance(replay, dict) else None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise _refused(name, path / "summary.json", "fingerprint.replay.args is not a list of strings; the file is "
                       "not trainflow's (run the run again with this trainflow)")
    return args


def overrides_of(path: Path, name: str, trust_targets: bool) -> list[str]:
    """The run's overrides as Hydra saved them (<run>/.hydra/overrides.yaml), each checked to be a plain override of
    trainflow's config (see the module docstring); those the replay sets itself are left out."""
    file = path / ".hydra" / "overrides.yaml"
    if not file.is_file():
        raise _refused(name, file, "missing; bisect replays a run from the overrides Hydra saved (a run of "
                       "trainflow train or train.py)")
    try:
        typed = yaml.safe_load(read_regular(file))  # a YAML tag (!!python/...) is an error here, never an object
    except yaml.YAMLError as exc:
        raise _refused(name, file, f"is not the list of overrides trainflow saves ({shown(str(exc).splitlines()[0])}); "
                       "bisect only runs with the overrides as a run saves them") from None
    if typed is None:
        typed = []
    if not isinstance(typed, list) or not all(isinstance(o, str) for o in typed):
        raise _refused(name, file, "is not a list of key=value strings; bisect only runs with the overrides as a "
                       "run saves them")
    for text in typed:
        check_override(text, name, file, trust_targets)
    return [o for o in typed if o.split("=", 1)[0].lstrip("+~") not in REPLAYED_KEYS]


def check_override(text: str, name: str, file: Path, trust_targets: bool) -> None:
    """One line unless `text` is a plain override of trainflow's config (and names no code, or the user trusts it)."""
    match = OVERRIDE.fullmatch(text)
    if match is None:
        raise _refused(name, file, f"{shell_quoted(text)} is not a plain key=value override of trainflow's config; "
                       "bisect replays nothing else")
    key = match.group(2)
    group, _, package = key.partition("@")  # a group's config placed at a package: under hydra too is Hydra's
    if any(re.match(r"(_global_\.)?hydra([./]|$)", part) for part in (group, package)):
        raise _refused(name, file, f"{shell_quoted(text)} sets Hydra itself (what runs, where, with which "
                       "launcher); bisect replays only trainflow's config")
    names_code = key.rsplit(".", 1)[-1] == "_target_" or TARGET_IN_VALUE.search(match.group(3) or "")
    if names_code and not trust_targets:
        raise _refused(name, file, f"{shell_quoted(text)} names code to import and call (a _target_); bisect runs "
                       f"it only when you trust the run: add {TRUST_FLAG}")


def config_folders(args: list[str], path: Path, name: str, trust_targets: bool) -> list[str]:
    """The run's own config folders (--config-dir DIR, hydra.searchpath=[...]) from its recorded arguments: YAML
    that can name code, so only with --trust-targets."""
    folders: list[str] = []
    for i, arg in enumerate(args):
        if arg in ("--config-dir", "-cd") and i + 1 < len(args):
            folders += ["--config-dir", args[i + 1]]
        elif arg.startswith("hydra.searchpath="):
            folders.append(arg)
    if folders and not trust_targets:
        raise _refused(name, path / "summary.json", f"the run read configs of its own ({shell_quoted(*folders)}), "
                       f"which can name code; bisect uses them only when you trust the run: add {TRUST_FLAG}")
    return folders


def thread_env(replay: Any, path: Path, name: str) -> dict[str, str]:
    """The run's thread counts (THREAD_ENV) as it recorded them, each of its variable's form."""
    env = replay.get("env") if isinstance(replay, dict) else None
    if not isinstance(env, dict):
        return {}
    taken = {}
    for key, form in THREAD_ENV.items():
        value = env.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not form.fullmatch(value):
            raise _refused(name, path / "summary.json", f"fingerprint.replay.env.{key} is {shown(repr(value))}, not "
                           "a value of its form; the file is not trainflow's")
        taken[key] = value
    return taken


def _run(path: Path, name: str, trust_targets: bool) -> dict[str, Any]:
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
    args = _recorded_args(replay, path, name)
    overrides = overrides_of(path, name, trust_targets)
    checkpoint = (summary.get("config") or {}).get("checkpoint") or {}
    committed = list_committed(resolve_dir(checkpoint.get("dir"), path)) if checkpoint.get("enabled") else []
    if not committed:
        raise CompareError(f"--bisect {name}: {path} has no committed checkpoint; bisect runs saved with "
                           "checkpoint=dcp (checkpoint.every_steps sets how finely the search starts)")
    env = replay.get("env") if isinstance(replay.get("env"), dict) else {}
    return {"dir": path, "name": name, "summary": summary, "overrides": overrides,
            "config_folders": config_folders(args, path, name, trust_targets),
            "threads": thread_env(replay, path, name), "recorded_pythonpath": env.get("PYTHONPATH"),
            "ignored_env": sorted(k for k, v in env.items() if v is not None and k not in THREAD_ENV
                                  and k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")),
            "committed": {c.step: c for c in committed},
            "code": (summary.get("fingerprint") or {}).get("code") or {}}


def _compare(a: Path, b: Path, rtol: float) -> dict[str, Any]:
    return compare_sources(Source(a), Source(b), rtol)


def replay_command(run: dict[str, Any], out: Path, resume: Committed | None, keep: int) -> list[str]:
    """trainflow's own entry point in this Python (-P: the folder it runs in is not on sys.path), with the run's
    checked overrides, checkpoints every step into `out`, resumed from `resume` (None: from the start)."""
    return [sys.executable, "-P", "-m", "trainflow", "train", *run["config_folders"], *run["overrides"],
            f"hydra.run.dir={out}", "checkpoint=dcp", f"checkpoint.dir={out / 'checkpoints'}",
            "checkpoint.every_steps=1", f"checkpoint.keep_last={keep}",
            f"checkpoint.resume={resume.path if resume else 'never'}", "logger=none", "metrics.ledger=off"]


def replay_env(run: dict[str, Any], pythonpath: str | None) -> dict[str, str]:
    """What a replay's environment sets beyond the user's own: the run's thread counts, and the code folder the user
    named for this side before their own PYTHONPATH."""
    changed = dict(run["threads"])
    if pythonpath:
        given = [str(Path(p).absolute()) for p in pythonpath.split(os.pathsep) if p]  # against the user's folder
        changed["PYTHONPATH"] = os.pathsep.join([*given, *filter(None, [os.environ.get("PYTHONPATH")])])
    return changed


def shown_command(cmd: list[str], cwd: Path, changed: dict[str, str]) -> str:
    """The replay as a line to paste into a shell: its folder, what it sets in the environment, its command."""
    env = ["env", *(f"{k}={v}" for k, v in changed.items())] if changed else []
    return f"{shell_quoted('cd', cwd)} && {shell_quoted(*env, *cmd)}"


def clear(out: Path) -> None:
    """An earlier bisect's replay folder goes (a run directory trainflow made); anything else there is refused."""
    if out.exists() or out.is_symlink():
        if out.is_symlink() or not (out / MARKER).is_file():
            raise CompareError(f"--out: {out} is in the way of a replay and is no replay of trainflow's (no {MARKER} "
                               "inside); nothing was changed: give another --out")
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)


def replay(run: dict[str, Any], out: Path, resume: Committed | None, until: int,
           pythonpath: str | None) -> dict[str, Any]:
    """Run the replay in out's folder until it has committed step `until` (then SIGTERM: it saves at the next step
    and stops); its command is printed first."""
    keep = until - (resume.step if resume else 0) + 4  # the steps of the bracket and the few past it
    cmd = replay_command(run, out, resume, keep)
    changed = replay_env(run, pythonpath)
    env = {**os.environ, **changed}
    env.pop("HYDRA_FULL_ERROR", None)
    clear(out)
    cwd = out.parent
    line = shown_command(cmd, cwd, changed)
    print(f"replay {run['name']}: {line}", flush=True)
    log = out.parent / f"{out.name}.log"
    started = time.monotonic()
    with open(log, "w") as output:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT,
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
                           f"{shown(tail[0])}; see {log}")
    return {"command": cmd, "cwd": str(cwd), "env": changed, "shown": line, "pythonpath": pythonpath,
            "log": str(log), "saved": saved, "seconds": round(time.monotonic() - started, 1)}


def _environment_warnings(run: dict[str, Any], pythonpath: str | None) -> list[str]:
    """What of the run's recorded environment its replay does not take, said, with how to give it."""
    name, warnings = run["name"], []
    recorded = run["recorded_pythonpath"]
    if isinstance(recorded, str) and recorded and recorded != os.environ.get("PYTHONPATH") and not pythonpath:
        warnings.append(f"{name} ran with PYTHONPATH={shown(recorded)}; its replay imports what this environment "
                        f"does: give {shell_quoted(f'--pythonpath-{name.lower()}', recorded)} to replay with that "
                        "code (after checking it)")
    if run["ignored_env"]:
        warnings.append(f"{name}'s recorded environment also sets {', '.join(shown(k) for k in run['ignored_env'])}: "
                        f"not taken (a replay takes only {', '.join(THREAD_ENV)} from a run's record)")
    return warnings


def _code_moved(run: dict[str, Any], now: dict[str, Any]) -> str | None:
    """The recorded commit, when the checkout bisect runs in is at another one (the replay runs today's code)."""
    recorded = run["code"]
    if not isinstance(recorded, dict) or not recorded.get("commit"):
        return None
    if now.get("commit") == recorded["commit"] and now.get("dirty") == recorded.get("dirty"):
        return None
    ran = f"{shown(run['dir'])} ran at commit {shown(str(recorded['commit'])[:10])}"
    ran += " (dirty)" if recorded.get("dirty") else ""
    if now.get("commit") is None:
        return f"{ran}; bisect runs outside a git checkout, and the replay runs the code this Python imports"
    dirty = " (dirty)" if now.get("dirty") else ""
    return f"{ran}; the checkout bisect runs in is at {str(now['commit'])[:10]}{dirty}: the replay runs what is here"


def bisect(a_path: Path, b_path: Path, out: Path, rtol: float | None, trust_targets: bool = False,
           pythonpaths: tuple[str | None, str | None] = (None, None)) -> dict[str, Any]:
    """The bisect's report; `out` (absolute) holds the replays, `pythonpaths` the code folders the user names for
    A's and B's replays."""
    a, b = _run(a_path, "A", trust_targets), _run(b_path, "B", trust_targets)
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
                              "warnings": []}
    if first_apart is None:
        report["conclusion"] = (f"A and B agree at every checkpoint they share (steps {common[0]}..{common[-1]}, "
                                f"within {tolerance:g}): nothing to bisect")
        report["details"] = []
        return report
    now = code_state(Path.cwd())
    report["warnings"] = [w for run, pythonpath in ((a, pythonpaths[0]), (b, pythonpaths[1]))
                          for w in (*_environment_warnings(run, pythonpath), _code_moved(run, now)) if w]
    resumes = [run["committed"][last_equal] if last_equal is not None else None for run in (a, b)]
    replays = {name: replay(run, out / "bisect" / name, resume, first_apart, pythonpath)
               for name, run, resume, pythonpath in (("a", a, resumes[0], pythonpaths[0]),
                                                     ("b", b, resumes[1], pythonpaths[1]))}
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
