"""Directory locks: one run at a time in a run directory or a checkpoint folder.

An exclusive `flock` on `<folder>/.lock`, held for the process's lifetime (the kernel drops it when the process
dies, so a crash never leaves a stale lock); the file names the holder. Within one process a folder is locked
once: a second lock on the same folder (a checkpoint dir that is the run dir itself) shares the first.
"""

from __future__ import annotations

import fcntl
import os
import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from trainflow.errors import ConfigError

LOCK_FILE = ".lock"


@dataclass
class _Held:
    fd: int
    users: int


_held: dict[Path, _Held] = {}  # this process's locks by lock file (a forked child inherits them, and their fds)


class DirLock:
    """An exclusive flock on `folder/.lock` for this process's lifetime; the file says who holds it.

    `key` and `fix` make the refusal a sentence about the setting that chose the folder.
    """

    def __init__(self, folder: Path, run_dir: Path | None = None, key: str = "checkpoint.dir",
                 fix: str = "point checkpoint.dir at another folder") -> None:
        self.path = (folder / LOCK_FILE).absolute()
        self._released = False
        if self.path in _held:
            _held[self.path].users += 1
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process"
            os.close(fd)
            raise ConfigError(f"{key}: {folder} is in use by another run ({holder}); wait for it to end, "
                              f"or {fix}") from None
        os.ftruncate(fd, 0)
        started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        run = f", run dir {run_dir.resolve()}" if run_dir else ""
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}{run}, since {started}\n".encode(), 0)
        _held[self.path] = _Held(fd, 1)

    def release(self) -> None:
        held = _held.get(self.path)
        if self._released or held is None:
            return
        self._released = True
        held.users -= 1
        if held.users == 0:
            del _held[self.path]
            os.close(held.fd)  # closing the last descriptor drops the flock
