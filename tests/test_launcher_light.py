"""trainflow's launchers cost any other Hydra app nothing it does not use: Hydra's plugin scan imports them at the
start of every Hydra app in the environment, and they run the jobs of any Hydra app, so neither the scan, nor
setting a launcher up, nor a job of an app that needs no torch loads torch or trainflow's training code.

Each check runs in a fresh interpreter (subprocess.run, not the suite's fork server, whose interpreter has torch
loaded already)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hydra_plugins.trainflow_launchers.common import TRAINFLOW_PARALLELISM
from trainflow.config.schema import ParallelismConfig

# each launcher, with the settings its set-up requires
LAUNCHERS = {"process": [], "torchrun": [], "slurm": [], "ray": [],
             "kubernetes": ["hydra.launcher.image=registry.example/trainflow:1", "hydra.launcher.volume_claim=runs"]}

# Hydra's plugin scan, then each trainflow launcher set up as Hydra's sweeper does (instantiate_launcher: the class
# made from its config, then its setup, which checks the settings); what was imported is printed last.
SCAN_AND_SET_UP = """
import json, sys
from hydra._internal.callbacks import Callbacks
from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path
from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra.types import HydraContext, RunMode

Plugins.instance()
scanned = "torch" in sys.modules
hydra = Hydra.create_main_hydra2(task_name="app", config_search_path=create_config_search_path(None))
made = {}
for name, overrides in json.loads(sys.argv[1]).items():
    overrides = [f"hydra/launcher={name}", *overrides]
    cfg = hydra.compose_config(None, overrides, RunMode.MULTIRUN, with_log_configuration=False)
    HydraConfig.instance().set_config(cfg)
    launcher = Plugins.instance().instantiate_launcher(
        hydra_context=HydraContext(config_loader=hydra.config_loader, callbacks=Callbacks(cfg)),
        task_function=lambda cfg: None, config=cfg)
    made[name] = type(launcher).__module__
print(json.dumps({"scanned": scanned, "made": made, "torch": "torch" in sys.modules,
                  "trainflow": sorted(m for m in sys.modules if m.startswith("trainflow"))}))
"""

# A Hydra app of someone else's that needs no torch: each job says whether its process had torch, and the app's own
# process says it at exit.
APP = """
import atexit, json, os, sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

atexit.register(lambda: print("app process torch:", "torch" in sys.modules))


@hydra.main(version_base=None, config_path=None, config_name=None)
def main(cfg) -> None:
    out = Path(HydraConfig.get().runtime.output_dir) / "job.json"
    out.write_text(json.dumps({"torch": "torch" in sys.modules, "pid": os.getpid(), "x": cfg.x}))


if __name__ == "__main__":
    main()
"""

# trainflow's modules a launcher may load for any app: none of them imports torch (the training code does)
LIGHT = {"trainflow", "trainflow.errors", "trainflow.record", "trainflow.record.sweep_outcome", "trainflow.util",
         "trainflow.util.failures", "trainflow.util.files", "trainflow.util.locks", "trainflow.util.rank",
         "trainflow.util.rundir", "trainflow.util.shown"}


def test_the_plugin_scan_and_each_launchers_set_up_import_no_torch(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCAN_AND_SET_UP, json.dumps(LAUNCHERS)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["made"] == {name: f"hydra_plugins.trainflow_launchers.{name}_launcher" for name in LAUNCHERS}
    assert seen["scanned"] is False and seen["torch"] is False
    assert set(seen["trainflow"]) <= LIGHT, set(seen["trainflow"]) - LIGHT


@pytest.mark.parametrize("launcher", ["process", "torchrun"])
def test_an_app_without_torch_runs_its_jobs_without_torch(tmp_path: Path, launcher: str) -> None:
    """The app's process and each job's process (the rank torchrun's agent started; the agent itself is torch's)."""
    (tmp_path / "app.py").write_text(APP)
    sweep = tmp_path / "sweep"
    done = subprocess.run([sys.executable, "app.py", "-m", f"hydra/launcher={launcher}", "+x=1,2",
                           f"hydra.sweep.dir={sweep}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "app process torch: False" in done.stdout.splitlines()
    jobs = [json.loads((sweep / str(num) / "job.json").read_text()) for num in (0, 1)]
    assert [job["x"] for job in jobs] == [1, 2]
    assert [job["torch"] for job in jobs] == [False, False]
    assert len({job["pid"] for job in jobs}) == 2  # each job ran in a fresh process of its own


def test_a_trainflow_job_is_known_by_its_parallelism_sections_type() -> None:
    """The launchers name the type rather than import it (importing it loads torch): the name is the type's."""
    assert f"{ParallelismConfig.__module__}.{ParallelismConfig.__qualname__}" == TRAINFLOW_PARALLELISM
