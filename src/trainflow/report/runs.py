"""Sweep reports: the runs under a folder side by side, as report.md, report.json and report.png.

A run is a folder holding a summary.json (it finished) or a `.hydra/` folder
without one (a sweep job that failed or is still running: it appears with the
line that says why). Each row: the run's overrides, steady-state throughput and
its speedup against the baseline run (the ladder's baseline rung, the one named,
or else the first) where it does the baseline's work, only at other speed
settings (SPEED_KEYS: a learning-rate or step-count sweep gets no speedup, and
says why), MFU, peak memory, first/last loss, the compile figures, the
profiler verdict and the checkpoint times. The picture: throughput per run as
bars, and every run's loss curve from its metrics.jsonl.

A sweep of the workflow ladder (`experiment=ladder`) also gets the gates of
trainflow.report.ladder; a FAIL makes `trainflow report` and the sweep exit non-zero.
`ReportCallback` writes the report into every multirun sweep directory: after
each job (so a sweep that stops early still has one) and once more at the end.
This module gathers the runs and builds the report; trainflow.report.render
draws its pages.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from trainflow.config.schema import LadderConfig, TrainerConfig, WorkerConfig, typed
from trainflow.errors import ConfigError, ReceivedFileError, TrainflowError
from trainflow.loggers.mlflow import finish_sweep
from trainflow.metrics.noise import read_metrics_log
from trainflow.record.summary_file import read_summary
from trainflow.report import ladder
from trainflow.report.render import markdown, write_png
from trainflow.util.files import SMALL_FILE_BYTES, read_regular, write_atomic
from trainflow.util.locks import LOCK_FILE
from trainflow.util.rank import env_rank
from trainflow.util.shown import shown

log = logging.getLogger(__name__)

FAILURE_FILE = "failure.txt"  # written into a failed job's folder: the line that says why
EXIT_GATE_FAILED = 1  # `trainflow report` and a sweep whose ladder gate failed (user errors exit 2)
REPORT_FILES = ("report.md", "report.json", "report.png")


class ReportError(TrainflowError):
    """A folder or file the report cannot use, explained with the fix."""


@dataclass
class RunRecord:
    """One run as the report sees it."""

    name: str  # path relative to the report's folder ("." for the folder itself)
    dir: Path
    overrides: list[str]
    rung: str | None
    summary: dict[str, Any] | None
    losses: dict[int, float] = field(default_factory=dict)
    error: str | None = None
    status: str = "finished"  # finished | failed | running | interrupted (run_status)
    skipped_lines: int = 0  # lines of its metrics.jsonl left out (cut off, or of another shape)

    def figure(self, *keys: str) -> Any:
        """summary[k1][k2]..., None where any level is missing."""
        value: Any = self.summary
        for key in keys:
            if not isinstance(value, dict):
                return None
            value = value.get(key)
        return value


def find_runs(root: Path) -> list[Path]:
    """Run folders under `root` (itself included), in job order for sweeps and path order otherwise."""
    if not root.exists():
        raise ReportError(f"{root}: no such folder; give a run folder, a sweep folder (multirun/<sweep name>) "
                          "or a folder holding them (e.g. outputs)")
    if not root.is_dir():
        raise ReportError(f"{root}: is a file, not a folder; give the folder of a run (the one holding "
                          "summary.json) or of a sweep")
    found = []
    for here, dirs, files in os.walk(root):
        if "summary.json" in files or ".hydra" in dirs:
            found.append(Path(here))
            dirs.clear()  # a run's own subfolders (checkpoints, profile, ...) hold no runs
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # any name: a run may be called `profile`
    if not found:
        raise ReportError(f"{root}: no runs found (no summary.json or .hydra folder below it); point trainflow "
                          "report at a run or sweep folder, e.g. outputs or multirun/<sweep name>")
    return sorted(found, key=lambda p: _order(p.relative_to(root)))


def _order(rel: Path) -> tuple:
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in rel.parts)


def load_run(path: Path, root: Path) -> RunRecord:
    """Read a run's summary, loss curve, overrides, ladder rung and (if it failed) the reason. Each file is read only
    when it is a regular file of bounded size and has the shape trainflow writes; anything else is one
    ReceivedFileError naming the file (and the field)."""
    summary = None
    summary_path = path / "summary.json"
    if os.path.lexists(summary_path):
        summary = read_summary(summary_path)
    overrides = read_overrides(path / ".hydra" / "overrides.yaml")
    rung = ((summary.get("config") or {}).get("ladder") or {}).get("rung") if summary else None
    if summary is None and (path / ".hydra" / "config.yaml").exists():
        rung = _saved_rung(path / ".hydra" / "config.yaml")
    status, error = run_status(path, summary)
    log_file = read_metrics_log(path / "metrics.jsonl")
    name = str(path.relative_to(root)) if path != root else "."
    return RunRecord(name, path, overrides, rung, summary, losses_of(log_file.entries), error, status,
                     log_file.skipped)


def read_overrides(path: Path) -> list[str]:
    """A run's `.hydra/overrides.yaml`: the list of strings Hydra writes there (none when there is no file), read
    with a safe YAML loader (a tag in a received file constructs nothing); anything else is one ReceivedFileError."""
    if not os.path.lexists(path):
        return []
    loaded = _safe_yaml(path)
    if not isinstance(loaded, list) or not all(isinstance(o, str) for o in loaded):
        held = "items that are not text" if isinstance(loaded, list) else f"a {type(loaded).__name__}"
        raise ReceivedFileError(f"{shown(path)}: is not the list of overrides Hydra writes (it holds {held}); rerun "
                                "the run, or leave its folder out")
    return loaded


def _saved_rung(path: Path) -> str | None:
    """ladder.rung of a run's `.hydra/config.yaml` (the rung of a job that wrote no summary yet)."""
    config = _safe_yaml(path)
    ladder = config.get("ladder") if isinstance(config, dict) else None
    rung = ladder.get("rung") if isinstance(ladder, dict) else None
    if rung is not None and not isinstance(rung, str):
        raise ReceivedFileError(f"{shown(path)}: ladder.rung is not text; rerun the run, or leave its folder out")
    return rung


def _safe_yaml(path: Path) -> Any:
    """A YAML file of a run folder, read by yaml.safe_load (plain data only: a tag such as !!python/object is
    refused, never constructed), as a regular file of bounded size."""
    try:
        return yaml.safe_load(read_regular(path, SMALL_FILE_BYTES))
    except yaml.YAMLError as exc:
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ReceivedFileError(f"{shown(path)}: not the plain YAML Hydra writes ({shown(problem)}); rerun the run, "
                                "or leave its folder out") from None


def run_status(path: Path, summary: dict[str, Any] | None) -> tuple[str, str | None]:
    """finished, failed (its failure.txt says why), running (a live process holds its lock), or interrupted (it
    stopped on a signal after a checkpoint, or died without a word): the same command resumes or reruns it."""
    stopped = ((summary or {}).get("checkpoint") or {}).get("stopped_by")
    if summary is not None and not stopped:
        return "finished", None
    if stopped:
        return "interrupted", (f"stopped by {stopped} at step {summary.get('steps')} after a committed checkpoint; "
                               "the same command resumes it")
    failure = path / FAILURE_FILE
    if os.path.lexists(failure):
        return "failed", read_regular(failure, SMALL_FILE_BYTES).decode(errors="replace").strip()
    if _lock_holder_alive(path):
        return "running", "still training (no summary.json yet)"
    return "interrupted", "no summary.json and no process at work on it: it was killed or never finished; the same " \
                          "command runs it again (from its newest committed checkpoint, if any)"


def _lock_holder_alive(path: Path) -> bool:
    """Whether the process named in the run's lock file (trainflow.util.locks: "pid N on HOST, ...") is alive here;
    a lock that is no regular file of a lock's size is nobody's."""
    try:
        text = read_regular(path / LOCK_FILE, SMALL_FILE_BYTES).decode(errors="replace")
    except ReceivedFileError:
        return False
    match = re.match(r"pid (\d+) on (\S+?),", text)
    if match is None or match.group(2) != socket.gethostname() or not 0 < int(match.group(1)) < 2**31:
        return False  # pid 0 would ask about this process group, a larger one overflows kill(2)
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def losses_of(entries: list[dict[str, Any]]) -> dict[int, float]:
    """The train loss by step; a step logged twice (a run resumed in place) keeps its last value."""
    return {entry["step"]: float(entry["train/loss"]) for entry in entries if entry.get("train/loss") is not None}


def build(root: Path, baseline: str | None = None) -> dict[str, Any]:
    """The report's content: rows, the baseline, the common overrides, and the ladder's gates if it is one."""
    runs = [load_run(p, root) for p in find_runs(root)]
    base = _pick_baseline(runs, baseline, root)
    common = [o for o in runs[0].overrides if all(o in r.overrides for r in runs)] if len(runs) > 1 else []
    base_sps = base.figure("steady_state", "samples_per_sec") if base else None
    rows = [_row(r, common, base_sps, _not_comparable(r, base)) for r in runs]
    report: dict[str, Any] = {
        "folder": str(root.resolve()),
        "written": time.strftime("%Y-%m-%d %H:%M:%S"),
        "baseline": base.name if base else None,
        "common_overrides": common,
        "runs": rows,
        "gates": None,
        "passed": None,
    }
    rungs = [ladder.Rung(r.rung, r.name, r.summary, r.losses, r.error) for r in runs if r.rung]
    if rungs:
        gates = [g.as_dict() for g in ladder.evaluate(rungs, *_gate_settings(runs))]
        report["gates"] = gates
        report["passed"] = not any(g["status"] == ladder.FAIL for g in gates)
    busy = {r.name: w for r in runs if (w := load_warning(r))}
    report["warnings"] = [*busy.values(), *(f"{r.dir / 'metrics.jsonl'}: {r.skipped_lines} line(s) left out (cut "
                                            "off, or not of the shape trainflow writes)" for r in runs
                                            if r.skipped_lines)]
    report["busy_runs"] = list(busy)  # their speed measured the machine's load too
    report["_runs"] = runs  # for the picture; dropped before writing JSON
    return report


def _pick_baseline(runs: list[RunRecord], wanted: str | None, root: Path) -> RunRecord | None:
    if wanted is not None:
        wanted = str(wanted)  # a sweep job's number may come as an int from the callback's config
        for r in runs:
            if r.name == wanted.rstrip("/"):
                return r
        raise ReportError(f"baseline {wanted!r}: no such run under {root}; use one of: "
                          f"{', '.join(r.name for r in runs)}")
    baseline_rungs = [r for r in runs if r.rung == "baseline"]
    return baseline_rungs[0] if baseline_rungs else runs[0]


def _gate_settings(runs: list[RunRecord]) -> tuple[LadderConfig, str]:
    """The ladder section (its tolerances) and the matmuls' arithmetic of a finished ladder job (all jobs share
    them); the schema's defaults when no job finished."""
    for r in runs:
        cfg = (r.summary or {}).get("config") or {}
        if r.rung and cfg:
            trainer = typed(cfg.get("trainer") or {}, TrainerConfig, "trainer")
            known = {k: v for k, v in (cfg.get("ladder") or {}).items() if k in LadderConfig.__dataclass_fields__}
            return typed(known, LadderConfig, "ladder"), r.summary.get("matmul_math") or trainer.precision
    return LadderConfig(), TrainerConfig.precision


OVERLOAD = 1.5  # the load average, per core, above which a run waited for cores it did not use itself


def load_warning(r: RunRecord) -> str | None:
    """A run whose machine was well busier than its cores when it ended (the 1-minute load average above 1.5x the
    cores: a run keeps every core busy by itself, so up to the core count is its own load): its processes waited
    for a core, so its speed figures (and any speedup against it) measure the machine's load too."""
    load, cores = r.figure("host", "load_average"), r.figure("host", "cpu_cores")
    if not load or not cores or load[0] <= OVERLOAD * cores:
        return None
    return (f"{r.name}" + (f" ({r.rung})" if r.rung else "") + f": the load average was {load[0]:.1f} on "
            f"{cores} cores at its end, so its timings include waiting for a core; rerun it on an idle machine "
            "before trusting its speed")


# The settings that change how fast a run does its work, never the work (what it computes, on what, for how long):
# a run whose overrides differ from the baseline's only in these has a speedup against it. A ladder's rungs differ in
# exactly these (`ladder=<rung>` sets them); trainer.batch_size and grad_accum are the batch's layout, compared only
# at the same global batch (_not_comparable).
SPEED_KEYS = ("compile", "parallelism", "trainer.precision", "trainer.batch_size", "trainer.grad_accum",
              "trainer.device", "trainer.log_every", "profiler", "checkpoint", "logger", "metrics", "hydra", "ladder",
              *(f"data.{key}" for key in WorkerConfig.__dataclass_fields__))


def _not_comparable(r: RunRecord, base: RunRecord | None) -> str | None:
    """Why `r`'s speed does not compare with the baseline's: another model, other data (its loader's worker
    settings aside: they are speed knobs), another global batch, or an override that changes the work (SPEED_KEYS
    aside); None when it compares (or either is unknown)."""
    if base is None or r is base or r.summary is None or base.summary is None:
        return None
    differ = [what for what, keys in (("model", ("config", "model")), ("tokenizer", ("config", "tokenizer")),
                                      ("global batch", ("global_batch",)))
              if r.figure(*keys) != base.figure(*keys)]
    data, base_data = (_data_identity(x.figure("config", "data")) for x in (r, base))
    if data != base_data:
        differ.insert(1, "data")
    if differ:
        return f"another {', '.join(differ)} than the baseline {base.name}"
    work = _work_keys(r.overrides, base.overrides)
    return (f"another {', '.join(work)} than the baseline {base.name}: other work, not the same work at another "
            "speed" if work else None)


def _work_keys(overrides: list[str], base_overrides: list[str]) -> list[str]:
    """The keys, other than SPEED_KEYS, that one list of overrides sets and the other does not set alike."""
    keys = {_override_key(o) for o in set(overrides) ^ set(base_overrides)}
    return sorted(k for k in keys if not any(k == s or k.startswith(f"{s}.") for s in SPEED_KEYS))


def _override_key(override: str) -> str:
    """The config key an override sets: `+trainer.x=1` -> trainer.x, `hydra/launcher=process` -> hydra.launcher,
    `model@sub=mlp` -> model."""
    return override.split("=", 1)[0].lstrip("+~").split("@", 1)[0].replace("/", ".")


def _data_identity(data: dict[str, Any] | None) -> dict[str, Any] | None:
    """The data section without its loader's worker settings."""
    return {k: v for k, v in data.items() if k not in WorkerConfig.__dataclass_fields__} if data else data


def _row(r: RunRecord, common: list[str], base_sps: float | None, not_compared: str | None) -> dict[str, Any]:
    sps = r.figure("steady_state", "samples_per_sec")
    comp = r.figure("compile") or {}
    verdict = r.figure("profiler", "verdict") or {}
    ckpt = r.figure("checkpoint") or {}
    return {
        "name": r.name,
        "rung": r.rung,
        "overrides": [o for o in r.overrides if o not in common],
        "status": r.status,
        "error": r.error,
        "steps": r.figure("steps"),
        "world_size": r.figure("world_size"),
        "device": r.figure("device"),
        "samples_per_sec": sps,
        "tokens_per_sec": r.figure("steady_state", "tokens_per_sec"),
        "step_time_s": r.figure("steady_state", "step_time_s"),
        "speedup": sps / base_sps if sps and base_sps and not not_compared else None,
        "not_compared": not_compared,  # why no speedup: not the baseline's work (model, data, global batch, overrides)
        "mfu": r.figure("mfu"),
        "peak_memory_bytes": r.figure("peak_memory_bytes"),
        "loss_first": r.figure("train_loss", "first"),
        "loss_last": r.figure("train_loss", "last"),
        "val_loss": r.figure("validation", "loss"),
        "validation": r.figure("validation"),  # every metric of the task, at the last evaluation
        "monitor": r.figure("task", "monitor"),  # the one train.py returns to sweepers, improving in direction `mode`
        "mode": r.figure("task", "mode"),
        "compile": {"graphs": comp.get("graphs"), "graph_breaks": r.figure("compile", "graph_breaks", "count"),
                    "recompiles": r.figure("compile", "recompiles", "count"),
                    "compile_time_s": comp.get("compile_time_s")}
        if comp.get("enabled") else None,
        "profiler": {"bound": verdict.get("bound"), "action": verdict.get("action")} if verdict else None,
        "checkpoint": {"saves": ckpt.get("saves"), "blocked_s": r.figure("checkpoint", "blocked_s", "total"),
                       "write_s": r.figure("checkpoint", "write_s", "total"),
                       "resumed_from_step": r.figure("resumed_from_step")}
        if ckpt else None,
        "cost": r.figure("cost"),  # energy (NVIDIA GPUs) and money (trainer.cost_per_hour), or why each is absent
        "metrics": str(r.dir / "metrics.jsonl") if r.losses else None,
        "plan": r.figure("parallelism", "plan"),  # parallelism=auto's decision and table
    }


# --- writing -----------------------------------------------------------------------------------------------


def write(root: Path, out: Path | None = None, baseline: str | None = None) -> dict[str, Any]:
    """Build the report of the runs under `root` and write report.md/.json/.png into `out` (default: root)."""
    out = out or root
    report = build(root, baseline)
    runs = report.pop("_runs")
    try:
        out.mkdir(parents=True, exist_ok=True)
        report["picture"] = None  # report.md links report.png only when this report drew it
        try:
            write_png([(plot_name(row), r.losses) for r, row in zip(runs, report["runs"], strict=True)], report,
                      out / "report.png")
            report["picture"] = "report.png"
        except ConfigError as exc:  # no matplotlib: the Markdown and JSON say so, and are written all the same
            report["warnings"].append(str(exc))
        write_atomic(out / "report.json", json.dumps(report, indent=2, default=str))
        write_atomic(out / "report.md", markdown(report))
    except OSError as exc:
        raise ReportError(f"{out}: cannot write the report ({exc.strerror or exc}); give a writable folder "
                          "with --out") from None
    return report


def plot_name(row: dict[str, Any]) -> str:
    """A run as the picture names it: its folder (a sweep's job number) and what sets it apart from the others, its
    ladder rung or else its own overrides (a sweep's swept values, e.g. `1: optim.lr=3e-4`), so that a legend says
    what each curve is."""
    if row["rung"]:
        return f"{row['name']} {row['rung']}"
    return f"{row['name']}: {' '.join(row['overrides'])}" if row["overrides"] else row["name"]


def failed_gates(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [g for g in report["gates"] or [] if g["status"] == ladder.FAIL]


# --- the sweep callback and the command ------------------------------------------------------------------------


def _job_dir(config: DictConfig) -> Path:
    return Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)


class ReportCallback(Callback):
    """Writes report.md/.json/.png into each multirun sweep directory; fails the sweep when a ladder gate fails.

    After each job the report is refreshed (and a failed job's reason saved next to it), so it exists even
    when the sweep stops early; Hydra then exits non-zero for the failed job. After the last job it is written
    once more. Hydra turns a callback's exceptions into warnings, so a failed gate ends the process itself:
    one line on stderr and exit code 1 (SystemExit passes through Hydra, as trainflow's user errors do).
    """

    def __init__(self, baseline: str | None = None) -> None:
        self.baseline = baseline

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN and env_rank() == 0:  # a rerun of a failed job: not failed (yet)
            (_job_dir(config) / FAILURE_FILE).unlink(missing_ok=True)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN or env_rank() != 0:
            return  # single runs have no sweep folder; other ranks of a job leave the report to rank 0

        job_dir = _job_dir(config)
        if job_return.status == JobStatus.FAILED:
            error = job_return._return_value
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            if not reason.startswith("job #"):
                reason = f"{type(error).__name__}: {reason}"
            job_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(job_dir / FAILURE_FILE, reason + "\n")  # replaces a link there, never writes through it
        write(Path(str(config.hydra.sweep.dir)), baseline=self.baseline)  # Hydra warns if this raises

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        if not sweep.is_dir() or not any((job / ".hydra").is_dir() for job in sweep.iterdir()):
            return  # no job ran (--info, a SLURM dry run): nothing to report
        report = write(sweep, baseline=self.baseline)
        finish_sweep(sweep, [sweep / f for f in REPORT_FILES])  # the report on the sweep's MLflow parent run
        for warning in report["warnings"]:
            log.warning(shown(warning))
        log.info("sweep report: %s", sweep / "report.md")
        failed = failed_gates(report)
        if failed:
            print(shown(f"ladder: {len(failed)} gate(s) FAILED: " + "; ".join(f"{g['name']}: {g['detail']}"
                                                                              for g in failed)
                        + f" (see {sweep / 'report.md'})"), file=sys.stderr)
            sys.exit(EXIT_GATE_FAILED)


def command(args: argparse.Namespace) -> int:
    """Write report.md, report.json and report.png comparing every run under FOLDER (a sweep, a folder of single
    runs, or one run). A workflow-ladder sweep also gets its gates; the exit code is 1 when one failed."""
    report = write(args.folder, args.out, args.baseline)
    out = args.out or args.folder
    gates = report["gates"] or []
    counts = {s: sum(g["status"] == s for g in gates) for s in (ladder.PASS, ladder.WARN, ladder.FAIL,
                                                                   ladder.NOT_EVALUATED)}
    tally = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    apart = [r for r in report["runs"] if r["not_compared"]]
    written = [str(out / f) for f in REPORT_FILES if f != "report.png" or report["picture"]]
    print_shown(f"wrote {', '.join(written)}: {len(report['runs'])} run(s)"
                + (f", {len(apart)} not compared with the baseline ("
                   + "; ".join(f"{r['name']}: {r['not_compared']}" for r in apart) + ")" if apart else "")
                + (f"; gates: {tally}" if gates else ""))
    for warning in report["warnings"]:
        print_shown(f"WARNING {warning}")
    for g in failed_gates(report):
        print_shown(f"FAIL {g['name']}: {g['detail']}")
    return EXIT_GATE_FAILED if failed_gates(report) else 0


def print_shown(line: str) -> None:
    """Print one line of a report's console output: what it took from files (run and folder names, failure lines)
    cannot start another line or move the cursor."""
    print(shown(line))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", type=Path, help="a sweep folder (multirun/<sweep name>), outputs/, or one run")
    p.add_argument("--out", type=Path, default=None, help="where to write the report (default: FOLDER)")
    p.add_argument("--baseline", default=None,
                   help="the run the speedups are against, as listed (default: the ladder's baseline, else the first)")
