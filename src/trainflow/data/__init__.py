"""Data: the built-in datasets shaped for the model, the global sample stream and its loaders.

Modules: `stream` (the resumable, world-size-independent sample stream), `text` (a corpus of text files),
`tokenizers` (bytes, a BPE trained here, a tokenizer.json), `hf` (local files read by Hugging Face datasets),
`shards` (token shards prepared once, memory-mapped), `identity` (what data a checkpoint was saved on, and what
changed since), `synthetic` (random tensors with something to learn), `iterable` (an IterableDataset's stream,
sharded and resumable through torchdata), `loaders` (micro-batch loaders: cut, pinned, workers, moved to the
device), `worker_errors` (a loader worker's error in one line), `user` (datasets by `data._target_`), `digits`
(scikit-learn's handwritten digits, a `_target_`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from trainflow.config.schema import LOADER_KEYS, DataSection, MLPConfig
from trainflow.data.identity import Identity, cache_checksum, settings_identity, shards_identity, text_identity
from trainflow.data.iterable import IterableBatches, IterableSource
from trainflow.data.loaders import (
    Batch,
    InProcessBatches,
    Pinned,
    VariableLengths,
    apply_to_tensors,
    make_loader,
    to_device,
)
from trainflow.data.shards import check_vocab, shard_datasets
from trainflow.data.stream import StreamSampler
from trainflow.data.synthetic import SyntheticClassification, SyntheticTokens
from trainflow.data.text import Corpus, TokenWindows, load_tokens
from trainflow.data.user import Collated, user_datasets
from trainflow.errors import ConfigError, DataError
from trainflow.util.targets import WHAT, call_target

__all__ = [
    "LOADER_KEYS", "Batch", "Collated", "DataBundle", "InProcessBatches", "IterableBatches", "IterableSource",
    "Pinned", "StreamSampler", "SyntheticClassification", "SyntheticTokens", "TokenWindows", "VariableLengths",
    "apply_to_tensors",
    "build_datasets", "load_tokens", "make_loader", "shards_data", "synthetic_data", "text_data", "to_device",
    "user_datasets",
]


@dataclass
class DataBundle:
    train: Dataset  # indexed by a micro-batch's index tensor, it returns the whole batch (an IterableSource: the
    # first items of its stream)
    val: Dataset | None  # None: the factory gave no validation set (no evaluation)
    is_lm: bool  # language-model data: task=auto picks lm
    seq_len: int  # tokens per sample (1 for non-sequence data)
    name: str  # how errors name the data: data=text, or the factory's import path
    identity: Identity  # what a checkpoint records of the data, to tell a resume on other data (data/identity.py)


def build_datasets(section: DataSection, lm_model: bool) -> DataBundle:
    """Train and held-out datasets shaped for the model, from the data section's `_target_` called with its keys
    (less the loader's): trainflow's options return a DataBundle, a user's factory (train, val) datasets."""
    target = str(section._target_)
    made = call_target("data", target, section.kwargs, WHAT["data"])
    if isinstance(made, DataBundle):
        return made
    train, val = user_datasets(made, target, section.collate_fn)
    identity = settings_identity(target, {
        "data (train samples)": len(train) if not isinstance(train, IterableSource) else None,
        "data (val samples)": len(val) if val is not None else None}, getattr(train.dataset, "data_identity", None))
    return DataBundle(train, val, lm_model, int(section.seq_len or 1), target, identity)


def text_data(paths: list[str] | None, suffixes: list[str], val_fraction: float, cache_dir: str,
              tokenizer: Mapping[str, Any] | None, seq_len: int, model_vocab_size: int | None = None) -> DataBundle:
    """data=text: a corpus of text files tokenized once into a cache, cut into windows of `seq_len` tokens; the last
    `val_fraction` of the tokens held out."""
    corpus = Corpus.of({"paths": paths, "suffixes": suffixes})
    tok = corpus.tokenizer(tokenizer)
    tok.check_fits(model_vocab_size)
    tokens = corpus.tokens(tok, {"cache_dir": cache_dir})
    split = int(len(tokens) * (1 - val_fraction))
    need, unit = seq_len + 1, tok.unit
    if split < need or len(tokens) - split < need:
        raise DataError(
            f"data.paths: the corpus has {len(tokens)} {unit}, too short for one training and one "
            f"validation sequence of {need} {unit} (val_fraction={val_fraction}); add text or lower data.seq_len"
        )
    identity = text_identity(corpus.files, cache_checksum(Path(tokens.filename)), tok.name, seq_len,
                             float(val_fraction))
    return DataBundle(TokenWindows(tokens[:split], seq_len), TokenWindows(tokens[split:], seq_len), True, seq_len,
                      "data=text", identity)


def synthetic_data(num_samples: int, data_seed: int, seq_len: int, vocab_size: int | None = None,
                   in_features: int | None = None, out_features: int | None = None) -> DataBundle:
    """data=synthetic: random tokens of the model's vocabulary (a language model: `vocab_size` set), else features
    for its `in_features` labelled by a fixed random teacher into `out_features` classes (MLP's defaults when
    unset)."""
    if vocab_size is not None:
        make = lambda n, s: SyntheticTokens(n, vocab_size, seq_len, s)  # noqa: E731
        return DataBundle(make(num_samples, data_seed), make(1024, data_seed + 1), True, seq_len, "data=synthetic",
                          _synthetic_identity(num_samples, data_seed, {"data.seq_len": seq_len}))
    in_f = MLPConfig.in_features if in_features is None else in_features
    classes = MLPConfig.out_features if out_features is None else out_features
    train = SyntheticClassification(num_samples, in_f, classes, task_seed=data_seed, input_seed=data_seed + 1)
    val = SyntheticClassification(4096, in_f, classes, task_seed=data_seed, input_seed=data_seed + 2)
    return DataBundle(train, val, False, 1, "data=synthetic", _synthetic_identity(num_samples, data_seed, {}))


def _synthetic_identity(num_samples: int, data_seed: int, shape: dict[str, int]) -> Identity:
    """Synthetic samples are their settings: the same size and seed draw the same samples."""
    return settings_identity("data=synthetic", {"data.num_samples": int(num_samples), "data.data_seed": int(data_seed),
                                                **shape})


def shards_data(path: str | None, seq_len: int, val_fraction: float,
                model_vocab_size: int | None = None) -> DataBundle:
    """data=shards: the windows of the folder `trainflow prepare --out` wrote, its tokens checked against the
    model's vocabulary."""
    if not path:
        raise ConfigError("data.path: data=shards needs the folder `trainflow prepare --out` wrote; set data.path")
    train, val, manifest = shard_datasets(Path(path).expanduser(), seq_len, float(val_fraction))
    check_vocab(manifest, model_vocab_size, path)
    return DataBundle(train, val, True, seq_len, "data=shards", shards_identity(manifest, seq_len, float(val_fraction)))
