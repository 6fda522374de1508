"""What a person watching a run sees: a short start header (what trains, how, where), the progress, and end lines
with the headline figures and the next commands; the full config only in config.yaml and train.log."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from helpers.runs import ROOT, TINY_GPT, ok, train

SHORT = ["trainer.max_steps=10", "trainer.log_every=5", "trainer.eval_steps=2"]


def test_the_default_run_starts_with_a_short_header_and_ends_with_its_figures_and_next_commands(run_dir: Path
                                                                                                 ) -> None:
    """The default config (compile off, for the suite's time): at most 20 console lines before the first step's
    line; the config is in train.log, not on the console."""
    run = ok(train(run_dir, "compile=off", *SHORT))
    console = (run.stdout + run.stderr).splitlines()
    first_step = next(i for i, line in enumerate(console) if "step 5/10" in line)
    assert first_step <= 20, "\n".join(console[:first_step])
    header = "\n".join(console[:first_step])
    assert "trains model GPT: 3.26M parameters; task LanguageModel (monitor: val loss, min)" in header
    assert re.search(r"data     data=text: [\d,]+ training items x 128 tokens; [\d,]+ held out", header), header
    assert f"run dir  {run_dir}" in header and "ckpts    off" in header
    assert "cpu, 1 process (single), fp32, eager; global batch 16 x 128 tokens; 10 steps, from step 0" in header
    assert "max_steps: 10" not in "\n".join(console) and "max_steps: 10" in (run_dir / "train.log").read_text()

    summary = run.summary
    end = "\n".join(console[-4:])
    assert re.search(r"done: 10 steps in [\d.]+ s; steady state [\d.,]+ samples/s, [\d.]+ ms/step; MFU [\d.]+%; "
                     r"peak memory [\d.]+ GiB; val loss [\d.]+", end), end
    assert f"val loss {summary['validation']['loss']:.4g}" in end and f"MFU {summary['mfu'] * 100:.1f}%" in end
    assert f"results  {run_dir}/summary.json" in end and f"next     tensorboard --logdir {run_dir}" in end


def test_print_config_shows_the_config_and_a_checkpointed_run_names_its_folder_and_the_export(run_dir: Path
                                                                                              ) -> None:
    run = ok(train(run_dir, *TINY_GPT, "trainer.max_steps=4", "trainer.print_config=true", "checkpoint=dcp"))
    console = run.stdout + run.stderr
    assert "max_steps: 4" in console
    assert f"ckpts    {run_dir}/checkpoints" in console
    assert f"next     trainflow export {run_dir} model.pt" in console


def test_launched_workers_print_like_a_single_run(run_dir: Path) -> None:
    """parallelism=fsdp on CPU starts two workers (trainflow's own launcher): the console shows the short header
    once (rank 0) and not the config, as one process does; trainer.print_config=false reaches the workers."""
    run = ok(train(run_dir, *TINY_GPT, "parallelism=fsdp", "parallelism.nproc_per_node=2", *SHORT))
    console = (run.stdout + run.stderr).splitlines()
    first_step = next(i for i, line in enumerate(console) if "step 5/10" in line)
    assert first_step <= 15, "\n".join(console[:first_step])
    assert sum(" trains model " in line for line in console) == 1, "\n".join(console)
    assert sum("run dir  " in line for line in console) == 1
    assert "max_steps: 10" not in "\n".join(console) and "max_steps: 10" in (run_dir / "train.log").read_text()


def _on_a_terminal(run_dir: Path, columns: int) -> str:
    """The console of a short run whose stdout and stderr are a terminal `columns` wide (0: one that reports no
    width, as a bare pty does)."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *TINY_GPT, "trainer.max_steps=10",
                             "trainer.log_every=5", f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env,
                            stdout=terminal, stderr=terminal, stdin=subprocess.DEVNULL)
    os.close(terminal)
    chunks = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the run ended and closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert proc.wait(timeout=60) == 0
    return b"".join(chunks).decode(errors="replace")


def test_a_terminal_gets_a_bar_with_the_speed_and_one_without_columns_gets_log_lines(tmp_path: Path) -> None:
    bar = _on_a_terminal(tmp_path / "wide", 120)
    assert re.search(r"\d+/10 \[.*loss [\d.]+, lr [\d.e+-]+, [\d.]+ ms/step, \d+ samples/s", bar), bar[-2000:]
    assert "step 5/10: loss" not in bar
    narrow = _on_a_terminal(tmp_path / "none", 0)
    assert "step 5/10: loss" in narrow and "step 10/10: loss" in narrow


def test_the_next_hint_is_a_command_to_paste_for_a_run_dir_with_a_space(tmp_path: Path) -> None:
    """A run dir holding a space: the `next` line quotes it, and the line pasted into a shell runs the export."""
    run_dir = tmp_path / "my runs" / "run 1"
    run = ok(train(run_dir, "model=mlp", "data=synthetic", "logger=none", "compile=off", "trainer.max_steps=2",
                   "trainer.eval_every=0", "checkpoint=dcp"))
    (hint,) = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("  next")]
    assert hint == f"  next     trainflow export '{run_dir}' model.pt"
    pasted = subprocess.run(["bash", "-c", hint.split("next", 1)[1].replace("trainflow", str(Path(
        sys.executable).parent / "trainflow"), 1)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert pasted.returncode == 0, pasted.stderr
    assert (tmp_path / "model.pt").stat().st_size > 0
