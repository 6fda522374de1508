"""What a person watching a run sees: the progress line or bar on rank 0, and train.log's handler."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)


class RunLogHandler(logging.FileHandler):
    """train.log's handler: a failed write (a full disk) is dropped quietly instead of printing a traceback.

    The run does not go on unnoticed: its next metrics.jsonl line meets the same disk and stops it in one line.
    """

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        if not isinstance(sys.exc_info()[1], OSError):
            super().handleError(record)


def progress_reporter(max_steps: int, mode: str, is_main: bool, start: int) -> Callable[[int | None, dict | None],
                                                                                         None]:
    """A tqdm bar on rank 0 when stdout is a terminal (or asked for); plain log lines otherwise.

    Call it with (step, values) at each log step, and with (None, None) at the end.
    """
    use_bar = is_main and (mode == "bar" or (mode == "auto" and sys.stdout.isatty()))
    bar = None
    if use_bar:
        from tqdm import tqdm

        bar = tqdm(total=max_steps, initial=start, unit="step", dynamic_ncols=True)

    def update(step: int | None, values: dict | None) -> None:
        if step is None:
            if bar is not None:
                bar.close()
            return
        if bar is not None:
            bar.n = step
            bar.set_postfix(loss=f"{values['train/loss']:.4f}", lr=f"{values['train/lr']:.2e}")
        elif is_main:
            ranks = (f"; ranks' own time median {values['perf/own_time_median_s'] * 1e3:.1f} ms, max "
                     f"{values['perf/own_time_max_s'] * 1e3:.1f} ms (rank {values['perf/slowest_rank']})"
                     if "perf/slowest_rank" in values else "")
            log.info("step %d/%d: loss %.4f, lr %.2e, %.1f ms/step, %.0f samples/s, data wait %.1f%%%s",
                     step, max_steps, values["train/loss"], values["train/lr"],
                     values["perf/step_time_s"] * 1e3, values["perf/samples_per_sec"],
                     values["perf/data_wait_fraction"] * 100, ranks)

    return update
