"""trainflow as a dependency of a user's own project: its wheel, installed in a fresh virtual environment beside the
torch already installed here, trains from an empty folder with the configs it ships, takes a project's own config
groups (examples/my_project, a project of its own that depends on trainflow), prepares shards and exports."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import ROOT

# a model of one's own, in a file of the folder the command runs in (no package, no PYTHONPATH)
MYMODELS = """import torch
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, vocab_size: int, width: int = 16) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(idx))
"""
TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=16", "trainer.batch_size=4",
        "trainer.max_steps=4", "trainer.log_every=2", "compile=off", "logger=none"]


def _closure(name: str, seen: set[str]) -> set[str]:
    """`name` and every distribution it requires (extras and markers that do not apply left out)."""
    dist = importlib.metadata.distribution(name)
    key = dist.metadata["Name"].lower()
    if key in seen:
        return seen
    seen.add(key)
    for requirement in dist.requires or []:
        if ";" in requirement:
            continue  # extras and platform markers: torch's own needs carry none on this machine
        _closure(re.split(r"[\s<>=!~\[(]", requirement, maxsplit=1)[0], seen)
    return seen


def _link_preinstalled_torch(into: Path) -> None:
    """A folder of links to torch and what it requires, as installed here: the fresh environment sees them through a
    .pth file, as a user's environment holds the torch they installed before trainflow (a CUDA or CPU build)."""
    into.mkdir()
    for name in _closure("torch", set()):
        dist = importlib.metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "bin"}
        for top in tops:
            source = Path(dist.locate_file(top))
            if source.exists() and not (into / top).exists():
                (into / top).symlink_to(source)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin/ folder of a fresh environment holding trainflow's wheel and my_project, beside the linked torch."""
    tmp = tmp_path_factory.mktemp("package")
    source = tmp / "source"  # the build writes build/ and egg-info beside its sources: never into the checkout
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", source], check=True)
    wheel = next((tmp / "dist").glob("trainflow-*.whl"))
    subprocess.run([sys._base_executable, "-m", "venv", tmp / "venv"], check=True)
    bin_dir = tmp / "venv" / "bin"
    _link_preinstalled_torch(tmp / "torch")
    site = next((tmp / "venv" / "lib").glob("python*/site-packages"))
    (site / "preinstalled_torch.pth").write_text(f"{tmp / 'torch'}\n")
    venv_pip = [bin_dir / "python", "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*venv_pip, "install", wheel], check=True)
    project = tmp / "my_project"  # likewise copied: its build would write beside its sources too
    shutil.copytree(ROOT / "examples" / "my_project", project,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([*venv_pip, "install", "--no-deps", "--no-build-isolation", project], check=True)
    return bin_dir


def run(bin_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "HYDRA_FULL_ERROR")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    proc = subprocess.run([str(bin_dir / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{args}: {proc.stderr[-3000:]}"
    return proc


def test_the_wheel_trains_from_an_empty_folder_with_a_projects_own_config_and_exports(venv: Path,
                                                                                      tmp_path: Path) -> None:
    where = "import torch, trainflow; print(trainflow.__file__, torch.__file__)"
    installed = run(venv, tmp_path, "python", "-c", where)
    package, torch_file = installed.stdout.split()
    assert str(ROOT) not in package and Path(torch_file).resolve().is_relative_to(Path(sys.prefix).resolve())

    run(venv, tmp_path, "trainflow", "train", *TINY, "checkpoint=dcp", "trainer.run_name=first")
    run_dir = tmp_path / "outputs" / "runs" / "first"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and 0 < summary["train_loss"]["last"] < 6  # bytes: ln(256) = 5.5 at the start
    assert (run_dir / "checkpoints" / "step_00000004").is_dir()

    project = tmp_path / "project"
    (project / "conf" / "experiment").mkdir(parents=True)
    (project / "conf" / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: mlp\n  - override /data: synthetic\n"
        "trainer:\n  max_steps: 3\n  run_name: mine\n")
    run(venv, project, "python", "-m", "trainflow", "train", "--config-dir", "conf", "experiment=mine",
        "compile=off", "logger=none", "checkpoint=dcp")
    mine = json.loads((project / "outputs" / "runs" / "mine" / "summary.json").read_text())
    assert mine["steps"] == 3 and mine["config"]["model"]["_target_"] == "trainflow.models.mlp.MLP"

    exported = run(venv, tmp_path, "trainflow", "export", str(run_dir), "model.pt")
    assert "the model of step 4" in exported.stdout and (tmp_path / "model.pt").stat().st_size > 0


def test_a_model_of_ones_own_trains_from_its_folder_and_the_help_names_the_command(venv: Path,
                                                                                  tmp_path: Path) -> None:
    """mymodels.py in the folder `trainflow train` runs in imports as `python -m` would import it; the header says
    from where. The installed command's help and errors name `trainflow train`, not a checkout's train.py."""
    (tmp_path / "mymodels.py").write_text(MYMODELS)
    own = run(venv, tmp_path, "trainflow", "train", "model=custom", "model._target_=mymodels.TinyNet",
              "model.vocab_size=256", "task=lm", *TINY[4:], "trainer.run_name=own", "checkpoint=dcp")
    assert "model TinyNet: 8,448 parameters (mymodels.TinyNet from ./mymodels.py); task LanguageModel" in own.stdout
    summary = json.loads((tmp_path / "outputs" / "runs" / "own" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["config"]["model"] == {"_target_": "mymodels.TinyNet", "vocab_size": 256}

    usage = run(venv, tmp_path, "trainflow", "train", "--help").stdout
    assert "  trainflow train --cfg job [overrides]" in usage and "train.py" not in usage


def test_my_project_is_a_project_that_depends_on_trainflow(venv: Path, tmp_path: Path) -> None:
    """Installed beside trainflow, its own package and conf/ train from any folder: no PYTHONPATH, no checkout."""
    conf = ROOT / "examples" / "my_project" / "conf"
    run(venv, tmp_path, "trainflow", "train", "--config-dir", str(conf), "experiment=my_project",
        "trainer.max_steps=20", "trainer.eval_every=10", "trainer.run_name=mine", "logger=none", "checkpoint=dcp")
    summary = json.loads((tmp_path / "outputs" / "runs" / "mine" / "summary.json").read_text())
    assert summary["task"]["monitor"] == "mae" and summary["validation"]["mae"] > 0
    metadata = run(venv, tmp_path, "python", "-c", "import importlib.metadata as m; print(m.requires('my-project'))")
    assert "trainflow" in metadata.stdout


def test_prepare_and_report_work_from_any_folder(venv: Path, tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.py").write_text("def f(x):\n    return x + 1\n" * 400)
    prepared = run(venv, tmp_path, "trainflow", "prepare", "--out", "shards", "--quiet", "data.paths=[corpus]")
    assert "wrote" in prepared.stdout and (tmp_path / "shards" / "manifest.json").is_file()
    run(venv, tmp_path, "trainflow", "train", *TINY, "data=shards", "data.path=shards", "trainer.run_name=shards",
        "checkpoint=dcp")
    report = run(venv, tmp_path, "trainflow", "report", "outputs")
    assert (tmp_path / "outputs" / "report.md").is_file(), report.stdout
