"""Sweep reports: `trainflow report` on real run folders, the multirun callback, and every bad input.

The runs are real `python train.py` processes (the tiny GPT, a few steps); the report is read back from
report.json, report.md and the PNG's bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.processes import run_process
from helpers.runs import ROOT, TINY_GPT, Run, one_line_error, train

from trainflow.report.render import figure
from trainflow.report.runs import plot_name, read_overrides

STEPS = ["trainer.max_steps=6", "trainer.eval_steps=2"]
TRAINFLOW = [str(Path(sys.executable).parent / "trainflow")]


def report_cmd(*args: str | Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return run_process([*TRAINFLOW, "report", *map(str, args)], ROOT, env, timeout=300)


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])




@pytest.fixture(scope="module")
def single_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Run]]:
    """Two single runs side by side, as `python train.py` leaves them under outputs/: the same model, data and batch,
    at two learning rates (other work: their speeds do not compare)."""
    folder = tmp_path_factory.mktemp("outputs")
    runs = [train(folder / "2026-01-01" / "10-00-00", *TINY_GPT, *STEPS),
            train(folder / "2026-01-01" / "11-00-00", *TINY_GPT, *STEPS, "optim.lr=3e-3")]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    return folder, runs


def test_report_on_a_folder_of_single_runs(single_runs: tuple[Path, list[Run]], tmp_path: Path) -> None:
    folder, runs = single_runs
    out = tmp_path / "report"
    proc = report_cmd(folder, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert "2 run(s)" in proc.stdout and "gates" not in proc.stdout  # plain runs: no ladder, no gates
    report = json.loads((out / "report.json").read_text())
    assert [r["name"] for r in report["runs"]] == ["2026-01-01/10-00-00", "2026-01-01/11-00-00"]
    assert report["baseline"] == "2026-01-01/10-00-00" and report["gates"] is None
    assert report["common_overrides"] == [*TINY_GPT, *STEPS]
    first, second = report["runs"]
    assert second["overrides"] == ["optim.lr=3e-3"] and first["overrides"] == []
    for row, run in zip(report["runs"], runs, strict=True):
        s = run.summary
        assert row["status"] == "finished" and row["steps"] == 6
        assert row["samples_per_sec"] == s["steady_state"]["samples_per_sec"] > 0
        assert row["loss_first"] == s["train_loss"]["first"] and row["loss_last"] == s["train_loss"]["last"]
        assert row["mfu"] == s["mfu"] and row["peak_memory_bytes"] == s["peak_memory_bytes"]
        assert row["compile"] is None and row["profiler"] is None and row["checkpoint"] is None
    # another learning rate is other work, not the same work faster: no speedup, and the note says so
    assert first["speedup"] == 1.0 and first["not_compared"] is None
    assert second["speedup"] is None
    note = "another optim.lr than the baseline 2026-01-01/10-00-00: other work, not the same work at another speed"
    assert second["not_compared"] == note
    assert f"2 run(s), 1 not compared with the baseline (2026-01-01/11-00-00: {note})" in proc.stdout
    md = (out / "report.md").read_text()
    assert "| 2026-01-01/11-00-00 | `optim.lr=3e-3` | finished |" in md
    assert f"- `2026-01-01/11-00-00`: {note}" in md and "| not compared |" in md
    assert "![throughput and loss curves](report.png)" in md
    width, height = png_size(out / "report.png")
    assert (width, height) == (1300, 500)
    assert (out / "report.png").stat().st_size > 20_000  # two panels with bars, curves and labels, not a blank


def test_report_warns_of_runs_that_ended_on_an_overloaded_machine(single_runs: tuple[Path, list[Run]],
                                                                   tmp_path: Path) -> None:
    """Each summary.json records the machine's load average and cores at the run's end; the report warns of a run
    whose 1-minute load exceeded report.OVERLOAD (1.5) x the cores (its timings include waiting for a core), and of
    no other."""
    folder, runs = single_runs
    for run in runs:
        host = run.summary["host"]
        assert host["cpu_cores"] == os.cpu_count() and len(host["load_average"]) == 3
        assert all(isinstance(x, float) and x >= 0 for x in host["load_average"])
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    cores = os.cpu_count()
    for name, load in (("10-00-00", cores * 2 + 0.5), ("11-00-00", cores - 0.5)):  # overloaded; not
        path = copy / "2026-01-01" / name / "summary.json"
        summary = json.loads(path.read_text())
        summary["host"]["load_average"][0] = load
        path.write_text(json.dumps(summary))
    proc = report_cmd(copy)
    assert proc.returncode == 0, proc.stderr
    warning = (f"2026-01-01/10-00-00: the load average was {cores * 2 + 0.5:.1f} on {cores} cores at its end, so "
               "its timings include waiting for a core; rerun it on an idle machine before trusting its speed")
    assert json.loads((copy / "report.json").read_text())["warnings"] == [warning]
    assert f"WARNING {warning}" in proc.stdout.splitlines()
    assert f"## Warnings\n\n- {warning}\n" in (copy / "report.md").read_text()
    # the bound: a load of OVERLOAD x the cores is the run's own and then some; just below it no warning, just above
    from trainflow.report.runs import OVERLOAD

    bound = OVERLOAD * cores
    for name, load in (("10-00-00", bound - 0.1), ("11-00-00", bound + 0.1)):
        path = copy / "2026-01-01" / name / "summary.json"
        summary = json.loads(path.read_text())
        summary["host"]["load_average"][0] = load
        path.write_text(json.dumps(summary))
    assert report_cmd(copy).returncode == 0
    assert json.loads((copy / "report.json").read_text())["warnings"] == [
        f"2026-01-01/11-00-00: the load average was {bound + 0.1:.1f} on {cores} cores at its end, so its timings "
        "include waiting for a core; rerun it on an idle machine before trusting its speed"]


def test_runs_of_another_model_data_or_batch_are_listed_apart_and_any_folder_name_is_a_run(
        single_runs: tuple[Path, list[Run]], tmp_path: Path) -> None:
    """A run folder named like a run's own subfolder (`profile`) is found; a run of another model, another data or
    another global batch gets no speedup against the baseline, and the report says why, per run."""
    folder, _ = single_runs
    copy = tmp_path / "outputs"
    shutil.copytree(folder, copy)
    source = copy / "2026-01-01" / "10-00-00"  # the baseline's overrides: only the summary's change sets each apart
    changes = {"profile": ("model", "n_layer", 4), "wider": ("data", "seq_len", 16), "bigger": ("global", None, 16)}
    for name, (section, key, value) in changes.items():
        shutil.copytree(source, copy / name)
        summary = json.loads((copy / name / "summary.json").read_text())
        if section == "global":
            summary["global_batch"] = value
        else:
            summary["config"][section][key] = value
        (copy / name / "summary.json").write_text(json.dumps(summary))
    workers = copy / "workers"  # a loader's worker settings are speed knobs: still compared
    shutil.copytree(source, workers)
    summary = json.loads((workers / "summary.json").read_text())
    summary["config"]["data"]["num_workers"] = 2
    (workers / "summary.json").write_text(json.dumps(summary))
    proc = report_cmd(copy, "--baseline", "2026-01-01/10-00-00")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads((copy / "report.json").read_text())["runs"]}
    assert set(rows) == {"2026-01-01/10-00-00", "2026-01-01/11-00-00", "bigger", "profile", "wider", "workers"}
    apart = {name: row["not_compared"] for name, row in rows.items() if row["not_compared"]}
    base = "than the baseline 2026-01-01/10-00-00"
    assert apart == {"profile": f"another model {base}", "wider": f"another data {base}",
                     "bigger": f"another global batch {base}",
                     "2026-01-01/11-00-00": f"another optim.lr {base}: other work, not the same work at another speed"}
    assert all(rows[name]["speedup"] is None for name in apart)
    assert rows["workers"]["speedup"] == pytest.approx(rows["workers"]["samples_per_sec"] /
                                                       rows["2026-01-01/10-00-00"]["samples_per_sec"])
    assert "6 run(s), 4 not compared with the baseline (2026-01-01/11-00-00: another optim.lr" in proc.stdout
    assert "; bigger: another global batch" in proc.stdout
    md = (copy / "report.md").read_text()
    assert "## Not compared with the baseline" in md and f"- `profile`: another model {base}" in md


def test_a_busy_machine_is_a_warning_on_the_picture_too(single_runs: tuple[Path, list[Run]]) -> None:
    from trainflow.report.render import figure
    from trainflow.report.runs import build, plot_name

    folder, runs = single_runs
    report = build(folder)
    report["busy_runs"] = []  # whatever this machine's load was when the fixture's runs ended
    calm = figure([(plot_name(row), r.losses) for r, row in zip(report.pop("_runs"), report["runs"], strict=True)],
                  report)
    assert "WARNING" not in calm._suptitle.get_text()
    report["busy_runs"] = ["2026-01-01/11-00-00"]
    busy = figure([(name, {}) for name in ("2026-01-01/10-00-00", "2026-01-01/11-00-00")], report)
    assert "WARNING: 1 run(s) measured on a busy machine (2026-01-01/11-00-00)" in busy._suptitle.get_text()
    assert busy._suptitle.get_color() == "tab:red"
    labels = [t.get_text() for t in busy.axes[0].texts]
    assert labels[0] == "1.00x" and labels[1].endswith("busy machine!")


def test_without_matplotlib_the_report_is_written_and_says_how_to_get_the_picture(
        single_runs: tuple[Path, list[Run]], tmp_path: Path) -> None:
    """matplotlib is an extra (trainflow[plots]): the Markdown and JSON need none of it."""
    folder, _ = single_runs
    (tmp_path / "no_matplotlib").mkdir()
    (tmp_path / "no_matplotlib" / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path / "no_matplotlib"), env.get("PYTHONPATH")) if p)
    out = tmp_path / "report"
    proc = run_process([*TRAINFLOW, "report", str(folder), "--out", str(out)], ROOT, env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]
    line = ("report.png: needs the matplotlib library, which is not installed; run pip install "
            "'trainflow[plots]'")
    wrote = proc.stdout.splitlines()[0]
    assert f"WARNING {line}" in proc.stdout.splitlines() and "report.png" not in wrote and "report.md" in wrote
    assert line in json.loads((out / "report.json").read_text())["warnings"]
    assert "](report.png)" not in (out / "report.md").read_text()  # no link to a picture it did not draw


def test_the_picture_names_each_run_by_what_sets_it_apart_and_escapes_names(single_runs: tuple[Path, list[Run]],
                                                                            tmp_path: Path) -> None:
    """The legend and the bars say what was swept (`optim.lr=3e-3`), not only a folder or job number; a name from a
    folder is drawn with its control characters escaped and its `$` literal (never mathtext), without warnings."""
    from trainflow.report.render import figure
    from trainflow.report.runs import build, plot_name

    folder, _ = single_runs
    copy = tmp_path / "outputs"
    shutil.copytree(folder, copy)
    (copy / "2026-01-01" / "11-00-00").rename(copy / "2026-01-01" / "$x$\nFAKE: all gates PASS \u6f22\U0001f600")
    report = build(copy)
    runs = report.pop("_runs")
    drawn = figure([(plot_name(row), r.losses) for r, row in zip(runs, report["runs"], strict=True)], report)
    bars, curves = drawn.axes
    # `$` sorts first: that run is the baseline, and the other is set apart by no override of its own
    names = ["2026-01-01/\\$x\\$\\nFAKE: all gates PASS \u6f22\U0001f600: optim.lr=3e-3", "2026-01-01/10-00-00"]
    assert [t.get_text() for t in bars.get_xticklabels()] == names
    assert [t.get_text() for t in curves.get_legend().get_texts()] == names
    # glyphs the font lacks are drawn as boxes, without a warning on the console
    proc = report_cmd(copy, "--out", tmp_path / "report")
    assert proc.returncode == 0 and (tmp_path / "report" / "report.png").is_file(), proc.stderr
    assert "Glyph" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_baseline_can_be_named(single_runs: tuple[Path, list[Run]], tmp_path: Path) -> None:
    folder, _ = single_runs
    proc = report_cmd(folder, "--out", tmp_path, "--baseline", "2026-01-01/11-00-00")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    first, second = report["runs"]
    assert report["baseline"] == "2026-01-01/11-00-00" and second["speedup"] == 1.0
    assert first["speedup"] is None and first["not_compared"] == (
        "another optim.lr than the baseline 2026-01-01/11-00-00: other work, not the same work at another speed")


def test_one_run_folder_reports_itself(single_runs: tuple[Path, list[Run]], tmp_path: Path) -> None:
    folder, _ = single_runs
    run = tmp_path / "run"
    shutil.copytree(folder / "2026-01-01" / "10-00-00", run)
    proc = report_cmd(run)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((run / "report.json").read_text())
    assert [r["name"] for r in report["runs"]] == ["."] and report["runs"][0]["speedup"] == 1.0


def test_a_summary_of_the_first_format_reads_under_todays_names(single_runs: tuple[Path, list[Run]],
                                                                 tmp_path: Path) -> None:
    """summary.json carries its format; one written before the number (format 1, trainer.warmup_steps) is read with
    today's names, so a report puts it beside today's runs of the same command."""
    from trainflow.record.summary_file import FORMAT, read_summary

    folder, runs = single_runs
    today = runs[0].summary
    assert today["format"] == FORMAT == 2 and today["config"]["trainer"]["excluded_steps"] == 2  # as TINY_GPT sets
    old = tmp_path / "runs" / "old"
    shutil.copytree(runs[0].run_dir, old)
    shutil.copytree(runs[0].run_dir, tmp_path / "runs" / "new")  # the same command today
    first = json.loads((old / "summary.json").read_text())
    del first["format"]
    first["config"]["trainer"]["warmup_steps"] = first["config"]["trainer"].pop("excluded_steps")
    (old / "summary.json").write_text(json.dumps(first))
    read = read_summary(old / "summary.json")
    assert read["format"] == 2 and read["config"]["trainer"]["excluded_steps"] == 2
    assert "warmup_steps" not in read["config"]["trainer"]
    proc = report_cmd(tmp_path / "runs", "--out", tmp_path / "report")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert sorted(r["name"] for r in report["runs"]) == ["new", "old"]
    assert all(r["speedup"] is not None for r in report["runs"])  # compared with each other, not listed apart


def test_a_multirun_sweep_gets_its_report_from_the_callback(tmp_path: Path) -> None:
    """Hydra's own launcher, two jobs in one process: the callback writes the report into the sweep folder."""
    sweep = tmp_path / "sweep"
    proc = run_process([sys.executable, str(ROOT / "train.py"), "-m", *TINY_GPT, "trainer.eval_steps=2",
                        "trainer.max_steps=4,6", f"hydra.sweep.dir={sweep}"], ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((sweep / "report.json").read_text())
    rows = report["runs"]
    assert [r["name"] for r in rows] == ["0", "1"] and [r["steps"] for r in rows] == [4, 6]
    assert [r["overrides"] for r in rows] == [["trainer.max_steps=4"], ["trainer.max_steps=6"]]
    # more steps is more work, not the same work faster: no speedup, and the note says why
    assert report["baseline"] == "0" and rows[0]["speedup"] == 1.0 and rows[1]["speedup"] is None
    assert rows[1]["not_compared"] == ("another trainer.max_steps than the baseline 0: other work, not the same work "
                                       "at another speed")
    summaries = [json.loads((sweep / n / "summary.json").read_text()) for n in ("0", "1")]
    assert [r["loss_last"] for r in rows] == [s["train_loss"]["last"] for s in summaries]
    png_size(sweep / "report.png")
    assert "| 1 | `trainer.max_steps=6` | finished |" in (sweep / "report.md").read_text()


def test_a_sweep_shows_speedups_only_where_the_swept_key_changes_the_speed_of_the_same_work(tmp_path: Path) -> None:
    """precision x learning rate: the bf16 job of the baseline's learning rate is the same work at another precision
    (a speedup); the other learning rate is other work at either precision (none, and the note says why)."""
    sweep = tmp_path / "sweep"
    proc = run_process([sys.executable, str(ROOT / "train.py"), "-m", *TINY_GPT, *STEPS,
                        "trainer.precision=fp32,bf16", "optim.lr=0.001,0.003", f"hydra.sweep.dir={sweep}"], ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((sweep / "report.json").read_text())
    rows = report["runs"]
    assert [r["overrides"] for r in rows] == [["trainer.precision=fp32", "optim.lr=0.001"],
                                              ["trainer.precision=fp32", "optim.lr=0.003"],
                                              ["trainer.precision=bf16", "optim.lr=0.001"],
                                              ["trainer.precision=bf16", "optim.lr=0.003"]]
    assert report["baseline"] == "0" and rows[0]["speedup"] == 1.0
    assert rows[2]["not_compared"] is None and rows[2]["samples_per_sec"] > 0
    assert rows[2]["speedup"] == pytest.approx(rows[2]["samples_per_sec"] / rows[0]["samples_per_sec"])
    note = "another optim.lr than the baseline 0: other work, not the same work at another speed"
    assert [(r["speedup"], r["not_compared"]) for r in (rows[1], rows[3])] == [(None, note)] * 2
    md = (sweep / "report.md").read_text()
    assert f"| 2 | `trainer.precision=bf16 optim.lr=0.001` | finished | {rows[2]['samples_per_sec']:.1f} | " \
           f"{rows[2]['speedup']:.2f}x |" in md
    assert f"- `1`: {note}" in md and f"- `3`: {note}" in md
    title = figure([(plot_name(row), {}) for row in rows], report).axes[0].get_title()
    assert title == "throughput; speedup vs 0"


@pytest.mark.parametrize(("changed", "note"), [
    ({"compile=off": "compile=default"}, None),
    ({"": "parallelism=ddp parallelism.nproc_per_node=2"}, None),
    ({"": "trainer.precision=bf16"}, None),
    ({"trainer.batch_size=8": "trainer.batch_size=4 trainer.grad_accum=2"}, None),  # the same global batch (8)
    ({"": "profiler=schedule checkpoint=dcp logger=tensorboard hydra/launcher=process data.num_workers=2"}, None),
    ({"": "ladder=compile"}, None),  # a ladder's rungs: each sets only the settings above
    ({"": "optim.lr=3e-3"}, "another optim.lr"),
    ({"": "model.n_embd=96"}, "another model.n_embd"),
    ({"trainer.max_steps=6": "trainer.max_steps=8"}, "another trainer.max_steps"),
    ({"compile=off": "compile=default optim.lr=1e-2 +trainer.seed=7"}, "another optim.lr, trainer.seed"),
], ids=["compile", "parallelism", "precision", "batch-layout", "tools", "ladder-rung", "lr", "model", "steps",
        "lr-and-compile"])
def test_a_run_has_a_speedup_only_where_its_overrides_differ_in_speed_settings(
        single_runs: tuple[Path, list[Run]], tmp_path: Path, changed: dict[str, str], note: str | None) -> None:
    """The baseline's run, its overrides changed: compile, parallelism, precision, the batch's layout, the profiler,
    checkpoints, loggers, the launcher and the loader's workers leave the work as it was (a speedup); any other key
    changes it (none, and the note names the key). The picture says "speedup vs" only where a run has one."""
    folder, _ = single_runs
    base = folder / "2026-01-01" / "10-00-00"
    copy = tmp_path / "runs"
    shutil.copytree(base, copy / "a")
    shutil.copytree(base, copy / "b")
    overrides = read_overrides(copy / "b" / ".hydra" / "overrides.yaml")
    (old, new), = changed.items()
    overrides = [o for o in overrides if o != old] + new.split()
    (copy / "b" / ".hydra" / "overrides.yaml").write_text(json.dumps(overrides))
    proc = report_cmd(copy, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    a, b = report["runs"]
    assert report["baseline"] == "a" and a["speedup"] == 1.0
    if note is None:
        assert b["not_compared"] is None and b["speedup"] == pytest.approx(b["samples_per_sec"] / a["samples_per_sec"])
    else:
        assert b["speedup"] is None
        assert b["not_compared"] == f"{note} than the baseline a: other work, not the same work at another speed"
        assert f"1 not compared with the baseline (b: {note} than the baseline a" in proc.stdout
    title = figure([("a", {}), ("b", {})], report).axes[0].get_title()
    assert title == ("throughput; speedup vs a" if note is None
                     else "throughput (no run does the baseline's work at other settings: no speedup)")


# --- bad inputs: one line naming the path and the fix, exit 2 ------------------------------------------------


def test_missing_folder(tmp_path: Path) -> None:
    one_line_error(report_cmd(tmp_path / "nope"), f"{tmp_path / 'nope'}: no such folder", "sweep folder")


def test_a_file_instead_of_a_folder(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text("{}")
    one_line_error(report_cmd(tmp_path / "summary.json"), "is a file, not a folder", "the folder of a run")


def test_folder_without_runs(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("no runs here")
    one_line_error(report_cmd(tmp_path), f"{tmp_path}: no runs found", "point trainflow report at a run")
    assert not (tmp_path / "report.md").exists()


def test_truncated_summary(single_runs: tuple[Path, list[Run]], tmp_path: Path) -> None:
    folder, _ = single_runs
    copy = tmp_path / "runs"
    shutil.copytree(folder, copy)
    summary = copy / "2026-01-01" / "11-00-00" / "summary.json"
    summary.write_text(summary.read_text()[:100])
    one_line_error(report_cmd(copy), f"{summary}: not valid JSON", "rerun it")


def test_unknown_baseline(single_runs: tuple[Path, list[Run]], tmp_path: Path) -> None:
    folder, _ = single_runs
    one_line_error(report_cmd(folder, "--out", tmp_path, "--baseline", "7"),
                   "baseline '7': no such run", "2026-01-01/10-00-00, 2026-01-01/11-00-00")


def test_unwritable_output(single_runs: tuple[Path, list[Run]], tmp_path: Path) -> None:
    folder, _ = single_runs
    blocker = tmp_path / "file"
    blocker.write_text("a file where the output folder should go")
    one_line_error(report_cmd(folder, "--out", blocker / "report"), f"{blocker / 'report'}: cannot write the report",
                   "--out")
