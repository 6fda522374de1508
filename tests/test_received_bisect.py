"""Run folders a user receives (a colleague's, a CI artifact) decide nothing that runs: `compare --bisect` replays
with trainflow's own entry point in this Python and the run's overrides checked as data, never the program,
arguments or environment its summary.json records; compare, report, ledger and export run nothing a hostile folder
names. Also where compare writes: --out against the user's folder, never over an earlier comparison unasked."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from helpers.runs import ok, train, trainflow

from trainflow.util.shown import shell_quoted

# the cheapest checkpointed run: a small MLP, a checkpoint every 2 steps (steps 2 and 4)
MLP = ["model=mlp", "model.hidden=32", "data=synthetic", "logger=none", "compile=off", "trainer.max_steps=4",
       "trainer.log_every=2", "trainer.excluded_steps=1", "trainer.eval_every=0", "trainer.eval_steps=2",
       "checkpoint=dcp", "checkpoint.every_steps=2"]
# what a replay keeps of MLP: the keys it sets itself go
OWN = [o for o in MLP if not o.startswith(("logger=", "checkpoint"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`a` and `b`: one config at two learning rates, apart from the first step on."""
    root = tmp_path_factory.mktemp("received")
    ok(train(root / "a", *MLP, "optim.lr=1e-3", "metrics.ledger=off"))
    ok(train(root / "b", *MLP, "optim.lr=1e-2", "metrics.ledger=off"))
    return root


def _hostile_copy(run: Path, to: Path, marker: Path) -> Path:
    """`run` copied, its summary.json's replay naming a shell that touches `marker`, with an environment that would
    run code (PYTHONPATH to a sitecustomize.py that touches it, LD_PRELOAD) and a variable of its own."""
    shutil.copytree(run, to)
    evil = to.parent / f"{to.name}_code"
    evil.mkdir()
    (evil / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    summary = json.loads((to / "summary.json").read_text())
    summary["fingerprint"]["replay"].update(
        python="/bin/sh", args=["-c", f"touch {marker}", "-m", "trainflow", "train"], cwd=str(to.parent),
        env={"PYTHONPATH": str(evil), "LD_PRELOAD": str(evil / "preload.so"), "TRAINFLOW_MARKER": str(marker),
             "OMP_NUM_THREADS": "1"})
    (to / "summary.json").write_text(json.dumps(summary))
    return to


def test_a_hostile_summary_runs_nothing_it_names_and_a_relative_out_is_the_users(runs: Path, tmp_path: Path) -> None:
    """B's summary.json names `/bin/sh -c 'touch MARKER'` as its replay, with PYTHONPATH to a sitecustomize.py that
    would touch it and an LD_PRELOAD: the marker never appears; each replay is trainflow train in this Python, its
    command printed first, in the folder --out names (relative: against the user's working folder, not the run's
    recorded one), and the bisect still names the step where the runs part."""
    marker = tmp_path / "MARKER"
    hostile = _hostile_copy(runs / "b", tmp_path / "hostile", marker)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = trainflow("compare", "--bisect", runs / "a", hostile, "--out", "rel/out", cwd=elsewhere)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not marker.exists()
    out = elsewhere / "rel" / "out"
    report = json.loads((out / "compare.json").read_text())
    assert (report["last_equal"], report["first_apart"], report["first_step"]) == (None, 2, 1)
    lines = proc.stdout.splitlines()
    for line, name in zip(lines[:2], ("a", "b"), strict=True):
        folder = out / "bisect" / name
        assert line == (f"replay {name.upper()}: {shell_quoted('cd', out / 'bisect')} && " + shell_quoted(
            "env", "OMP_NUM_THREADS=1", sys.executable, "-P", "-m", "trainflow", "train", *OWN,
            f"optim.lr={'1e-3' if name == 'a' else '1e-2'}", f"hydra.run.dir={folder}", "checkpoint=dcp",
            f"checkpoint.dir={folder / 'checkpoints'}", "checkpoint.every_steps=1", "checkpoint.keep_last=6",
            "checkpoint.resume=never", "logger=none", "metrics.ledger=off"))
        assert report["replays"][name]["cwd"] == str(out / "bisect") and report["replays"][name]["saved"][:2] == [1, 2]
        assert "ld.so" not in (out / "bisect" / f"{name}.log").read_text()  # no LD_PRELOAD reached it
    assert lines[2].startswith("A and B part at step 1: first tensor app.model.")
    assert report["faithful"]["b"]["same"]  # the replay reproduces B's own checkpoint: the overrides were B's
    assert {  # A ran with the PYTHONPATH this environment has: nothing to say of it
        f"B ran with PYTHONPATH={tmp_path / 'hostile_code'}; its replay imports what this environment does: give "
        f"--pythonpath-b {tmp_path / 'hostile_code'} to replay with that code (after checking it)",
        "B's recorded environment also sets LD_PRELOAD, TRAINFLOW_MARKER: not taken (a replay takes only "
        "OMP_NUM_THREADS, MKL_NUM_THREADS, CUBLAS_WORKSPACE_CONFIG from a run's record)"} <= set(report["warnings"])
    assert not any(w.startswith("A ran with") for w in report["warnings"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "hostile", "hostile_code"]  # nothing else


TAG = "!!python/object/apply:subprocess.call [[touch, {marker}]]"


@pytest.mark.parametrize(("overrides", "args", "env", "said"), [
    (["hydra/launcher=basic"], None, None, "hydra/launcher=basic sets Hydra itself (what runs, where, with which "
                                           "launcher); bisect replays only trainflow's config"),
    (["hydra.callbacks.x._target_=subprocess.call"], None, None, "sets Hydra itself"),
    (["model@hydra.callbacks.x=mlp"], None, None, "sets Hydra itself"),  # trainflow's own config, put under hydra
    (["model._target_=subprocess.call"], None, None,
     "model._target_=subprocess.call names code to import and call (a _target_); bisect runs it only when you trust "
     "the run: add --trust-targets"),
    (["+model.args={_target_:subprocess.call}"], None, None, "names code to import and call (a _target_)"),
    (["--config-dir=/tmp"], None, None, "--config-dir=/tmp is not a plain key=value override of trainflow's "
                                        "config; bisect replays nothing else"),
    (["optim.lr=1e-2\ntouch"], None, None, "is not a plain key=value override"),
    (TAG, None, None, "is not the list of overrides trainflow saves"),
    ([], ["-m", "trainflow", "train", "--config-dir", "/tmp/confs"], None,
     "the run read configs of its own (--config-dir /tmp/confs), which can name code; bisect uses them only when you "
     "trust the run: add --trust-targets"),
    ([], None, {"OMP_NUM_THREADS": "1; touch x"}, "fingerprint.replay.env.OMP_NUM_THREADS is '1; touch x', not a "
                                                  "value of its form"),
])
def test_bisect_refuses_a_run_whose_record_names_code(runs: Path, tmp_path: Path, overrides: list[str] | str,
                                                      args: list[str] | None, env: dict | None, said: str) -> None:
    """An override that sets Hydra itself, names code, or is no plain override; a YAML tag; config folders of the
    run's own; a thread count that is not a number: one line naming the file, exit 2, nothing run or written."""
    marker = tmp_path / "MARKER"
    hostile = shutil.copytree(runs / "b", tmp_path / "b")
    file = hostile / ".hydra" / "overrides.yaml"
    file.write_text(overrides.format(marker=marker) if isinstance(overrides, str) else json.dumps(overrides))
    summary = json.loads((hostile / "summary.json").read_text())
    summary["fingerprint"]["replay"]["args"] = args or summary["fingerprint"]["replay"]["args"]
    summary["fingerprint"]["replay"]["env"].update(env or {})
    (hostile / "summary.json").write_text(json.dumps(summary))
    proc = trainflow("compare", "--bisect", runs / "a", hostile, "--out", tmp_path / "out", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    where = hostile / "summary.json" if args or env else file
    assert line.startswith(f"Error: --bisect B: {where}: ") and said in line, line
    assert not marker.exists() and not (tmp_path / "out").exists()


def _hostile_folder(run: Path, to: Path, marker: Path) -> Path:
    """`run` copied with every place a file could name code filled: the replay naming a shell, `_target_`s that touch
    `marker` in config.yaml, Hydra's config and summary.json's config, and a YAML tag in .hydra/overrides.yaml."""
    shutil.copytree(run, to)
    call = {"_target_": "subprocess.call", "args": ["touch", str(marker)]}
    summary = json.loads((to / "summary.json").read_text())
    summary["fingerprint"]["replay"].update(python="/bin/sh", args=["-c", f"touch {marker}"])
    summary["config"]["model"] = {**summary["config"]["model"], **call}
    (to / "summary.json").write_text(json.dumps(summary))
    for config in (to / "config.yaml", to / ".hydra" / "config.yaml"):
        text = config.read_text()
        config.write_text(text + f"\nhostile:\n  _target_: subprocess.call\n  args: [touch, {marker}]\n")
    (to / ".hydra" / "overrides.yaml").write_text(f"- {TAG.format(marker=marker)}\n- optim.lr=1e-2\n")
    return to


@pytest.mark.parametrize("command", ["compare", "report", "ledger", "export", "export-hf"])
def test_no_command_runs_what_a_hostile_folder_names(runs: Path, tmp_path: Path, command: str) -> None:
    """Each command that reads a run folder, given one whose every file names code: the marker never appears."""
    marker = tmp_path / "MARKER"
    folder = tmp_path / "received"
    hostile = _hostile_folder(runs / "b", folder / "hostile", marker)
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text(json.dumps({**json.loads((hostile / "summary.json").read_text()), "run_dir": str(hostile),
                                  "overrides": [TAG.format(marker=marker), "model._target_=subprocess.call"]}) + "\n")
    argv = {"compare": ("compare", runs / "a", hostile, "--out", tmp_path / "out"),
            "report": ("report", folder, "--out", tmp_path / "out"),
            "ledger": ("ledger", ledger, "--config", hostile),
            "export": ("export", hostile / "checkpoints", tmp_path / "model.pt"),
            "export-hf": ("export", hostile / "checkpoints", tmp_path / "hf", "--format", "hf")}[command]
    proc = trainflow(*argv, cwd=tmp_path)
    assert proc.returncode is not None and not marker.exists(), proc.stdout + proc.stderr
    assert os.listdir(tmp_path / "received") == ["hostile"]  # nothing written into the received folder


def test_compare_writes_a_new_folder_each_time_and_replaces_only_when_asked(runs: Path, tmp_path: Path) -> None:
    """Without --out: the next free outputs/compare/N under the working folder; an --out that holds a comparison is
    refused in one line naming --force (the earlier one kept byte for byte), and replaced with it."""
    first = trainflow("compare", runs / "a", runs / "b", cwd=tmp_path)
    second = trainflow("compare", runs / "b", runs / "a", cwd=tmp_path)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    for proc, n, a in ((first, 1, "a"), (second, 2, "b")):
        page = tmp_path / "outputs" / "compare" / str(n) / "compare.json"
        assert json.loads(page.read_text())["a"]["runs"] == [a]
        assert f"wrote {page.with_name('compare.md')}, {page}" in proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["outputs"]
    kept = (tmp_path / "outputs" / "compare" / "1" / "compare.json").read_bytes()
    again = trainflow("compare", runs / "b", runs / "a", "--out", "outputs/compare/1", cwd=tmp_path)
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.strip() == (f"Error: --out {tmp_path / 'outputs' / 'compare' / '1'}: holds an earlier "
                                    "comparison (compare.md); nothing was changed: give another --out, or add --force "
                                    "to replace it")
    assert (tmp_path / "outputs" / "compare" / "1" / "compare.json").read_bytes() == kept
    forced = trainflow("compare", runs / "b", runs / "a", "--out", "outputs/compare/1", "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    replaced = json.loads((tmp_path / "outputs" / "compare" / "1" / "compare.json").read_text())
    assert replaced["a"]["runs"] == ["b"]


def test_a_link_planted_at_outputs_compare_is_refused_and_never_written_through(runs: Path, tmp_path: Path) -> None:
    """`outputs/compare` is a folder compare makes: a link there (a shared working folder) is refused in one line,
    exit 2, its target left empty and the link as it was."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (tmp_path / "work" / "outputs").mkdir(parents=True)
    link = tmp_path / "work" / "outputs" / "compare"
    link.symlink_to(theirs)
    proc = trainflow("compare", runs / "a", runs / "b", cwd=tmp_path / "work")
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.strip() == (f"Error: {link}: is a symbolic link; compare writes its pages into folders it "
                                   "makes, never through a link it did not make, and nothing was written: remove the "
                                   "link, or give --out DIR")
    assert list(theirs.iterdir()) == [] and link.readlink() == theirs
    assert os.listdir(tmp_path / "work" / "outputs") == ["compare"]


def test_a_link_planted_at_outputs_compare_n_is_passed_over(runs: Path, tmp_path: Path) -> None:
    """Links named as the next comparisons would be (one to a folder of someone else's, one dangling, one named by a
    digit that is not ASCII): the next comparison goes past every name there, and nothing is written through them."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    folder = tmp_path / "outputs" / "compare"
    folder.mkdir(parents=True)
    (folder / "1").symlink_to(theirs)
    (folder / "2").symlink_to(tmp_path / "not-yet")
    (folder / "\u00b2").symlink_to(theirs)  # `²`: a digit to str.isdigit, not to int()
    proc = trainflow("compare", runs / "a", runs / "b", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"wrote {folder / '3' / 'compare.md'}, {folder / '3' / 'compare.json'}" in proc.stdout
    assert json.loads((folder / "3" / "compare.json").read_text())["a"]["runs"] == ["a"]
    assert list(theirs.iterdir()) == [] and not (tmp_path / "not-yet").exists()
    assert sorted(os.listdir(folder)) == ["1", "2", "3", "\u00b2"]


def test_checkpoints_of_tensors_of_other_shapes_name_the_shapes(runs: Path, tmp_path: Path) -> None:
    """A model half as wide: its tensors cannot be subtracted, and the line says their shapes, not `relative inf`."""
    ok(train(tmp_path / "narrow", *[o for o in MLP if o != "model.hidden=32"], "model.hidden=16",
             "metrics.ledger=off"))
    proc = trainflow("compare", runs / "a" / "checkpoints", tmp_path / "narrow" / "checkpoints", "--out",
                     tmp_path / "out")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    first = report["first"]
    assert first["why"] == "shape [32, 100] torch.float32 in A, [16, 100] torch.float32 in B", first
    assert f"  first differing tensor: {first['tensor']} (shape [32, 100] torch.float32 in A, [16, 100] " \
           "torch.float32 in B)" in proc.stdout.splitlines()
    assert "relative inf" not in proc.stdout
    assert f"- first differing tensor: `{first['tensor']}`: shape [32, 100]" in (tmp_path / "out" / "compare.md"
                                                                                 ).read_text()
