"""Tensor parallel (parallelism.tp) on gloo CPU ranks: TP 2, FSDP 2 x TP 2 and DDP 2 x TP 2 train like one
process (the parity check: parameters after 3 SGD steps within 1e-5 relative, fp32), the gradient norm is the
whole model's, and checkpoints reshard between the layouts (FSDP 2 x TP 2 -> one process -> TP 2) with the
resumed losses equal to the uninterrupted run's within fp32 tolerance.

Every run keeps the global batch at 8 samples (parallelism.global_batch), so all layouts consume the same global
sample stream: a TP group reads one batch, the data-parallel ranks split it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.checkpoints import assert_close_losses, assert_parity_checked
from helpers.runs import TINY_GPT, Run, logged_by_step, losses_by_step, ok, train

from trainflow.conf import CONFIG_DIR

BASE = [*TINY_GPT, "optim=sgd", "trainer.grad_accum=2", "parallelism.global_batch=8", "trainer.max_steps=4",
        "trainer.eval_every=0", "trainer.eval_steps=1", "checkpoint=dcp", "checkpoint.every_steps=2"]
CHECKED = ["parallelism.check=true", "parallelism.check_steps=3", "parallelism.check_tolerance=1e-5"]
FSDP2_TP2 = ["parallelism=fsdp", "parallelism.tp=2", "parallelism.nproc_per_node=4", "trainer.grad_clip=0.5"]
TP2 = ["parallelism=fsdp", "parallelism.tp=2", "parallelism.nproc_per_node=2"]


GRAD_NORM = "train/grad_norm"


def step_dir(run: Run, step: int) -> Path:
    return run.run_dir / "checkpoints" / f"step_{step:08d}"


def expected_rank0_parameters(tp: int) -> tuple[int, int]:
    """TINY_GPT's parameters, and rank 0's share under GPT.tp_plan: layer norms and the row-wise layers' biases
    are replicated, every other parameter is split in tp equal parts (the tied embedding counted once)."""
    from trainflow.models.gpt import GPT

    model = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
    replicated = re.compile(r".*(ln1|ln2|ln_f)\.(weight|bias)$|.*(attn\.proj|mlp\.2)\.bias$")
    total = local = 0
    for name, param in model.named_parameters():
        total += param.numel()
        local += param.numel() if replicated.match(name) else param.numel() // tp
    return local, total


def assert_checked(run: Run, layout: str, mesh: dict[str, int]) -> None:
    assert_parity_checked(run, layout, mesh)
    local, total = expected_rank0_parameters(mesh["tp"])
    assert f"tensor parallel over {mesh['tp']} ranks: rank 0 holds {local} of the {total} parameters" in run.stdout


def test_tp2_on_two_ranks_matches_one_process(tmp_path: Path) -> None:
    no_checkpoints = [a for a in BASE if not a.startswith("checkpoint")]  # a checkpoint key alone is refused
    run = ok(train(tmp_path / "run", *no_checkpoints, *TP2, *CHECKED, "trainer.max_steps=3", "checkpoint=off"))
    assert_checked(run, "tp 2", {"replicate": 1, "shard": 1, "tp": 2})
    assert run.summary["parallelism"]["global_batch"] == 8 and run.summary["parallelism"]["per_rank_batch"] == 4
    # GPT's plan keeps the logits split by vocabulary; the loss and its backward run under loss_parallel()
    assert "of the 118528 parameters; loss parallel: the logits stay split by vocabulary" in run.stdout


@pytest.fixture(scope="module")
def fsdp_tp(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The reference: FSDP 2 x TP 2 on 4 ranks, 4 uninterrupted steps with the parity check, saves at 2 and 4."""
    return ok(train(tmp_path_factory.mktemp("fsdp_tp") / "run", *BASE, *FSDP2_TP2, *CHECKED))


@pytest.fixture(scope="module")
def single_from_fsdp_tp(fsdp_tp: Run, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """FSDP 2 x TP 2's step 2 resumed in one process (saved at 3 and 4; the same max_steps: the schedule's)."""
    return ok(train(tmp_path_factory.mktemp("single") / "run", *BASE, "trainer.grad_clip=0.5",
                    "checkpoint.every_steps=1", f"checkpoint.resume={step_dir(fsdp_tp, 2)}"))


def test_fsdp2_x_tp2_matches_one_process(fsdp_tp: Run) -> None:
    assert_checked(fsdp_tp, "fsdp x tp 2", {"replicate": 1, "shard": 2, "tp": 2})
    assert "fsdp: 2 shard units + root over 2 ranks (mesh 2 shard)" in fsdp_tp.stdout


def test_gradient_norm_is_the_whole_models(fsdp_tp: Run, single_from_fsdp_tp: Run) -> None:
    """Clipped at 0.5 (every step's norm is above it): a norm over one shard would clip by another factor."""
    sharded, whole = logged_by_step(fsdp_tp.run_dir, GRAD_NORM), logged_by_step(single_from_fsdp_tp.run_dir, GRAD_NORM)
    assert min(sharded.values()) > 0.5
    assert [sharded[s] for s in (3, 4)] == pytest.approx([whole[s] for s in (3, 4)], rel=1e-5)


def test_checkpoint_reshards_fsdp_tp_to_one_process_to_tp(fsdp_tp: Run, single_from_fsdp_tp: Run,
                                                          tmp_path: Path) -> None:
    reference = losses_by_step(fsdp_tp.run_dir)
    assert single_from_fsdp_tp.summary["resumed_from_step"] == 2
    assert_close_losses(losses_by_step(single_from_fsdp_tp.run_dir), reference, range(3, 5))
    manifest = json.loads((step_dir(single_from_fsdp_tp, 3) / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and manifest["samples_seen"] == 3 * 8  # the data position, global
    tp = ok(train(tmp_path / "run", *BASE, *TP2, "trainer.grad_clip=0.5",
                  f"checkpoint.resume={step_dir(single_from_fsdp_tp, 3)}"))
    assert tp.summary["resumed_from_step"] == 3 and tp.summary["parallelism"]["layout"] == "tp 2"
    assert_close_losses(losses_by_step(tp.run_dir), reference, range(4, 5))


def test_export_gathers_the_tp_shards(fsdp_tp: Run, single_from_fsdp_tp: Run, tmp_path: Path) -> None:
    """An FSDP 2 x TP 2 checkpoint exports whole tensors that load into the plain GPT, equal to the one-process
    run's weights of the same step within fp32 rounding."""
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from trainflow.checkpoint import export_weights
    from trainflow.util.tolerance import relative_error

    export_weights(step_dir(fsdp_tp, 4), tmp_path / "tp.pt")
    export_weights(step_dir(single_from_fsdp_tp, 4), tmp_path / "single.pt")
    sharded, whole = (torch.load(tmp_path / name, weights_only=True) for name in ("tp.pt", "single.pt"))
    model = instantiate(OmegaConf.create(fsdp_tp.summary["config"]["model"]))
    model.load_state_dict(sharded)  # strict: every tensor whole, the names the plain model's
    assert sharded.keys() == whole.keys()
    assert max(relative_error(sharded[k].double(), whole[k].double()) for k in whole) < 1e-5


LLAMA = ["model=custom", "model._target_=test_tensor_parallel.tiny_llama", "+model.vocab_size=256",
         "+model.hidden_size=64", "+model.intermediate_size=128", "+model.num_hidden_layers=2",
         "+model.num_attention_heads=4", "+model.num_key_value_heads=2", "+model.max_position_embeddings=64",
         "data=text", "data.seq_len=32"]


def test_hugging_face_llama_under_tp2_by_its_own_plan(tmp_path: Path) -> None:
    """transformers' plan splits attention and MLP, and leaves the norms whole: the gradient norm (clipped at 0.5)
    spans DTensors and plain tensors, and the run still matches one process."""
    run = ok(train(tmp_path / "run", *TINY_GPT, *LLAMA, "optim=sgd", "trainer.max_steps=3", "trainer.eval_every=0",
                   "trainer.grad_clip=0.5", *TP2, *CHECKED, env={"PYTHONPATH": str(Path(__file__).parent)}))
    check = run.summary["parallelism"]["check"]
    assert check["passed"] and check["param_rel_diff"] <= 1e-5, check
    assert min(logged_by_step(run.run_dir, GRAD_NORM).values()) > 0.5  # clipping acted on every step
    config = {a[len("+model."):].split("=")[0]: int(a.split("=")[1]) for a in LLAMA if a.startswith("+model.")}
    named = dict(tiny_llama(**config).named_parameters())
    whole = sum(p.numel() for name, p in named.items() if "norm" in name)  # the plan leaves the RMSNorms whole
    total = sum(p.numel() for p in named.values())
    assert f"rank 0 holds {(total - whole) // 2 + whole} of the {total} parameters" in run.stdout


@pytest.mark.slow
def test_ddp2_x_tp2_matches_one_process(tmp_path: Path) -> None:
    run = ok(train(tmp_path / "run", *BASE, "parallelism=ddp", "parallelism.tp=2", "parallelism.nproc_per_node=4",
                   *CHECKED, "trainer.max_steps=3", "checkpoint=off"))
    assert_checked(run, "ddp x tp 2", {"replicate": 2, "tp": 2})


@pytest.mark.slow
def test_hsdp2x2_x_tp2_matches_one_process(tmp_path: Path) -> None:
    """8 ranks on 2 cores: slow."""
    run = ok(train(tmp_path / "run", *BASE, "parallelism=hsdp", "parallelism.tp=2", "parallelism.nproc_per_node=8",
                   "parallelism.hsdp.shard_size=2", *CHECKED, "trainer.max_steps=3", "checkpoint=off"))
    assert_checked(run, "hsdp x tp 2", {"replicate": 2, "shard": 2, "tp": 2})


@pytest.mark.parametrize(("overrides", "world", "per_node", "expected"), [
    (["parallelism=fsdp", "parallelism.tp=2"], 4, 4, ("fsdp x tp 2", 1, 2, 2)),
    (["parallelism=ddp", "parallelism.tp=2"], 4, 4, ("ddp x tp 2", 2, 1, 2)),
    (["parallelism=hsdp", "parallelism.tp=2"], 8, 4, ("hsdp x tp 2", 2, 2, 2)),  # shard: a node's 2 TP groups
    (["parallelism=fsdp", "parallelism.tp=8"], 32, 8, ("fsdp x tp 8", 1, 4, 8)),  # 4 nodes x 8 GPUs, TP per node
    (["parallelism=hsdp", "parallelism.tp=8"], 32, 8, ("hsdp x tp 8", 4, 1, 8)),
    (["parallelism=fsdp", "parallelism.tp=-1", "parallelism.dp_shard=2"], 8, 8, ("fsdp x tp 4", 1, 2, 4)),
    (["parallelism=hsdp", "parallelism.dp_replicate=2", "parallelism.dp_shard=-1"], 8, 8, ("hsdp", 2, 4, 1)),
    (["parallelism=fsdp"], 4, 4, ("fsdp", 1, 4, 1)),  # the presets as before
    (["parallelism=ddp"], 4, 4, ("ddp", 4, 1, 1)),
])
def test_degrees_on_one_mesh(overrides: list[str], world: int, per_node: int,
                             expected: tuple[str, int, int, int]) -> None:
    """The presets and the degrees give the mesh each layout needs; TP is the last dimension, within a node."""
    from hydra import compose, initialize_config_dir

    from trainflow.config.schema import register_configs
    from trainflow.distributed.mesh import layout

    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=[*TINY_GPT, *overrides])
    found = layout(cfg.parallelism, world, per_node)
    assert (found.name, found.replicate, found.shard, found.tp) == expected
    assert found.world_size == world


def tiny_llama(**config: int) -> object:
    """A transformers Llama of the given LlamaConfig keys, returning logits (the lm task's contract); its config
    declares `base_model_tp_plan`, which trainflow applies."""
    import transformers

    class LlamaLogits(transformers.LlamaForCausalLM):
        def forward(self, idx):  # noqa: ANN001, ANN202 - transformers' own types
            return super().forward(input_ids=idx, use_cache=False).logits

    return LlamaLogits(transformers.LlamaConfig(**config))


def test_slurm_dry_run_of_4_nodes_x_8_gpus_with_tp8_keeps_tp_in_a_node(tmp_path: Path) -> None:
    """One srun step of 32 tasks; their mesh (rank 0's view, on a fake process group of 32) puts each TP group of 8
    on one node's consecutive ranks and shards FSDP over the 4 nodes."""
    import torch.distributed as dist
    from helpers.slurm import SLURM, multirun
    from hydra import compose, initialize_config_dir
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainflow.config.schema import register_configs
    from trainflow.distributed.mesh import layout, mesh_for

    overrides = ["parallelism=fsdp", "parallelism.tp=8", "model.n_head=8"]
    proc = multirun(tmp_path, *SLURM, "hydra.launcher.nodes=4",
                    "hydra.launcher.gpus_per_node=8", "hydra.launcher.dry_run=true", *overrides, timeout=60)
    assert proc.returncode == 0, proc.stderr
    script = (tmp_path / "dry_run.sbatch").read_text().splitlines()
    assert {"#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8"} <= set(script)
    assert len([line for line in script if line.startswith("srun ")]) == 1
    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=overrides)
    found = layout(cfg.parallelism, 32, 8)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=32)
    try:
        mesh = mesh_for(found, "cpu")
        assert mesh.mesh_dim_names == ("replicate", "shard", "tp") and tuple(mesh.shape) == (1, 4, 8)
        assert mesh["tp"].mesh.tolist() == list(range(8)) and mesh["shard"].mesh.tolist() == [0, 8, 16, 24]
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_checkpoint_reshards_fsdp_tp_to_fsdp4_to_hsdp_x_tp(fsdp_tp: Run, tmp_path: Path) -> None:
    """The rest of the chain: FSDP 2 x TP 2 -> FSDP 4 -> HSDP 2 x 2 x TP 2 (8 ranks)."""
    reference = losses_by_step(fsdp_tp.run_dir)
    fsdp4 = ok(train(tmp_path / "fsdp4", *BASE, "parallelism=fsdp", "parallelism.nproc_per_node=4",
                     "trainer.grad_clip=0.5", "checkpoint.every_steps=1", f"checkpoint.resume={step_dir(fsdp_tp, 2)}"))
    assert_close_losses(losses_by_step(fsdp4.run_dir), reference, range(3, 5))
    hsdp = ok(train(tmp_path / "hsdp", *BASE, "parallelism=hsdp", "parallelism.tp=2", "parallelism.nproc_per_node=8",
                    "parallelism.hsdp.shard_size=2", "trainer.grad_clip=0.5",
                    f"checkpoint.resume={step_dir(fsdp4, 3)}"))
    assert hsdp.summary["parallelism"]["mesh"] == {"replicate": 2, "shard": 2, "tp": 2}
    assert_close_losses(losses_by_step(hsdp.run_dir), reference, range(4, 5))
