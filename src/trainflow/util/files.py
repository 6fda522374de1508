"""Writing a file whole: a reader (another rank, a report, a resumed run) sees the old bytes or the new, never half.
Also: JSON written whole in the run directory (a failure is one line), what a path that is not a regular file is,
in words (and whether one to be read is one), and whether a folder takes new files.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainflow.errors import ReceivedFileError, RunDirError
from trainflow.util.shown import shown

# What a reader of a received file takes at most: enough for any file trainflow writes, bounded so that a file
# linked to /dev/zero or grown by someone else cannot exhaust memory.
SMALL_FILE_BYTES = 16 << 20  # summary.json, overrides.yaml, a marker
LOG_FILE_BYTES = 512 << 20  # metrics.jsonl, a ledger


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write to: renamed over `path` when the block succeeds, removed when not.

    The temporary file is created here, new and unpredictable (O_EXCL: a link or file planted under its name is never
    followed or reused), so concurrent writers of one file each rename a whole file of their own; its name ends in
    `path`'s suffix (writers such as matplotlib choose the format from it). The rename replaces a link at `path`
    itself, never the file it points to.
    """
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename (see atomic_path)."""
    with atomic_path(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)


_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFLNK: "a symbolic link", stat.S_IFIFO: "a FIFO (named pipe)",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket",
          stat.S_IFREG: "a regular file"}


def kind_of(mode: int) -> str:
    """What an `lstat`/`stat` st_mode is, in words: a FIFO or a device read as a file would hang or never end."""
    return _KINDS.get(stat.S_IFMT(mode), "not a file")


def not_a_file(path: Path) -> str | None:
    """Why `path` cannot be read as a file, in words (it does not exist; it is a FIFO, a device, a folder), or None
    for a regular file (links followed). Checked before anything opens it: reading a FIFO waits for a writer
    forever, beyond the reach of Ctrl-C when a library's native code opens it."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "is a broken symbolic link" if path.is_symlink() else "does not exist"
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    return None if stat.S_ISREG(mode) else f"is {kind_of(mode)}, not a regular file"


def cannot_write(folder: Path | str) -> OSError | None:
    """Why no file can be made in `folder` (created when missing), or None: tried with a real file, since the
    mode bits do not tell (a read-only mount, root, ACLs)."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return exc
    return None


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write via a temporary file and rename, so readers never see half a file."""
    try:
        write_atomic(path, json.dumps(obj, indent=2, default=str))
    except OSError as exc:
        raise run_dir_error(path.parent, path.name, exc) from None


def run_dir_error(run_dir: Path, name: str, exc: OSError) -> RunDirError:
    """The one line for a file of the run directory that could not be written (a full disk, a read-only mount)."""
    return RunDirError(f"hydra.run.dir: writing {name} in {run_dir} failed ({exc.strerror or exc}); free space or "
                       "point hydra.run.dir at a writable disk")


def read_regular(path: Path, limit: int = SMALL_FILE_BYTES) -> bytes:
    """The bytes of `path` if it is a regular file (links followed) of at most `limit` bytes; anything else is one
    ReceivedFileError naming it. Opened without blocking and checked on the open descriptor, so a FIFO never waits
    for a writer, a device is never read, and a file swapped in after the check is not the one read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ReceivedFileError(f"{shown(path)}: cannot be read ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        os.close(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ReceivedFileError(f"{shown(path)}: is {kind_of(st.st_mode)}, not a regular file; trainflow reads "
                                    "only the files it writes (replace it with the run's own file, or leave it out)")
        raise ReceivedFileError(f"{shown(path)}: is {st.st_size} bytes, more than the {limit} bytes trainflow ever "
                                "writes there; it is not trainflow's file (leave it out)")
    with open(fd, "rb", buffering=0) as f:
        chunks, taken = [], 0
        while taken <= limit and (chunk := f.read(limit + 1 - taken)):
            chunks.append(chunk)
            taken += len(chunk)
    if taken > limit:
        raise ReceivedFileError(f"{shown(path)}: grew past {limit} bytes while it was read; it is not trainflow's file")
    return b"".join(chunks)
