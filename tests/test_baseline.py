"""The baseline stage: one eager process that learns, measures itself and reproduces bit for bit."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.runs import ROOT, TINY_GPT, train


def test_loss_and_validation_loss_fall_on_text(run_dir: Path) -> None:
    run = train(run_dir, *TINY_GPT, "trainer.max_steps=40", "trainer.eval_every=20", "trainer.eval_steps=4",
                "optim.lr=3e-3", "optim.warmup_steps=5")
    assert run.returncode == 0, run.stderr
    losses = run.losses()
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5  # bytes: from ~ln(256) towards ~2.5
    vals = [m["val/loss"] for m in run.metrics() if "val/loss" in m]
    assert len(vals) == 2 and vals[1] < vals[0]
    summary = run.summary
    assert summary["validation"]["loss"] == pytest.approx(vals[1])
    assert summary["validation"]["perplexity"] == pytest.approx(math.exp(vals[1]), rel=1e-6)


def test_same_seed_gives_bit_identical_losses(tmp_path: Path) -> None:
    common = [*TINY_GPT, "trainer.max_steps=8", "data=synthetic", "model.dropout=0.1"]
    a = train(tmp_path / "a", *common)
    b = train(tmp_path / "b", *common)
    c = train(tmp_path / "c", *common, "trainer.seed=7")
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + b.stderr + c.stderr
    assert a.losses() == b.losses()  # exact float equality, dropout included
    assert a.losses() != c.losses()


def test_seed_mlp_experiment_trains(run_dir: Path) -> None:
    run = train(run_dir, "experiment=seed_mlp", "trainer.max_steps=200", "logger=none")
    assert run.returncode == 0, run.stderr
    summary = run.summary
    assert summary["config"]["model"]["_target_"] == "trainflow.models.mlp.MLP"
    assert summary["train_loss"]["last"] < 0.5 * summary["train_loss"]["first"]
    assert summary["validation"]["loss"] < 0.6  # a learnable teacher; chance level is ln(10) = 2.3
    assert "perplexity" not in summary["validation"] and summary["steady_state"]["tokens_per_sec"] == 0


def test_flop_counter_matches_the_analytic_count_for_the_mlp() -> None:
    from trainflow.metrics.flops import count_train_flops
    from trainflow.models.mlp import MLP
    from trainflow.tasks import Classification

    batch = 32
    inputs, targets = torch.randn(batch, 100), torch.randint(10, (batch,))
    layers = [(100, 256), (256, 10)]
    forward = sum(2 * batch * i * o for i, o in layers)
    weight_grads = forward  # dL/dW costs what the forward matmul costs
    input_grads = 2 * batch * 256 * 10  # only the second layer passes a gradient back (inputs need none)
    assert count_train_flops(MLP(), (inputs, targets), Classification()) == (forward + weight_grads + input_grads, None)


def test_tensorboard_scalars_read_back_with_tensorboards_reader(run_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = [o for o in TINY_GPT if o != "logger=none"]
    run = train(run_dir, *overrides, "logger=tensorboard", "trainer.max_steps=6", "trainer.log_every=2")
    assert run.returncode == 0, run.stderr
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("loss/train", "train/lr", "train/grad_norm", "perf/step_time_s", "perf/samples_per_sec",
                "perf/tokens_per_sec", "perf/data_wait_fraction", "perf/peak_memory_mib", "perf/mfu", "loss/val",
                "val/perplexity"):
        assert tag in tags, tag
    tb_losses = [(e.step, e.value) for e in events.Scalars("loss/train")]
    jsonl_losses = [(m["step"], m["train/loss"]) for m in run.metrics() if "train/loss" in m]
    assert [s for s, _ in tb_losses] == [2, 4, 6]
    assert [v for _, v in tb_losses] == pytest.approx([v for _, v in jsonl_losses], rel=1e-6)  # TB stores fp32


def gpt_train_flops(model: dict, batch: int, seq_len: int) -> int:
    """Matmul FLOPs of one forward + backward step of trainflow's GPT, counted the way FlopCounterMode counts.

    A matmul of [m, k] x [k, n] is 2*m*k*n FLOPs. Per block: qkv (C -> 3C), proj (C -> C) and the MLP
    (C -> 4C -> C) are 24*N*C^2 for N = batch * seq_len tokens; attention is Q @ K^T and P @ V, 2*B*T*T*C each
    (the causal mask saves nothing in the count). The tied head is 2*N*C*V. Backward costs twice the forward:
    every matmul needs the gradient of its input and of its weight (the embeddings' output needs a gradient
    too, so even the first block's inputs do); layer norms, GELU, softmax and the loss count no FLOPs.
    """
    n_layer, c, vocab = model["n_layer"], model["n_embd"], model["vocab_size"]
    tokens = batch * seq_len
    forward = n_layer * (24 * tokens * c * c + 4 * batch * seq_len * seq_len * c) + 2 * tokens * c * vocab
    return 3 * forward


def test_gpt_flop_count_equals_the_analytic_count_at_other_sizes() -> None:
    from trainflow.metrics.flops import count_train_flops
    from trainflow.models.gpt import GPT
    from trainflow.tasks import LanguageModel

    model = {"n_layer": 3, "n_embd": 96, "n_head": 4, "vocab_size": 100, "block_size": 16}
    tokens = torch.randint(100, (5, 16))
    flops, _ = count_train_flops(GPT(**model), (tokens, tokens), LanguageModel())
    assert flops == gpt_train_flops(model, batch=5, seq_len=16)


def test_summary_has_sane_figures(run_dir: Path) -> None:
    run = train(run_dir, *TINY_GPT, "trainer.max_steps=10", "trainer.excluded_steps=3", "trainer.log_every=5")
    assert run.returncode == 0, run.stderr
    s = run.summary
    steady = s["steady_state"]
    assert steady["excluded_steps"] == 3 and steady["steps"] == 7
    assert steady["samples_per_sec"] == pytest.approx(8 / steady["step_time_s"], rel=1e-6)
    assert steady["tokens_per_sec"] == pytest.approx(8 * 32 / steady["step_time_s"], rel=1e-6)
    assert 0 <= s["data_wait_fraction"] < 0.5
    assert 0 < s["mfu"] < 1.5  # measured matmul peak; tiny models sit well below it
    assert s["peak_memory_bytes"] > 50e6  # a process with torch loaded
    assert s["flops_per_step"] > 0 and s["world_size"] == 1 and s["device"] == "cpu"
    assert s["flops_per_step"] == gpt_train_flops(s["config"]["model"], batch=8, seq_len=32)
    assert s["mfu"] == pytest.approx(s["flops_per_step"] / steady["step_time_s"] / s["peak_flops"], rel=1e-12)
    assert s["train_loss"]["first"] > s["train_loss"]["last"] > 0
    assert s["config"]["trainer"]["max_steps"] == 10
    assert (run_dir / "config.yaml").exists() and (run_dir / ".hydra" / "config.yaml").exists()
    assert "step 10/10" in (run_dir / "train.log").read_text()


def help_rows(out: str) -> dict[str, list[tuple[str, str]]]:
    """`--help`'s groups table: each group's (option, description) rows; a chosen option keeps its `*`."""
    rows: dict[str, list[tuple[str, str]]] = {}
    group = None
    for line in out.split("Groups: ")[1].split("\n\nKeys:")[0].splitlines()[1:]:
        group = line[:15].strip() or group
        option, _, about = line[15:].lstrip(" ").partition(" ")
        rows.setdefault(group, []).append((option, about.strip()))
    return rows


def test_help_lists_every_option_of_every_group_with_its_line_and_loads_no_torch(tmp_path: Path) -> None:
    """One line per option, from the option's own YAML; the defaults (or the options given) marked; a project's own
    option (--config-dir) listed beside trainflow's; answered without importing torch (so at once)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "my_net.yaml").write_text("# My own network, for the help test.\n_target_: x.Net\n")
    probe = ("import runpy, sys; sys.argv = ['train.py', *sys.argv[1:]]; runpy.run_path('train.py', "
             "run_name='__main__'); print('torch loaded:', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe, "--help", "model=mlp", "--config-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    rows = help_rows(out)
    assert [o for o, _ in rows["model"]] == ["cnn", "custom", "gpt_medium", "gpt_small", "gpt_tiny", "*mlp", "my_net"]
    assert dict(rows["model"])["my_net"] == "My own network, for the help test."
    assert dict(rows["model"])["gpt_tiny"].startswith("~3.3M parameters")
    assert [o for o, _ in rows["optim"]] == ["*adamw", "custom", "sgd"]
    assert [o for o, _ in rows["task"]] == ["*auto", "classify", "custom", "lm"]
    assert [o for o, _ in rows["tokenizer"]] == ["bpe", "*bytes", "file"]
    assert {o for o, _ in rows["hydra/launcher"]} >= {"process", "slurm", "torchrun"}
    assert all(about for group in rows.values() for _, about in group), "an option without a description"
    assert not any(group.startswith("schema") for group in rows)
    assert out.rstrip().endswith("torch loaded: False")


def test_a_cached_cpu_peak_below_what_a_run_achieved_is_measured_again(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A peak cached while the machine was loaded would put MFU above 1: it is re-measured and the max kept."""
    import json

    from trainflow.metrics import flops as metrics

    cache = tmp_path / "peak_flops.json"
    monkeypatch.setattr(metrics, "_PEAK_CACHE", cache)
    cpu = torch.device("cpu")
    first = metrics.peak_flops(cpu, "fp32", None)
    (key,) = json.loads(cache.read_text())
    cache.write_text(json.dumps({key: 1e6}))  # as if measured on a machine busy with something else
    assert metrics.peak_flops(cpu, "fp32", None) == 1e6  # below what runs achieve: kept until one shows it
    refreshed = metrics.peak_flops(cpu, "fp32", None, at_least=2e6)
    assert refreshed > 0.2 * first and json.loads(cache.read_text()) == {key: refreshed}
    assert metrics.peak_flops(cpu, "fp32", 5e9, at_least=1e12) == 5e9  # an explicit metrics.peak_flops wins


def test_tokens_per_second_counts_the_tokens_of_varied_lengths(run_dir: Path) -> None:
    """With data.seq_lens the batches are shorter than data.seq_len: tokens/s counts what was trained on."""
    run = train(run_dir, *TINY_GPT, "data.seq_lens=[8,16]", "trainer.max_steps=8", "trainer.eval_steps=1")
    assert run.returncode == 0, run.stderr[-3000:]
    steady = run.summary["steady_state"]
    tokens_per_sample = steady["tokens_per_sec"] / steady["samples_per_sec"]
    assert 8 <= tokens_per_sample <= 16  # 32 (the full length) before the fix
    logged = [m["perf/tokens_per_sec"] / m["perf/samples_per_sec"] for m in run.metrics() if "train/loss" in m]
    assert sorted({round(t, 6) for t in logged}) == [8, 16]  # each step trains on one of the two lengths
