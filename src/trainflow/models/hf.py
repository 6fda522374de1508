"""Hugging Face models built from a config: random weights, nothing downloaded (`model._target_` points here)."""

from __future__ import annotations

from typing import Any

from torch import nn

from trainflow.errors import ConfigError
from trainflow.util.optional import import_hf


def gpt2(**config: Any) -> nn.Module:
    """A `transformers` GPT2LMHeadModel of the given GPT2Config keys (vocab_size, n_positions, n_embd, ...).

    Its `forward(input_ids=..., labels=...)` returns the next-token loss as `.loss` (the model shifts the labels),
    which `task.loss_from_model: true` trains on. The key/value cache is off (training never reads it); the
    first and last tokens are id 0, the end-of-text token of tokenizer=bpe.
    """
    transformers = import_hf("transformers", "model._target_")
    known = transformers.GPT2Config().to_dict()
    unknown = sorted(set(config) - set(known))
    if unknown:  # GPT2Config keeps any key as an attribute: a misspelt one would otherwise be ignored silently
        raise ConfigError(f"model.{unknown[0]}: not a GPT2Config key; use GPT2Config's names, e.g. n_embd, "
                          "n_layer, n_head, n_positions, vocab_size")
    settings = {"use_cache": False, "bos_token_id": 0, "eos_token_id": 0, **config}
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings))
    model.loss_type = "ForCausalLM"  # the loss it uses anyway; its class name does not say so, and it would warn
    return model
