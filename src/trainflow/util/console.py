"""What a person watching a run sees: the progress line or bar on rank 0, and train.log's handler."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from trainflow import __version__
from trainflow.util.shown import shell_quoted

log = logging.getLogger(__name__)


class FileOnly(logging.Filter):
    """On the console's handler: leaves out the records logged with `extra=FILE_ONLY` (the full config), which
    train.log keeps."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "file_only", False)


FILE_ONLY = {"file_only": True}
NO_CHECKPOINTS = "off (checkpoint=dcp saves them, and the same command then resumes)"


class RunLogHandler(logging.FileHandler):
    """train.log's handler: a failed write (a full disk) is dropped quietly instead of printing a traceback.

    The run does not go on unnoticed: its next metrics.jsonl line meets the same disk and stops it in one line.
    """

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        if not isinstance(sys.exc_info()[1], OSError):
            super().handleError(record)


def progress_reporter(max_steps: int, mode: str, is_main: bool, start: int) -> Callable[[int | None, dict | None],
                                                                                         None]:
    """A tqdm bar on rank 0 when stdout is a terminal with room for one (or asked for); plain log lines otherwise.

    Call it with (step, values) at each log step, and with (None, None) at the end.
    """
    use_bar = is_main and (mode == "bar" or (mode == "auto" and _terminal_columns() > 0))
    bar = None
    if use_bar:
        bar = tqdm(total=max_steps, initial=start, unit="step", dynamic_ncols=True)

    def update(step: int | None, values: dict | None) -> None:
        if step is None:
            if bar is not None:
                bar.close()
            return
        if bar is not None:
            bar.n = step
            bar.set_postfix_str(f"loss {values['train/loss']:.4f}, lr {values['train/lr']:.2e}, "
                                f"{values['perf/step_time_s'] * 1e3:.1f} ms/step, "
                                f"{values['perf/samples_per_sec']:.0f} samples/s")
        elif is_main:
            ranks = (f"; ranks' own time median {values['perf/own_time_median_s'] * 1e3:.1f} ms, max "
                     f"{values['perf/own_time_max_s'] * 1e3:.1f} ms (rank {values['perf/slowest_rank']})"
                     if "perf/slowest_rank" in values else "")
            log.info("step %d/%d: loss %.4f, lr %.2e, %.1f ms/step, %.0f samples/s, data wait %.1f%%%s",
                     step, max_steps, values["train/loss"], values["train/lr"],
                     values["perf/step_time_s"] * 1e3, values["perf/samples_per_sec"],
                     values["perf/data_wait_fraction"] * 100, ranks)

    return update


def _terminal_columns() -> int:
    """The width of the terminal stdout is, 0 when it is none (a file, a pipe) or reports no width (a bare pty)."""
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else 0
    except (OSError, ValueError):
        return 0


@dataclass(frozen=True)
class RunFacts:
    """What the start header says of a run: what trains, how, and where its files go."""

    model: str
    parameters: int
    data: str
    train_items: int
    val_items: int | None
    seq_len: int
    task: str
    monitor: str
    mode: str
    device: str
    world_size: int
    strategy: str
    precision: str
    compiled: str  # "eager" or how torch.compile runs
    global_batch: int
    max_steps: int
    resumed_from: int | None
    run_dir: Path
    checkpoint_dir: Path | None  # None: checkpointing is off
    loggers: tuple[str, ...]
    # what a section of your code imported and from where, by section: {"model": "mymodels.TinyNet from ./mymodels.py"}
    origins: Mapping[str, str] = field(default_factory=dict)


def start_header(f: RunFacts) -> str:
    """The lines a run starts with on the console: enough to know it is the run meant (the whole config is in
    config.yaml and train.log)."""
    tokens = f" x {f.seq_len} tokens" if f.seq_len > 1 else ""
    held_out = f"{f.val_items:,} held out" if f.val_items else f"{f.data} gives no validation set: no evaluation"
    start = f"resumes at step {f.resumed_from}" if f.resumed_from else "from step 0"
    ranks = f"{f.world_size} process{'es' if f.world_size > 1 else ''} ({f.strategy})"
    model, data, task = (f" ({f.origins[name]})" if name in f.origins else "" for name in ("model", "data", "task"))
    return "\n".join([
        f"trainflow {__version__} trains model {f.model}: {_count(f.parameters)} parameters{model}; task {f.task} "
        f"(monitor: val {f.monitor}, {f.mode}){task}",
        f"  data     {f.data}: {f.train_items:,} training items{tokens}; {held_out}{data}",
        f"  how      {f.device}, {ranks}, {f.precision}, {f.compiled}; global batch {f.global_batch}{tokens}; "
        f"{f.max_steps} steps, {start}",
        f"  run dir  {shown(f.run_dir)}  (config.yaml, train.log, metrics.jsonl, summary.json"
        f"{', tensorboard/' if 'tensorboard' in f.loggers else ''})",
        f"  ckpts    {shown(f.checkpoint_dir) if f.checkpoint_dir else NO_CHECKPOINTS}",
    ])


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def shown(path: Path) -> str:
    """`path` as a user reads it best: relative to the working folder when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def end_lines(summary: dict, run_dir: Path, wall_s: float, loggers: tuple[str, ...], export_ready: bool) -> str:
    """The lines a run ends with: where its results are, its headline figures, and what to run next."""
    steady = summary.get("steady_state")
    figures = [f"{summary['steps']} steps in {wall_s:.1f} s"]
    if steady:
        figures.append(f"steady state {steady['samples_per_sec']:,.1f} samples/s, {steady['step_time_s'] * 1e3:.1f} "
                       "ms/step")
    else:
        figures.append("steady state not reached (too few steps after warm-up)")
    if summary.get("mfu") is not None:
        figures.append(f"MFU {summary['mfu'] * 100:.1f}%")
    if summary.get("peak_memory_bytes"):
        figures.append(f"peak memory {summary['peak_memory_bytes'] / 2**30:.2f} GiB")
    task, validation = summary["task"], summary.get("validation") or {}
    if task["monitor"] in validation:
        figures.append(f"val {task['monitor']} {validation[task['monitor']]:.4g}")
    nexts = []  # commands to paste, one a line (quoted: a run dir may hold a space)
    if "tensorboard" in loggers:
        nexts.append(shell_quoted("tensorboard", "--logdir", shown(run_dir)))
    if export_ready:
        nexts.append(shell_quoted("trainflow", "export", shown(run_dir), "model.pt"))
    return "\n".join([f"done: {'; '.join(figures)}", f"  results  {shown(run_dir / 'summary.json')}",
                      *(f"  {'next' if i == 0 else '':<8} {command}" for i, command in enumerate(nexts))])
