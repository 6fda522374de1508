"""trainer.precision=fp8: torchao's float8 training (its Float8Linear: the matmuls of nn.Linear layers in float8
with per-tensor or per-row scales, everything else in bf16 under autocast).

What it needs, refused in one line otherwise (before the process group forms): an NVIDIA GPU with float8 tensor
cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell) and torchao (`pip install 'trainflow[fp8]'`).
Recipes (trainer.fp8_recipe): `tensorwise` scales each tensor once and, under FSDP2, all-gathers the weights in
float8 (half the bytes of bf16); `rowwise` scales each row (finer, more robust to outliers, slower kernels, no
float8 all-gather). Layers whose dimensions are not multiples of 16 (float8 matmul kernels need them) and the
output layer (its logits are the loss's input, where float8's 3-bit mantissa costs the most) stay in bf16.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from trainflow.errors import ConfigError

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.0)


def check_fp8(device: torch.device) -> None:
    """One line when this run cannot train in float8: no GPU, an older GPU, or torchao missing."""
    cuda = device.type == "cuda"
    refusal = fp8_refusal(device.type, torch.cuda.get_device_capability(device) if cuda else None,
                          torch.cuda.get_device_name(device) if cuda else None,
                          importlib.util.find_spec("torchao") is not None)
    if refusal:
        raise ConfigError(refusal)


def fp8_refusal(device_type: str, capability: tuple[int, int] | None, device_name: str | None,
                torchao_installed: bool) -> str | None:
    """Why a run on this device cannot train in float8 (the error's text), or None when it can: a function of what
    check_fp8 reads from the machine, so that every branch is tested on any machine."""
    if device_type != "cuda" or capability is None:
        return (f"trainer.precision: fp8 runs float8 matmuls on NVIDIA GPUs of compute capability "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, Hopper: H100, H200) with torchao "
                f"(pip install 'trainflow[fp8]'), and this run is on {device_type}; use "
                "trainer.precision=bf16 or fp32")
    if tuple(capability) < MIN_CAPABILITY:
        return (f"trainer.precision: fp8 needs float8 tensor cores (compute capability "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer: Ada, Hopper), and "
                f"{device_name} is {capability[0]}.{capability[1]}; use trainer.precision=bf16")
    if not torchao_installed:
        return ("trainer.precision: fp8 trains with torchao's float8 layers, and torchao is not "
                "installed: pip install 'trainflow[fp8]' (a torchao built for this torch), or use "
                "trainer.precision=bf16")
    return None


def _float8_friendly(module: nn.Module, fqn: str) -> bool:
    """Linear layers whose both dimensions are multiples of 16, except the output layer (`head`, `lm_head`)."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] in ("head", "lm_head", "output"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_float8(model: nn.Module, recipe: str, sharded: bool) -> int:
    """Swap the model's float8-friendly nn.Linear layers for torchao's Float8Linear, in place; returns how many.
    `sharded`: FSDP2 wraps the model next, and tensorwise scaling all-gathers its weights in float8."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # lazy: torchao is the fp8 extra

    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise" and sharded:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=config, module_filter_fn=_float8_friendly)
    after = sum(type(m) is nn.Linear for m in model.modules())
    return before - after
