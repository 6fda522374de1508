"""Tensor parallel: each layer split over the ranks of the mesh's tp dimension, by the model's own plan.

A plan maps module names (fnmatch patterns such as `blocks.*.attn.qkv`) to torch's ParallelStyles, which
`torch.distributed.tensor.parallel.parallelize_module` applies: parameters become DTensors sharded over the TP
group, and each module's inputs and outputs are redistributed as the style says. Where the plan comes from, in
order: `parallelism.tp_plan._target_` (called with the model), the model's `tp_plan` (a dict, or a method
returning one: trainflow's GPT has one; a transformers model's whole plan, style names such as "colwise"), its
config's `base_model_tp_plan` (applied under its base model). Parameters tied to each other (GPT's embedding
and output layer) are tied again afterwards: each module's style distributes its own copy.
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any

import torch.distributed.tensor.parallel as styles
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from trainflow.errors import ConfigError
from trainflow.util.targets import call_target

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Hugging Face's plan entries (transformers' tensor-parallel style names) as torch styles
_HF_STYLES = {
    "colwise": lambda t, r: t.ColwiseParallel(),
    "rowwise": lambda t, r: t.RowwiseParallel(),
    "colwise_rep": lambda t, r: t.ColwiseParallel(output_layouts=r()),
    "colwise_gather_output": lambda t, r: t.ColwiseParallel(output_layouts=r()),
    "rowwise_rep": lambda t, r: t.RowwiseParallel(input_layouts=r()),
    "embedding_rowwise": lambda t, r: t.RowwiseParallel(input_layouts=r()),
    "sequence_parallel": lambda t, r: t.SequenceParallel(),
}


def as_styles(model: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """`plan` with transformers' style names (a Hugging Face model's `tp_plan`) replaced by torch's styles."""
    named = {name: style for name, style in plan.items() if isinstance(style, str)}
    if not named:
        return plan
    unknown = sorted(set(named.values()) - set(_HF_STYLES))
    if unknown:
        raise ConfigError(f"parallelism.tp: {type(model).__name__}'s TP plan uses {', '.join(unknown)}, which "
                          f"trainflow does not translate (it knows {', '.join(_HF_STYLES)}); give a plan of torch "
                          "ParallelStyles by parallelism.tp_plan._target_")
    return {name: _HF_STYLES[style](styles, Replicate) if isinstance(style, str) else style
            for name, style in plan.items()}


def hf_base_plan(model: nn.Module) -> dict[str, Any] | None:
    """A transformers model's config's `base_model_tp_plan`, on this model's names (under its base model)."""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not plan:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    return {prefix + name: style for name, style in plan.items()}


def tp_plan(model: nn.Module, target: Any, tp: int) -> dict[str, Any]:
    """The model's plan, from the first of: parallelism.tp_plan._target_, a `tp_plan`, a Hugging Face plan."""
    if target is not None and target.get("_target_"):
        kwargs = {k: v for k, v in target.items() if k != "_target_"}
        return call_target("parallelism.tp_plan", target["_target_"], {"model": model, **kwargs}, "a TP plan")
    own = getattr(model, "tp_plan", None)  # trainflow's GPT: a method; a transformers model: a property
    plan = (own() if callable(own) else dict(own)) if own else hf_base_plan(model)
    if not plan:
        raise ConfigError(f"parallelism.tp: {tp} splits each layer by the model's plan, and {type(model).__name__} "
                          "has none; give the model a `tp_plan` ({module name: ParallelStyle}), set "
                          "parallelism.tp_plan._target_ to a function of the model returning one, or set "
                          "parallelism.tp=1")
    return as_styles(model, plan)


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, target: Any = None) -> nn.Module:
    """Split `model` in place over the 1-D TP `mesh` by its plan; tied parameters stay tied."""
    plan = tp_plan(model, target, mesh.size())
    tied: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    parallelize_module(model, mesh, plan)
    model.vocab_parallel_output = any(_leaves_output_split(style) for style in plan.values())
    for names in tied.values():
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
    return model


def styled_modules(model: nn.Module, plan: dict[str, Any]) -> list[tuple[nn.Module, Any]]:
    """Each module a plan entry reaches and its style, matched as parallelize_module matches (fnmatch per name
    part), in the plan's order."""
    found = []
    for pattern, style in plan.items():
        parts = pattern.split(".") if pattern else []
        for name, module in model.named_modules():
            atoms = name.split(".") if name else []
            if len(atoms) == len(parts) and all(fnmatch(a, p) for a, p in zip(atoms, parts, strict=True)):
                found.append((module, style))
    return found


def shard_dims(model: nn.Module, plan: dict[str, Any]) -> list[int | None]:
    """The dimension tensor parallel splits each of `model.parameters()` along (None: replicated), as the plan's
    torch styles place them: column-wise, a Linear's weight and bias by rows (its outputs), an Embedding's weight
    by columns; row-wise, a Linear's weight by columns (its inputs, its bias replicated), an Embedding's by rows
    (the vocabulary). Any other style is counted as replicating its module's parameters (an over-estimate).
    What the memory plan (parallelism=auto) sizes TP layouts with, before any mesh exists."""
    dims: dict[int, int | None] = {}
    for module, style in styled_modules(model, as_styles(model, plan)):
        embedding = isinstance(module, nn.Embedding)
        for name, param in module.named_parameters(recurse=False):
            if isinstance(style, ColwiseParallel):
                dim = 1 if embedding else 0
            elif isinstance(style, RowwiseParallel):
                dim = 0 if embedding else (1 if name == "weight" else None)
            else:
                dim = None
            dims.setdefault(id(param), dim)  # a tied parameter: its first module's split (tied ones agree)
    return [dims.get(id(p)) for p in model.parameters()]


def gathered_inputs(model: nn.Module, plan: dict[str, Any]) -> list[nn.Module]:
    """The column-wise Linear modules: under sequence parallel their input is all-gathered whole (and saved so
    for backward) on every TP rank, the part of a block's activations tensor parallel does not split."""
    return [m for m, style in styled_modules(model, as_styles(model, plan))
            if isinstance(style, ColwiseParallel) and isinstance(m, nn.Linear)]


def _leaves_output_split(style: Any) -> bool:
    """A column-wise style that keeps its output a DTensor split over the last dimension (the logits by vocabulary)."""
    return isinstance(style, ColwiseParallel) and not style.use_local_output and \
        tuple(style.output_layouts) in ((Shard(-1),), (Shard(2),))

