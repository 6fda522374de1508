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

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig
from torch.utils.data import Dataset

from trainflow.config.schema import MLPConfig
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
from trainflow.data.stream import StreamSampler
from trainflow.data.synthetic import SyntheticClassification, SyntheticTokens
from trainflow.data.text import Corpus, TokenWindows, load_tokens
from trainflow.data.user import LOADER_KEYS, Collated, user_datasets
from trainflow.errors import ConfigError, DataError

__all__ = [
    "LOADER_KEYS", "Batch", "Collated", "DataBundle", "InProcessBatches", "IterableBatches", "IterableSource",
    "Pinned", "StreamSampler", "SyntheticClassification", "SyntheticTokens", "TokenWindows", "VariableLengths",
    "apply_to_tensors",
    "build_datasets", "load_tokens", "make_loader", "to_device", "user_datasets",
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


def build_datasets(cfg: DictConfig, model_cfg: DictConfig) -> DataBundle:
    """Train and held-out datasets shaped for the model: built in, or the user's by data._target_."""
    if cfg.get("_target_"):
        train, val = user_datasets(cfg)
        identity = settings_identity(cfg._target_, {
            "data (train samples)": len(train) if not isinstance(train, IterableSource) else None,
            "data (val samples)": len(val) if val is not None else None}, getattr(train.dataset, "data_identity", None))
        return DataBundle(train, val, "vocab_size" in model_cfg, int(cfg.get("seq_len") or 1), cfg._target_,
                          identity)
    if cfg.kind == "text":
        seq_len = int(cfg.seq_len)
        corpus = Corpus.of(cfg)
        tokenizer = corpus.tokenizer(cfg.get("tokenizer"))
        tokenizer.check_fits(model_cfg.get("vocab_size"))
        tokens = corpus.tokens(tokenizer, cfg)
        split = int(len(tokens) * (1 - cfg.val_fraction))
        need, unit = seq_len + 1, tokenizer.unit
        if split < need or len(tokens) - split < need:
            raise DataError(
                f"data.paths: the corpus has {len(tokens)} {unit}, too short for one training and one "
                f"validation sequence of {need} {unit} (val_fraction={cfg.val_fraction}); "
                "add text or lower data.seq_len"
            )
        identity = text_identity(corpus.files, cache_checksum(Path(tokens.filename)), tokenizer.name, seq_len,
                                 float(cfg.val_fraction))
        return DataBundle(TokenWindows(tokens[:split], seq_len), TokenWindows(tokens[split:], seq_len), True, seq_len,
                          "data=text", identity)
    if cfg.kind == "shards":
        return _shards(cfg, model_cfg)
    if "vocab_size" in model_cfg:
        seq_len = int(cfg.seq_len)
        make = lambda n, s: SyntheticTokens(n, model_cfg.vocab_size, seq_len, s)  # noqa: E731
        return DataBundle(make(cfg.num_samples, cfg.data_seed), make(1024, cfg.data_seed + 1), True, seq_len,
                          "data=synthetic", _synthetic_identity(cfg, {"data.seq_len": seq_len}))
    in_f, classes = (model_cfg.get(key, getattr(MLPConfig, key)) for key in ("in_features", "out_features"))
    seed = cfg.data_seed
    train = SyntheticClassification(cfg.num_samples, in_f, classes, task_seed=seed, input_seed=seed + 1)
    val = SyntheticClassification(4096, in_f, classes, task_seed=seed, input_seed=seed + 2)
    return DataBundle(train, val, False, 1, "data=synthetic", _synthetic_identity(cfg, {}))


def _synthetic_identity(cfg: DictConfig, shape: dict[str, int]) -> Identity:
    """Synthetic samples are their settings: the same size and seed draw the same samples."""
    return settings_identity("data=synthetic", {"data.num_samples": int(cfg.num_samples),
                                                "data.data_seed": int(cfg.data_seed), **shape})


def _shards(cfg: DictConfig, model_cfg: DictConfig) -> DataBundle:
    """data=shards: the prepared folder's windows, its tokens checked against the model's vocabulary."""
    from trainflow.data.shards import check_vocab, shard_datasets

    if not cfg.path:
        raise ConfigError("data.path: data=shards needs the folder `trainflow prepare --out` wrote; set data.path")
    train, val, manifest = shard_datasets(Path(cfg.path).expanduser(), int(cfg.seq_len), float(cfg.val_fraction))
    check_vocab(manifest, model_cfg.get("vocab_size"), cfg.path)
    return DataBundle(train, val, True, int(cfg.seq_len), "data=shards",
                      shards_identity(manifest, int(cfg.seq_len), float(cfg.val_fraction)))
