"""The bytes of a checkpoint: written with a checksum per file, read back without running code from them.

Trust model. A checkpoint folder is data, never code. DCP shards hold the tensors' raw bytes (format 3: a
torch.save record, as earlier formats wrote, is refused); their dtypes and shapes come from `.metadata`, which is
read by an allow-list unpickler that knows the DCP metadata classes, torch dtypes/sizes/layouts and nothing else;
every other value (progress, LR schedule, optimizer hyperparameters, RNG states) is JSON. Only files the manifest
lists are opened, each a regular file inside the folder (store.py checks that first, with lstat). The per-file
xxh3-64 checksums in the manifest catch damage (a flipped byte, a truncated shard), not tampering: whoever can
write the folder can rewrite the manifest too. xxh3-64 rather than CRC32 or a cryptographic hash: it is 5x faster
than zlib.crc32 here (benchmarks/checkpoint.py), so hashing costs a few percent of a save; its 64 bits make an
undetected random corruption vanishingly unlikely.

Also here: what a failure inside DCP (which wraps whatever a rank raised) was, in one line.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import queue
import stat
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from trainflow.errors import CheckpointError
from trainflow.util.activity import Activity, ended, started

_CHUNK = 8 << 20

# A single-process run saves and loads without a process group on purpose: DCP's warning about it is noise.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")


# ---------------------------------------------------------------------------------------------------------------
# Writing: raw tensor bytes, one checksum per file computed from the bytes while they are written

RAW_RECORD = "trainflow.raw/1"  # in a record's transform_descriptors: its bytes are the tensor's, row-major


class _ChecksummedFile(io.RawIOBase):
    """A file that hashes every byte written, in the order written; a 1 MB buffer gathers the small writes.

    fileno() is asked for only to fsync the finished file, so the buffer is flushed there.
    """

    def __init__(self, path: Path) -> None:
        self._file = open(path, "wb", buffering=1 << 20)  # noqa: SIM115 (closed in close())
        self.hash = xxhash.xxh3_64()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.hash.update(b)
        return self._file.write(b)

    def tell(self) -> int:
        return self._file.tell()

    def fileno(self) -> int:
        self._file.flush()
        return self._file.fileno()

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording the checksum of every file it writes under its final name."""

    def __init__(self) -> None:
        super().__init__()
        self.checksums: dict[str, str] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = _ChecksummedFile(Path(path))
        try:
            yield stream
        finally:
            stream.close()
        self.checksums[Path(path).name] = stream.hash.hexdigest()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        if Path(path).name in self.checksums:
            self.checksums[Path(new_path).name] = self.checksums.pop(Path(path).name)


def tensor_bytes(tensor: torch.Tensor) -> Any:
    """A CPU tensor's values as a buffer of bytes, row-major (a copy only when it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer storing each tensor as its raw bytes (no torch.save archive, no pickle), with a checksum
    per file.

    DCP's own writer makes every tensor a small zip archive with a pickled header (torch.save): for the ~300
    tensors of a GPT that costs more than writing the bytes. Here a shard file is the tensors' bytes back to back;
    each record's offset and length go into DCP's `.metadata` as usual, marked RAW_RECORD, and its dtype and shape
    are DCP's own metadata of that chunk (SafeReader reads them back). Files, buckets per writer thread and the
    `.metadata` are DCP's. Only tensors are written: a non-tensor (pickled) entry is refused.
    """

    def __init__(self, path: Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _ChecksummingFileSystem()
        self.upload_thread: int | None = None  # the thread writing it, while it does

    @property
    def checksums(self) -> dict[str, str]:
        return self.fs.checksums

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """DCP's first call on the thread that writes this checkpoint (the async upload's, or the caller's): from
        here to its end (finish, or the caller's `end_upload` after a failure) that thread declares an upload."""
        self.upload_thread = threading.get_ident()
        started(Activity.UPLOADING)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().write_data(*args, **kwargs)
        except BaseException:
            self.end_upload()  # a refused entry, a full disk: DCP raises without calling finish
            raise

    def finish(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().finish(*args, **kwargs)
        finally:
            self.end_upload()

    def end_upload(self) -> None:
        """The upload's thread no longer writes this checkpoint (called again once its result is known: a save
        that failed before finish never ended it)."""
        if self.upload_thread is not None:
            ended(Activity.UPLOADING, self.upload_thread)
            self.upload_thread = None

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue) -> Future[list[WriteResult]]:
        """Write the queued files on `thread_count` threads (this one included), as DCP's writer does."""
        results: list[WriteResult] = []
        errors: list[BaseException] = []

        def drain() -> None:
            try:
                while True:
                    path, storage_key, items = file_queue.get_nowait()
                    results.extend(self._write_shard(path, storage_key, items, planner))
            except queue.Empty:
                pass
            except BaseException as exc:  # raised in the calling thread below
                errors.append(exc)

        threads = [threading.Thread(target=drain) for _ in range(1, self.thread_count)]
        for t in threads:
            t.start()
        drain()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_shard(self, path: Path, storage_key: str, items: list[WriteItem],
                     planner: SavePlanner) -> list[WriteResult]:
        pickled = [item.index.fqn for item in items if item.type == WriteItemType.BYTE_IO]
        if pickled:
            raise CheckpointError(f"{pickled[0]}: not a tensor; trainflow keeps non-tensor state out of the shards "
                                  "(in state.json), it never pickles it")
        results = []
        with self.fs.create_stream(path, "wb") as stream:
            for item in items:
                data = tensor_bytes(planner.resolve_data(item).cpu())
                offset = stream.tell()
                stream.write(data)
                results.append(WriteResult(index=item.index, size_in_bytes=data.nbytes,
                                           storage_data=_StorageInfo(storage_key, offset, data.nbytes,
                                                                     transform_descriptors=[RAW_RECORD])))
            if self.sync_files:
                os.fsync(stream.fileno())
        return results


def write_json(path: Path, value: Any) -> str:
    """Write `value` as JSON, fsync'd; return its checksum (the bytes are at hand)."""
    data = json.dumps(value, indent=1).encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return xxhash.xxh3_64_hexdigest(data)


def file_checksum(path: Path) -> str:
    """The file's xxh3-64; a link or anything but a regular file is refused, not followed or read."""
    digest = xxhash.xxh3_64()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO opens without a writer, unread
    with open(fd, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path}: not a regular file; the checkpoint is corrupt")
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_files(folder: Path, checksums: dict[str, str]) -> str | None:
    """The first file whose checksum differs from the manifest's, as a phrase; None when all match."""
    names = sorted(checksums)
    with ThreadPoolExecutor(max_workers=min(4, len(names) or 1)) as pool:  # xxhash releases the GIL
        actual = list(pool.map(lambda name: file_checksum(folder / name), names))
    for name, got in zip(names, actual, strict=True):
        if got != checksums[name]:
            return f"{name} has checksum {got}, the manifest says {checksums[name]} (its bytes changed after the save)"
    return None


# ---------------------------------------------------------------------------------------------------------------
# Reading: no code runs


_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # a lookup of torch.strided & co by name
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file that would need code to be run (or objects built) to be read."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata: its dataclasses, torch dtypes, sizes and layouts, and plain builtin values."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"it refers to {module}.{name}, which DCP metadata never holds")


def read_metadata(path: Path) -> Metadata:
    """A checkpoint's `.metadata` through the allow-list unpickler; one-line CheckpointError when it is not one."""
    try:
        with open(path / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except UnsafeCheckpoint as exc:
        raise UnsafeCheckpoint(f"{path}/.metadata: refused without running it: {exc}; the checkpoint is damaged or "
                               "was tampered with: do not use it") from None
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise CheckpointError(f"{path}/.metadata: unreadable ({type(exc).__name__}: {exc}); the checkpoint is "
                              "corrupt") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}/.metadata: holds a {type(metadata).__name__}, not DCP metadata; the "
                              "checkpoint is corrupt")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader that runs no code: the allow-list `.metadata` unpickler, raw records read as bytes; any
    other record (a pickled object, a torch.save archive) refused, and with `names` (the manifest's files) a
    record in any other file too."""

    def __init__(self, path: Path, names: set[str] | None = None, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._names = names
        self._metadata = metadata  # read by the caller already: DCP gets it without reading the file again

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata or read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._tensors = metadata.state_dict_metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        pickled = [item.storage_index.fqn for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if pickled:
            raise UnsafeCheckpoint(f"{self.path}: {pickled[0]} is stored as a pickled object, which trainflow does "
                                   "not load (it could run code); the checkpoint was tampered with or is not "
                                   "trainflow's")
        archived = [item.storage_index.fqn for item in plan.items if not self._is_raw(item)]
        if archived:
            raise CheckpointError(f"{self.path}: {archived[0]} is a torch.save record, which checkpoint format 3 "
                                  "never writes; trainflow reads raw records only: the checkpoint is not of this "
                                  "format or was tampered with")
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            if self._names is not None and name not in self._names:
                raise CheckpointError(f"{self.path}/.metadata: names {name!r} as a shard, which the manifest does "
                                      "not list; the checkpoint is corrupt or was tampered with")
            with open(Path(self.path) / name, "rb", buffering=0) as f:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    self._read_raw(f, item, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _is_raw(self, item: ReadItem) -> bool:
        return RAW_RECORD in (self.storage_data[item.storage_index].transform_descriptors or ())

    def _read_raw(self, f: io.RawIOBase, item: ReadItem, planner: LoadPlanner) -> None:
        """One raw record: its bytes, viewed with the dtype and shape DCP's metadata gives the stored chunk."""
        info = self.storage_data[item.storage_index]
        index = item.storage_index
        meta = self._tensors.get(index.fqn)
        chunk = next((c for c in getattr(meta, "chunks", ()) if list(c.offsets) == list(index.offset)), None)
        if chunk is None:
            raise CheckpointError(f"{self.path}/.metadata: {index.fqn} has a record but no tensor chunk at "
                                  f"{list(index.offset)}; the checkpoint is corrupt")
        expected = math.prod(chunk.sizes) * meta.properties.dtype.itemsize
        if info.length != expected:
            raise CheckpointError(f"{self.path}/{info.relative_path}: {index.fqn} is recorded as {info.length} bytes, "
                                  f"its shape {list(chunk.sizes)} {meta.properties.dtype} needs {expected}; the "
                                  "checkpoint is corrupt")
        data = torch.empty(info.length, dtype=torch.uint8)
        f.seek(info.offset)
        if f.readinto(data.numpy()) != info.length:
            raise CheckpointError(f"{self.path}/{info.relative_path}: ends inside {index.fqn} (truncated); the "
                                  "checkpoint is corrupt")
        stored = data.view(meta.properties.dtype).reshape(chunk.sizes)
        tensor = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointError(f"{self.path}: {index.fqn} reads as {list(tensor.size())}, the model expects "
                                  f"{list(target.size())}; the checkpoint does not fit this model")
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def read_json(path: Path) -> Any:
    """A JSON file of a checkpoint: plain values only, however it was written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc}); the checkpoint is corrupt") from None


# ---------------------------------------------------------------------------------------------------------------
# Failures inside DCP, which wraps whatever a rank raised


def root_error(exc: BaseException) -> BaseException:
    """The error a (possibly multi-rank) DCP failure wraps: the first rank's, following explicit causes."""
    failures = getattr(exc, "failures", None)
    if failures:
        return root_error(next(iter(sorted(failures.items())))[1][0])
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def reraise_interrupt(exc: BaseException) -> None:
    """Ctrl-C or an exit inside DCP (which wraps whatever a rank raised) stays what it is: cli.py says one line."""
    root = root_error(exc)
    if isinstance(root, KeyboardInterrupt | SystemExit):
        raise root from None
    if isinstance(exc, KeyboardInterrupt | SystemExit):
        raise exc


def failure_cause(exc: BaseException) -> str:
    """The root error of a (possibly multi-rank) DCP failure, in one line."""
    failures = getattr(exc, "failures", None)
    if failures:
        rank, (inner, _trace) = next(iter(sorted(failures.items())))
        return f"rank {rank}: {failure_cause(inner)}"
    while exc.__cause__ is not None and str(exc.__cause__):
        exc = exc.__cause__
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else "")
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
