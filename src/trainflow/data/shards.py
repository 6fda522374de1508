"""Prepared token shards: a corpus tokenized once (`trainflow prepare`), then read by memory map (`data=shards`).

A prepared folder holds `shard_NNNNN.bin` (the tokens of a group of the corpus's files, each file followed by the
tokenizer's separator, as uint16 or uint32 by the vocabulary's size) and `manifest.json`: the index (each shard's
token count, in order) and each shard's byte size and xxh3-64 checksum, the dtype and the tokenizer. Preparing
writes each shard under a temporary name, renames it, then records it in `shard_NNNNN.json`: run again, prepare
keeps the shards that are whole (their checksums checked against their records) and writes the rest, those an
interruption left undone and those damaged or removed since. The manifest is written last, with the command.

Training cuts each shard into windows of `seq_len + 1` tokens (a window never spans two shards) and numbers the
windows of all shards in order: the global sample stream (data/stream.py) serves them as it serves any map-style
dataset, so the stream, its resume on any world size and its per-epoch shuffle are the same. A shard is mapped
the first time a rank reads a window of it, so each rank opens only the shards its positions fall in; each read
checks the open shard against what the check at start saw of it.
`shard_stream` (a `data._target_`) serves the same windows as a sharded stream instead: whole shards per rank and
worker, disjoint, in order within each shard.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import multiprocessing
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
import xxhash
from torch.utils.data import Dataset, IterableDataset
from tqdm import tqdm

from trainflow.data.identity import checksum_of, file_checksum
from trainflow.data.text import PIECES_AT_ONCE, Corpus, _pieces
from trainflow.data.tokenizers import Tokenizer
from trainflow.errors import ConfigError, DataError
from trainflow.util.files import atomic_path, write_atomic

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1
SHARD_BYTES = 64 << 20  # text a shard holds, about: files are grouped in order until they reach it


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.bin"


@dataclass(frozen=True)
class Job:
    """One shard to write: its number and the corpus files it holds."""

    index: int
    files: tuple[str, ...]
    key: str  # of those files (names, sizes, times) and the tokenizer: a record with another key is redone


def plan(files: list[Path], tokenizer: Tokenizer, shard_bytes: int) -> list[Job]:
    """The corpus's files in order, grouped into shards of about `shard_bytes` of text."""
    groups: list[list[Path]] = [[]]
    size = 0
    for f in files:
        if groups[-1] and size >= shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(f)
        size += f.stat().st_size
    jobs = []
    for i, group in enumerate(groups):
        key = xxhash.xxh3_64(tokenizer.name.encode())
        for f in group:
            st = f.stat()
            key.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        jobs.append(Job(i, tuple(map(str, group)), key.hexdigest()))
    return jobs


_TOKENIZER: Tokenizer | None = None  # a prepare worker's tokenizer, given once when the worker starts
PR_SET_PDEATHSIG = 1  # prctl: the signal the kernel sends this process when its parent dies


@contextlib.contextmanager
def _workers_ignore_ctrl_c() -> Iterator[None]:
    """SIGINT ignored while the pool starts its workers: they start ignoring it (an ignored signal stays ignored
    across exec, and Python leaves it so), also while they import, so Ctrl-C is the parent's alone to handle: it
    stops the pool and says so in one line."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        yield
        return
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


def _start_worker(tokenizer: Tokenizer, parent: int) -> None:
    """A prepare worker dies with its parent: a SIGKILLed prepare leaves no worker tokenizing on, or waiting
    forever for a task."""
    global _TOKENIZER
    _TOKENIZER = tokenizer
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)


def write_shard(job: Job, out: Path, tokenizer: Tokenizer | None = None) -> dict:
    """Tokenize the job's files into its shard (renamed into place when whole) and record it; returns the record."""
    tokenizer = tokenizer or _TOKENIZER
    assert tokenizer is not None
    path = out / shard_name(job.index)
    digest, tokens = xxhash.xxh3_64(), 0
    separator = np.asarray(tokenizer.separator, dtype=tokenizer.dtype)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for name in job.files:
            pieces = _pieces(Path(name))
            while batch := [p for _, p in zip(range(PIECES_AT_ONCE), pieces, strict=False)]:
                for ids in tokenizer.encode(batch):
                    data = np.asarray(ids, dtype=tokenizer.dtype).tobytes()
                    f.write(data)
                    digest.update(data)
                    tokens += len(ids)
            f.write(separator.tobytes())
            digest.update(separator.tobytes())
            tokens += len(separator)
    record = {"name": path.name, "tokens": tokens, "bytes": path.stat().st_size, "checksum": digest.hexdigest(),
              "key": job.key, "source_bytes": sum(Path(n).stat().st_size for n in job.files)}
    write_atomic(path.with_suffix(".json"), json.dumps(record))
    return record


def _done(job: Job, out: Path) -> dict | None:
    """The shard's record when an earlier prepare finished it from the same files and tokenizer and the shard is
    still whole (its size and checksum those of the record): a missing or damaged shard is prepared again."""
    try:
        record = json.loads((out / shard_name(job.index)).with_suffix(".json").read_text())
        whole = record.get("key") == job.key and (out / record["name"]).stat().st_size == record["bytes"]
        return record if whole and file_checksum(out / record["name"]) == record["checksum"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Prepared:
    """What a prepare did: the manifest it wrote, and how many of its shards it wrote (the others were whole)."""

    manifest: dict
    written: int


def prepare(corpus: Corpus, tokenizer: Tokenizer, out: Path, workers: int, shard_bytes: int = SHARD_BYTES,
            progress: bool = True, command: list[str] | None = None) -> Prepared:
    """Tokenize the corpus into shards in `out` with `workers` processes; shards finished before and still whole
    (their checksums checked) are kept, the others written again. `command`: the prepare command, kept in the
    manifest so that a message about a damaged shard can give it."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".shard_*.tmp*"):  # a shard or record a killed prepare was writing (atomic_path's names)
        stale.unlink()
    jobs = plan(corpus.files, tokenizer, shard_bytes)
    records: dict[int, dict] = {}
    todo = []
    for job in jobs:
        if (record := _done(job, out)) is not None:
            records[job.index] = record
        else:
            todo.append(job)
    if records:
        log.info("prepare: %d of %d shards already in %s and whole (checksums checked); preparing the other %d",
                 len(records), len(jobs), out, len(todo))
    total = sum(Path(n).stat().st_size for job in todo for n in job.files)
    with _Progress(total, progress) as bar:
        if workers <= 1:
            for job in todo:
                records[job.index] = bar.update(write_shard(job, out, tokenizer))
        else:
            # spawn: a fresh interpreter per worker (the tokenizers library's threads do not survive a fork)
            context = multiprocessing.get_context("spawn")
            with _workers_ignore_ctrl_c():
                pool = context.Pool(workers, initializer=_start_worker, initargs=(tokenizer, os.getpid()))
            with pool:
                for index, record in pool.imap_unordered(_write_in_worker, [(job, out) for job in todo]):
                    records[index] = bar.update(record)
    shards = [{k: records[i][k] for k in ("name", "tokens", "bytes", "checksum")} for i in range(len(jobs))]
    manifest = {"format": FORMAT, "dtype": tokenizer.dtype.name, "vocab_size": tokenizer.vocab_size,
                "tokenizer": tokenizer.name, "tokens": sum(s["tokens"] for s in shards), "shards": shards,
                "prepared_by": {"command": command, "cwd": os.getcwd()} if command else None}
    write_atomic(out / MANIFEST, json.dumps(manifest, indent=1))
    return Prepared(manifest, len(todo))


def _write_in_worker(args: tuple[Job, Path]) -> tuple[int, dict]:
    return args[0].index, write_shard(*args)


class _Progress:
    """A tqdm bar of the corpus's bytes, with tokens/s and the ETA tqdm computes from the bytes' rate."""

    def __init__(self, total: int, shown: bool) -> None:
        self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not shown)
        self.tokens, self.started = 0, time.perf_counter()

    def update(self, record: dict) -> dict:
        self.tokens += record["tokens"]
        rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{rate / 1e3:.0f}k tokens/s")
        self.bar.update(record["source_bytes"])
        return record

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


def read_manifest(folder: Path) -> dict:
    """The prepared folder's manifest, each shard checked whole (present, its size, its checksum): one line naming
    the first that is not."""
    return checked_manifest(folder)[0]


Stamp = tuple[int, int, int]  # a shard file's size, modification time (ns) and inode, as its check at start saw them


def _stamp(st: os.stat_result) -> Stamp:
    return st.st_size, st.st_mtime_ns, st.st_ino


def checked_manifest(folder: Path) -> tuple[dict, dict[str, Stamp]]:
    """read_manifest's manifest, and the stamp of each shard as it was checked: a run tells a shard that changed
    after it (removed, truncated, rewritten) when it reads it."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"data.path: {path} does not exist; prepare the corpus first with `trainflow prepare "
                        f"data=text data.paths=[...] --out {folder}`, or point data.path at a prepared "
                        "folder") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"data.path: {path} is unreadable ({exc}); run `trainflow prepare --out {folder}` again "
                        "with the overrides it was prepared with (it rewrites the manifest and keeps the shards "
                        "that are whole)") from None
    stamps = {}
    for shard in manifest["shards"]:
        shard_path = folder / shard["name"]
        try:
            st = os.stat(shard_path)
        except FileNotFoundError:
            raise DataError(f"data.path: shard {shard_path} is missing; {prepare_again(folder, manifest)}") from None
        if st.st_size != shard["bytes"]:
            raise DataError(f"data.path: shard {shard_path} is {st.st_size} bytes, the manifest says {shard['bytes']} "
                            f"(truncated); {prepare_again(folder, manifest)}")
        if file_checksum(shard_path) != shard["checksum"]:
            raise DataError(f"data.path: shard {shard_path} fails its checksum (its bytes changed after it was "
                            f"prepared); {prepare_again(folder, manifest)}")
        stamps[shard["name"]] = _stamp(st)
    return manifest, stamps


def prepare_again(folder: Path, manifest: dict) -> str:
    """The fix for a missing or damaged shard: the command that prepared the folder, which re-checks every shard
    against its checksum and writes the missing or damaged ones again."""
    by = manifest.get("prepared_by") or {}
    if by.get("command"):
        how = f"`{shlex.join(by['command'])}` again from {by['cwd']}"
    else:
        how = f"`trainflow prepare --out {folder}` again with the overrides it was prepared with"
    return f"run {how}: it re-checks every shard and writes the missing or damaged ones again"


class ShardWindows(Dataset):
    """Windows [first, first + count) of the prepared shards' windows, gathered a micro-batch at a time.

    Given the shards' stamps from their check at start, a shard is checked again each time it is read: one fstat of
    the open file. A shard deleted, truncated or rewritten since then stops the run in one line naming it (a read
    of a map whose file was truncated would end the process with SIGBUS instead); one only touched is hashed again,
    and read on if its bytes are the manifest's.
    """

    def __init__(self, folder: Path, manifest: dict, seq_len: int, first: int = 0, count: int | None = None,
                 stamps: dict[str, Stamp] | None = None) -> None:
        self.folder, self.seq_len, self.dtype = folder, seq_len, np.dtype(manifest["dtype"])
        self.manifest, self.stamps = manifest, stamps
        self.names = [s["name"] for s in manifest["shards"]]
        per_shard = np.asarray([max(0, (s["tokens"] - 1) // seq_len) for s in manifest["shards"]], dtype=np.int64)
        self.ends = np.cumsum(per_shard)  # window i of all shards lies in the first shard whose end exceeds i
        self.begins = self.ends - per_shard
        self.first = first
        self.count = int(self.ends[-1]) - first if count is None else count
        self.maps: dict[int, np.ndarray] = {}  # the shards this process opened, by number
        self.files: dict[int, BinaryIO] = {}  # and their open files, to check them against their stamps
        self.span = np.arange(seq_len + 1)

    def __len__(self) -> int:
        return self.count

    def __getstate__(self) -> dict:
        """What a loader worker gets: no open files or maps (each process opens its own)."""
        return {**self.__dict__, "maps": {}, "files": {}}

    def _shard(self, i: int) -> np.ndarray:
        if i not in self.maps:
            path = self.folder / self.names[i]
            try:
                self.files[i] = open(path, "rb")  # noqa: SIM115 (kept open while the run reads the shard)
            except FileNotFoundError:
                raise DataError(f"data.path: shard {path} was removed while the run trained (it was whole at "
                                f"start); {self._fix()}") from None
            self._check(i)
            # the map seen as a plain array: indexing it makes no memmap objects
            self.maps[i] = np.memmap(self.files[i], dtype=self.dtype, mode="r").view(np.ndarray)
        elif self.stamps is not None:
            self._check(i)
        return self.maps[i]

    def _check(self, i: int) -> None:
        """The open shard is as its check at start saw it, or its bytes are still the manifest's."""
        if self.stamps is None:
            return
        name, f = self.names[i], self.files[i]
        stamp = _stamp(os.fstat(f.fileno()))
        if stamp == self.stamps[name]:
            return
        shard = self.manifest["shards"][i]
        if stamp[0] != shard["bytes"]:
            why = f"it is {stamp[0]} bytes, the manifest says {shard['bytes']}"
        elif checksum_of(f) != shard["checksum"]:
            why = "it fails its checksum"
        else:  # touched, or copied over with the same bytes
            self.stamps[name] = stamp
            return
        raise DataError(f"data.path: shard {self.folder / name} changed while the run trained ({why}); "
                        f"{self._fix()}")

    def _fix(self) -> str:
        return (f"{prepare_again(self.folder, self.manifest)}, then run the same training command: it resumes from "
                "the last committed checkpoint")

    def __getitem__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        windows = np.asarray(indices, dtype=np.int64).reshape(-1) + self.first
        shards = np.searchsorted(self.ends, windows, side="right")
        starts = (windows - self.begins[shards])[:, None] * self.seq_len + self.span  # each window's token offsets
        if (shards == shards[0]).all():  # a micro-batch of one shard: one gather (the cost between two steps is
            # mostly cold caches, so fewer numpy calls is what shortens the data wait)
            window = torch.from_numpy(self._shard(int(shards[0]))[starts]).to(torch.int64)
        else:
            out = np.empty((len(windows), self.seq_len + 1), dtype=np.int64)
            for shard in np.unique(shards):
                rows = np.flatnonzero(shards == shard)
                out[rows] = self._shard(int(shard))[starts[rows]]
            window = torch.from_numpy(out)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def check_vocab(manifest: dict, vocab_size: int | None, folder: str) -> None:
    """Shards of more tokens than the model's vocabulary stop the run in one line (not an embedding's IndexError)."""
    if vocab_size is not None and manifest["vocab_size"] > vocab_size:
        raise ConfigError(f"model.vocab_size: is {vocab_size}, but the shards in {folder} were prepared with a "
                          f"tokenizer of {manifest['vocab_size']} tokens; set model.vocab_size={manifest['vocab_size']}"
                          f" (or tokenizer.vocab_size, which it follows)")


def shard_datasets(folder: Path, seq_len: int, val_fraction: float) -> tuple[ShardWindows, ShardWindows, dict]:
    """The train windows (the first 1 - val_fraction of them) and the validation ones, and the manifest."""
    manifest, stamps = checked_manifest(folder)
    every = ShardWindows(folder, manifest, seq_len)
    split = int(len(every) * (1 - val_fraction))
    if split < 1 or len(every) - split < 1:
        raise DataError(f"data.path: the prepared shards in {folder} hold {len(every)} windows of {seq_len + 1} "
                        f"tokens, too few for one training and one validation window (val_fraction={val_fraction}); "
                        "prepare more text or lower data.seq_len")
    return (ShardWindows(folder, manifest, seq_len, 0, split, stamps),
            ShardWindows(folder, manifest, seq_len, split, len(every) - split, stamps), manifest)



class ShardStream(IterableDataset):
    """The prepared training windows as a sharded stream (data/sharded.py): `shard(i)` yields shard i's windows in
    order, each `(inputs, targets)`, so every rank and worker reads whole shards of its own, disjoint from the
    others' (the trade: no shuffle across shards, where data=shards shuffles every window of the corpus)."""

    def __init__(self, windows: ShardWindows) -> None:
        self.windows = windows
        self.num_shards = len(windows.names)

    def shard(self, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        w = self.windows
        first, end = max(int(w.begins[index]), w.first), min(int(w.ends[index]), w.first + w.count)
        for i in range(first - w.first, end - w.first):  # the windows of the shard that lie in this split
            inputs, targets = w[torch.tensor([i])]
            yield inputs[0], targets[0]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(self.num_shards):
            yield from self.shard(index)


class WindowItems(Dataset):
    """ShardWindows one window at a time, as a `data._target_`'s map-style dataset is read (and then collated)."""

    def __init__(self, windows: ShardWindows) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.windows[torch.tensor([i])]
        return inputs[0], targets[0]


def shard_stream(path: str, seq_len: int, val_fraction: float = 0.05,
                 vocab_size: int | None = None) -> dict[str, Dataset]:
    """A `data._target_`: the prepared folder's training windows as a sharded stream (whole shards per rank and
    worker), its validation windows map-style. `data=custom data._target_=trainflow.data.shards.shard_stream
    +data.path=DIR data.seq_len=N +data.vocab_size=${model.vocab_size}` (checked against the shards)."""
    train, val, manifest = shard_datasets(Path(path).expanduser(), seq_len, val_fraction)
    check_vocab(manifest, vocab_size, path)
    return {"train": ShardStream(train), "val": WindowItems(val)}
