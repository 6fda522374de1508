"""trainflow writes only files it made, never through a link it did not make, and a ledger loses only what was cut.

A shared, world-writable folder (mode 1777, made here) holds what someone else planted: a `.lock` or `.lock.owner`
that is a symbolic link, a FIFO or a file of other content, a ledger path that is a shell's rc file or a link, a
symbolically linked step folder in checkpoint.dir. Every file named as a victim must stay byte for byte as it was.
The ledger's own reading and printing: lines of the wrong shape or type skipped and counted, a FIFO or a /dev/zero
link one line, a run name holding terminal escapes printed escaped; a cut last line stays alone and the next run's
line is listed; a full disk (a real small tmpfs where this process may mount one, else a file-size limit) leaves
the line whole or absent.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.checkpoints import train_and_save
from helpers.processes import run_process
from helpers.runs import ROOT, TINY_GPT, can_mount, ok, one_line_error, tmpfs, train, trainflow

from trainflow.checkpoint import store
from trainflow.checkpoint.export import check_output
from trainflow.errors import CheckpointError, ConfigError
from trainflow.record import ledger
from trainflow.record.sweeps import IDENTITY_FILE, claim_checkpoint_dir
from trainflow.util.files import write_atomic
from trainflow.util.locks import LOCK_FILE, OWNER_FILE, DirLock
from trainflow.util.rundir import MARKER, mark

RC_TEXT = b"# ~/.bashrc of someone else\nexport PATH=$HOME/bin:$PATH\nalias ll='ls -l'\n"
TINY_RUN = [*TINY_GPT, "trainer.max_steps=3", "trainer.eval_every=0", "trainer.eval_steps=1"]


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A world-writable folder with the sticky bit, as /tmp or a shared outputs folder is."""
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o1777)
    return folder


def victim(folder: Path, name: str = "victim.txt") -> Path:
    path = folder / name
    path.write_bytes(RC_TEXT)
    return path


def line_of(run: str, **fields: object) -> dict:
    """A ledger line of the shape trainflow writes (entry), with `fields` replaced."""
    return {"ledger": ledger.VERSION, "run": run, "run_dir": f"/runs/{run}", "time": "2026-12-01T10:00:00+00:00",
            "status": "finished", "model": "trainflow.models.gpt.GPT", "overrides": ["optim.lr=1e-3"],
            "fingerprint": {"host": "node1", "config_hash": "3f2a9c01d4e5", "device": {"type": "cpu", "name": "x",
                                                                                      "count": 1, "nodes": 1}},
            "figures": {"steps": 3, "step_time_s": 0.01, "validation": {"loss": 2.5}, "monitor": "loss"},
            "config": {}, **fields}


# --- locks --------------------------------------------------------------------------------------------------------


def test_a_run_refuses_a_planted_lock_link_and_leaves_its_target_as_it_was(shared: Path, tmp_path: Path) -> None:
    """checkpoint.dir in a shared folder where someone planted `.lock` -> a file of theirs: the run stops in one line
    naming the link, and the file it points to is byte for byte what it was (it was truncated and rewritten)."""
    target = victim(tmp_path)
    (shared / LOCK_FILE).symlink_to(target)
    run = train(tmp_path / "run", *TINY_RUN, "checkpoint=dcp", f"checkpoint.dir={shared}")
    one_line_error(run, f"checkpoint.dir: {shared / LOCK_FILE} is a symbolic link, not trainflow's lock file",
                   "nothing was changed", "point checkpoint.dir at another folder")
    assert target.read_bytes() == RC_TEXT
    assert (shared / LOCK_FILE).readlink() == target and not list((tmp_path / "run").glob("step_*"))


@pytest.mark.parametrize("planted", ["link", "dangling link", "fifo", "foreign file", "hard link"])
def test_a_lock_file_that_is_not_trainflows_is_refused_untouched(shared: Path, tmp_path: Path, planted: str) -> None:
    """Whatever stands where `.lock` goes and is not trainflow's is refused in one line naming it, never opened
    through, truncated or waited on."""
    target, lock = victim(tmp_path), shared / LOCK_FILE
    if planted == "link":
        lock.symlink_to(target)
    elif planted == "dangling link":
        lock.symlink_to(tmp_path / "not-yet")
    elif planted == "fifo":
        os.mkfifo(lock)
    elif planted == "foreign file":
        lock.write_bytes(RC_TEXT)
    else:
        os.link(target, lock)
    with pytest.raises(ConfigError) as exc:
        DirLock(shared)
    said = {"link": "is a symbolic link", "dangling link": "is a symbolic link", "fifo": "is a FIFO (named pipe)",
            "foreign file": "holds something other than the line of a run holding the lock",
            "hard link": "is a hard link to a file of 2 names"}[planted]
    assert str(exc.value).startswith(f"checkpoint.dir: {lock} {said}, not trainflow's lock file; ")
    assert target.read_bytes() == RC_TEXT and not (tmp_path / "not-yet").exists()
    if planted == "foreign file":
        assert lock.read_bytes() == RC_TEXT


def test_trainflows_own_lock_file_is_still_taken_over(tmp_path: Path) -> None:
    """A lock file an earlier run left (its holder line; a run dir whose name holds a newline) is trainflow's."""
    left = f"pid 12345 on node1, run dir {tmp_path}/odd\nname, since 2026-12-01 10:00:00 UTC\n"
    (tmp_path / LOCK_FILE).write_text(left)
    lock = DirLock(tmp_path, run_dir=tmp_path / "run")
    try:
        assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} on ")
    finally:
        lock.release()


TAKE_WITHOUT_FLOCK = """
import sys
from pathlib import Path
from trainflow.errors import ConfigError
from trainflow.util.locks import DirLock
try:
    DirLock(Path(sys.argv[1]), use_flock=False)
except ConfigError as exc:
    print("refused:", exc)
"""


@pytest.mark.parametrize("planted", ["link", "fifo"])
def test_a_planted_lock_owner_file_is_refused_untouched(shared: Path, tmp_path: Path, planted: str) -> None:
    """Where the filesystem has no flock the lock is `.lock.owner`: a link there is never read through nor removed,
    a FIFO never waited on."""
    target, owner = victim(tmp_path), shared / OWNER_FILE
    owner.symlink_to(target) if planted == "link" else os.mkfifo(owner)
    proc = subprocess.run([sys.executable, "-c", TAKE_WITHOUT_FLOCK, str(shared)], capture_output=True, text=True,
                          timeout=60)  # a process of its own: a FIFO waited on fails the test instead of hanging it
    said = "is a symbolic link" if planted == "link" else "is a FIFO (named pipe)"
    assert proc.stdout.startswith(f"refused: checkpoint.dir: {owner} {said}, not trainflow's lock file; "), (
        proc.stdout + proc.stderr[-2000:])
    assert target.read_bytes() == RC_TEXT and (owner.is_symlink() or owner.is_fifo())


# --- markers, retention, exports ----------------------------------------------------------------------------------


def test_a_marker_link_is_refused_and_nothing_is_created_through_it(shared: Path, tmp_path: Path) -> None:
    """A `.trainflow` marker that is a dangling link: writing the marker would create the file it names."""
    (shared / MARKER).symlink_to(tmp_path / "created-through-the-link")
    with pytest.raises(SystemExit):
        mark(shared, "hydra.run.dir")
    assert not (tmp_path / "created-through-the-link").exists() and (shared / MARKER).is_symlink()


@pytest.mark.parametrize("dangling", [False, True])
def test_a_sweep_jobs_identity_link_is_refused(shared: Path, tmp_path: Path, dangling: bool) -> None:
    """A sweep job's checkpoint folder names the job's identity (run_identity): a link there is neither read through
    nor replaced."""
    target = tmp_path / "not-yet" if dangling else victim(tmp_path)
    (shared / IDENTITY_FILE).symlink_to(target)
    with pytest.raises(ConfigError) as exc:
        claim_checkpoint_dir(shared, "optim.lr=0.001")
    assert str(exc.value).startswith(f"checkpoint.dir: {shared / IDENTITY_FILE} is a symbolic link, not trainflow's")
    assert (shared / IDENTITY_FILE).readlink() == target
    assert not target.exists() if dangling else target.read_bytes() == RC_TEXT


def test_retention_never_follows_a_linked_step_folder_out_of_checkpoint_dir(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A step folder of checkpoint.dir that is a link to a folder elsewhere: retention neither marks, renames nor
    deletes through it, says so once, and logs no deletion that did not happen."""
    train_and_save(tmp_path, 3, keep_last=3)
    ckpts, elsewhere = tmp_path / "ckpts", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (ckpts / "step_00000002").rename(elsewhere / "step_00000002")
    (ckpts / "step_00000002").symlink_to(elsewhere / "step_00000002")
    before = {p.name: p.read_bytes() for p in (elsewhere / "step_00000002").iterdir()}
    with caplog.at_level(logging.INFO, logger="trainflow.checkpoint"):
        assert store.retain(ckpts, 1, None) == [ckpts / ".tmp-deleting-step_00000001"]
        assert store.retain(ckpts, 1, None) == []  # the link is said once
    assert {p.name: p.read_bytes() for p in (elsewhere / "step_00000002").iterdir()} == before
    assert (ckpts / "step_00000002").is_symlink()
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if "symbolic link" in m] == [
        f"checkpoint: retention left {ckpts / 'step_00000002'} alone: it is a symbolic link (to "
        f"{elsewhere / 'step_00000002'}), and trainflow deletes nothing through a link; remove it yourself once it "
        "is not needed"]
    assert [m for m in said if "retention deleted" in m] == [
        f"checkpoint: retention deleted {ckpts / 'step_00000001'} (checkpoint.keep_last=1)"]


def test_an_export_never_replaces_a_link_or_a_foreign_file_even_with_force(shared: Path, tmp_path: Path) -> None:
    target = victim(tmp_path)
    (shared / "model.pt").symlink_to(target)
    (shared / "notes.pt").write_bytes(RC_TEXT)
    for path, what in ((shared / "model.pt", "a symbolic link"), (shared / "notes.pt", "a file")):
        with pytest.raises(CheckpointError) as exc:
            check_output(path, force=True)
        assert str(exc.value).startswith(f"{path} is {what} trainflow did not export")
    assert target.read_bytes() == RC_TEXT and (shared / "notes.pt").read_bytes() == RC_TEXT


# --- a ledger path must be a ledger -------------------------------------------------------------------------------


def test_a_run_never_appends_to_a_file_that_is_not_a_ledger(shared: Path, tmp_path: Path) -> None:
    """metrics.ledger=<someone's rc file>: the run finishes, the file is byte for byte what it was, one warning."""
    rc = victim(shared, ".bashrc")
    run = ok(train(tmp_path / "run", *TINY_RUN, f"metrics.ledger={rc}"))
    assert rc.read_bytes() == RC_TEXT
    warned = [line for line in (run.stdout + run.stderr).splitlines() if "is not a ledger" in line]
    assert len(warned) == 1 and f"metrics.ledger: {rc}: is not a ledger" in warned[0], run.stderr[-2000:]
    assert (run.run_dir / "summary.json").is_file()


def test_a_linked_ledger_in_outputs_is_refused_and_a_cut_line_loses_only_itself(shared: Path, tmp_path: Path) -> None:
    """outputs/ledger.jsonl that is a link (planted in a shared outputs folder): refused in one warning, its target
    unchanged. Then the link is replaced by a ledger whose last line was cut: the next run's line is listed."""
    project = shared / "project"
    (project / "outputs").mkdir(parents=True)
    (project / "outputs").chmod(0o1777)
    target, ledger_file = victim(tmp_path), project / "outputs" / "ledger.jsonl"
    ledger_file.symlink_to(target)
    command = [sys.executable, str(ROOT / "train.py"), *TINY_RUN]
    proc = run_process([*command, "hydra.run.dir=outputs/linked"], project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert target.read_bytes() == RC_TEXT and ledger_file.is_symlink()
    warned = [line for line in (proc.stdout + proc.stderr).splitlines() if "is a symbolic link" in line]
    assert len(warned) == 1 and f"{ledger_file}: is a symbolic link" in warned[0], proc.stderr[-2000:]

    ledger_file.unlink()
    whole = json.dumps(line_of("earlier"), separators=(",", ":")).encode() + b"\n"
    ledger_file.write_bytes(whole + whole[:57])  # a full disk cut the last line
    proc = run_process([*command, "hydra.run.dir=outputs/next"], project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ledger_file.read_bytes().startswith(whole + whole[:57] + b"\n{")  # the fragment stays alone
    listed = trainflow("ledger", cwd=project)
    assert listed.returncode == 0, listed.stderr
    assert [row.split()[2] for row in listed.stdout.splitlines()[1:3]] == ["earlier", "next"]
    assert "2 of 2 run(s)" in listed.stdout and "1 line(s) did not parse" in listed.stdout


# --- a full disk: the line is whole or absent ---------------------------------------------------------------------


def fill(folder: Path) -> None:
    """Fill the filesystem of `folder` to its last byte (pages first, then the last page byte by byte)."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for chunk in (b"\0" * 4096, b"\0"):
            with contextlib.suppress(OSError):
                while os.write(fd, chunk):
                    pass
    finally:
        os.close(fd)


@pytest.mark.skipif(not can_mount(), reason="needs a mount of its own (root, outside a restricted container)")
def test_a_full_disk_leaves_the_ledger_whole(tmp_path: Path) -> None:
    """A line that fits only in part (the ledger's last page has room for half of it) is taken back whole; once
    there is room, the next line is whole."""
    with tmpfs(tmp_path / "small", "64k") as disk:
        path = disk / "ledger.jsonl"
        ledger.append(path, line_of("before"))
        before = path.read_bytes()
        fill(disk)
        with pytest.raises(OSError) as exc:
            ledger.append(path, line_of("too-big", pad="x" * 6000))  # more than the page's room: a short write
        assert exc.value.errno == errno.ENOSPC
        assert path.read_bytes() == before
        (disk / "filler").unlink()
        ledger.append(path, line_of("after"))
        lines, skipped = ledger.read(path)
        assert [line["run"] for line in lines] == ["before", "after"] and skipped == 0


WRITE_UNDER_A_LIMIT = """
import resource, sys
from pathlib import Path
from trainflow.record import ledger
from trainflow.record.sweeps import IDENTITY_FILE, claim_checkpoint_dir
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
try:
    ledger.append(Path(sys.argv[1]), {**ledger.read(Path(sys.argv[1]))[0][0], "run": "too-big", "pad": "x" * 6000})
except OSError as exc:
    print("refused", exc.errno)
"""


def test_a_file_size_limit_leaves_the_ledger_whole(tmp_path: Path) -> None:
    """The same where no filesystem can be mounted: a file-size limit (RLIMIT_FSIZE) halfway through the line."""
    path = tmp_path / "ledger.jsonl"
    ledger.append(path, line_of("before"))
    before = path.read_bytes()
    proc = subprocess.run([sys.executable, "-c", WRITE_UNDER_A_LIMIT, str(path), str(len(before) + 3000)],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["refused", str(errno.EFBIG)], proc.stderr[-2000:]
    assert path.read_bytes() == before
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY  # the limit was the child's


# --- reading a ledger: bounded, typed, printed escaped ------------------------------------------------------------


@pytest.mark.parametrize("changed", [{"model": None}, {"figures": [1, 2]}, {"figures": {"step_time_s": "0.01"}},
                                     {"figures": {"validation": {"loss": "low"}}}, {"overrides": "optim.lr=1"},
                                     {"fingerprint": {"device": "cpu"}}, {"fingerprint": {"config_hash": 7}},
                                     {"time": 1765000000}, {"ledger": True}, {"status": ["a"]}])
def test_a_line_of_the_wrong_shape_is_skipped_and_counted(tmp_path: Path, changed: dict) -> None:
    path = tmp_path / "ledger.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in (line_of("good"), line_of("bad", **changed))))
    lines, skipped = ledger.read(path)
    assert [line["run"] for line in lines] == ["good"] and skipped == 1
    proc = trainflow("ledger", path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "1 of 1 run(s)" in proc.stdout and f"WARNING {path}: 1 line(s) did not parse" in proc.stdout


def test_a_line_missing_a_field_is_skipped(tmp_path: Path) -> None:
    line = line_of("partial")
    del line["figures"]
    path = tmp_path / "ledger.jsonl"
    path.write_text(json.dumps(line) + "\n")
    assert ledger.read(path) == ([], 1)


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_a_ledger_that_is_no_regular_file_is_one_line(tmp_path: Path, kind: str) -> None:
    """`trainflow ledger` and compare's `ledger:` selection: a FIFO is never waited on, /dev/zero never read."""
    path = tmp_path / "ledger.jsonl"
    os.mkfifo(path) if kind == "fifo" else path.symlink_to("/dev/zero")
    what = "a FIFO (named pipe)" if kind == "fifo" else "a character device"
    for proc in (trainflow("ledger", path, timeout=60),
                 trainflow("compare", f"ledger:ledger={path}", tmp_path, "--out", tmp_path / "out", timeout=60)):
        one_line_error(proc, f"{path}: is {what}, not a regular file")


def test_a_run_name_with_terminal_escapes_is_printed_escaped(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    name = "evil\x1b[2J\x1b]0;owned\x07\nFAKE: all gates PASS"
    path.write_text(json.dumps(line_of(name, status="finished\x1b[31m")) + "\n")
    proc = trainflow("ledger", path)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout
    assert not any(line.startswith("FAKE") for line in proc.stdout.splitlines())
    assert "evil\\x1b[2J\\x1b]0;owned\\x07\\nFAKE:" in proc.stdout and "finished\\x1b[31m" in proc.stdout


def test_a_run_folder_given_as_config_reads_its_summary_bounded(tmp_path: Path) -> None:
    """`trainflow ledger --config <run folder>` takes the folder's summary.json as data: a FIFO is one line."""
    path = tmp_path / "ledger.jsonl"
    path.write_text(json.dumps(line_of("good")) + "\n")
    (tmp_path / "run").mkdir()
    os.mkfifo(tmp_path / "run" / "summary.json")
    proc = trainflow("ledger", path, "--config", tmp_path / "run", timeout=60)
    one_line_error(proc, f"config={tmp_path / 'run'}: {tmp_path / 'run' / 'summary.json'}: is a FIFO")
    (tmp_path / "run" / "summary.json").unlink()
    (tmp_path / "run" / "summary.json").write_text("[]")
    proc = trainflow("ledger", path, "--config", tmp_path / "run")
    one_line_error(proc, "holds no fingerprint.config_hash")


def test_a_whole_file_write_never_follows_a_link_planted_under_its_temporary_name(tmp_path: Path) -> None:
    """The temporary file of an atomic write is new and unpredictable: a link planted where a predictable name would
    be (the folder is world-writable) is never written through, and the file lands whole."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    for name in (f".summary.json.tmp{os.getpid()}.json", f".summary.json.tmp{os.getpid()}"):
        (shared / name).symlink_to(victim)
    write_atomic(shared / "summary.json", "{}\n")
    assert victim.read_text() == "precious\n"
    assert (shared / "summary.json").read_text() == "{}\n" and not (shared / "summary.json").is_symlink()
    assert sorted(p.name for p in shared.iterdir() if not p.is_symlink()) == ["summary.json"]
