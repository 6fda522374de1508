"""A folder's results are kept: what a run or a sweep job may do in a folder that holds an earlier run's results
(summary.json, metrics.jsonl).

Folder names leave out the settings a resume may change (compile, parallelism, checkpoint, logger, more steps), so
a command with other such settings can land in a folder of earlier results. Nothing there is replaced unasked:

- the same config, finished: nothing to do; one line names where its results are, which stay byte for byte;
- the run continues from its own committed checkpoint there (the same command after a stop, more steps, another
  world size, compile switched): it goes on, and what differs from the folder's last run is said in one line at
  the start; a summary.json made with another config is kept as summary.<n>.json beside the new one;
- the same config, not finished and nothing to resume (a stop or a crash without checkpoints): it runs again;
- anything else (another config that would start again at step 0 over the earlier figures, or a finished run with
  nothing left to train) is refused in one line naming the difference and the way on: a folder of its own.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainflow.checkpoint.store import list_committed, resolve_dir
from trainflow.config.schema import RunConfig, plain
from trainflow.errors import ConfigError, TrainflowError
from trainflow.record.summary_file import read_summary, upgraded
from trainflow.util.files import LOG_FILE_BYTES, read_regular
from trainflow.util.shown import shown

RESULTS = ("summary.json", "metrics.jsonl")
MAX_SAID = 4  # differences named in a line; the rest are counted


@dataclass(frozen=True)
class Earlier:
    """What a folder holds from the runs before this one."""

    folder: Path
    summary: dict[str, Any] | None  # its summary.json (readable, today's names)
    last_config: dict[str, Any] | None  # the config of the folder's last run (its config.yaml)
    results: tuple[str, ...]  # the results it holds (of RESULTS)


def read_earlier(folder: Path) -> Earlier:
    """The folder's results and configs as received data: regular files of bounded size only, else unknown."""
    results = tuple(name for name in RESULTS if _size(folder / name) > 0)
    try:
        summary: dict[str, Any] | None = read_summary(folder / "summary.json")
    except (OSError, TrainflowError):  # none, cut off, or not one trainflow wrote: no finished result to keep
        summary = None
    last = _read(folder / "config.yaml", yaml.safe_load)
    return Earlier(folder, summary, last if isinstance(last, dict) else None, results)


def _size(path: Path) -> int:
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 1  # a link or a FIFO where a result goes counts as held


def _read(path: Path, parse: Any) -> Any:
    try:
        return parse(read_regular(path, LOG_FILE_BYTES).decode())
    except (TrainflowError, ValueError, yaml.YAMLError):
        return None


def finished(earlier: Earlier, cfg: RunConfig) -> dict[str, Any] | None:
    """The summary of a run that finished in the folder with the config `cfg` (the checked one), else None: no
    summary, a stop on a signal (it resumes), or another config."""
    summary = earlier.summary
    if summary is None or (summary.get("checkpoint") or {}).get("stopped_by"):
        return None
    return summary if summary.get("config") == plain(cfg) else None


def finished_line(folder: Path, summary: dict[str, Any]) -> str:
    kept = ", ".join(name for name in RESULTS if (folder / name).exists())
    return (f"finished already in {shown(folder)} (step {summary.get('steps')}, the same config): nothing to do, "
            f"its results kept ({kept}); to train again, give this run its own folder (trainer.run_name=<new name> "
            "or hydra.run.dir=<new folder>)")


def differences(old: Any, new: Any) -> list[str]:
    """`key: old -> new` for every leaf of two configs that differs, in key order."""
    flat_old, flat_new = _flat(old), _flat(new)
    missing = "(none)"
    return [f"{key}: {shown(str(flat_old.get(key, missing)))} -> {shown(str(flat_new.get(key, missing)))}"
            for key in sorted(flat_old.keys() | flat_new.keys()) if flat_old.get(key, missing) != flat_new.get(
                key, missing)]


def _flat(cfg: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(cfg, dict) or not cfg:
        return {prefix.rstrip("."): cfg} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        out.update(_flat(value, f"{prefix}{key}."))
    return out


def said(found: list[str]) -> str:
    more = f" and {len(found) - MAX_SAID} more" if len(found) > MAX_SAID else ""
    return ", ".join(found[:MAX_SAID]) + more


def continued_step(cfg: RunConfig, folder: Path) -> int | None:
    """The step of the run's own newest committed checkpoint it resumes from (checkpoint.resume=auto), else None."""
    if not cfg.checkpoint.enabled or cfg.checkpoint.resume != "auto":
        return None
    own = list_committed(resolve_dir(cfg.checkpoint.dir, folder))
    return own[-1].step if own else None


def check_may_write(earlier: Earlier, cfg: RunConfig, key: str, fix: str) -> str | None:
    """Whether this run may write into a folder of earlier results (see the module's rules): None (nothing held
    there, or the same config), a line naming what differs from the folder's last run (it continues there), or a
    ConfigError naming the difference and `fix` (nothing is changed)."""
    if not earlier.results:
        return None
    ours = plain(cfg)
    found = ["its config.yaml is missing or unreadable"] if earlier.last_config is None else \
        [d for d in differences(earlier.last_config, ours) if not d.startswith(_derived(cfg))]
    step = continued_step(cfg, earlier.folder)
    held = f"{shown(earlier.folder)} holds the {' and '.join(earlier.results)} of an earlier run"
    summary = earlier.summary
    if step is not None and step >= cfg.trainer.max_steps and summary is not None and summary.get("config") != ours:
        other = differences(summary.get("config"), ours)
        raise ConfigError(f"{key}: {held}, finished at step {summary.get('steps')} with other settings "
                          f"({said(other)}): nothing left to train and nothing was changed; raise trainer.max_steps "
                          f"to continue it, or {fix}")
    if not found:
        return None
    if step is None:
        raise ConfigError(f"{key}: {held} with other settings ({said(found)}), and this run would start again at "
                          f"step 0 over its figures; nothing was changed: {fix}")
    return f"this run continues {shown(earlier.folder)} from step {step}, with other settings than its last run: " \
           f"{said(found)}"


def _derived(cfg: RunConfig) -> tuple[str, ...]:
    """The keys a run decides itself and config.yaml holds as decided: the per-rank batch of a global batch,
    parallelism=auto's layout."""
    keys = ("trainer.batch_size:",) if cfg.parallelism.global_batch is not None else ()
    return keys + (("parallelism.",) if cfg.parallelism.strategy == "auto" else ())


def keep_summary_aside(folder: Path, config: dict[str, Any]) -> Path | None:
    """Before a run writes summary.json: one there made with another config (or unreadable) is renamed to the
    first free summary.<n>.json, never replaced; returns where it went."""
    path = folder / "summary.json"
    if not path.exists() and not path.is_symlink():
        return None
    earlier = _read(path, json.loads)
    if isinstance(earlier, dict) and upgraded(earlier).get("config") == config:
        return None  # the same config's summary (a stop, then the same command): this run's own figures follow it
    n = 1
    while (aside := folder / f"summary.{n}.json").exists() or aside.is_symlink():
        n += 1
    try:
        path.rename(aside)
    except OSError as exc:
        raise ConfigError(f"hydra.run.dir: cannot keep the earlier {path} aside as {aside.name} "
                          f"({exc.strerror}); nothing was replaced: free space or check the folder's permissions") \
            from None
    return aside
