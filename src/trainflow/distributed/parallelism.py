"""Wrapping the model for its strategy: activation checkpointing, then DDP, or FSDP2 (HSDP on a 2-D mesh).

Order of model assembly (run.py): pipeline stages over the mesh's pp dimension (trainflow.distributed.pipeline:
each stage is wrapped on its own by what follows) -> tensor parallel over the mesh's tp dimension
(trainflow.distributed.tensor) -> activation checkpointing -> DDP, or FSDP2 `fully_shard` on each block of
`model.blocks` then on the root (one device mesh: 1-D for FSDP, replicate x shard for HSDP and for DDP under TP
or PP, see trainflow.distributed.mesh) -> compile -> optimizer. `parallelism=auto` picks one of these before
(trainflow.distributed.memory_plan). The optimizer must see the final (sharded) parameters.

Activation checkpointing (parallelism.activation_checkpointing): `full` recomputes a block's whole forward in
backward; `selective` keeps the outputs of the matmuls and attention (the compute-intensive ops, as torch's own
partitioner lists them) and recomputes the rest (norms, activations, dropout, views: cheap, and most of the
bytes after the matmuls); both on every `activation_checkpointing_every`-th block. `budget` is compile's: the
partitioner of the compiled graph keeps the activations that fit `activation_budget` of what it would save and
recomputes the cheapest of the rest (torch._functorch.config.activation_memory_budget).

Per-block compile and FSDP2: compile each block *in place* (`block.compile()`) after `fully_shard`, i.e. in
run.py's order (parallelize, then compile). Measured with torch 2.13 on CPU (2 gloo ranks, GPT blocks,
backends aot_eager and inductor): in-place compile after `fully_shard` and before it both train like eager
FSDP (largest per-tensor relative difference from one eager process after 3 AdamW steps: 1.0e-4 for eager
FSDP and aot_eager, 2.6e-4 for inductor; 0 graph breaks; one graph shared by all blocks). Replacing a
block by the `torch.compile(block)` wrapper trains as well but renames every parameter
(`blocks.0._orig_mod.`), which checkpoints see: do not. Whole-model compile on top of FSDP2 cannot trace
into the sharded blocks (the compile stage warns and compiles the blocks instead).

Gradient accumulation: `no_grad_sync(model, sync=False)` skips the all-reduce (DDP `no_sync`) or the
reduce-scatter (FSDP2 `set_requires_gradient_sync(False)`) on all but the last micro-step.

Loss parallel: where the model's output stays split by vocabulary (GPT's TP plan), `loss_context(model)` is the
context the train step, evaluation and the compile check compute the loss (and its backward) in, and
`local_loss` the plain tensor made of the replicated DTensor loss for what follows.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._functorch.config
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trainflow.config.schema import FSDPConfig, ParallelismConfig
from trainflow.distributed.mesh import MeshLayout, build_mesh, data_parallel_mesh, layout, mesh_for
from trainflow.distributed.pipeline import ZERO_BUBBLE, split_model
from trainflow.distributed.process_group import DistEnv
from trainflow.distributed.tensor import apply_tensor_parallel
from trainflow.errors import ConfigError
from trainflow.models import model_blocks
from trainflow.util.float8 import convert_to_float8

log = logging.getLogger(__name__)


_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parallelize(model: nn.Module, cfg: ParallelismConfig, env: DistEnv,
                precision: str = "fp32", fp8_recipe: str = "tensorwise") -> nn.Module:
    """Pipeline stages, tensor parallel, float8 layers, activation checkpointing, then DDP or FSDP2 for the chosen
    strategy; one process trains the model as is (float8 layers and checkpointing aside)."""
    if not env.distributed:
        _float8(model, precision, fp8_recipe, sharded=False)
        checkpoint_activations(model, cfg)
        return model
    found = layout(cfg, env.world_size)
    mesh = mesh_for(found, env.device.type)
    if found.pp > 1:
        if found.tp > 1:
            raise ConfigError(f"parallelism.pp: {found.pp} stages with parallelism.tp={found.tp} fail in torch 2.13 "
                              "on the first step (the stages' sequence-parallel activations arrive in another size "
                              "than the schedule's shape inference expects: gloo 'Received data size doesn't match "
                              "expected size, 16384 vs 8192'); use parallelism.tp=1 with pp, or pp=1 with tp")
        if found.dp_size > 1 and cfg.pp_schedule in ZERO_BUBBLE:
            raise ConfigError(f"parallelism.pp_schedule: {cfg.pp_schedule} with {found.dp_size} data-parallel "
                              "ranks leaves the last stage's weight gradients unset in torch 2.13 (None after "
                              "the step: its split backward and FSDP2 miss each other); use 1f1b or "
                              "interleaved_1f1b, or "
                              f"parallelism.nproc_per_node={found.pp} (the pipeline alone)")
        return split_model(model, found.pp, cfg.pp_schedule, mesh,
                           lambda part: _wrap(part, cfg, env, precision, fp8_recipe, found, mesh))
    return _wrap(model, cfg, env, precision, fp8_recipe, found, mesh)


def _float8(model: nn.Module, precision: str, recipe: str, sharded: bool) -> None:
    """trainer.precision=fp8: torchao's float8 layers in place of the nn.Linear ones (trainflow.util.float8)."""
    if precision != "fp8":
        return
    swapped = convert_to_float8(model, recipe, sharded)
    log.info("fp8: %d linear layers train in float8 (%s scaling%s)", swapped, recipe,
             ", float8 all-gather" * (sharded and recipe == "tensorwise"))


def _wrap(model: nn.Module, cfg: ParallelismConfig, env: DistEnv, precision: str, recipe: str,
          found: MeshLayout, mesh: DeviceMesh) -> nn.Module:
    """The model (or one pipeline stage) split by TP, its linear layers in float8 (trainer.precision=fp8 with
    trainer.fp8_recipe), checkpointed, then wrapped for data parallel."""
    if found.tp > 1:
        total = sum(p.numel() for p in model.parameters())
        apply_tensor_parallel(model, mesh["tp"], cfg.tp_plan)
        if env.is_main:
            local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
            log.info("tensor parallel over %d ranks: rank 0 holds %d of the %d parameters%s", found.tp, local, total,
                     "; loss parallel: the logits stay split by vocabulary" * model.vocab_parallel_output)
    _float8(model, precision, recipe, sharded=found.dp_size > 1)
    checkpoint_activations(model, cfg)
    if found.dp_size == 1 and (found.tp > 1 or found.pp > 1):  # one copy spans the world: nothing to replicate
        return model
    if found.sharded or found.tp > 1 or found.pp > 1:  # DDP under TP or PP: FSDP2 over shard groups of one rank
        return shard(model, cfg.fsdp, env, precision, data_parallel_mesh(mesh))
    d = cfg.ddp
    return DistributedDataParallel(
        model, device_ids=[env.device.index] if env.device.type == "cuda" else None, bucket_cap_mb=d.bucket_cap_mb,
        find_unused_parameters=d.find_unused_parameters, static_graph=d.static_graph,
        gradient_as_bucket_view=d.gradient_as_bucket_view,
    )


def _checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(type(module).forward, module, *args, use_reentrant=False, **kwargs)


def _selectively_checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(type(module).forward, module, *args, use_reentrant=False, context_fn=selective_context,
                      **kwargs)


def saved_ops() -> set[Any]:
    """The ops whose outputs selective checkpointing keeps: the compute-intensive ones of torch's partitioner
    (matmuls, convolutions) and every scaled-dot-product attention kernel."""
    # lazy: torch._functorch.partitioners costs ~0.9 s at start; only selective checkpointing needs it
    from torch._functorch.partitioners import get_default_op_list

    ops = {op.default for op in get_default_op_list().compute_intensive_ops if hasattr(op, "default")}
    aten = torch.ops.aten
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_attention_math", "linear"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    return ops


def selective_context() -> Any:
    """The contexts of a selectively checkpointed forward: the saved ops' outputs kept, everything else
    recomputed in backward."""
    keep = saved_ops()

    def policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_activations(model: nn.Module, cfg: ParallelismConfig) -> None:
    """Activation checkpointing as parallelism.activation_checkpointing says (names and state dicts unchanged)."""
    mode = cfg.activation_checkpointing
    if mode == "budget":
        torch._functorch.config.activation_memory_budget = cfg.activation_budget
    if mode in ("full", "selective"):
        checkpoint_blocks(model, mode == "selective", cfg.activation_checkpointing_every)


def checkpoint_blocks(model: nn.Module, selective: bool = False, every: int = 1) -> None:
    """Recompute every `every`-th block's activations in backward instead of keeping them (all of them, or
    `selective`: those selective_context does not keep); a block is counted by its number in model.blocks."""
    blocks = model_blocks(model)
    mode = "selective" if selective else "full"
    if blocks is None:
        raise ConfigError(f"parallelism.activation_checkpointing: {mode} recomputes each module of model.blocks, and "
                          f"{type(model).__name__} has no `blocks` list; set it to off")
    forward = _selectively_checkpointed_forward if selective else _checkpointed_forward
    for number, block in blocks.named_children():
        if int(number) % every == 0:
            block.forward = functools.partial(forward, block)


def shard_units(model: nn.Module, wrap: str, min_params: int) -> list[nn.Module]:
    """The submodules that get their own `fully_shard`, children before parents (the root comes last, apart)."""
    blocks = model_blocks(model)
    if wrap == "blocks" and blocks is None:
        raise ConfigError(f"parallelism.fsdp.wrap: blocks shards each module of model.blocks, and "
                          f"{type(model).__name__} has none; use parallelism.fsdp.wrap=size (or auto)")
    if wrap != "size" and blocks is not None:
        return list(blocks)
    # By size: a module whose parameters (not already in a smaller unit) reach min_params becomes a unit, unless
    # one of its parameters is shared with a module outside it (tied weights stay with the root).
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(id(module))
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        pending = sum(visit(child) for child in module.children())
        pending += sum(p.numel() for p in module.parameters(recurse=False))
        inside = {id(m) for m in module.modules()}
        self_contained = all(owners[id(p)] <= inside for p in module.parameters())
        if module is not model and pending >= min_params and self_contained:
            units.append(module)
            return 0
        return pending

    visit(model)
    return units


def fsdp_dtypes(param_dtype: str | None, reduce_dtype: str | None, precision: str) -> tuple[str | None, str | None]:
    """FSDP2's (param, reduce) dtypes: what the user set, else bf16 parameters under bf16 autocast (gathering fp32
    would move twice the bytes for matmuls that run in bf16 anyway) and an fp32 reduce-scatter (summing bf16
    gradients over many ranks loses precision)."""
    param = param_dtype or ("bf16" if precision in ("bf16", "fp8") else None)
    reduce = reduce_dtype or ("fp32" if param not in (None, "fp32") else None)
    return param, reduce


def shard(model: nn.Module, cfg: FSDPConfig, env: DistEnv, precision: str = "fp32",
          mesh: DeviceMesh | None = None) -> nn.Module:
    """FSDP2: `fully_shard` each unit (blocks, or modules by size), then the root, over one device mesh (FSDP: one
    dimension; HSDP: replicate x shard)."""
    param_dtype, reduce_dtype = fsdp_dtypes(cfg.param_dtype, cfg.reduce_dtype, precision)
    mesh = data_parallel_mesh(mesh or build_mesh(env.device.type, env.world_size))
    options = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype]),
        "offload_policy": CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy(),
    }
    units = shard_units(model, cfg.wrap, cfg.min_params)
    for unit in units:
        fully_shard(unit, reshard_after_forward=cfg.reshard_after_forward, **options)
    # The root's reshard_after_forward is left to FSDP (kept gathered: backward needs it first); passing True
    # would cost an all-gather at the start of every backward.
    fully_shard(model, **options)
    if env.is_main:
        log.info("%s: %d shard units + root over %d ranks (mesh %s)", env.strategy, len(units), mesh.size(),
                 " x ".join(f"{size} {name}" for name, size in zip(mesh.mesh_dim_names, mesh.shape, strict=True)))
    return model


def is_parallelized(model: nn.Module) -> bool:
    """Whether parallelize() has wrapped (DDP) or sharded (FSDP2) the model already."""
    return unwrap(model) is not model or isinstance(model, FSDPModule)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under any compile / DDP wrappers (FSDP2 shards in place: nothing to peel)."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def no_grad_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce / reduce-scatter on micro-steps that are not the last of an accumulation."""
    if sync:
        return contextlib.nullcontext()
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):  # under torch.compile's wrapper
        model = model._orig_mod
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        return _fsdp_no_sync(model)
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


def full_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of every parameter; FSDP2 shards are gathered (a collective: call on every rank)."""
    for name, param in unwrap(model).named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        yield name, full.detach()


def loss_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """torch's `loss_parallel()` for a model whose output stays split by vocabulary (trainflow's GPT under TP): the
    task's cross-entropy runs on the shards, no rank gathers the whole logits; the loss's backward must run inside
    it too. Nothing for any other model."""
    return loss_context_of(model)()


def loss_context_of(model: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """What makes `loss_context(model)`, decided once: the training step enters it every micro-step, and asking
    the model each time costs a few microseconds."""
    if not getattr(unwrap(model), "vocab_parallel_output", False):
        return contextlib.nullcontext
    return loss_parallel


def local_loss(loss: Any) -> Any:
    """The loss as a plain tensor (under loss parallel it is a replicated DTensor), for the collectives and logs
    after it; gradients flow through."""
    return loss.to_local() if hasattr(loss, "to_local") else loss
