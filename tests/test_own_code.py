"""Your own model, data and task without a config file of your own: model=custom, data=custom and task=custom
(open sections: `_target_` and your keys), a `_target_` set on a built-in option (the option's keys the target does
not take are dropped, one line says which; a key you add that it does not take is refused), and the same from
experiment files. Each command trains in a real process and its loss falls.

The user's code is a package written into a temporary folder on PYTHONPATH. Its `resnet18` has torchvision's
signature (`*, weights=None, progress=True, **kwargs`, a model of `num_classes` outputs) but builds a small CNN, so
the path torchvision's model takes is tested where torchvision is not installed; the test with torchvision's own
resnet18 runs where torchvision imports.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from helpers.processes import run_process
from helpers.runs import ROOT, Run, train
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from trainflow.conf import CONFIG_DIR
from trainflow.config.sections import OWN_KEYS, settled_sections
from trainflow.errors import ConfigError

QUICK = ["logger=none", "compile=off", "trainer.max_steps=30", "trainer.batch_size=16", "trainer.log_every=5",
         "trainer.excluded_steps=1", "trainer.eval_every=0", "trainer.eval_steps=2", "optim.lr=3e-3"]
# the command, with the stand-in for torchvision.models.resnet18
ONE_COMMAND = ["model=custom", "model._target_=shapes.resnet18", "+model.num_classes=10", "data=custom",
               "data._target_=shapes.make_datasets", "task=classify"]

SHAPES = '''
"""A user's package: images of 10 classes told apart by their mean colour, and models that classify them."""
import torch
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 1000, width: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                                  nn.Flatten(), nn.Linear(width * 16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def resnet18(*, weights=None, progress: bool = True, **kwargs) -> nn.Module:
    """torchvision.models.resnet18's signature; its kwargs (num_classes, ...) go to the model."""
    assert weights is None
    return SmallCNN(**kwargs)


def make_datasets(size: int = 512, image_size: int = 16, seed: int = 0):
    means = torch.randn(10, 3, 1, 1, generator=torch.Generator().manual_seed(seed))

    def split(n: int, split_seed: int) -> list:
        g = torch.Generator().manual_seed(split_seed)
        labels = torch.randint(0, 10, (n,), generator=g)
        images = means[labels] + 0.5 * torch.randn(n, 3, image_size, image_size, generator=g)
        return list(zip(images, labels))

    return split(size, seed + 1), split(64, seed + 2)


def smoothed_loss(model, batch, smoothing: float = 0.0):
    images, labels = batch
    logits = model(images)
    loss = nn.functional.cross_entropy(logits, labels, label_smoothing=smoothing)
    return loss, {"accuracy": (logits.argmax(-1) == labels).float().mean()}
'''


@pytest.fixture
def user(tmp_path: Path) -> dict[str, str]:
    """The environment of a run that imports the user's package `shapes` from a temporary folder."""
    (tmp_path / "pkg" / "shapes").mkdir(parents=True)
    (tmp_path / "pkg" / "shapes" / "__init__.py").write_text(SHAPES)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "pkg"), os.environ.get("PYTHONPATH")]))}


def learned(run: Run) -> Run:
    """The run trained: it exited 0 and its loss fell by a quarter or more from ~2.23 (chance: ln 10 = 2.30)."""
    assert run.returncode == 0, run.stderr[-3000:]
    losses = run.losses()
    assert len(losses) == 6 and losses[-1] < 0.75 * losses[0], losses
    return run


def saved_section(run: Run, group: str) -> dict:
    return yaml.safe_load((run.run_dir / "config.yaml").read_text())[group]


def notices(run: Run) -> list[str]:
    return [line.split(" - ", 1)[1] for line in (run.stdout + run.stderr).splitlines()
            if "trainflow.config.sections" in line]


def test_one_command_trains_your_model_on_your_data(tmp_path: Path, user: dict[str, str]) -> None:
    run = learned(train(tmp_path / "run", *ONE_COMMAND, *QUICK, env=user))
    assert saved_section(run, "model") == {"_target_": "shapes.resnet18", "num_classes": 10}
    assert saved_section(run, "data") == {"_target_": "shapes.make_datasets", "num_workers": 0, "pin_memory": None,
                                          "persistent_workers": False, "prefetch_factor": None}
    assert "model SmallCNN:" in run.stdout + run.stderr and notices(run) == []


def test_torchvision_resnet18_from_one_command(tmp_path: Path, user: dict[str, str]) -> None:
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # not installed, or built for another torch
        pytest.skip(f"torchvision does not import here ({type(exc).__name__})")
    args = [a.replace("shapes.resnet18", "torchvision.models.resnet18") for a in ONE_COMMAND]
    run = learned(train(tmp_path / "run", *args, *QUICK, "+data.image_size=32", env=user))
    assert "model ResNet:" in run.stdout + run.stderr


def test_a_target_on_a_built_in_option_drops_the_keys_it_does_not_take(tmp_path: Path,
                                                                         user: dict[str, str]) -> None:
    """gpt_tiny's and data=text's keys are not passed to the user's code; the keys added here are (no `+` needed)."""
    run = learned(train(tmp_path / "run", "model._target_=shapes.SmallCNN", "model.num_classes=10", "model.width=12",
                        "data._target_=shapes.make_datasets", "data.size=256", "task=classify", *QUICK, env=user))
    assert saved_section(run, "model") == {"_target_": "shapes.SmallCNN", "num_classes": 10, "width": 12}
    assert notices(run) == [
        "model._target_: shapes.SmallCNN does not take model=gpt_tiny's vocab_size, block_size, n_layer, n_head, "
        "n_embd, dropout, bias: dropped (model=custom starts without them)",
        "data._target_: shapes.make_datasets does not take data=text's seq_len, paths, suffixes, val_fraction, "
        "cache_dir, tokenizer, model_vocab_size: dropped (data=custom starts without them)"]


def test_a_key_added_that_the_target_does_not_take_is_refused(tmp_path: Path, user: dict[str, str]) -> None:
    """The same rule whoever adds the key (the command line here): one line, before anything is built."""
    run = train(tmp_path / "run", "model._target_=shapes.SmallCNN", "model.num_clases=10", *QUICK, env=user)
    assert run.returncode == 1 and [line for line in run.stderr.splitlines() if line.strip()] == [
        "Error: model.num_clases: shapes.SmallCNN takes no such argument; did you mean model.num_classes? it takes "
        "num_classes, width"], run.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_your_folder_is_importable_by_the_installed_command_and_its_workers(tmp_path: Path) -> None:
    """`trainflow train model=custom model._target_=mymodels.TinyNet` with mymodels.py in the folder it runs in, as
    `python -m` would import it, no PYTHONPATH: in the command and in the two workers it starts; the header says
    what it imported and from where."""
    (tmp_path / "shapes").mkdir()
    (tmp_path / "shapes" / "__init__.py").write_text(SHAPES)  # a package of the folder, and a module beside it
    (tmp_path / "mymodels.py").write_text("from shapes import SmallCNN as TinyNet  # noqa: F401\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "TRAINFLOW_USER_FOLDER")}
    env["PYTHONPATH"] = str(ROOT / "src")  # trainflow's code only: nothing of the folder
    args = [a.replace("shapes.resnet18", "mymodels.TinyNet") for a in ONE_COMMAND]
    proc = run_process([str(Path(sys.executable).parent / "trainflow"), "train", *args, *QUICK,
                        "parallelism=ddp", "parallelism.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'run'}"],
                       tmp_path, env, 600)
    run = learned(Run(proc.returncode, proc.stdout, proc.stderr, tmp_path / "run"))
    console = run.stdout + run.stderr
    assert "model SmallCNN: " in console and "parameters (mymodels.TinyNet from ./mymodels.py); task" in console
    assert "(shapes.make_datasets from ./shapes/__init__.py)" in console
    assert json.loads((run.run_dir / "summary.json").read_text())["world_size"] == 2


def experiment(tmp_path: Path, text: str) -> list[str]:
    """Overrides that run `text` as experiment=mine from a config dir of the user's own."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(textwrap.dedent(text))
    return ["--config-dir", str(tmp_path / "conf"), "experiment=mine"]


def test_an_experiment_overriding_to_the_open_sections(tmp_path: Path, user: dict[str, str]) -> None:
    args = experiment(tmp_path, """\
        # @package _global_
        defaults:
          - override /model: custom
          - override /data: custom
          - override /task: custom
        model: {_target_: shapes.SmallCNN, num_classes: 10, width: 12}
        data: {_target_: shapes.make_datasets, size: 256}
        task: {_target_: shapes.smoothed_loss, smoothing: 0.05, monitor: accuracy, mode: max}
        """)
    run = learned(train(tmp_path / "run", *args, *QUICK, env=user))
    assert saved_section(run, "task") == {"_target_": "shapes.smoothed_loss", "smoothing": 0.05,
                                          "monitor": "accuracy", "mode": "max", "train_metrics": "log_step"}
    assert run.summary["validation"]["accuracy"] > 0.3 and notices(run) == []  # chance: 0.1


def test_an_experiment_setting_targets_on_the_default_options(tmp_path: Path, user: dict[str, str]) -> None:
    """Lightning-hydra-template's habit: an experiment swaps `_target_` and adds keys, with no defaults list."""
    args = experiment(tmp_path, """\
        # @package _global_
        model: {_target_: shapes.SmallCNN, num_classes: 10}
        data: {_target_: shapes.make_datasets, size: 256}
        task: {kind: classify}
        """)
    run = learned(train(tmp_path / "run", *args, *QUICK, env=user))
    assert saved_section(run, "model") == {"_target_": "shapes.SmallCNN", "num_classes": 10}
    assert [line.split(":")[0] for line in notices(run)] == ["model._target_", "data._target_"]


# -- which keys a built-in option's section keeps (composed here, nothing trained) -------------------------------


def composed(*overrides: str) -> dict[str, dict]:
    """The model, data, task and optim sections as their targets are called, of the run train.py would compose;
    Hydra's record (the options chosen) is set."""
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
    record = HydraConfig.instance()
    previous = record.cfg
    record.set_config(cfg)
    try:
        return settled_sections(cfg, {group: OmegaConf.to_container(cfg[group], resolve=True) for group in OWN_KEYS})
    finally:
        record.cfg = previous  # other tests in this process compose without it


def test_a_subclass_of_the_options_model_keeps_its_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    cfg = composed("model._target_=unstable_model.GPTNaNAtStep", "+model.nan_at_step=3")  # GPT(**gpt) underneath
    assert set(cfg["model"]) == {"_target_", "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout",
                              "bias", "nan_at_step"}


def test_an_option_key_is_dropped_whoever_typed_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rule, whichever way a key got there: gpt_tiny's n_layer, typed on the command line here, is dropped as
    BranchyMLP does not take it, as it would be from the option's file."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    cfg = composed("model._target_=test_compile.BranchyMLP", "model.n_layer=2")
    assert set(cfg["model"]) == {"_target_"}


def test_a_target_keeps_the_option_keys_its_signature_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    cfg = composed("model=mlp", "model._target_=test_compile.BranchyMLP")  # (in_features, hidden, out_features)
    assert set(cfg["model"]) == {"_target_", "in_features", "hidden", "out_features"}


def test_another_trainflow_model_on_a_built_in_option_gets_none_of_its_keys() -> None:
    cfg = composed("model._target_=trainflow.models.mlp.MLP", "model.hidden=32")  # over gpt_tiny
    assert cfg["model"] == {"_target_": "trainflow.models.mlp.MLP", "hidden": 32}


def test_a_key_a_built_in_option_lacks_is_named() -> None:
    with pytest.raises(ConfigError, match=r"^model\.n_heads: model=gpt_tiny has no such key \(it has vocab_size, "):
        composed("model.n_heads=3")
    with pytest.raises(ConfigError, match=r"^task\.smoothing: task=auto has no such key"):
        composed("task.smoothing=0.1")


def test_a_nested_target_is_built_first_and_its_failure_names_its_key() -> None:
    """Lightning-style: the model's argument is a section of its own (here torch's encoder layer)."""
    from trainflow.models import build_model

    layer = {"_target_": "torch.nn.TransformerEncoderLayer", "d_model": 8, "nhead": 2, "dim_feedforward": 16,
             "batch_first": True}
    model = build_model("torch.nn.TransformerEncoder", {"encoder_layer": layer, "num_layers": 2})
    assert len(model.layers) == 2 and model.layers[0].linear1.out_features == 16
    with pytest.raises(ConfigError) as err:
        build_model("torch.nn.TransformerEncoder", {"num_layers": 2, "encoder_layer": {**layer, "nhead": 3}})
    assert str(err.value).startswith("model.encoder_layer: torch.nn.TransformerEncoderLayer(d_model=8, nhead=3, "
                                     "dim_feedforward=16, batch_first=True) failed: AssertionError: ")
    assert str(err.value).endswith("; fix the model.encoder_layer.* values")
