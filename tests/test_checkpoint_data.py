"""A resume knows its data: each checkpoint records the identity of the data it was saved on (data/identity.py),
and a resume on other data is refused in one line naming what changed, unless checkpoint.on_data_change=restart;
every change a resume makes (micro-batch, accumulation, global batch, world size, data) is said and listed.

The runs are real `python train.py` processes on a real corpus of files; the identities compared in this process
are built from real files and real prepared manifests."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers.checkpoints import tree_hash
from helpers.runs import ROOT, TINY_GPT, ok, train

from trainflow.checkpoint.safe_io import file_checksum
from trainflow.data import identity
from trainflow.data.identity import differences, shards_identity, text_identity

ARGS = [*TINY_GPT, "trainer.eval_every=0", "trainer.eval_steps=1", "checkpoint=dcp", "checkpoint.every_steps=2"]
ADDED = {"aa_added.py": "def added():\n    return 'a file added after the checkpoint'\n" * 20,
         "zz_added.py": "class Added:\n    pass\n" * 40}


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps on a corpus of trainflow's data modules, saved at steps 2 and 4 (the folder holds corpus/ and ck/)."""
    root = tmp_path_factory.mktemp("first")
    shutil.copytree(ROOT / "src" / "trainflow" / "data", root / "corpus", ignore=shutil.ignore_patterns("__pycache__"))
    ok(train(root / "run", *ARGS, *data_args(root), "trainer.max_steps=4"))
    return root


def data_args(root: Path) -> list[str]:
    return [f"data.paths=[{root / 'corpus'}]", f"data.cache_dir={root / 'cache'}", f"checkpoint.dir={root / 'ck'}"]


def copy_of(first: Path, tmp_path: Path) -> Path:
    """The first run's corpus and checkpoints, copied: a test changes its own (a copied corpus is the same data)."""
    shutil.copytree(first / "corpus", tmp_path / "corpus")
    shutil.copytree(first / "ck", tmp_path / "ck")
    return tmp_path


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


def test_the_same_data_moved_and_touched_resumes_without_a_word(first: Path, tmp_path: Path) -> None:
    """A corpus copied elsewhere and its files touched: another token cache is built, of the same tokens, so the
    data is the same and the resume says nothing about it."""
    root = copy_of(first, tmp_path)
    for f in (root / "corpus").iterdir():
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    run = ok(train(root / "run", *ARGS, *data_args(root), "trainer.max_steps=6"))
    assert run.summary["resumed_from_step"] == 4 and run.summary["checkpoint"]["resume_changes"] == []
    assert " - resume: " not in (root / "run" / "train.log").read_text()  # no line of the resume's changes
    assert len(list((root / "cache").glob("*.bin"))) == 1  # built here (the copy's files: another cache key)
    saved = json.loads((root / "ck" / "step_00000006" / "state.json").read_text())
    assert saved["data"]["content"] == json.loads((first / "ck" / "step_00000004" / "state.json").read_text())[
        "data"]["content"]
    assert saved["samples_seen"] == 6 * 8  # the position went on: 6 steps of 8 samples


def test_files_added_since_the_checkpoint_are_refused_in_one_line_naming_them(first: Path, tmp_path: Path) -> None:
    root = copy_of(first, tmp_path)
    for name, text in ADDED.items():
        (root / "corpus" / name).write_text(text)
    before = tree_hash(root / "ck")
    run = train(root / "run", *ARGS, *data_args(root), "trainer.max_steps=6")
    assert run.returncode == 2, run.stderr[-3000:]
    assert errors(run.stderr) == [
        f"Error: data.paths: 2 files added (aa_added.py, zz_added.py) since step 4 (the files are under "
        f"{root / 'corpus'} here, {first / 'corpus'} then); {root / 'ck' / 'step_00000004'} was saved on the data as "
        "it was then, and its data position counts in that data: resume with that data, or set "
        "checkpoint.on_data_change=restart to train on this data from the checkpoint (the data position restarts "
        "at sample 0; the step, weights, optimizer and LR schedule go on)"]
    assert "Traceback" not in run.stderr and tree_hash(root / "ck") == before


def test_restart_takes_the_new_data_from_sample_0_and_every_change_is_said(first: Path, tmp_path: Path) -> None:
    """checkpoint.on_data_change=restart with a file removed and trainer.grad_accum 1 -> 2: the resume lists the
    accumulation, the global batch and the data, in the log and in summary.json; the next checkpoint's position
    counts from 0 in the new data, and records the new data."""
    root = copy_of(first, tmp_path)
    (root / "corpus" / "digits.py").unlink()
    run = ok(train(root / "run", *ARGS, *data_args(root), "trainer.max_steps=6", "trainer.grad_accum=2",
                   "checkpoint.on_data_change=restart"))
    moved = f" (the files are under {root / 'corpus'} here, {first / 'corpus'} then)"
    restart = ("checkpoint.on_data_change=restart: the data position restarts at sample 0 of this data (it was at 32 "
               "of the checkpoint's)")
    log = (root / "run" / "train.log").read_text()
    for line in ("resume: trainer.grad_accum is 2 in the config, 1 in the checkpoint; using the config's 2",
                 "resume: global batch is 16 in the config, 8 in the checkpoint; using the config's 16",
                 f"resume: data.paths: 1 file removed (digits.py) since step 4{moved}; {restart}",
                 "resumed from step 4 ("):
        assert line in log, line
    changes = run.summary["checkpoint"]["resume_changes"]
    assert [(c["key"], c["checkpoint"], c["used"]) for c in changes[:2]] == [
        ("trainer.grad_accum", 1, 2), ("global batch", 8, 16)]
    assert changes[2]["key"] == "data.paths" and changes[2]["note"] == restart and len(changes) == 3
    saved = json.loads((root / "ck" / "step_00000006" / "state.json").read_text())
    assert saved["samples_seen"] == 2 * 16  # from 0: two steps of 16 samples, not 32 + 32
    assert saved["layout"] == {"trainer.batch_size": 8, "trainer.grad_accum": 2, "global batch": 16}
    assert saved["data"]["parts"]["count"] == len(list((first / "corpus").iterdir())) - 1


def test_a_checkpoint_without_the_record_resumes_and_says_so(first: Path, tmp_path: Path) -> None:
    """A checkpoint of a trainflow that recorded no data (state.json without `data` and `layout`, its manifest's
    size and checksum made to fit) resumes on changed data, with one line saying it could not check."""
    root = copy_of(first, tmp_path)
    folder = root / "ck" / "step_00000004"
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({k: v for k, v in state.items() if k not in ("data", "layout")}))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["state.json"] = (folder / "state.json").stat().st_size
    manifest["checksums"]["state.json"] = file_checksum(folder / "state.json")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (root / "corpus" / "aa_added.py").write_text(ADDED["aa_added.py"])
    run = ok(train(root / "run", *ARGS, *data_args(root), "trainer.max_steps=6"))
    assert run.summary["resumed_from_step"] == 4 and run.summary["checkpoint"]["resume_changes"] == []
    assert (f"resume: {folder} records no identity of its data (saved by an earlier trainflow): resumed without "
            "checking that the data is the same") in (root / "run" / "train.log").read_text()


# ---------------------------------------------------------------------------------------------------------------
# what the records say, compared in this process


def corpus_identity(folder: Path, **settings: object) -> dict:
    """A data=text record of the files under `folder`, their tokens hashed as the token cache would be (bytes)."""
    files = sorted(folder.iterdir())
    tokens = "".join(file_checksum(f) for f in files)
    return text_identity(files, tokens, str(settings.get("tokenizer", "bytes")), 32,
                         float(settings.get("val_fraction", 0.05)))


def test_each_change_of_a_corpus_is_named(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(5):
        (corpus / f"f{i}.txt").write_text(f"file {i}\n" * (10 + i))
    saved = corpus_identity(corpus)
    assert differences(saved, corpus_identity(corpus), 20) == []
    (corpus / "f0.txt").unlink()
    (corpus / "f1.txt").write_text("longer now\n" * 50)
    (corpus / "f2.txt").write_text((corpus / "f2.txt").read_text().replace("file", "elif"))  # the same size
    for i in range(5, 9):
        (corpus / f"f{i}.txt").write_text("new\n")
    said = [c["said"] for c in differences(saved, corpus_identity(corpus, val_fraction=0.1, tokenizer="bpe-1a2b"),
                                           20)]
    assert said == ["tokenizer: bpe-1a2b here, bytes at step 20",
                    "data.val_fraction: 0.1 here, 0.05 at step 20 (the held-out split moves)",
                    "data.paths: 4 files added (f5.txt, f6.txt, f7.txt, and 1 more), 1 file removed (f0.txt), 1 file "
                    "changed (f1.txt) since step 20"]
    same_sizes = corpus_identity(corpus)
    (corpus / "f3.txt").write_text((corpus / "f3.txt").read_text().replace("file", "FILE"))
    assert [c["said"] for c in differences(same_sizes, corpus_identity(corpus), 7)] == [
        "data.paths: the same files and sizes as at step 7, other tokens: a file's content changed"]


def test_too_many_files_to_list_are_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(identity, "MAX_PARTS", 3)
    for i in range(4):
        (tmp_path / f"f{i}.txt").write_text("x" * (i + 1))
    saved = corpus_identity(tmp_path)
    (tmp_path / "f4.txt").write_text("y")
    assert saved["parts"]["list"] is None and saved["parts"]["count"] == 4
    assert [c["said"] for c in differences(saved, corpus_identity(tmp_path), 3)] == [
        "data.paths: 5 files here, 4 at step 3 (too many to name the ones that differ)"]


def test_other_shards_and_other_kinds_of_data_are_named() -> None:
    def manifest(checksums: list[str]) -> dict:
        return {"tokenizer": "bytes", "shards": [{"name": f"shard_{i:05d}.bin", "checksum": c}
                                                 for i, c in enumerate(checksums)]}

    saved = shards_identity(manifest(["a1", "b2", "c3"]), 32, 0.05)
    assert differences(saved, shards_identity(manifest(["a1", "b2", "c3"]), 32, 0.05), 5) == []
    assert [c["said"] for c in differences(saved, shards_identity(manifest(["a1", "xx", "c3", "d4"]), 64, 0.05),
                                           5)] == [
        "data.seq_len: 64 here, 32 at step 5 (the held-out split moves)",
        "data.path: 1 shard added (shard_00003.bin), 1 shard changed (shard_00001.bin) since step 5"]
    other = identity.settings_identity("data=synthetic", {"data.num_samples": 100, "data.data_seed": 0})
    assert [c["said"] for c in differences(saved, other, 5)] == ["data: data=synthetic here, data=shards at step 5"]
