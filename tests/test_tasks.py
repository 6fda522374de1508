"""The task and data by _target_: what turns a batch into the loss and metrics, the user's datasets on the global
stream, and the two examples that run here (experiment=digits, examples/my_project) through every stage.

Each example runs end to end in a few short processes: single-process learning (loss falls, the monitored metric
improves), FSDP on 2 ranks with the profiler and DCP checkpoints, a resume from the middle whose losses equal the
uninterrupted run's step for step, and DDP with compile=default.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers.processes import run_process
from helpers.runs import ROOT, Run, losses_by_step, ok, train
from torch import nn

from trainflow.data import Collated, StreamSampler, SyntheticClassification, SyntheticTokens, to_device
from trainflow.errors import ConfigError, DataError
from trainflow.tasks import Classification, LanguageModel, UserTask, probe

MY_PROJECT = ROOT / "examples" / "my_project"
MY_PROJECT_ARGS = ["--config-dir", str(MY_PROJECT / "conf"), "experiment=my_project"]
MY_PROJECT_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(MY_PROJECT), os.environ.get("PYTHONPATH")]))}
QUICK = ["logger=none", "trainer.log_every=1", "trainer.excluded_steps=1", "trainer.eval_steps=2"]
TWO_RANKS = ["parallelism.nproc_per_node=2", "parallelism.global_batch=32"]
PROFILED = ["profiler=schedule", "profiler.wait=0", "profiler.warmup=1", "profiler.active=2"]
SAVED = ["checkpoint=dcp", "checkpoint.every_steps=4", "trainer.max_steps=8", "trainer.eval_every=0"]


def digits_without_val(val_fraction: float, split_seed: int) -> dict:
    """A data._target_ (tests/ on PYTHONPATH) that gives no validation set."""
    from trainflow.data.digits import digits

    return {"train": digits(val_fraction, split_seed)[0], "val": None}




# --- the tasks on real tensors ----------------------------------------------------------------------------------


def test_classification_metrics_are_the_fractions_of_right_answers() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.0, 0.0], [0.0, 2.0, 3.0, 1.0], [1.0, 0.0, 0.0, 4.0], [0.0, 0.0, 1.0, 2.0]])
    targets = torch.tensor([0, 1, 3, 0])  # right, second best, right, last
    task = Classification(top_k=2)
    loss, metrics = task(lambda x: x, (logits, targets))
    assert loss.item() == pytest.approx(nn.functional.cross_entropy(logits, targets).item())
    assert metrics["accuracy"].item() == 0.5 and metrics["top2_accuracy"].item() == 0.75
    assert task.count({"inputs": logits, "targets": targets}) == (4, 0)
    assert "top5_accuracy" not in Classification()(lambda x: x, (logits, targets))[1]  # 4 classes: top-5 is moot


def test_classification_metrics_of_sequence_logits_count_every_position_and_record_no_graph() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 8, requires_grad=True)  # [B, T, C]: one prediction per position
    targets = torch.randint(8, (3, 5))
    loss, metrics = Classification(top_k=3)(lambda x: x, (logits, targets))
    flat, labels = logits.detach().reshape(15, 8), targets.reshape(15)
    ranks = (flat > flat.gather(1, labels[:, None])).sum(1)  # classes scored above the target (no ties here)
    assert metrics["accuracy"].item() == pytest.approx((ranks == 0).float().mean().item())
    assert metrics["top3_accuracy"].item() == pytest.approx((ranks < 3).float().mean().item())
    assert 0 < metrics["accuracy"].item() < metrics["top3_accuracy"].item() < 1
    assert loss.requires_grad and not any(m.requires_grad for m in metrics.values())
    column = Classification(top_k=3)(lambda x: x, (flat, labels[:, None]))[1]  # targets [B, 1], as some data gives
    assert column == Classification(top_k=3)(lambda x: x, (flat, labels))[1]


def test_lm_task_reads_dict_batches_counts_tokens_and_takes_the_models_own_loss() -> None:
    ids = torch.randint(10, (3, 5))
    logits = torch.randn(3, 5, 10)
    loss, _ = LanguageModel()(lambda x: logits, {"input_ids": ids, "labels": ids})
    assert loss.item() == pytest.approx(nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).item())
    assert LanguageModel().count((ids, ids)) == (3, 15)
    assert LanguageModel().finish({"loss": 2.0})["perplexity"] == pytest.approx(7.389, rel=1e-3)

    class OwnLoss(nn.Module):
        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": (input_ids - labels).float().abs().sum() + 7.0}

    task = LanguageModel(loss_from_model=True)
    assert task(OwnLoss(), {"input_ids": ids, "labels": ids})[0].item() == 7.0
    assert task.count({"input_ids": ids, "labels": ids}) == (3, 15)


def test_probe_names_the_data_model_and_shapes_and_refuses_a_missing_monitor() -> None:
    model = nn.Linear(4, 3)
    batch = (torch.randn(1, 5), torch.tensor([1]))
    with pytest.raises(DataError) as refused:
        probe(Classification(), model, batch, "my.data", "my.Model")
    assert str(refused.value).startswith("data: my.data gives batches of ([1, 5] float32, [1] int64), which the task "
                                         "Classification cannot put through model my.Model (RuntimeError: ")
    fits = (torch.randn(1, 4), torch.tensor([1]))
    assert probe(Classification(monitor="accuracy"), model, fits, "d", "m") == ["loss", "accuracy"]
    with pytest.raises(ConfigError, match=r"^task.monitor: 'f1' is not a metric of this task \(loss, accuracy\)"):
        probe(Classification(monitor="f1"), model, fits, "d", "m")
    user = UserTask(lambda m, b: (m(b[0]).sum(), {"vector": torch.ones(2)}), "my.task")
    with pytest.raises(ConfigError, match="^task._target_: my.task returned a result whose metrics vector are not"):
        probe(user, model, fits, "d", "m")


def test_a_model_the_flop_counter_cannot_count_gets_the_reason_instead_of_mfu() -> None:
    from trainflow.metrics.flops import count_train_flops

    class PositiveOnly(nn.Module):  # boolean indexing: an output size the meta device cannot know
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) + x[x > 0].sum()

    batch = (torch.randn(8, 4), torch.randint(3, (8,)))
    flops, reason = count_train_flops(PositiveOnly(), batch, Classification())
    assert flops is None and reason.startswith("FlopCounterMode could not count PositiveOnly on the meta device (")
    forward = 2 * 8 * 4 * 3
    assert count_train_flops(nn.Linear(4, 3), batch, Classification()) == (2 * forward, None)  # + the weight grad


def test_nested_batches_move_and_collate_as_they_are() -> None:
    items = [{"x": torch.full((2,), float(i)), "pair": (torch.tensor(i), [torch.tensor([i, i])])} for i in range(6)]
    data = Collated(items, torch.utils.data.default_collate, "items")
    batch = data[torch.tensor([4, 1])]
    assert batch["x"].tolist() == [[4.0, 4.0], [1.0, 1.0]] and batch["pair"][0].tolist() == [4, 1]
    moved = to_device(batch, torch.device("meta"))
    assert moved["pair"][1][0].device.type == "meta" and list(moved["pair"][1][0].shape) == [2, 2]
    with pytest.raises(DataError, match=r"^data: default_collate cannot batch the items of ragged \(RuntimeError: "):
        Collated([torch.zeros(2), torch.zeros(3)], torch.utils.data.default_collate, "ragged")[torch.tensor([0, 1])]


def test_user_datasets_keep_the_stream_position_on_any_world_size() -> None:
    """The same stream positions give the same items, gathered by one rank or split over two."""
    data = Collated(list(range(100)), torch.utils.data.default_collate, "numbers")

    def first_batches(batch_size: int, rank: int, world_size: int) -> list[list[int]]:
        sampler = StreamSampler(len(data), batch_size, rank, world_size, seed=5, start=40)
        return [data[indices].tolist() for _, indices in zip(range(3), sampler, strict=False)]

    one, two = first_batches(8, 0, 1), [first_batches(4, r, 2) for r in (0, 1)]
    assert one == [a + b for a, b in zip(*two, strict=True)]


# --- experiment=digits --------------------------------------------------------------------------------------------


def test_digits_learns_and_reports_the_monitored_accuracy(tmp_path: Path) -> None:
    run = ok(train(tmp_path / "run", "experiment=digits", *QUICK, "trainer.max_steps=60", "trainer.eval_every=20",
                   "trainer.eval_steps=12"))
    s = run.summary
    assert s["task"] == {"name": "Classification", "monitor": "accuracy", "mode": "max",
                         "metrics": ["loss", "accuracy", "top5_accuracy"]}
    vals = [m for m in run.metrics() if "val/accuracy" in m]
    assert [m["step"] for m in vals] == [20, 40, 60]
    assert vals[-1]["val/accuracy"] > max(0.7, vals[0]["val/accuracy"])  # chance is 0.1
    assert vals[-1]["val/loss"] < vals[0]["val/loss"] < 2.3
    train_acc = [m["train/accuracy"] for m in run.metrics() if "train/accuracy" in m]
    assert len(train_acc) == 60 and sum(train_acc[-10:]) > sum(train_acc[:10])
    validation = s["validation"]
    assert validation["accuracy"] == vals[-1]["val/accuracy"] and s["flops_per_step"] > 0 and s["mfu_absent"] is None
    assert f"step 60: val loss {validation['loss']:.4g}, accuracy {validation['accuracy']:.4g}" in run.stdout


def test_the_built_in_synthetic_data_gathers_the_streams_samples_across_an_epoch() -> None:
    indices = next(iter(StreamSampler(100, 8, 0, 1, seed=3, start=95)))  # positions 95..102: two epochs' orders
    assert indices.shape == (8,)
    classes = SyntheticClassification(100, 6, 3, task_seed=0, input_seed=1)
    inputs, labels = classes[indices]
    assert torch.equal(inputs, classes.x[indices]) and torch.equal(labels, classes.y[indices])
    tokens = SyntheticTokens(100, 50, 7, seed=0)
    inputs, targets = tokens[indices]
    assert inputs.shape == (8, 7) and torch.equal(inputs, tokens.tokens[indices, :-1])
    assert torch.equal(targets, tokens.tokens[indices, 1:]) and inputs.is_contiguous() and targets.is_contiguous()


def test_a_log_interval_reports_the_mean_of_its_steps_metrics(tmp_path: Path) -> None:
    """The interval's loss and (task.train_metrics=every_step) accuracies, summed at the log step, are the means of
    what each step logs alone; by default the accuracies are the log step's own (batch 48: fractions binary floats
    do not hold exactly; two micro-steps a step)."""
    common = ["experiment=seed_mlp", "logger=none", "trainer.max_steps=8", "trainer.batch_size=48",
              "trainer.grad_accum=2", "trainer.eval_every=0"]

    def logged(name: str, *overrides: str) -> list[dict]:
        return [m for m in ok(train(tmp_path / name, *common, *overrides)).metrics() if "train/loss" in m]

    each = logged("each", "trainer.log_every=1")
    grouped = logged("by4", "trainer.log_every=4", "task.train_metrics=every_step")
    at_log_steps = logged("log_step", "trainer.log_every=4")
    assert [m["step"] for m in grouped] == [4, 8] and len(each) == 8
    for logged_, steps in zip(grouped, (each[:4], each[4:]), strict=True):
        for key in ("train/loss", "train/accuracy", "train/top5_accuracy"):
            assert logged_[key] == pytest.approx(sum(m[key] for m in steps) / 4, rel=1e-6, abs=1e-7), key
    assert len({m["train/accuracy"] for m in each}) > 1  # the steps differ: a mean, not one step's value
    assert [m["step"] for m in at_log_steps] == [4, 8]
    for logged_, mean, own in zip(at_log_steps, grouped, (each[3], each[7]), strict=True):
        assert logged_["train/loss"] == mean["train/loss"]  # the loss is the interval's mean either way
        for key in ("train/accuracy", "train/top5_accuracy"):
            assert logged_[key] == pytest.approx(own[key], rel=1e-6), key
    assert [m["train/accuracy"] for m in at_log_steps] != [m["train/accuracy"] for m in grouped]


def test_data_without_a_validation_set_trains_without_evaluation(tmp_path: Path) -> None:
    run = ok(train(tmp_path / "run", "experiment=digits", *QUICK, "trainer.max_steps=3",
                   "data._target_=test_tasks.digits_without_val", env={"PYTHONPATH": str(ROOT / "tests")}))
    assert run.summary["validation"] is None and run.summary["steps"] == 3 and len(run.losses()) == 3
    assert run.stdout.count("test_tasks.digits_without_val gives no validation set: no evaluation") == 1
    assert not [m for m in run.metrics() if any(k.startswith("val/") for k in m)]


def check_resume_equals(reference: Run, resumed: Run, example: str) -> None:
    straight, again = losses_by_step(reference.run_dir), losses_by_step(resumed.run_dir)
    assert resumed.summary["resumed_from_step"] == 4, example
    assert {s: again[s] for s in range(5, 9)} == {s: straight[s] for s in range(5, 9)}, example
    assert len(set(straight.values())) == 8  # the batches differ: equal losses are not a coincidence


# digits takes the same path as the user's own project (my_project), which make test runs
@pytest.mark.parametrize("example", [pytest.param("digits", marks=pytest.mark.slow), "my_project"])
def test_example_through_fsdp_profiler_checkpoint_resume_and_compiled_ddp(example: str, tmp_path: Path) -> None:
    args, env = (["experiment=digits"], None) if example == "digits" else (MY_PROJECT_ARGS, MY_PROJECT_ENV)
    fsdp = ok(train(tmp_path / "fsdp", *args, *QUICK, "parallelism=fsdp", *TWO_RANKS, *PROFILED, *SAVED, env=env))
    assert fsdp.summary["world_size"] == 2 and fsdp.summary["parallelism"]["strategy"] == "fsdp"
    assert fsdp.summary["profiler"]["verdict"] and list((fsdp.run_dir / "profile").glob("*trace.json*"))
    step4 = fsdp.run_dir / "checkpoints" / "step_00000004"
    resumed = ok(train(tmp_path / "resumed", *args, *QUICK, "parallelism=fsdp", *TWO_RANKS, *SAVED,
                       f"checkpoint.resume={step4}", env=env))
    check_resume_equals(fsdp, resumed, example)

    ddp = ok(train(tmp_path / "ddp", *args, *QUICK, "parallelism=ddp", *TWO_RANKS, "compile=default",
                   "compile.check=true", "parallelism.check=true", "trainer.max_steps=8", "trainer.eval_every=0",
                   env=env))
    s = ddp.summary
    assert s["compile"]["enabled"] and s["compile"]["graphs"] >= 1 and s["parallelism"]["strategy"] == "ddp"
    check, parity = s["compile"]["check"], s["parallelism"]["check"]  # both through the task, on the user's batches
    assert check["passed"] and check["grads_compared"] == {"digits": 10, "my_project": 6}[example]  # every tensor
    assert parity["passed"] and len(parity["losses"]) == 3
    compiled, eager = losses_by_step(ddp.run_dir), losses_by_step(fsdp.run_dir)
    assert compiled.keys() == eager.keys() == set(range(1, 9))
    assert all(abs(compiled[k] - eager[k]) <= 1e-4 * eager[k] for k in eager), (compiled, eager)  # fp32 parity
    monitor = s["task"]["monitor"]
    assert monitor == ("accuracy" if example == "digits" else "mae") and s["validation"][monitor] >= 0


def test_my_project_learns_with_its_own_task_and_monitor(tmp_path: Path) -> None:
    run = ok(train(tmp_path / "run", *MY_PROJECT_ARGS, *QUICK, "trainer.max_steps=40", "trainer.eval_every=20",
                   env=MY_PROJECT_ENV))
    s = run.summary
    assert s["task"] == {"name": "UserTask", "monitor": "mae", "mode": "min", "metrics": ["loss", "mae", "within_0.25"]}
    vals = [m for m in run.metrics() if "val/mae" in m]
    assert vals[-1]["val/mae"] < vals[0]["val/mae"] and vals[-1]["val/loss"] < vals[0]["val/loss"]
    assert s["validation"]["within_0.25"] == vals[-1]["val/within_0.25"] > 0
    config = json.loads(json.dumps(s["config"]))
    assert config["data"]["collate_fn"] == {"_target_": "my_project.data.PadSets", "pad_to": 12}


def test_a_sweep_reports_each_jobs_monitored_metric(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_process([sys.executable, str(ROOT / "train.py"), "-m", "experiment=digits", *QUICK,
                        "trainer.max_steps=4,8", "trainer.eval_every=0", f"hydra.sweep.dir={sweep}"], ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((sweep / "report.json").read_text())["runs"]
    summaries = [json.loads((sweep / n / "summary.json").read_text()) for n in ("0", "1")]
    assert [(r["monitor"], r["mode"]) for r in rows] == [("accuracy", "max")] * 2
    assert [r["validation"] for r in rows] == [s["validation"] for s in summaries]
    table = (sweep / "report.md").read_text()
    for name, s in zip(("0", "1"), summaries, strict=True):
        assert f"| {name} | `trainer.max_steps={s['steps']}` |" in table
        assert f"| accuracy {s['validation']['accuracy']:.4f} (max) |" in table
