"""parallelism=auto: budgets that force each outcome (DDP, FSDP, FSDP + activation checkpointing, tensor parallel,
refusal), the decision table in summary.json, and the estimate kept honest against what the run measured.

The budgets come from the table of a first run (never hard-coded): half-way between two layouts' totals, the
plan must pick the cheaper-to-communicate one that fits.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.runs import TINY_GPT, Run, ok, train

from trainflow.conf import CONFIG_DIR
from trainflow.config.schema import typed_section
from trainflow.distributed.memory_estimate import ModelFacts
from trainflow.distributed.memory_plan import GB

BASE = [*TINY_GPT, "parallelism=auto", "parallelism.nproc_per_node=2", "trainer.max_steps=2",
        "trainer.eval_every=0", "trainer.eval_steps=1"]
STATE = ("params", "grads", "optimizer")
# The measured peak over the estimate, CPU (peak RSS since the plan): 1.26 measured for the default gpt_tiny in one
# process; allocator slack, gloo buffers and the loss's temporaries are outside the estimate.
PEAK_FACTOR = (0.75, 2.0)


def budget_between(table: dict, cheaper: str, dearer: str) -> str:
    """A budget (GB) half-way between two layouts' totals: the dearer one no longer fits, the cheaper one does."""
    assert table[cheaper]["total"] < table[dearer]["total"], table
    return f"parallelism.memory_budget_gb={(table[cheaper]['total'] + table[dearer]['total']) / 2 / GB!r}"


@pytest.fixture(scope="module")
def roomy(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """2 ranks and a budget of 1 GB: everything fits, DDP is chosen."""
    return ok(train(tmp_path_factory.mktemp("roomy") / "run", *BASE, "parallelism.memory_budget_gb=1"))


def test_ddp_when_it_fits(roomy: Run) -> None:
    parallelism = roomy.summary["parallelism"]
    plan = parallelism["plan"]
    assert plan["choice"] == "ddp" and parallelism["strategy"] == "ddp" and plan["budget_bytes"] == GB
    checkpointed = ("", " + selective activation checkpointing", " + activation checkpointing")
    assert list(plan["table"]) == ["ddp", *(f"fsdp{ac}" for ac in checkpointed),  # then TP: 2 heads, 2 ranks
                                   *(f"tp 2{ac}" for ac in checkpointed),  # then PP: 2 blocks, 2 ranks
                                   *(f"pp 2{ac}" for ac in checkpointed)]
    ddp, fsdp, selective, ac = (plan["table"][k] for k in list(plan["table"])[:4])
    assert ddp["buckets"] == ddp["grads"] > 0 and fsdp["buckets"] == 0 and fsdp["all_gather"] > 0
    assert fsdp["params"] * 2 == pytest.approx(ddp["params"], rel=0.01)  # sharded over 2 ranks
    assert ac["activations"] < selective["activations"] < fsdp["activations"] == ddp["activations"]
    assert "parallelism=auto chose ddp on 2 ranks" in roomy.stdout and "* ddp" in roomy.stdout
    # exact items: what the run's rank 0 held after training
    assert plan["check"]["params_bytes"] == ddp["params"] and plan["check"]["optimizer_bytes"] == ddp["optimizer"]


def test_the_sweep_report_shows_the_decision(roomy: Run, tmp_path: Path) -> None:
    from trainflow.report import runs as report

    plan = roomy.summary["parallelism"]["plan"]
    written = report.write(roomy.run_dir, tmp_path)
    assert written["runs"][0]["plan"] == plan
    page = (tmp_path / "report.md").read_text()
    ddp_mib = plan["table"]["ddp"]["total"] / 2**20
    assert f"**ddp {ddp_mib:.1f}**, fsdp " in page and "parallelism.memory_budget_gb=1" in page


def test_fsdp_when_ddp_does_not_fit(roomy: Run, tmp_path: Path) -> None:
    table = roomy.summary["parallelism"]["plan"]["table"]
    run = ok(train(tmp_path / "run", *BASE, budget_between(table, "fsdp", "ddp")))
    parallelism = run.summary["parallelism"]
    assert parallelism["plan"]["choice"] == "fsdp" and parallelism["strategy"] == "fsdp"
    assert parallelism["mesh"] == {"replicate": 1, "shard": 2}
    assert run.summary["config"]["parallelism"]["activation_checkpointing"] == "off"
    check = parallelism["plan"]["check"]
    assert check["params_bytes"] == table["fsdp"]["params"] and check["optimizer_bytes"] == table["fsdp"]["optimizer"]


def test_fsdp_with_activation_checkpointing_when_fsdp_does_not_fit(roomy: Run, tmp_path: Path) -> None:
    table = roomy.summary["parallelism"]["plan"]["table"]
    run = ok(train(tmp_path / "run", *BASE, budget_between(table, "fsdp + activation checkpointing", "fsdp")))
    assert run.summary["parallelism"]["plan"]["choice"] == "fsdp + activation checkpointing"
    assert run.summary["parallelism"]["strategy"] == "fsdp"
    assert run.summary["config"]["parallelism"]["activation_checkpointing"] == "full"
    assert run.summary["train_loss"]["last"] < run.summary["train_loss"]["first"] * 1.1  # it trains


def test_refusal_names_what_is_needed_and_what_would_fit(roomy: Run, tmp_path: Path) -> None:
    table = roomy.summary["parallelism"]["plan"]["table"]
    leanest = min(table, key=lambda name: table[name]["total"])
    assert leanest == "tp 2 + activation checkpointing"  # the block's activations split over 2 ranks
    need = table[leanest]["total"]
    run = train(tmp_path / "run", *BASE, f"parallelism.memory_budget_gb={need * 0.9 / GB!r}")
    assert run.returncode == 2, run.stderr[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert lines[0].startswith(f"Error: parallelism.memory_budget_gb: no strategy fits: the leanest, {leanest}, "
                               f"needs {need / GB:.3g} GB per rank")
    fix = re.search(r"it would fit with (\d+) ranks or trainer\.batch_size=(\d+)", lines[0])
    assert fix and int(fix.group(1)) > 2 and 1 <= int(fix.group(2)) < 8, lines[0]
    assert not (tmp_path / "run" / "summary.json").exists()


def test_estimate_is_honest_in_one_process(tmp_path: Path) -> None:
    """The default gpt_tiny in one process: exact state, total within PEAK_FACTOR of the measured peak."""
    run = ok(train(tmp_path / "run", "model=gpt_tiny", "trainer.batch_size=8", "logger=none", "compile=off",
                   "parallelism=auto", "trainer.max_steps=2", "trainer.excluded_steps=0", "trainer.eval_every=0",
                   "trainer.eval_steps=1"))
    plan = run.summary["parallelism"]["plan"]
    assert plan["choice"] == "single" and "available RAM / 1 local rank" in plan["budget_source"]
    row, check = plan["table"]["single"], plan["check"]
    assert row["params"] == row["grads"] == run.summary["parameters"] * 4 == check["params_bytes"]
    assert check["optimizer_bytes"] == row["optimizer"] and row["optimizer"] >= 2 * row["params"]
    assert PEAK_FACTOR[0] <= check["peak_over_estimate"] <= PEAK_FACTOR[1], check


def test_a_model_without_blocks_is_sharded_by_size_and_said_once(tmp_path: Path) -> None:
    run = ok(train(tmp_path / "run", "model=mlp", "data=synthetic", "logger=none", "compile=off", "parallelism=auto",
                   "trainer.max_steps=2", "trainer.eval_every=0", "trainer.eval_steps=1"))
    note = "has no `blocks` list, so FSDP would shard modules by size"
    assert run.stdout.count(note) == 1, run.stdout[-2000:]
    assert list(run.summary["parallelism"]["plan"]["table"]) == ["single"]  # no activation checkpointing offered


def test_slurm_four_nodes_of_eight_gpus_rendezvous_once_and_auto_picks_hsdp_8_by_4(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sbatch script of nodes=4 gpus_per_node=8 (parallelism=auto: a task per GPU; dry run, nothing
    submitted) starts one srun of 32 tasks, which all meet at one address; under parallelism=auto with sharding
    needed, rank 0 of those 32 (a fake process group stands in for the cluster) chooses HSDP: 8 shards within a node
    x 4 replicas."""
    from dataclasses import replace

    import torch
    import torch.distributed as dist
    from helpers.slurm import SLURM, multirun
    from hydra import compose, initialize_config_dir
    from submitit.helpers import TorchDistributedEnvironment
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainflow.config.checks import check_config
    from trainflow.config.schema import RunConfig, register_configs
    from trainflow.distributed import DistEnv
    from trainflow.distributed.memory_plan import apply_auto
    from trainflow.distributed.mesh import build_mesh, hsdp_shape
    from trainflow.models import build_model
    from trainflow.tasks import LanguageModel

    proc = multirun(tmp_path, *SLURM, "hydra.launcher.nodes=4",
                    "hydra.launcher.gpus_per_node=8", "hydra.launcher.dry_run=true", "parallelism=auto", timeout=60)
    assert proc.returncode == 0, proc.stderr
    script = (tmp_path / "dry_run.sbatch").read_text().splitlines()
    assert {"#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8"} <= set(script)
    assert len([line for line in script if line.startswith("srun ")]) == 1  # one job step: every task in it

    # What each of the 32 tasks exports (the job runner's TorchDistributedEnvironment) from SLURM's variables
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    seen = set()
    for rank in range(32):
        for key, value in {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "32", "SLURM_JOB_NUM_NODES": "4",
                           "SLURM_NODEID": str(rank // 8), "SLURM_JOB_NODELIST": "gpu[01-04]",
                           "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 8)}.items():
            monkeypatch.setenv(key, value)
        e = TorchDistributedEnvironment()
        seen.add((e.master_addr, e.master_port, e.world_size, e.local_world_size))
        assert e.rank == rank and e.local_rank == rank % 8
    assert len(seen) == 1 and next(iter(seen))[::2] == ("gpu01", 32)  # one rendezvous for all 32 ranks
    assert next(iter(seen))[3] == 8  # ranks per node: what HSDP shards over by default

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = check_config(compose("train", overrides=[*TINY_GPT, "parallelism=auto"]))
    model = build_model(cfg.model._target_, cfg.model.kwargs)
    example = (torch.zeros(1, cfg.model.block_size, dtype=torch.long),) * 2
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=32)

    def with_budget(gb: float) -> RunConfig:
        return replace(cfg, parallelism=replace(cfg.parallelism, memory_budget_gb=gb))

    try:
        env = DistEnv(0, 32, 0, torch.device("cpu"), "auto")
        table = apply_auto(with_budget(1.0), env, model, example, LanguageModel())[1].plan.table
        assert list(table)[:3] == ["ddp", "hsdp", "fsdp"]
        cfg = with_budget(float(budget_between(table, "hsdp", "ddp").split("=")[1]))
        env, auto = apply_auto(cfg, env, model, example, LanguageModel())
        cfg = replace(cfg, parallelism=auto.parallelism)  # the decision, as the run records it
        assert auto.plan.choice.name == "hsdp" and env.strategy == cfg.parallelism.strategy == "hsdp"
        assert hsdp_shape(cfg.parallelism, 32) == (4, 8)
        mesh = build_mesh("cpu", 32, hsdp_shape(cfg.parallelism, 32))
        assert mesh.mesh_dim_names == ("replicate", "shard") and tuple(mesh.shape) == (4, 8)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# Tensor parallel on the ladder: the plan's arithmetic in-process (the tiny GPT, measured on a real example), and
# one real run that the batch forces onto TP 2.


@pytest.fixture(scope="module")
def tiny_facts() -> ModelFacts:
    import contextlib

    import torch
    from omegaconf import OmegaConf

    from trainflow.config.schema import FSDPConfig, OptimSection
    from trainflow.distributed.memory_estimate import model_facts
    from trainflow.models.gpt import GPT
    from trainflow.tasks import LanguageModel

    torch.manual_seed(0)
    model = GPT(n_layer=2, n_head=4, n_embd=64, block_size=32)
    example = (torch.randint(0, 256, (4, 32)),) * 2
    return model_facts(model, OptimSection(_target_="torch.optim.AdamW"), OmegaConf.structured(FSDPConfig), example,
                       LanguageModel(), contextlib.nullcontext())


TINY = typed_section("model", {"n_head": 4, "n_embd": 64})


def test_tp_degrees_stay_inside_a_node_and_divide_the_heads(tiny_facts: ModelFacts) -> None:
    from dataclasses import replace

    from trainflow.distributed.memory_plan import tp_degrees

    assert tp_degrees(tiny_facts, TINY, 8, 8) == (2, 4)  # 8 does not divide 4 heads
    assert tp_degrees(tiny_facts, TINY, 16, 2) == (2,)  # a node of 2 ranks: tp 2 at most
    six_heads = typed_section("model", {"n_head": 6, "n_embd": 96})
    assert tp_degrees(tiny_facts, six_heads, 12, 6) == (2, 3, 6)  # all divide 6 heads, 96
    assert tp_degrees(tiny_facts, TINY, 1, 1) == ()
    assert tp_degrees(replace(tiny_facts, tp_dims=None), TINY, 8, 8) == ()  # a model without a TP plan


def test_tp_layouts_divide_the_state_and_the_gathered_block(tiny_facts: ModelFacts) -> None:
    from trainflow.distributed.memory_estimate import estimate
    from trainflow.distributed.memory_plan import candidates

    layouts, left_out = candidates(4, 4, True, (2, 4), global_batch=16)
    checkpointed = ("", " + selective activation checkpointing", " + activation checkpointing")
    assert left_out == [] and [c.name for c in layouts] == [
        "ddp", *(f"fsdp{ac}" for ac in checkpointed), "ddp x tp 2", *(f"fsdp x tp 2{ac}" for ac in checkpointed),
        *(f"tp 4{ac}" for ac in checkpointed)]
    rows = {c.name: estimate(tiny_facts, c) for c in layouts}
    batch = {c.name: c.batch for c in layouts}
    assert batch["fsdp"] == 4 and batch["fsdp x tp 2"] == 8 and batch["tp 4"] == 16  # the global batch stays
    # FSDP 4 and FSDP 2 x TP 2 hold a quarter of the state each (TP 2 a little more: layer norms, row biases
    # replicated); TP alone has nothing to gather, FSDP x TP gathers half the block FSDP gathers
    for item in STATE:
        assert rows["fsdp x tp 2"][item] == pytest.approx(rows["fsdp"][item], rel=0.01)
        assert rows["ddp x tp 2"][item] == pytest.approx(2 * rows["fsdp x tp 2"][item], rel=0.01)
    assert rows["fsdp x tp 2"]["all_gather"] == pytest.approx(rows["fsdp"]["all_gather"] / 2, rel=0.01)
    assert rows["tp 4"]["all_gather"] == 0 and rows["ddp x tp 2"]["buckets"] == 0 < rows["ddp"]["buckets"]
    # activations: the blocks' share is divided by tp, all but the gathered inputs of qkv and the MLP's first
    # layer; outside the blocks (the logits) each TP rank holds its whole, tp times larger, micro-batch
    saved, gathered = tiny_facts.saved, tiny_facts.gathered
    assert gathered == [2 * 4 * 32 * 64 * 4] * 2  # qkv's and mlp.0's input, b x t x n_embd fp32, per block
    expected = 2 * (saved.outside + sum((b - g) / 2 + g for b, g in zip(saved.per_block, gathered, strict=True)))
    assert rows["fsdp x tp 2"]["activations"] == int(expected)


def test_tp_when_no_data_parallel_layout_fits(tiny_facts: ModelFacts) -> None:
    from trainflow.distributed.memory_estimate import GB, estimate
    from trainflow.distributed.memory_plan import candidates, decide, why_tensor_parallel

    layouts, _ = candidates(4, 4, True, (2, 4), global_batch=16)
    table = {c.name: estimate(tiny_facts, c)["total"] for c in layouts}
    leanest_dp = min(t for name, t in table.items() if "tp" not in name)
    rescue = min(t for name, t in table.items() if "tp" in name)
    assert rescue < leanest_dp  # the block and its activations, divided by tp, fit where FSDP's do not
    plan = decide(tiny_facts, layouts, (rescue + leanest_dp) // 2, "test", 4, "fp32")
    assert plan.choice.tp > 1 and plan.choice is next(c for c in layouts if table[c.name] <= plan.budget_bytes)
    reason = why_tensor_parallel(plan, [], 16, 1)
    assert reason.startswith("tensor parallel: no data-parallel layout fits: the leanest, fsdp + activation "
                             f"checkpointing, needs {leanest_dp / GB:.3g} GB per rank")


def test_refusal_with_tp_on_the_ladder_names_the_leanest(tiny_facts: ModelFacts) -> None:
    from trainflow.distributed.memory_estimate import GB, estimate
    from trainflow.distributed.memory_plan import candidates, decide
    from trainflow.errors import ConfigError

    layouts, _ = candidates(4, 4, True, (2, 4), global_batch=16)
    leanest = min(layouts, key=lambda c: estimate(tiny_facts, c)["total"])
    need = estimate(tiny_facts, leanest)["total"]
    with pytest.raises(ConfigError) as refused:
        decide(tiny_facts, layouts, int(need * 0.9), "parallelism.memory_budget_gb=x", 4, "fp32")
    assert str(refused.value).startswith(f"parallelism.memory_budget_gb: no strategy fits: the leanest, "
                                         f"{leanest.name}, needs {need / GB:.3g} GB per rank")
    assert "it would fit with" in str(refused.value)


@pytest.fixture(scope="module")
def batch_forced(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """2 ranks and parallelism.global_batch=1: one sample cannot split over 2 data-parallel ranks, so auto
    chooses TP 2 (one copy of the model over both ranks, which read the one sample together)."""
    return ok(train(tmp_path_factory.mktemp("tp") / "run", *BASE, "parallelism.memory_budget_gb=1",
                    "parallelism.global_batch=1", "trainer.excluded_steps=0"))


def test_tp_when_the_global_batch_is_smaller_than_the_world(batch_forced: Run, tmp_path: Path) -> None:
    from trainflow.report import runs as report

    parallelism = batch_forced.summary["parallelism"]
    plan = parallelism["plan"]
    checkpointed = ("", " + selective activation checkpointing", " + activation checkpointing")
    # one sample splits neither over 2 data-parallel ranks nor into PP 2's 2 pipeline micro-batches
    assert plan["choice"] == "tp 2" and plan["excluded"] == ["ddp", *(f"fsdp{ac}" for ac in checkpointed),
                                                             *(f"pp 2{ac}" for ac in checkpointed)]
    assert plan["reason"].startswith("tensor parallel: the global batch 1 x 1 accumulation step does not split")
    assert parallelism["mesh"] == {"replicate": 1, "shard": 1, "tp": 2}
    config = batch_forced.summary["config"]
    assert config["parallelism"]["tp"] == 2 and config["trainer"]["batch_size"] == 1
    assert "parallelism=auto chose tp 2 on 2 ranks: " in batch_forced.stdout
    assert "GB per rank under a budget of 1 GB" in batch_forced.stdout
    assert "(tensor parallel: the global batch 1" in batch_forced.stdout
    row, check = plan["table"]["tp 2"], plan["check"]
    # exact: rank 0's TP shards of the parameters and of AdamW's state, as the estimate has them
    assert check["params_bytes"] == row["params"] < batch_forced.summary["parameters"] * 4 * 0.75
    assert check["optimizer_bytes"] == row["optimizer"]
    assert batch_forced.summary["train_loss"]["last"] < batch_forced.summary["train_loss"]["first"] * 1.1
    report.write(batch_forced.run_dir, tmp_path)
    page = (tmp_path / "report.md").read_text()
    assert f"**tp 2 {row['total'] / 2**20:.1f}**" in page and f"; {plan['reason']}" in page


NO_TP = ["model.n_head=1", "parallelism.global_batch=2"]  # one head: no TP degree divides it


def test_pp_when_no_layout_without_it_fits(tmp_path: Path) -> None:
    """One head leaves no TP degree; 2 blocks split into PP 2's stages, each holding one block's parameters and
    the embeddings unsharded: below FSDP + activation checkpointing for this small model. A budget between the
    two takes PP, and the decision line says why."""
    table = ok(train(tmp_path / "table", *BASE, *NO_TP, "parallelism.memory_budget_gb=1")).summary
    table = table["parallelism"]["plan"]["table"]
    assert [name for name in table if "pp" in name] == [
        "pp 2", "pp 2 + selective activation checkpointing", "pp 2 + activation checkpointing"]
    run = ok(train(tmp_path / "run", *BASE, *NO_TP, budget_between(table, "pp 2", "fsdp + activation checkpointing")))
    parallelism = run.summary["parallelism"]
    assert parallelism["plan"]["choice"] == "pp 2" and parallelism["mesh"] == {"replicate": 1, "shard": 1, "pp": 2}
    assert run.summary["config"]["parallelism"]["pp"] == 2 and parallelism["pipeline"]["stages"] == 2
    need = table["pp 2"]["total"] / GB
    assert f"parallelism=auto chose pp 2 on 2 ranks: {need:.3g} GB per rank under a budget of " in run.stdout
    assert ("(pipeline parallel: no layout without it fits: the leanest, fsdp + activation checkpointing, needs "
            f"{table['fsdp + activation checkpointing']['total'] / GB:.3g} GB per rank") in run.stdout
    assert parallelism["plan"]["reason"].startswith("pipeline parallel: no layout without it fits")
