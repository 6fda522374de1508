"""Directory locks: one run at a time in a run directory or a checkpoint folder.

An exclusive `flock` on `<folder>/.lock`, held for the process's lifetime (the kernel drops it when the process
dies, so a crash never leaves a stale lock); the file names the holder. Within one process a folder is locked
once: a second lock on the same folder (a checkpoint dir that is the run dir itself) shares the first.

Cluster filesystems mounted without flock support (ENOLCK, EOPNOTSUPP) get a lock file created with O_EXCL
instead (`<folder>/.lock.owner`, naming host and pid). A crash leaves that file behind: on the same host a holder
whose pid is gone is stale and the lock is taken over; a holder on another host cannot be checked from here, so
the refusal says which file to delete once that run is known to be gone.

The lock folder may be a shared, world-writable one: its `.lock` and `.lock.owner` are opened without following a
link (O_NOFOLLOW), and only a regular file that is empty or names a holder (HOLDER) is taken and rewritten; a link,
a FIFO, a hard link to another file or a file of other content is refused in one line naming it, never truncated.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import socket
import stat
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from trainflow.errors import ConfigError
from trainflow.util.files import kind_of
from trainflow.util.shown import shown

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
OWNER_FILE = ".lock.owner"  # the O_EXCL lock where flock is not supported
# what a lock file of trainflow's holds: its holder (a run dir's name may hold any character, a newline included)
HOLDER = re.compile(r"pid \d+ on \S+(, run dir .+)?, since [^\n]+\n?", re.DOTALL)
_HOLDER_BYTES = 8192  # more than any holder line: a longer file is not a lock file of trainflow's
_NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})


def flock_unsupported(exc: OSError) -> bool:
    """Whether a failed flock means the filesystem has no flock (use a lock file), not that the folder is busy."""
    return exc.errno in _NO_FLOCK


def pid_alive(pid: int) -> bool:
    """Whether a process of this id runs on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


@dataclass
class _Held:
    fd: int  # the flock's descriptor, or -1 for an O_EXCL lock file
    users: int
    owner_file: Path | None = None


_held: dict[Path, _Held] = {}  # this process's locks by lock file (a forked child inherits them, and their fds)


def held_by_another(folder: Path) -> bool:
    """Whether another process holds `folder`'s lock now (this process's own lock is not another's): a folder in
    use is never put back or cleaned up by a run that was refused, whatever it finds there."""
    path = (folder / LOCK_FILE).absolute()
    if path in _held:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return (folder / OWNER_FILE).exists()  # a filesystem without flock: its O_EXCL lock file
    except OSError:
        return True  # a link or something unreadable where the lock is: not ours to judge, so leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as exc:
        return not flock_unsupported(exc) or (folder / OWNER_FILE).exists()
    finally:
        os.close(fd)  # closing drops the shared lock just taken
    return False


class DirLock:
    """An exclusive flock on `folder/.lock` for this process's lifetime; the file says who holds it.

    `key` and `fix` make the refusal a sentence about the setting that chose the folder.
    """

    def __init__(self, folder: Path, run_dir: Path | None = None, key: str = "checkpoint.dir",
                 fix: str = "point checkpoint.dir at another folder", use_flock: bool = True) -> None:
        self.path = (folder / LOCK_FILE).absolute()
        self._released = False
        if self.path in _held:
            _held[self.path].users += 1
            return
        started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        run = f", run dir {run_dir.resolve()}" if run_dir else ""
        holder = f"pid {os.getpid()} on {socket.gethostname()}{run}, since {started}\n"
        fd = _open_lock_file(self.path, key, fix)
        try:
            if not use_flock:
                raise OSError(errno.ENOLCK, "flock not used")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = shown(os.pread(fd, 4096, 0).decode(errors="replace").strip()) or "a process"
            os.close(fd)
            raise ConfigError(f"{key}: {folder} is in use by another run ({other}); wait for it to end, "
                              f"or {fix}") from None
        except OSError as exc:
            os.close(fd)
            if not flock_unsupported(exc):
                raise
            _held[self.path] = _Held(-1, 1, _take_owner_file(folder, holder, key, fix))
            return
        if not _holder_or_empty(os.pread(fd, _HOLDER_BYTES + 1, 0)):  # read under the flock: no writer is inside
            os.close(fd)
            raise ConfigError(_foreign(self.path, "holds something other than the line of a run holding the lock",
                                       key, fix))
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        _held[self.path] = _Held(fd, 1)

    def release(self) -> None:
        held = _held.get(self.path)
        if self._released or held is None:
            return
        self._released = True
        held.users -= 1
        if held.users == 0:
            del _held[self.path]
            if held.owner_file is not None:
                held.owner_file.unlink(missing_ok=True)
            else:
                os.close(held.fd)  # closing the last descriptor drops the flock


def _open_lock_file(path: Path, key: str, fix: str) -> int:
    """`path` opened for reading and writing (created when absent) if it can be trainflow's lock file: never
    through a link, and a regular file of its own (no other name links to it); else one line naming it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ConfigError(_foreign(path, "is a symbolic link", key, fix)) from None
    st = os.fstat(fd)
    problem = (f"is {kind_of(st.st_mode)}" if not stat.S_ISREG(st.st_mode) else
               f"is a hard link to a file of {st.st_nlink} names" if st.st_nlink > 1 else None)
    if problem is not None:
        os.close(fd)
        raise ConfigError(_foreign(path, problem, key, fix))
    return fd


def _holder_or_empty(data: bytes) -> bool:
    """Whether a lock file's bytes are trainflow's: nothing yet, or the line naming a holder."""
    return not data or (len(data) <= _HOLDER_BYTES and HOLDER.fullmatch(data.decode(errors="replace")) is not None)


def _foreign(path: Path, problem: str, key: str, fix: str) -> str:
    return (f"{key}: {shown(path)} {problem}, not trainflow's lock file; trainflow never writes through a link or "
            f"into a file it did not make, and nothing was changed: remove it if it is yours, or {fix}")


def _read_owner_file(path: Path, key: str, fix: str) -> str:
    """The holder `.lock.owner` names ("" when it is gone or empty), read without following a link; a link, a
    FIFO or a file that names no holder is one line naming it (never removed: it is not trainflow's)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ConfigError(_foreign(path, "is a symbolic link", key, fix)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(_foreign(path, f"is {kind_of(st.st_mode)}", key, fix))
        data = os.pread(fd, _HOLDER_BYTES + 1, 0)
    finally:
        os.close(fd)
    if not _holder_or_empty(data):
        raise ConfigError(_foreign(path, "holds something other than the line of a run holding the lock", key, fix))
    return data.decode(errors="replace").strip()


def _take_owner_file(folder: Path, holder: str, key: str, fix: str) -> Path:
    """The O_EXCL lock: create `.lock.owner` or find who holds it (a dead pid on this host is taken over)."""
    path = (folder / OWNER_FILE).absolute()
    host = socket.gethostname()
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            other = shown(_read_owner_file(path, key, fix))
            pid, _, other_host = other.removeprefix("pid ").partition(" on ")
            other_host = other_host.split(",")[0]
            if other_host == host and pid.isdigit() and not pid_alive(int(pid)):
                log.warning("%s: removed the stale lock of pid %s on %s (no such process)", key, pid, host)
                path.unlink(missing_ok=True)
                continue
            raise ConfigError(f"{key}: {folder} is in use by another run ({other or 'a process'}; this filesystem "
                              f"has no flock, so the lock is the file {path}, which that run deletes at its end); "
                              f"wait for it to end, or {fix}; if that run is gone (its host crashed), delete "
                              f"{path}") from None
        with os.fdopen(fd, "w") as f:
            f.write(holder)
        return path
    raise ConfigError(f"{key}: {path} keeps reappearing; another run is starting there: {fix}")
