"""The suite's set-up (one thread a process, trainflow's configs registered, Ctrl-C taken) and its fixtures; the
helpers every test uses are in tests/helpers (runs.py: running trainflow and checking what it did)."""

from __future__ import annotations

import os

# Every process of the suite computes on one thread, set before torch is imported here or in any child: the suite
# runs several tests at once on a few cores, where two threads a process wait at each op's barrier (a tiny run's
# step took 6x as long, its CPU time 1.5x) and the runs compare only with each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.runs import stop_started

from trainflow.cli import register_with_hydra

register_with_hydra()  # tests that compose configs in this process need what train.py registers
# A suite started in the background (`make test &`, a job without a terminal) inherits an ignored SIGINT, and so would
# every run it starts: the Ctrl-C tests press it as a terminal does, on processes that take it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test() -> Iterator[None]:
    """A run a test started and did not see end (an assertion failed first) is killed with the test, not left to
    train on for hours beside the rest of the suite."""
    yield
    stop_started()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def hydra_version_unset() -> Iterator[None]:
    """Hydra's own test suites as Hydra runs them: no version_base chosen yet. Composing with version_base="1.3"
    earlier in the same process (any trainflow test that composes) stays Hydra's process-wide choice, under which
    their apps would not change into the job's folder as the suites expect."""
    from hydra.version import VersionBase

    before, unset = VersionBase.instance(), VersionBase.__new__(VersionBase)  # the class hands out one instance
    unset.__init__()
    VersionBase.set_instance(unset)
    yield
    VersionBase.set_instance(before)
