"""A decoder-only transformer small enough to read top to bottom.

Blocks sit in `self.blocks` (an nn.ModuleList) so that later stages can wrap
(FSDP), checkpoint or compile them one at a time. `GPT.tp_plan` says how tensor
parallelism splits it (trainflow.distributed.tensor applies it). A pipeline
stage (trainflow.distributed.pipeline) holds some of its parts, the others None:
forward runs the parts it holds.
"""

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.dropout = dropout
        # qkv's outputs are head by head ([q k v] of head 0, then of head 1, ...): split by rows into equal
        # parts (tensor parallel, column-wise), each part is whole heads with their q, k and v
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        heads = qkv.shape[-1] // (3 * self.head_dim)  # this rank's heads: all, or 1/tp under tensor parallel
        q, k, v = qkv.view(b, t, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=bias),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    # the order of the numbers behind the state dict's names, saved with each checkpoint: 2, qkv's rows head by head
    # ([q k v] of head 0, then head 1: what tensor parallelism splits); 1, before: q, k, v of all heads
    weights_layout = 2

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 256,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def tp_plan(self) -> dict[str, Any]:
        """Megatron-style tensor parallel with sequence parallel: between blocks the activations are split along
        the sequence (layer norms, dropout and the residual stream run on 1/tp of the tokens); attention and the
        MLP all-gather them, split qkv and the first MLP layer by columns (whole heads, a share of the hidden
        units) and the output projections by rows, whose reduce-scatter splits the sequence again. The
        embeddings are split by rows (vocabulary, positions); the tied output layer by vocabulary, its logits left
        split for the loss (loss parallel: distributed.parallelism.loss_context; docs/performance.md, Scale)."""
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_output=True)
        plan: dict[str, Any] = {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        }
        for i, _ in self.blocks.named_children():  # a pipeline stage's blocks keep their own numbers
            plan.update({
                f"blocks.{i}.ln1": SequenceParallel(), f"blocks.{i}.attn": gather,
                f"blocks.{i}.attn.qkv": ColwiseParallel(),
                f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                f"blocks.{i}.ln2": SequenceParallel(), f"blocks.{i}.mlp": gather,
                f"blocks.{i}.mlp.0": ColwiseParallel(), f"blocks.{i}.mlp.2": RowwiseParallel(output_layouts=Shard(1)),
            })
        return plan

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx  # a pipeline stage after the first takes the previous stage's activations
        if self.tok_emb is not None:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.head is not None else x
