"""Files a user receives (a colleague's run folder, a CI artifact, a shared outputs folder), made hostile, each tried in
a real `trainflow compare|report` process, as a table.

For each row: the command ends within HANG_S (a FIFO read without care waits for a writer forever: that fails the
row, never hangs the suite), with the row's exit code, no traceback, one line naming the file (or option) and saying
the row's words in their order, no forged line and no terminal escape on the console or in the pages, nothing run
that the files name, and nothing written (the run folders byte-identical, no --out folder) unless the row says what
it writes. A row may instead cite a test of another file that tries a received input its own way (Cited): those of
tests/test_received_writes.py (locks, ledgers, retention, exports) and tests/test_received_bisect.py (bisect's
replay) are listed there. docs/reliability.md is rendered from this table (see test_reliability_readme.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.processes import run_process
from helpers.runs import ok, train

from trainflow.metrics.noise import read_metrics_log
from trainflow.util.files import SMALL_FILE_BYTES

HANG_S = 90  # a command that has not ended by then hangs (each ends in seconds here, on a busy machine too)
FORGED = "FAKE: all gates PASS"  # a line a folder name must never make trainflow print
ESCAPES = "\x1b]0;owned\x07\x1b[2J"  # set the terminal's title, clear the screen

# the cheapest real run: a small MLP on synthetic data
MLP = ["model=mlp", "model.hidden=32", "data=synthetic", "logger=none", "compile=off", "trainer.max_steps=8",
       "trainer.log_every=2", "trainer.excluded_steps=2", "trainer.eval_every=4", "trainer.eval_steps=2",
       "metrics.ledger=off"]


@dataclass(frozen=True)
class Received:
    """A hostile received input tried here: `args` of `trainflow`, run in {tmp}, which holds a (run A) and b (run B),
    two copies of one finished run, changed by `setup`."""

    id: str
    what: str  # the received input, in words (docs/reliability.md)
    does: str  # what trainflow does, in words
    args: tuple[str, ...]
    names: str  # the file or option the line names ({tmp} is filled in); exit 2: the line begins `Error: <names>`
    says: tuple[str, ...]  # the decisive words in order
    setup: Callable[[Path], None] | None = None
    exit: int = 2
    writes: bool = False  # it writes its pages (the input is left out or shown escaped): its out folder may appear
    after: Callable[[Path], None] | None = None  # checks on the pages it wrote


@dataclass(frozen=True)
class Cited:
    """A received input tried by a test of another file."""

    what: str
    does: str
    test: str  # file::function


# -- setups: each changes the copies of the run in {tmp} --------------------------------------------------------------


def summary(tmp: Path, name: str = "b") -> Path:
    return tmp / name / "summary.json"


def replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def replace_with_dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def edit_summary(tmp: Path, change: Callable[[dict], object]) -> None:
    data = json.loads(summary(tmp).read_text())
    data = change(data) or data
    summary(tmp).write_text(json.dumps(data))


def steady_state_as_text(tmp: Path) -> None:
    edit_summary(tmp, lambda s: s.update(steady_state="fast"))


def figure_as_text(tmp: Path) -> None:
    edit_summary(tmp, lambda s: s["steady_state"].update(samples_per_sec="12"))


def validation_as_text(tmp: Path) -> None:
    edit_summary(tmp, lambda s: s["validation"].update(loss="low"))


def summary_as_list(tmp: Path) -> None:
    summary(tmp).write_text("[]")


def summary_cut_off(tmp: Path) -> None:
    text = summary(tmp).read_text()
    summary(tmp).write_text(text[: len(text) // 2])


def summary_too_large(tmp: Path) -> None:
    with summary(tmp).open("r+b") as f:
        f.truncate(SMALL_FILE_BYTES + 1)  # sparse: no disk used


def bad_metrics_lines(tmp: Path) -> None:
    with (tmp / "b" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 9, "train/loss": "low"}\n{"train/loss": 1.0}\n["step", 10]\n')


def overrides_with_a_tag(tmp: Path) -> None:
    (tmp / "b" / ".hydra" / "overrides.yaml").write_text(
        f"- !!python/object/apply:os.system ['touch {tmp / 'ran'}']\n")


def overrides_not_a_list(tmp: Path) -> None:
    (tmp / "b" / ".hydra" / "overrides.yaml").write_text("optim.lr: 0.1\n")


def unfinished(tmp: Path) -> None:
    """b as a job that wrote no summary: its status comes from failure.txt, the lock, .hydra/config.yaml."""
    summary(tmp).unlink()


def failure_fifo(tmp: Path) -> None:
    unfinished(tmp)
    os.mkfifo(tmp / "b" / "failure.txt")


def lock_fifo(tmp: Path) -> None:
    unfinished(tmp)
    (tmp / "b" / ".lock").unlink(missing_ok=True)
    os.mkfifo(tmp / "b" / ".lock")


def lock_of_an_impossible_pid(tmp: Path) -> None:
    unfinished(tmp)
    (tmp / "b" / ".lock").write_text(f"pid {2**70} on {socket.gethostname()}, since 2026-01-01 00:00:00 UTC\n")


def config_with_a_tag(tmp: Path) -> None:
    unfinished(tmp)
    (tmp / "b" / ".hydra" / "config.yaml").write_text(
        f"ladder: !!python/object/apply:os.system ['touch {tmp / 'ran'}']\n")


def listed_as_interrupted(tmp: Path) -> None:
    (run,) = json.loads((tmp / "out" / "report.json").read_text())["runs"]
    assert run["status"] == "interrupted" and "no process at work on it" in run["error"]


def sweeps_named(names: tuple[str, ...]) -> Callable[[Path], None]:
    """Two sweep folders, s1 and s2, whose jobs are copies of the run under hostile folder names."""
    def setup(tmp: Path) -> None:
        for sweep in ("s1", "s2"):
            for name in names:
                shutil.copytree(tmp / "a", tmp / sweep / name, symlinks=True)
    return setup


FORGING = (f"x\n{FORGED}",)
ESCAPING = (f"y{ESCAPES}",)

COMPARE = ("compare", "{tmp}/a", "{tmp}/b", "--out", "{tmp}/out")
REPORT = ("report", "{tmp}/b", "--out", "{tmp}/out")
NOT_TRAINFLOWS = "not a regular file"
BISECT = "test_received_bisect.py::"  # bisect's replay, compare's --out
WRITES = "test_received_writes.py::"  # what a run, the ledger and an export write, and how the ledger is read

RECEIVED: list[Received | Cited] = [
    Received("summary-fifo", "summary.json is a FIFO", "refused at once (never opened for a blocking read)",
             COMPARE, "compare B: {tmp}/b/summary.json", ("is a FIFO", NOT_TRAINFLOWS),
             lambda tmp: replace_with_fifo(summary(tmp))),
    Received("summary-dev-zero", "summary.json is a link to /dev/zero", "refused at once (a device is never read)",
             REPORT, "{tmp}/b/summary.json", ("is a character device", NOT_TRAINFLOWS),
             lambda tmp: replace_with_dev_zero(summary(tmp))),
    Received("summary-too-large", "summary.json of more than 16 MiB", "refused before it is read",
             COMPARE, "compare B: {tmp}/b/summary.json", ("bytes, more than the", "not trainflow's file"),
             summary_too_large),
    Received("summary-cut-off", "summary.json cut off mid-way", "refused in one line",
             REPORT, "{tmp}/b/summary.json", ("not valid JSON", "cut off", "rerun it"), summary_cut_off),
    Received("summary-list", "summary.json holding `[]`", "refused in one line naming its shape",
             COMPARE, "compare B: {tmp}/b/summary.json", ("holds a list", "not a section", "leave its folder out"),
             summary_as_list),
    Received("summary-section-text", 'summary.json with `"steady_state": "fast"`', "refused, naming the field",
             REPORT, "{tmp}/b/summary.json", ('steady_state is text ("fast")', "not a section"),
             steady_state_as_text),
    Received("summary-figure-text", 'summary.json with a figure that is a string (`"samples_per_sec": "12"`)',
             "refused, naming the field", COMPARE, "compare B: {tmp}/b/summary.json",
             ("steady_state.samples_per_sec is text", "not a number"), figure_as_text),
    Received("summary-validation-text", 'summary.json with a validation metric that is a string',
             "refused, naming the field", REPORT, "{tmp}/b/summary.json",
             ("validation is a section", "not a section of numbers"), validation_as_text),
    Received("metrics-fifo", "metrics.jsonl is a FIFO", "refused at once", REPORT, "{tmp}/b/metrics.jsonl",
             ("is a FIFO", NOT_TRAINFLOWS), lambda tmp: replace_with_fifo(tmp / "b" / "metrics.jsonl")),
    Received("metrics-dev-zero", "metrics.jsonl is a link to /dev/zero", "refused at once", COMPARE,
             "compare B: {tmp}/b/metrics.jsonl", ("is a character device", NOT_TRAINFLOWS),
             lambda tmp: replace_with_dev_zero(tmp / "b" / "metrics.jsonl")),
    Received("metrics-bad-lines", "metrics.jsonl lines with a loss that is a string, without `step`, not an object",
             "those lines are left out and counted, the rest compared (the log is appended line by line: one bad "
             "line says nothing of the others); one warning line", COMPARE, "WARNING {tmp}/b/metrics.jsonl",
             ("3 line(s) left out", "not of the shape trainflow writes"), bad_metrics_lines, exit=0, writes=True),
    Received("overrides-yaml-tag", "`.hydra/overrides.yaml` holding a YAML tag that runs a command",
             "read by a safe YAML loader: refused, the command not run", REPORT, "{tmp}/b/.hydra/overrides.yaml",
             ("not the plain YAML Hydra writes", "python/object/apply:os.system"), overrides_with_a_tag),
    Received("overrides-not-a-list", "`.hydra/overrides.yaml` that is not a list of strings", "refused in one line",
             COMPARE, "compare B: {tmp}/b/.hydra/overrides.yaml", ("is not the list of overrides", "a dict"),
             overrides_not_a_list),
    Received("config-yaml-tag", "`.hydra/config.yaml` of an unfinished job holding a YAML tag",
             "read by a safe YAML loader: refused, the command not run", REPORT, "{tmp}/b/.hydra/config.yaml",
             ("not the plain YAML Hydra writes",), config_with_a_tag),
    Received("failure-fifo", "failure.txt of an unfinished job is a FIFO", "refused at once", REPORT,
             "{tmp}/b/failure.txt", ("is a FIFO", NOT_TRAINFLOWS), failure_fifo),
    Received("lock-fifo", "`.lock` of an unfinished job is a FIFO", "not read: no live process holds the run, which "
             "is listed as interrupted", REPORT, "wrote {tmp}/out/report.md", ("1 run(s)",), lock_fifo, exit=0,
             writes=True, after=listed_as_interrupted),
    Received("lock-impossible-pid", "`.lock` of an unfinished job naming a pid beyond any (2**70) on this host",
             "no such process: the run is listed as interrupted", REPORT, "wrote {tmp}/out/report.md", ("1 run(s)",),
             lock_of_an_impossible_pid, exit=0, writes=True, after=listed_as_interrupted),
    Received("forged-line-compare", f"job folders named `x\\n{FORGED}` in two sweeps", "compared; the name is printed "
             "with `\\n` escaped: no forged line on the console or in compare.md", ("compare", "{tmp}/s1", "{tmp}/s2",
                                                                                   "--out", "{tmp}/out"),
             "x\\n" + FORGED, ("->",), sweeps_named(FORGING), exit=0, writes=True),
    Received("forged-line-report", f"a run folder named `x\\n{FORGED}`", "reported; no forged line in report.md",
             ("report", "{tmp}/s1", "--out", "{tmp}/out"), "wrote {tmp}/out/report.md",
             ("1 run(s)",), sweeps_named(FORGING), exit=0, writes=True),
    Received("escapes-in-names", "job folders whose names hold terminal escapes (set the title, clear the screen)",
             "compared; the escapes printed as `\\x1b`, inert", ("compare", "{tmp}/s1", "{tmp}/s2", "--out",
                                                                 "{tmp}/out"),
             "y\\x1b]0;owned\\x07", ("->",), sweeps_named(ESCAPING), exit=0, writes=True),
    Received("gate-typo-val", "a gate one letter off a validation metric (`val_los`)",
             "refused once the runs are read, before any page: the closest metric the runs have",
             (*COMPARE, "--fail-on", "val_los=+0.01"), "--fail-on val_los=+0.01",
             ("no run of either side has the validation metric 'los'", "did you mean val_loss?")),
    Received("gate-typo", "a gate one letter off a figure (`step_tme`)", "refused before any file is read",
             (*COMPARE, "--fail-on", "step_tme=+5%"), "--fail-on step_tme=+5%",
             ("'step_tme' is no figure", "did you mean step_time?")),
    Received("gate-threshold", "a gate whose threshold is no number (`step_time=1.2.3`)", "refused in one line",
             (*COMPARE, "--fail-on", "step_time=1.2.3"), "--fail-on step_time=1.2.3",
             ("'1.2.3' is not a number", "step_time=+5%")),
    Received("gate-kind", "a checkpoints' gate (`tensors`) on two runs", "refused before any file is read",
             (*COMPARE, "--fail-on", "tensors=1e-5"), "--fail-on tensors=1e-5",
             ("tensors gates two checkpoints", "a figure of the runs")),
    Received("gate-missing-figure", "a gate on a figure both runs lack (the cost per million tokens of an MLP)",
             "the gate FAILs (exit 1) and says --allow-missing; with it, NOT EVALUATED",
             (*COMPARE, "--fail-on", "cost_per_mtok=+5%"), "GATE FAIL cost_per_mtok=+5%",
             ("A and B have no cost_per_mtok", "--allow-missing"), exit=1, writes=True),
    # -- tried their own way by other files: bisect's replay, and what a run, the ledger and an export write --------
    Cited("summary.json whose replay names `/bin/sh -c 'touch …'` with PYTHONPATH to a sitecustomize.py and "
          "LD_PRELOAD (`compare --bisect`)", "nothing it names runs: each replay is `trainflow train` in this Python, "
          "its command printed first; of the recorded environment only the thread counts are taken, the rest named "
          "in a warning", BISECT + "test_a_hostile_summary_runs_nothing_it_names_and_a_relative_out_is_the_users"),
    Cited("`.hydra/overrides.yaml` that sets Hydra itself, names a `_target_`, is no plain override or holds a YAML "
          "tag; a recorded environment value not of its form (`compare --bisect`)", "refused in one line naming the "
          "file, exit 2, nothing run or written; a `_target_` is replayed only with `--trust-targets`",
          BISECT + "test_bisect_refuses_a_run_whose_record_names_code"),
    Cited("a run folder whose every file names code (replay, `_target_`s, YAML tags), given to compare, report, "
          "ledger and export", "nothing it names runs, nothing is written into it",
          BISECT + "test_no_command_runs_what_a_hostile_folder_names"),
    Cited("`compare --bisect` with a relative `--out`", "the folder is the user's working folder's, not the run's "
          "recorded one", BISECT + "test_a_hostile_summary_runs_nothing_it_names_and_a_relative_out_is_the_users"),
    Cited("`compare --out` over an earlier comparison", "refused in one line naming --force, the earlier one kept "
          "byte for byte", BISECT + "test_compare_writes_a_new_folder_each_time_and_replaces_only_when_asked"),
    Cited("`outputs/compare` that is a link (planted in a shared working folder), for compare without --out",
          "refused in one line, exit 2: nothing written through it", BISECT + "test_a_link_planted_at_outputs_compare_"
          "is_refused_and_never_written_through"),
    Cited("links at `outputs/compare/N` (to someone's folder, dangling, named by a non-ASCII digit)", "passed over: "
          "the next comparison goes past every name there; nothing written through them",
          BISECT + "test_a_link_planted_at_outputs_compare_n_is_passed_over"),
    Cited("checkpoints of tensors of other shapes", "compared; the line names both shapes, never `relative inf`",
          BISECT + "test_checkpoints_of_tensors_of_other_shapes_name_the_shapes"),
    Cited("`.lock` in a shared checkpoint.dir that is a link to someone's file", "the run stops in one line naming "
          "the link; the file it points to is byte for byte what it was",
          WRITES + "test_a_run_refuses_a_planted_lock_link_and_leaves_its_target_as_it_was"),
    Cited("`.lock` that is a dangling link, a FIFO, a file of other content or a hard link",
          "refused in one line naming it, never opened through, truncated or waited on",
          WRITES + "test_a_lock_file_that_is_not_trainflows_is_refused_untouched"),
    Cited("`.lock.owner` (the lock where a filesystem has no flock) that is a link or a FIFO",
          "refused in one line; never read through, removed or waited on",
          WRITES + "test_a_planted_lock_owner_file_is_refused_untouched"),
    Cited("a `.trainflow` marker that is a dangling link", "refused; nothing is created through it",
          WRITES + "test_a_marker_link_is_refused_and_nothing_is_created_through_it"),
    Cited("a sweep job's identity file that is a link", "refused; neither read through nor replaced",
          WRITES + "test_a_sweep_jobs_identity_link_is_refused"),
    Cited("a step folder of checkpoint.dir that is a link to a folder elsewhere", "retention neither marks, renames "
          "nor deletes through it, says so once, and logs no deletion that did not happen",
          WRITES + "test_retention_never_follows_a_linked_step_folder_out_of_checkpoint_dir"),
    Cited("an export path that is a link or a file trainflow did not export", "refused, with --force too; the file "
          "is byte for byte what it was",
          WRITES + "test_an_export_never_replaces_a_link_or_a_foreign_file_even_with_force"),
    Cited("`metrics.ledger=<a shell's rc file>`", "the run finishes, one warning (`is not a ledger`), the file byte "
          "for byte what it was", WRITES + "test_a_run_never_appends_to_a_file_that_is_not_a_ledger"),
    Cited("`outputs/ledger.jsonl` that is a link; a ledger whose last line was cut", "the link is refused in one "
          "warning, its target unchanged; the next line is not glued to the fragment, and `trainflow ledger` lists "
          "it, counting the fragment",
          WRITES + "test_a_linked_ledger_in_outputs_is_refused_and_a_cut_line_loses_only_itself"),
    Cited("a ledger on a disk that fills mid-line", "the line is whole or absent",
          WRITES + "test_a_full_disk_leaves_the_ledger_whole"),
    Cited("a ledger under a file-size limit reached mid-line", "the line is whole or absent",
          WRITES + "test_a_file_size_limit_leaves_the_ledger_whole"),
    Cited('ledger lines of the wrong shape or type (`"model": null`, figures as a list or as text)',
          "skipped and counted in one warning; the others listed",
          WRITES + "test_a_line_of_the_wrong_shape_is_skipped_and_counted"),
    Cited("a ledger that is a FIFO or a link to /dev/zero (`trainflow ledger`, compare's `ledger:`)",
          "one line naming it: never waited on, never read",
          WRITES + "test_a_ledger_that_is_no_regular_file_is_one_line"),
    Cited("a ledger run name holding terminal escapes and a newline", "printed with `\\x1b` and `\\n` escaped: "
          "no escape, no forged line", WRITES + "test_a_run_name_with_terminal_escapes_is_printed_escaped"),
    Cited("`trainflow ledger --config <run folder>` whose summary.json is a FIFO", "one line naming it",
          WRITES + "test_a_run_folder_given_as_config_reads_its_summary_bounded"),
    Cited("a link planted where an atomic write's temporary file would go (a world-writable folder)", "never written "
          "through: the temporary name is new and unpredictable, and the file lands whole",
          WRITES + "test_a_whole_file_write_never_follows_a_link_planted_under_its_temporary_name"),
    Cited("a run dir holding a space", "the `next` hint is shell-quoted: pasted, it runs",
          "test_console.py::test_the_next_hint_is_a_command_to_paste_for_a_run_dir_with_a_space"),
    Cited("run names with glyphs the font lacks", "drawn as boxes, no glyph warning on the console",
          "test_report.py::test_the_picture_names_each_run_by_what_sets_it_apart_and_escapes_names"),
    Cited("pipeline micro-batches that do not divide the per-rank batch", "refused, suggesting only counts it "
          "accepts", "test_bad_inputs.py::test_bad_input[pp-microbatches-not-dividing]"),
]


# -- running a row ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = ok(train(tmp_path_factory.mktemp("received") / "run", *MLP))
    return run.run_dir


def fill(text: str, tmp: Path) -> str:
    return text.replace("{tmp}", str(tmp))


def tree(root: Path) -> dict[str, str]:
    """Every entry under `root` by its path: a regular file's sha256, else its kind (a FIFO is never opened)."""
    out = {}
    for path in sorted(root.rglob("*")):
        mode = path.lstat().st_mode
        target = os.readlink(path) if path.is_symlink() else ""
        out[str(path.relative_to(root))] = (hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(mode)
                                            else f"{stat.S_IFMT(mode):o} {target}")
    return out


def line_pattern(row: Received, tmp: Path) -> re.Pattern:
    """A whole line naming the file (an error: first, after `Error: `), then each of the row's words in order."""
    names = re.escape(fill(row.names, tmp))
    head = rf"Error: {names}(?=[: ])" if row.exit == 2 else f".*?{names}"
    return re.compile(head + "".join(f".*?{re.escape(fill(w, tmp))}" for w in row.says) + ".*")


def trainflow_in(tmp: Path, args: tuple[str, ...]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    try:
        return run_process([str(Path(sys.executable).parent / "trainflow"), *(fill(a, tmp) for a in args)], tmp, env,
                           timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"trainflow {' '.join(args)} hung: still running after {HANG_S} s")


ROWS = [r for r in RECEIVED if isinstance(r, Received)]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_received_input(row: Received, finished_run: Path, tmp_path: Path) -> None:
    for side in ("a", "b"):
        shutil.copytree(finished_run, tmp_path / side)
    if row.setup:
        row.setup(tmp_path)
    before = tree(tmp_path)
    proc = trainflow_in(tmp_path, row.args)
    after = {k: v for k, v in tree(tmp_path).items() if not (row.writes and k.split("/")[0] == "out")}
    lines = (proc.stderr if row.exit == 2 else proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == row.exit, proc.stdout[-2000:] + proc.stderr[-3000:]
    expected = line_pattern(row, tmp_path)
    assert any(expected.fullmatch(line) for line in lines), f"{expected.pattern}\nnot in\n{proc.stdout + proc.stderr}"
    assert "Traceback" not in proc.stdout + proc.stderr
    if row.exit == 2:
        assert [line for line in proc.stderr.splitlines() if line.strip()] == [next(
            line for line in lines if line.startswith("Error:"))]
    assert after == before  # nothing written, nothing changed (the pages of a row that writes them aside)
    assert not (tmp_path / "ran").exists()  # nothing a file named ran
    if row.after:
        row.after(tmp_path)
    pages = [p.read_text() for p in (tmp_path / "out").glob("*.md")] if row.writes else []
    for text in (proc.stdout, proc.stderr, *pages):
        assert not any(line.startswith(FORGED) for line in text.splitlines()), text
        assert "\x1b" not in text and "\x07" not in text, text


def test_a_figure_one_side_lacks_is_not_evaluated_with_allow_missing(finished_run: Path, tmp_path: Path) -> None:
    for side in ("a", "b"):
        shutil.copytree(finished_run, tmp_path / side)
    proc = trainflow_in(tmp_path, (*COMPARE, "--fail-on", "cost_per_mtok=+5%", "--allow-missing"))
    assert proc.returncode == 0, proc.stderr
    assert "GATE NOT EVALUATED cost_per_mtok=+5% (a -> b): A and B have no cost_per_mtok (--allow-missing)" \
        in proc.stdout.splitlines()
    gates = json.loads((tmp_path / "out" / "compare.json").read_text())["gates"]
    assert [g["status"] for g in gates] == ["NOT EVALUATED"]


def test_only_the_bad_metrics_lines_are_left_out(finished_run: Path, tmp_path: Path) -> None:
    """A line of another shape costs only itself: every line the run wrote is read as it was, the bad ones counted."""
    path = shutil.copy(finished_run / "metrics.jsonl", tmp_path / "metrics.jsonl")
    good = [json.loads(line) for line in Path(path).read_text().splitlines()]
    with open(path, "a") as f:
        f.write('{"step": 9, "train/loss": "low"}\n{"train/loss": 1.0}\n["step", 10]\n{"step": true}\n\n'
                '{"step": 11, "val/loss": [1]}\n{"step": 12, "my/own": "text"}\n{"step": 13, "perf/mfu": null}\n')
    log = read_metrics_log(Path(path))
    assert log.entries == [*good, {"step": 12, "my/own": "text"}, {"step": 13, "perf/mfu": None}]
    assert log.skipped == 5 and len(good) >= 4


# -- the table in docs/reliability.md --------------------------------------------------------------------------------


def _shown(text: str) -> str:
    return text.replace("{tmp}", "<dir>").replace("\n", "\\n").replace("|", "\\|")


def markdown_rows(cite: Callable[[str], str] = lambda test: f"`tests/{test}`") -> list[str]:
    """The table as docs/reliability.md shows it: a row of this file with its command, a cited one with its test
    (`cite`: how the page names a test)."""
    rows = ["| received input | what trainflow does | try it | exit | says (among other words) |",
            "|---|---|---|---|---|"]
    for r in RECEIVED:
        if isinstance(r, Cited):
            rows.append(f"| {_shown(r.what)} | {_shown(r.does)} | {cite(r.test)} | | |")
            continue
        command = " ".join(f"'{a}'" if "\n" in a else a for a in ("trainflow", *r.args))
        says = " … ".join(_shown(w) for w in (r.names, *r.says))
        rows.append(f"| {_shown(r.what)} | {_shown(r.does)} | `{_shown(command)}` | {r.exit} | {says} |")
    return rows
