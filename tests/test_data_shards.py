"""Prepared token shards: `trainflow prepare` (in parallel, resumable), then `data=shards` by memory map, with the
same exact stream; shards that are missing, truncated or changed are refused in one line naming them."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.processes import left_behind, run_process
from helpers.runs import ROOT, TINY_GPT, losses_by_step, start, train, wait_for_log

from trainflow.checkpoint import check_intact, list_committed
from trainflow.conf import CONFIG_DIR
from trainflow.config.schema import DataSection
from trainflow.data.shards import MANIFEST, ShardWindows, prepare, read_manifest, shard_datasets, shard_name
from trainflow.data.stream import StreamSampler
from trainflow.data.text import Corpus
from trainflow.errors import DataError


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """trainflow's own source (~270 kB) in shards of ~0.1 MB of text, a BPE of 512 tokens, 2 worker processes."""
    tmp = tmp_path_factory.mktemp("shards")
    shutil.copytree(ROOT / "src" / "trainflow", tmp / "corpus", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp / "prepared"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "trainflow"), "prepare", "--out", str(out), "--workers", "2",
         "--shard-mb", "0.05", "--quiet", "--config-dir", str(CONFIG_DIR), f"data.paths=[{tmp / 'corpus'}]",
         "tokenizer=bpe", "tokenizer.vocab_size=512", f"tokenizer.cache_dir={tmp / 'tok'}"],
        capture_output=True, text=True, cwd=tmp, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"train with data=shards data.path={out} model.vocab_size=512" in done.stdout
    return out


def test_prepare_writes_checksummed_uint16_shards_of_the_corpus(prepared: Path) -> None:
    manifest = read_manifest(prepared)
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 512 and len(manifest["shards"]) >= 4
    tokens = [np.fromfile(prepared / s["name"], dtype=np.uint16) for s in manifest["shards"]]
    assert [len(t) for t in tokens] == [s["tokens"] for s in manifest["shards"]]  # the index
    assert sum(map(len, tokens)) == manifest["tokens"] and all(int(t.max()) < 512 for t in tokens)
    assert all(t[-1] == 0 for t in tokens)  # each shard's last file ends with <|endoftext|>


def test_a_rank_opens_only_the_shards_its_positions_fall_in(prepared: Path) -> None:
    """Counted: after two micro-batches, each of 2 ranks has mapped exactly the shards of the windows it read."""
    manifest = read_manifest(prepared)
    for rank in range(2):
        windows = ShardWindows(prepared, manifest, 32)
        sampler = iter(StreamSampler(len(windows), 2, rank, 2, seed=0))
        read = [next(sampler) for _ in range(2)]
        for indices in read:
            windows[indices]
        wanted = {int(np.searchsorted(windows.ends, i, side="right")) for b in read for i in b.tolist()}
        assert set(windows.maps) == wanted and len(wanted) < len(manifest["shards"])
        inputs, targets = windows[read[0]]  # window i: 33 tokens of its shard, from (i - the shard's first) x 32
        i = int(read[0][1])
        shard = int(np.searchsorted(windows.ends, i, side="right"))
        offset = (i - int(windows.begins[shard])) * 32
        expected = np.fromfile(prepared / shard_name(shard), dtype=np.uint16)[offset:offset + 33].astype(np.int64)
        assert inputs[1].tolist() == expected[:-1].tolist() and targets[1].tolist() == expected[1:].tolist()


def test_a_batch_of_one_shard_and_one_across_shards_gather_the_same_tokens(prepared: Path) -> None:
    """The one-gather path (every window in one shard) and the per-shard path return the shards' own tokens."""
    manifest = read_manifest(prepared)
    windows = ShardWindows(prepared, manifest, 32)
    tokens = [np.fromfile(prepared / s["name"], dtype=np.uint16).astype(np.int64) for s in manifest["shards"]]

    def expected(i: int) -> list[int]:
        shard = int(np.searchsorted(windows.ends, i, side="right"))
        offset = (i - int(windows.begins[shard])) * 32
        return tokens[shard][offset:offset + 33].tolist()

    last_of_first = int(windows.ends[0]) - 1
    for batch in ([3, 0, last_of_first], [last_of_first, last_of_first + 1, int(windows.ends[-1]) - 1]):
        inputs, targets = windows[torch.tensor(batch)]
        assert inputs.dtype == targets.dtype == torch.int64 and inputs.is_contiguous() and targets.is_contiguous()
        joined = [a + [b[-1]] for a, b in zip(inputs.tolist(), targets.tolist(), strict=True)]
        assert joined == [expected(i) for i in batch] and torch.equal(inputs[:, 1:], targets[:, :-1])


def test_an_interrupted_prepare_does_only_what_is_left(prepared: Path, tmp_path: Path) -> None:
    """What a kill leaves: a shard renamed into place without its record, another half-written under its temporary
    name, no manifest: the next prepare writes those two again, byte for byte, and keeps the others untouched."""
    copy = tmp_path / "prepared"
    shutil.copytree(prepared, copy)
    before = read_manifest(copy)
    (copy / MANIFEST).unlink()
    (copy / shard_name(1)).with_suffix(".json").unlink()
    (copy / shard_name(2)).unlink()
    (copy / shard_name(2)).with_suffix(".json").unlink()
    (copy / f".{shard_name(2)}.tmp4242.bin").write_bytes(b"half a shard")  # what a kill leaves of one being written
    kept = {p.name: p.stat().st_mtime_ns for p in copy.glob("shard_*.bin")}
    cfg = {"paths": [str(prepared.parent / "corpus")], "suffixes": [".py"]}
    corpus = Corpus.of(_section(cfg))
    tok = corpus.tokenizer(_section({"kind": "bpe", "vocab_size": 512, "cache_dir": str(prepared.parent / "tok")}))
    done = prepare(corpus, tok, copy, workers=1, shard_bytes=int(0.05 * (1 << 20)), progress=False,
                   command=before["prepared_by"]["command"])
    assert done.written == 2 and {**done.manifest, "prepared_by": None} == {**before, "prepared_by": None}
    rewritten = {p.name for p in copy.glob("shard_*.bin") if kept.get(p.name) != p.stat().st_mtime_ns}
    assert rewritten == {shard_name(1), shard_name(2)}
    assert not list(copy.glob(".*"))  # nothing half-written left behind


def _section(values: dict):
    from omegaconf import OmegaConf

    return OmegaConf.create(values)


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped"])
def test_a_damaged_shard_is_refused_in_one_line_naming_it(prepared: Path, tmp_path: Path, damage: str) -> None:
    copy = tmp_path / "prepared"
    shutil.copytree(prepared, copy)
    shard = copy / shard_name(3)
    data = bytearray(shard.read_bytes())
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(data[:-2])
    else:
        data[len(data) // 2] ^= 1
        shard.write_bytes(bytes(data))
    said = {"missing": "is missing", "truncated": f"is {len(data) - 2} bytes, the manifest says {len(data)} "
            "(truncated)", "flipped": "fails its checksum (its bytes changed after it was prepared)"}[damage]
    with pytest.raises(DataError, match="^" + re.escape(f"data.path: shard {shard} {said}; ")) as raised:
        read_manifest(copy)
    assert "\n" not in str(raised.value) and "trainflow prepare" in str(raised.value)


def prepare_command(corpus: Path, out: Path, *extra: str) -> list[str]:
    """`trainflow prepare` of a corpus into `out` (byte tokens: nothing to train), no progress bar; `extra`: options,
    then overrides."""
    return [str(TRAINFLOW), "prepare", "--out", str(out), "--quiet", *extra, f"data.paths=[{corpus}]"]


TRAINFLOW = Path(sys.executable).parent / "trainflow"


def the_fix(message: str) -> tuple[list[str], Path]:
    """The command a message about a shard says to run again, and the folder to run it from."""
    command, cwd = re.search(r"run `(.+?)` again from (\S+): it re-checks every shard", message).groups()
    argv = shlex.split(command)
    assert argv[:2] == ["trainflow", "prepare"]
    return [str(TRAINFLOW), *argv[1:]], Path(cwd)


def test_the_prepare_command_a_message_gives_writes_damaged_and_missing_shards_again(tmp_path: Path) -> None:
    """A shard with a flipped byte and one removed (its record kept): training's message names the command that
    prepared the folder; run again, it re-checks every shard by checksum and writes those two again, byte for byte,
    and keeps the others."""
    shutil.copytree(ROOT / "src" / "trainflow" / "data", tmp_path / "corpus",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "prepared"
    first = subprocess.run(prepare_command(tmp_path / "corpus", out, "--shard-mb", "0.02"), capture_output=True,
                           text=True, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr
    shards = sorted(out.glob("shard_*.bin"))
    original = {p.name: p.read_bytes() for p in shards}
    assert len(shards) >= 4 and f"wrote {len(shards)} of {len(shards)} shards, " in first.stdout
    flipped = bytearray(original[shard_name(2)])
    flipped[len(flipped) // 2] ^= 1
    (out / shard_name(2)).write_bytes(bytes(flipped))
    (out / shard_name(1)).unlink()
    with pytest.raises(DataError) as raised:
        read_manifest(out)
    command, cwd = the_fix(str(raised.value))
    assert cwd == tmp_path and str(raised.value).startswith(f"data.path: shard {out / shard_name(1)} is missing; ")
    again = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=300)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    assert (f"wrote 2 of {len(shards)} shards ({len(shards) - 2} already there and whole: checksums checked)"
            in again.stdout)
    assert {p.name: p.read_bytes() for p in out.glob("shard_*.bin")} == original
    assert read_manifest(out)["shards"] == json.loads((out / MANIFEST).read_text())["shards"]


def big_corpus(folder: Path, files: int = 8) -> Path:
    """Files of 1.5 MB of text: a shard of 3 MB takes byte tokens a second or so to write."""
    folder.mkdir()
    text = "".join(f"line {i} of a corpus that takes a while to tokenize\n" for i in range(30_000))
    for i in range(files):
        (folder / f"part{i}.txt").write_text(text)
    return folder


def wait_for_a_shard_being_written(proc: subprocess.Popen, out: Path) -> None:
    """Until a worker writes a shard (its temporary file exists): the pool runs."""
    deadline = time.monotonic() + 120
    while not list(out.glob(".shard_*.tmp*")):
        assert proc.poll() is None, f"prepare ended ({proc.returncode}) before a shard was being written"
        assert time.monotonic() < deadline, "no shard was being written after 120 s"
        time.sleep(0.01)


def test_ctrl_c_during_prepare_is_one_line_and_the_same_command_finishes(tmp_path: Path) -> None:
    """Ctrl-C pressed as a terminal does (SIGINT to the whole process group: prepare and its 2 workers) while the
    shards are written: one line, exit 130, no traceback from any process, no worker left; the same command then
    writes what was left and a whole manifest."""
    corpus, out = big_corpus(tmp_path / "corpus"), tmp_path / "prepared"
    command = prepare_command(corpus, out, "--workers", "2", "--shard-mb", "3", "data.suffixes=[.txt]")
    with left_behind() as leftovers:
        proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            wait_for_a_shard_being_written(proc, out)
            os.killpg(proc.pid, signal.SIGINT)
            _, stderr = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert leftovers(10) == {}
    assert proc.returncode == 130, stderr
    assert stderr.splitlines() == [f"Interrupted: trainflow prepare stopped; the shards it finished in {out} are "
                                   "kept: run the same command to prepare the rest"]
    assert not (out / MANIFEST).exists()
    again = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr
    assert len(read_manifest(out)["shards"]) == 4 and not list(out.glob(".*"))


def children(pid: int) -> dict[int, str]:
    """The child processes of `pid`, by pid, with their command lines."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found[int(child)] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return found


def exit_code_of_adopted(pid: int, timeout: float = 120) -> int:
    """The exit code of `pid`, a process this one adopted (left_behind), once it has ended (negative: the signal
    that ended it); it is reaped here."""
    deadline = time.monotonic() + timeout
    while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0:
        assert time.monotonic() < deadline, f"process {pid} still runs {timeout:.0f} s after its parent died"
        time.sleep(0.01)
    return os.waitstatus_to_exitcode(ended[1])


def test_sigkill_of_prepare_leaves_no_worker_behind(tmp_path: Path) -> None:
    """prepare --workers 2 SIGKILLed as a worker begins a shard of 12 MB (seconds of work): each worker dies with it,
    killed by the SIGKILL the kernel sends it as its parent dies, or, one still starting, ending itself (exit code 1)
    as it finds its parent gone; none ends after a shard it went on with (it would fail to hand it to the dead parent,
    with a traceback). Multiprocessing's resource tracker exits as its pipe closes. Each end is waited for as an
    event, not for a fixed time (on a busy machine the tracker's takes more than a second): nothing is left."""
    corpus, out = big_corpus(tmp_path / "corpus", files=16), tmp_path / "prepared"
    command = prepare_command(corpus, out, "--workers", "2", "--shard-mb", "12", "data.suffixes=[.txt]")
    with left_behind() as leftovers, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            wait_for_a_shard_being_written(proc, out)
            workers = [pid for pid, line in children(proc.pid).items() if "multiprocessing.spawn" in line]
        finally:
            proc.kill()
            proc.wait()
        assert len(workers) == 2
        codes = [exit_code_of_adopted(pid) for pid in workers]
        assert -signal.SIGKILL in codes and set(codes) <= {-signal.SIGKILL, 1}, codes  # the one writing: killed
        assert leftovers(120) == {}  # returns as soon as none is left (the tracker's exit)
    assert "Traceback" not in (tmp_path / "stderr").read_text()


def test_a_shard_is_checked_again_each_time_it_is_read(prepared: Path, tmp_path: Path) -> None:
    """After the check at start, a read of an open shard compares it with its stamp (one fstat): touched, it is
    hashed again and read on; a byte flipped in place, it is refused in one line naming it."""
    shutil.copytree(prepared, tmp_path / "prepared")
    train_set, _, _ = shard_datasets(tmp_path / "prepared", 32, 0.05)
    first = train_set[torch.tensor([0, 1])]
    shard = tmp_path / "prepared" / shard_name(0)
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    again = train_set[torch.tensor([0, 1])]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    with open(shard, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(DataError) as raised:
        train_set[torch.tensor([0, 1])]
    assert str(raised.value).startswith(f"data.path: shard {shard} changed while the run trained (it fails its "
                                        "checksum); run `trainflow prepare ")


TRUNCATE_WHILE_MAPPED = """
import os, sys, torch
from pathlib import Path
from trainflow.data.shards import shard_datasets, shard_name
from trainflow.errors import DataError

folder = Path(sys.argv[1])
train_set, _, _ = shard_datasets(folder, 32, 0.05)
windows = torch.tensor([100, 101])  # tokens 3200 to 3265 of shard 0: bytes in its second page
train_set[windows]  # shard 0 is mapped
os.truncate(folder / shard_name(0), 100)
try:
    train_set[windows]
except DataError as exc:
    print(exc)
"""


def test_a_mapped_shard_truncated_is_refused_not_a_bus_error(prepared: Path, tmp_path: Path) -> None:
    """Reading pages of a map whose file was truncated ends a process with SIGBUS: the read's fstat sees the new size
    first and says it in one line (in a process of its own, so that a bus error cannot end this one)."""
    shutil.copytree(prepared, tmp_path / "prepared")
    done = run_process([sys.executable, "-c", TRUNCATE_WHILE_MAPPED, str(tmp_path / "prepared")], ROOT, timeout=120)
    size = read_manifest(prepared)["shards"][0]["bytes"]
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith(f"data.path: shard {tmp_path / 'prepared' / shard_name(0)} changed while the run "
                                  f"trained (it is 100 bytes, the manifest says {size}); run `trainflow prepare ")


def test_a_loader_workers_shard_error_is_one_line(prepared: Path, tmp_path: Path) -> None:
    """A shard removed after the check at start, first read by a DataLoader worker: the error comes out as it was
    raised, one line, not torch's `Caught DataError in DataLoader worker process 0.` and the worker's traceback."""
    from trainflow.data import make_loader

    shutil.copytree(prepared, tmp_path / "prepared")
    train_set, _, manifest = shard_datasets(tmp_path / "prepared", 32, 0.05)
    for shard in manifest["shards"]:
        (tmp_path / "prepared" / shard["name"]).unlink()
    cfg = DataSection(num_workers=1, persistent_workers=False, prefetch_factor=2, seq_lens=None)
    with pytest.raises(DataError) as raised:
        next(iter(make_loader(train_set, StreamSampler(len(train_set), 2, 0, 1, seed=0), cfg, False)))
    assert "\n" not in str(raised.value)
    folder = re.escape(str(tmp_path / "prepared"))
    assert re.fullmatch(rf"data\.path: shard {folder}/shard_\d{{5}}\.bin was removed while the run trained \(it was "
                        r"whole at start\); run `trainflow prepare .*", str(raised.value))


def test_training_from_shards_learns_and_resumes_exactly(prepared: Path, tmp_path: Path) -> None:
    """12 steps straight (saving at 6 and 12), then the same run resumed from step 6: the loss falls, and the
    resumed steps' losses equal the uninterrupted run's."""
    common = [*TINY_GPT, "data=shards", f"data.path={prepared}", "model.vocab_size=512", "trainer.eval_every=0",
              "trainer.max_steps=12", "checkpoint=dcp", "checkpoint.every_steps=6"]
    whole = train(tmp_path / "whole", *common, f"checkpoint.dir={tmp_path / 'ck'}")
    assert whole.returncode == 0, whole.stderr
    straight = losses_by_step(tmp_path / "whole")
    assert sum(list(straight.values())[-3:]) < sum(list(straight.values())[:3])
    saved = tmp_path / "ck" / "step_00000006"
    assert json.loads((saved / "state.json").read_text())["stream_version"] == 2
    again = train(tmp_path / "again", *common, f"checkpoint.dir={tmp_path / 'ck2'}", f"checkpoint.resume={saved}")
    assert again.returncode == 0, again.stderr
    resumed = losses_by_step(tmp_path / "again")
    assert min(resumed) == 7 and [resumed[s] for s in range(7, 13)] == [straight[s] for s in range(7, 13)]


@pytest.mark.parametrize("damage", ["removed", "flipped"])
def test_a_shard_removed_or_changed_while_a_run_trains_stops_it_in_one_line(tmp_path: Path, damage: str) -> None:
    """The last shard holds exactly the held-out windows, so the run first reads it at its final evaluation; it is
    removed (or a byte of it flipped in place) while the run trains: one line naming it and the command that
    prepared it, exit 2, the committed checkpoints whole. That command writes the removed shard again, and the same
    training command then resumes from the last committed checkpoint and finishes."""
    shutil.copytree(ROOT / "src" / "trainflow" / "data", tmp_path / "corpus",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "prepared"
    done = subprocess.run(prepare_command(tmp_path / "corpus", out, "--shard-mb", "0.02"), capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    manifest = read_manifest(out)
    windows = ShardWindows(out, manifest, 32)
    held_out = len(windows) - int(windows.begins[-1])  # the last shard's windows
    args = [*TINY_GPT, "data=shards", f"data.path={out}", f"data.val_fraction={(held_out - 0.5) / len(windows)}",
            "trainer.max_steps=400", "trainer.eval_every=0", "trainer.eval_steps=1", "checkpoint=dcp",
            "checkpoint.every_steps=20", f"checkpoint.dir={tmp_path / 'ck'}"]
    run_dir = tmp_path / "run"
    proc = start(run_dir, *args)
    wait_for_log(run_dir, "checkpoint step 20 committed", proc)
    shard = out / shard_name(len(manifest["shards"]) - 1)
    if damage == "removed":
        shard.unlink()
    else:
        with open(shard, "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 1]))
    assert proc.wait(timeout=300) == 2, "the run ended before the shard was damaged, or not in one line"
    said = {"removed": "was removed while the run trained (it was whole at start)",
            "flipped": "changed while the run trained (it fails its checksum)"}[damage]
    output = (tmp_path / "run.out").read_text()
    lines = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in output, output[-3000:]
    assert lines[0].startswith(f"Error: data.path: shard {shard} {said}; run `"), lines[0]
    assert lines[0].endswith("writes the missing or damaged ones again, then run the same training command: it "
                             "resumes from the last committed checkpoint")
    committed = list_committed(tmp_path / "ck")
    assert [c.step for c in committed] == [340, 360, 380]  # every save before the final evaluation; none after
    for checkpoint in committed:
        check_intact(checkpoint, committed)
    if damage == "flipped":
        return  # (prepare writing a flipped shard again: the test above)
    command, cwd = the_fix(lines[0])
    assert subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=300).returncode == 0
    resumed = train(run_dir, *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.summary["resumed_from_step"] == 380 and resumed.summary["steps"] == 400


def test_two_ranks_map_only_the_shards_of_their_own_windows(prepared: Path, tmp_path: Path) -> None:
    """A real run on 2 DDP ranks (gloo), counted from outside: every shard file each rank memory-maps
    (tests/count_maps, an audit hook) is one its own stream positions fall in, training's and the final
    evaluation's, or the first one, whose first windows every rank reads at start to check the batch's shapes;
    no other. The ranks' windows are disjoint. (The shuffle is over the windows of the whole
    corpus, so the ranks' shard sets may overlap: they read disjoint windows, not disjoint shards.)"""
    maps = tmp_path / "maps.txt"
    run = train(tmp_path / "run", *TINY_GPT, "data=shards", f"data.path={prepared}", "model.vocab_size=512",
                "trainer.batch_size=2", "trainer.max_steps=2", "trainer.eval_every=0", "trainer.eval_steps=1",
                "parallelism=ddp", "parallelism.nproc_per_node=2",
                env={"PYTHONPATH": str(ROOT / "tests" / "count_maps"), "TRAINFLOW_TEST_MAPS": str(maps)})
    assert run.returncode == 0, run.stderr[-3000:]
    opened: dict[int, set[str]] = {0: set(), 1: set()}
    for line in maps.read_text().splitlines():
        rank, _, path = line.split(" ", 2)
        opened[int(rank)].add(Path(path).name)
    manifest = read_manifest(prepared)
    every = ShardWindows(prepared, manifest, 32)
    split = int(len(every) * 0.95)  # data.val_fraction's default: the validation windows follow the training ones
    seed = run.summary["config"]["trainer"]["seed"]
    windows = {}
    for rank in range(2):
        trained = iter(StreamSampler(split, 2, rank, 2, seed=seed))
        read = [int(i) for _ in range(2) for i in next(trained)]
        held_out = StreamSampler(len(every) - split, 2, rank, 2, 0, shuffle=False)
        evaluated = [split + int(i) for i in next(iter(held_out))]
        windows[rank] = set(read)
        shapes = [0, 1]  # run.py's example batch: windows [0, trainer.batch_size)
        shards = {shard_name(int(np.searchsorted(every.ends, i, side="right"))) for i in read + evaluated + shapes}
        assert opened[rank] == shards, f"rank {rank} mapped {sorted(opened[rank])}, its windows lie in {sorted(shards)}"
    assert len(windows[0]) == len(windows[1]) == 4 and not windows[0] & windows[1]
    assert all(len(o) < len(manifest["shards"]) for o in opened.values())


def test_two_ranks_read_disjoint_whole_shards_as_a_sharded_stream(prepared: Path, tmp_path: Path) -> None:
    """`data._target_=trainflow.data.shards.shard_stream` on 2 DDP ranks, 1 loader worker each: the shard files
    each rank's worker maps (counted by tests/count_maps) are its own whole shards, r, r + 2, ..., disjoint from the
    other's, and the saved position counts what each rank took of them. (The rank's main process maps the first
    shard, for the batch's shapes, and the validation windows' shard: not training reads.)"""
    maps = tmp_path / "maps.txt"
    run = train(tmp_path / "run", *TINY_GPT, "data=custom", "data._target_=trainflow.data.shards.shard_stream",
                f"+data.path={prepared}", "data.seq_len=32", "+data.vocab_size=${model.vocab_size}",
                "data.num_workers=1", "model.vocab_size=512",
                "trainer.batch_size=2", "trainer.max_steps=3", "trainer.eval_every=0", "trainer.eval_steps=1",
                "parallelism=ddp", "parallelism.nproc_per_node=2", "checkpoint=dcp", "checkpoint.every_steps=3",
                f"checkpoint.dir={tmp_path / 'ck'}",
                env={"PYTHONPATH": str(ROOT / "tests" / "count_maps"), "TRAINFLOW_TEST_MAPS": str(maps)})
    assert run.returncode == 0, run.stderr[-3000:]
    read: dict[int, set[str]] = {0: set(), 1: set()}
    for line in maps.read_text().splitlines():
        rank, process, path = line.split(" ", 2)
        if process == "worker":
            read[int(rank)].add(Path(path).name)
    assert read == {0: {shard_name(0)}, 1: {shard_name(1)}}  # 3 micro-batches of 2 windows: each its first shard
    taken = [json.loads((tmp_path / "ck" / "step_00000003" / f"data_rank{r:05d}.json").read_text()) for r in (0, 1)]
    assert [t["taken"] for t in taken] == [{"0": 6}, {"1": 6}] and all(t["sharded"] for t in taken)


def test_shards_of_a_larger_vocabulary_than_the_model_are_refused_in_one_line(prepared: Path) -> None:
    """data=shards and shard_stream alike: the line names model.vocab_size and the number to set."""
    from trainflow.data import shards_data
    from trainflow.data.shards import shard_stream
    from trainflow.errors import ConfigError

    said = (f"model.vocab_size: is 256, but the shards in {prepared} were prepared with a tokenizer of 512 tokens; "
            "set model.vocab_size=512 (or tokenizer.vocab_size, which it follows)")
    with pytest.raises(ConfigError, match="^" + re.escape(said) + "$"):
        shards_data(str(prepared), 32, 0.05, model_vocab_size=256)
    with pytest.raises(ConfigError, match="^" + re.escape(said) + "$"):
        shard_stream(str(prepared), 32, vocab_size=256)
    assert len(shard_stream(str(prepared), 32, vocab_size=512)["val"]) == len(shards_data(
        str(prepared), 32, 0.05, model_vocab_size=512).val)
