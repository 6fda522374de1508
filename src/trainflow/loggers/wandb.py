"""Weights & Biases: one W&B run per trainflow run, continued across resumes (`pip install 'trainflow[wandb]'`).

- mode: `logger.wandb.mode`, else `WANDB_MODE`, else online where an API key is configured (`WANDB_API_KEY`,
  `wandb login`'s .netrc entry) and offline otherwise: an offline run is written below `<run dir>/wandb/` (or
  `logger.wandb.dir`, or `WANDB_DIR`: one that cannot be written is one line at start, never W&B's silent
  fallback to the system's temporary folder) and reaches no network; `wandb sync <run dir>/wandb/offline-run-*`
  uploads it later;
- in a process of its own (loggers/process.py): its client's work, its uploads at the end and anything it waits
  on stay out of the loop's process and bounded in time;
- config: the resolved config; project / entity / group / tags / notes from `logger.wandb.*`; a sweep job's group
  is its sweep's name unless `logger.wandb.group` says otherwise; a run started from another run's checkpoint is a
  new W&B run whose config names that checkpoint (`trainflow.resumed_from`) and that run's W&B id
  (`trainflow.resumed_from_run`);
- history: every scalar of metrics.jsonl at its step; at the end the final figures (`summary/*`), which W&B's
  summary then holds; a resumed run logs only the steps past the resumed one, and again those of metrics.jsonl
  up to it that a crashed process did not get into its W&B run;
- at the end: config.yaml, summary.json, compile_report.json and the profiler's verdict (profiler.md) as the run's
  files, and its exit code: 0 for FINISHED, 1 for FAILED, 75 (not finished: resumed later) for KILLED.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainflow.errors import ConfigError, home_note, unwritable_reason
from trainflow.loggers import FAILED, FINISHED, RunInfo, history
from trainflow.loggers.mlflow import source_tags, sweep_name
from trainflow.loggers.wandb_files import last_step, offline_runs
from trainflow.util.files import cannot_write

EXIT_CODES = {FINISHED: 0, FAILED: 1}  # KILLED (and any other): 75, trainflow's exit code of a stop after a save
KILLED_EXIT = 75


class WandbLogger:
    """One W&B run (rank 0), its own run object: a run the user's code opened with `wandb.init` stays as it is."""

    in_own_process = True  # its client's Python work stays off the loop, and run.finish (an upload) is bounded

    def __init__(self, project: str = "trainflow", entity: str | None = None, group: str | None = None,
                 tags: list[str] | None = None, notes: str | None = None, mode: str | None = None,
                 dir: str | None = None) -> None:  # noqa: A002 (wandb.init's own name for it)
        try:
            import wandb  # noqa: F401 (the extra, checked before any training)
        except ImportError:
            raise ConfigError("logger.wandb: the wandb package is not installed; pip install 'trainflow[wandb]', "
                              "or leave wandb out of logger=[...]") from None
        self.project, self.entity, self.group = project, entity, group
        self.tags, self.notes, self.mode, self.dir = list(tags or []), notes, mode, dir
        self.run: Any = None
        self._logged_to = 0  # steps up to here are in the tracked run already

    def start(self, run: RunInfo) -> str:
        import wandb  # lazy: wandb is the wandb extra

        self._check_dir()
        mode = self._mode()
        if mode:  # for the whole process: W&B's own telemetry then stays offline too, not only the run
            wandb.setup(settings=wandb.Settings(mode=mode))
        self.run = wandb.init(
            project=self.project, entity=self.entity, name=run.name, notes=self.notes, tags=self.tags,
            group=self.group or (sweep_name(run.sweep_dir) if run.sweep_dir is not None else None),
            config={**run.config, **source_tags(run)}, id=run.tracked_id, resume="allow", mode=mode,
            dir=self.dir or (None if os.environ.get("WANDB_DIR") else str(run.run_dir)),
            # the console stays trainflow's (train.log has it all); the run is its own, not wandb.run's
            settings=wandb.Settings(console="off", reinit="create_new"))
        if run.resumed_step is not None:
            self._catch_up(run)
        return self.run.id

    def _catch_up(self, run: RunInfo) -> None:
        """A resumed run holds the steps its earlier processes got to W&B: online, up to the server's last step;
        offline, what their run folders hold (a crash loses the end of what W&B had not written). The steps
        between that and the resumed step are logged again from metrics.jsonl, the later ones skipped."""
        held = self.run.starting_step - 1
        if self.run.offline:
            wandb_dir = Path(self.run.dir).parent.parent  # <dir>/wandb/offline-run-<time>-<id>/files
            held = max((last_step(f) for f in offline_runs(wandb_dir, self.run.id)
                        if f != Path(self.run.dir).parent), default=0)
        for step, values in history(run.run_dir, held, run.resumed_step):
            self.run.log(values, step=step)
        self._logged_to = max(run.resumed_step, held)

    def _check_dir(self) -> None:
        """A W&B folder set by logger.wandb.dir or WANDB_DIR that cannot be written is one line (W&B itself would
        fall back to the system's temporary folder, outside the run directory, with a warning on a console it
        does not have here)."""
        key, configured = ("logger.wandb.dir", self.dir) if self.dir else ("WANDB_DIR", os.environ.get("WANDB_DIR"))
        if not configured:
            return
        root = Path(configured).expanduser()
        folder = root / (".wandb" if (root / ".wandb").is_dir() else "wandb")
        if (exc := cannot_write(folder)) is not None:
            raise ConfigError(f"{key}: cannot write W&B's files in {folder}{home_note(configured)} "
                              f"({unwritable_reason(folder, exc)}); point {key} at a writable folder, or unset it "
                              "to keep them below the run directory")

    def _mode(self) -> str | None:
        """The configured mode, else W&B's own choice (WANDB_MODE) when set, else online only with a key."""
        if self.mode or os.environ.get("WANDB_MODE"):
            return self.mode
        return "online" if _has_api_key() else "offline"

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if step > self._logged_to:
            self.run.log(dict(values), step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        (Path(self.run.dir) / f"{tag}.md").write_text(text)  # the run's files folder: kept with the run

    def artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            self.run.save(str(path), base_path=str(path.parent), policy="end", glob=False)

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=EXIT_CODES.get(status, KILLED_EXIT))


def _has_api_key() -> bool:
    """An API key W&B would use: its environment variables or the .netrc entry `wandb login` writes."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    from wandb.sdk.lib.wbauth.host_url import HostUrl  # lazy: wandb is the wandb extra
    from wandb.sdk.lib.wbauth.wbnetrc import read_netrc_auth_with_source  # lazy: wandb is the wandb extra

    try:
        return read_netrc_auth_with_source(host=HostUrl(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")))\
            is not None
    except Exception:  # a key in a bad format: online, where W&B's own error says what is wrong with it
        return True
