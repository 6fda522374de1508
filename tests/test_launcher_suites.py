"""Hydra's own launcher test suites (hydra.test_utils.launcher_common_tests) on trainflow's process and torchrun
launchers: Hydra's test apps have no trainflow config, so each job runs with the launcher's own settings (one rank,
no restart), as any Hydra app's would.

The launcher suite runs on both launchers; the integration suite (apps started in a process of their own) and the
batched sweeper's on the process launcher only: both launchers compose a job and run it in a child process through
the same SweepLauncher, _worker and run_job_here, and torchrun's agent would add a minute to the suite's time for
nothing the launcher suite does not try. The SLURM launcher's suite runs in test_launcher_slurm.py, on the cluster."""

from __future__ import annotations

import pytest
from hydra.test_utils.launcher_common_tests import (
    BatchedSweeperTestSuite,
    IntegrationTestSuite,
    LauncherTestSuite,
)


@pytest.mark.parametrize(("launcher_name", "overrides"), [("process", []), ("torchrun", [])])
@pytest.mark.usefixtures("hydra_version_unset")
class TestLauncher(LauncherTestSuite):
    pass


@pytest.mark.parametrize(("launcher_name", "overrides"), [("process", ["hydra.sweeper.max_batch_size=2"])])
@pytest.mark.usefixtures("hydra_version_unset")
class TestBatchedSweeps(BatchedSweeperTestSuite):
    pass


@pytest.mark.parametrize(("task_launcher_cfg", "extra_flags"), [
    ({}, ["-m", "hydra/hydra_logging=disabled", "hydra/job_logging=disabled", "hydra/launcher=process"])])
@pytest.mark.usefixtures("hydra_version_unset")
class TestIntegration(IntegrationTestSuite):
    pass
