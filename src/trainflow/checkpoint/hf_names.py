"""trainflow's GPT (models/gpt.py) as a Hugging Face GPT-2: the config fields that match and the tensor names.

GPT-2 keeps its linear layers as Conv1D, whose weights are stored (in, out): the transpose of nn.Linear's. Its
output layer is tied to the token embedding (not stored). GPT-2 always has biases: a GPT without them
(`bias=false`) maps to zero biases, which compute the same. Dropout maps to GPT-2's three rates; GPT-2 also
drops after the attention projection, which only training sees. The GPT's qkv outputs run head by head ([q k v]
of head 0, then of head 1: the order tensor parallelism splits by whole heads); GPT-2's c_attn holds q of every
head, then k, then v: the rows are reordered both ways.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from trainflow.errors import CheckpointError
from trainflow.models.gpt import GPT

GPT_TARGET = "trainflow.models.gpt.GPT"
HF_TARGET = "trainflow.models.hf.gpt2"
TIED = "head.weight"  # GPT-2's lm_head is tied to transformer.wte: not stored

_TOP = {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight",
        "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"}
_BLOCK = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.0": "mlp.c_fc",
          "mlp.2": "mlp.c_proj"}
_CONV1D = ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")
_IN_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)")
_QKV = re.compile(r"blocks\.\d+\.attn\.qkv\.(weight|bias)")


def hf_name(name: str) -> tuple[str, bool] | None:
    """(GPT-2's name for a GPT tensor, whether it is transposed); None for a tensor GPT-2 has no place for."""
    if name in _TOP:
        return _TOP[name], False
    match = _IN_BLOCK.fullmatch(name)
    if match is None or match.group(2) not in _BLOCK:
        return None
    layer, module, kind = match.groups()
    return f"transformer.h.{layer}.{_BLOCK[module]}.{kind}", kind == "weight" and module in _CONV1D


def gpt_names(hf_names: list[str]) -> dict[str, tuple[str, bool]]:
    """The inverse: GPT name -> (GPT-2 name, transposed), for the GPT-2 tensors named."""
    present = set(hf_names)
    out = {}
    for name in hf_names:
        match = re.fullmatch(r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)", name)
        inverse = {v: k for k, v in _TOP.items()}
        if name in inverse:
            out[inverse[name]] = (name, False)
        elif match and (module := next((k for k, v in _BLOCK.items() if v == match.group(2)), None)):
            out[f"blocks.{match.group(1)}.{module}.{match.group(3)}"] = (name, match.group(3) == "weight"
                                                                         and module in _CONV1D)
    if "transformer.wte.weight" in present:
        out[TIED] = ("transformer.wte.weight", False)
    return out


def to_gpt2(name: str, tensor: torch.Tensor, transposed: bool, n_head: int) -> torch.Tensor:
    """The GPT tensor `name` in GPT-2's layout: qkv's rows from head by head to q, k, v of all heads; Conv1D
    weights transposed."""
    if _QKV.fullmatch(name):
        tensor = tensor.unflatten(0, (n_head, 3, -1)).transpose(0, 1).flatten(0, 2)
    return tensor.t() if transposed else tensor


def from_gpt2(name: str, tensor: torch.Tensor, transposed: bool, n_head: int) -> torch.Tensor:
    """The inverse of `to_gpt2`: a GPT-2 tensor in the layout of the GPT tensor `name`."""
    tensor = tensor.t() if transposed else tensor
    if _QKV.fullmatch(name):
        tensor = tensor.unflatten(0, (3, n_head, -1)).transpose(0, 1).flatten(0, 2)
    return tensor


def as_stored(name: str, tensor: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A tensor whose layout is already the model's (a model's own names, a Hugging Face model's own save)."""
    return tensor


def gpt2_config(model_cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """(GPT2Config keyword arguments for a GPT of this config, the shapes of the GPT's tensors); what cannot be
    mapped is refused in one line."""
    kwargs = {k: v for k, v in model_cfg.items() if k != "_target_"}
    with torch.device("meta"):
        model = GPT(**kwargs)
    block = model.blocks[0]
    act = block.mlp[1]
    activation = {"none": "gelu", "tanh": "gelu_new"}.get(act.approximate) if isinstance(act, nn.GELU) else None
    if activation is None:
        raise CheckpointError(f"export --format hf: the GPT's activation {act!r} has no GPT-2 activation_function; "
                              "export --format safetensors instead")
    if model.head.weight is not model.tok_emb.weight:
        raise CheckpointError("export --format hf: the GPT's output layer is not tied to its token embedding, "
                              "which GPT-2 requires; export --format safetensors instead")
    n_embd, dropout = model.tok_emb.embedding_dim, float(kwargs.get("dropout", 0.0))
    config = {"vocab_size": model.tok_emb.num_embeddings, "n_positions": model.block_size, "n_embd": n_embd,
              "n_layer": len(model.blocks), "n_head": block.attn.n_head, "n_inner": block.mlp[0].out_features,
              "activation_function": activation, "resid_pdrop": dropout, "embd_pdrop": dropout,
              "attn_pdrop": dropout, "layer_norm_epsilon": block.ln1.eps, "tie_word_embeddings": True,
              "bos_token_id": 0, "eos_token_id": 0}
    return config, {k: list(v.shape) for k, v in model.state_dict().items()}
