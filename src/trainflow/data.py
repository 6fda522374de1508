"""Datasets and resumable, world-size-independent sampling.

The training stream is defined globally: position p of the stream is sample
`perm_e[p % n]` of epoch `e = p // n`, where `perm_e` is a permutation seeded by
(seed, e). Rank r of W takes, for its k-th micro-batch, the positions
`start + k*b*W + r*b + [0, b)`. So every rank reads a disjoint share, each epoch
is reshuffled, and the data position is a single number (samples consumed)
that any number of ranks can resume from without repeating or skipping.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset

from trainflow.errors import DataError, home_note, unwritable_reason
from trainflow.files import atomic_path
from trainflow.seeding import SEED_STRIDE

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets) of one micro-batch

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests"}


def default_corpus() -> list[Path]:
    """The running interpreter's standard library source: real text on every machine."""
    return [Path(sysconfig.get_paths()["stdlib"])]


def list_files(paths: list[Path], suffixes: list[str]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if not path.exists():
            raise DataError(f"data.paths: {path} {_why_missing(path)}; give existing files or folders")
        if path.is_file():
            files.append(path)
            continue
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
            files.extend(Path(root) / n for n in sorted(names) if n.endswith(tuple(suffixes)))
    if not files:
        raise DataError(
            f"data.paths: no files ending in {', '.join(suffixes)} under {', '.join(map(str, paths))}; "
            "set data.suffixes or point data.paths at text files"
        )
    for f in files:
        if not f.is_file():  # a dangling symlink, or a folder or device named like a corpus file
            raise DataError(f"data.paths: {f} {_why_missing(f)}; remove it, or fix it, or narrow data.suffixes")
    return files


def _why_missing(path: Path) -> str:
    if path.is_symlink() and not path.exists():
        return f"is a broken symbolic link (to {os.readlink(path)}, which does not exist)"
    return "is not a regular file" if path.exists() else "does not exist"


CHUNK_BYTES = 16 << 20  # the corpus is copied through memory this much at a time, whatever the size of its files


def load_tokens(cfg: DictConfig) -> np.ndarray:
    """Byte-level tokens of the corpus, cached once as a file and memory-mapped.

    The cache is written in chunks of CHUNK_BYTES, so a corpus larger than memory is tokenized in bounded memory;
    training then reads it through the memory map, page by page.
    """
    paths = [Path(p).expanduser() for p in cfg.paths] if cfg.paths is not None else default_corpus()
    files = list_files(paths, list(cfg.suffixes))
    key = hashlib.sha256()
    for f in files:
        st = f.stat()
        key.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    cache_dir = Path(cfg.cache_dir).expanduser()
    cache = cache_dir / f"{key.hexdigest()[:20]}.bin"
    if not cache.exists():
        _write_cache(files, cache, cfg.cache_dir)
    if cache.stat().st_size == 0:
        raise DataError(f"data.paths: the corpus ({len(files)} file(s)) is empty; point data.paths at text")
    return np.memmap(cache, dtype=np.uint8, mode="r")


def _write_cache(files: list[Path], cache: Path, configured: str) -> None:
    """Concatenate the files' bytes (byte-level tokens are the bytes) into `cache`, one chunk at a time.

    Written to a temporary name and renamed: concurrent ranks never see a half-written cache, and a failed
    write leaves nothing behind.
    """
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(cache) as tmp, open(tmp, "wb") as out:
            for f in files:
                _append(f, out)
    except OSError as exc:
        raise DataError(f"data.cache_dir: cannot write the token cache in {cache.parent}{home_note(configured)} "
                        f"({unwritable_reason(cache.parent, exc)}); point data.cache_dir at a writable folder with "
                        "room for the corpus") from None
    log.info("tokenized %d files (%.1f MB) into %s", len(files), cache.stat().st_size / 1e6, cache)


def _append(source: Path, out: BinaryIO) -> None:
    """Copy `source` to `out` in CHUNK_BYTES pieces; a read failure names the corpus file, a write one raises."""
    try:
        src = open(source, "rb")  # noqa: SIM115 (closed below; read errors must be told from write errors)
    except OSError as exc:
        raise _unreadable(source, exc) from None
    with src:
        while True:
            try:
                chunk = src.read(CHUNK_BYTES)
            except OSError as exc:
                raise _unreadable(source, exc) from None
            if not chunk:
                return
            out.write(chunk)


def _unreadable(path: Path, exc: OSError) -> DataError:
    return DataError(f"data.paths: cannot read {path} ({exc.strerror or exc}); make it readable or remove it from "
                     "the corpus")


class TokenWindows(Dataset):
    """Non-overlapping windows of `seq_len + 1` tokens; item i -> (input, next-token target)."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        window = torch.from_numpy(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int64))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()  # pinned copies need contiguous tensors


class SyntheticClassification(Dataset):
    """The seed article's random inputs, labelled by a fixed random teacher so the loss can fall."""

    def __init__(self, num_samples: int, in_features: int, num_classes: int, task_seed: int, input_seed: int) -> None:
        teacher = torch.randn(in_features, num_classes, generator=torch.Generator().manual_seed(task_seed))
        self.x = torch.randn(num_samples, in_features, generator=torch.Generator().manual_seed(input_seed))
        self.y = (self.x @ teacher).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[indices], self.y[indices]


class SyntheticTokens(Dataset):
    """Random token sequences (a language-model shape with nothing to learn beyond unigram)."""

    def __init__(self, num_samples: int, vocab_size: int, seq_len: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(vocab_size, (num_samples, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[indices]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


class StreamSampler:
    """This rank's micro-batches of the global sample stream, forever, from a start position."""

    def __init__(
        self, num_samples: int, batch_size: int, rank: int, world_size: int, seed: int, start: int = 0,
        shuffle: bool = True,
    ) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.start = start
        self.shuffle = shuffle
        self._perm: tuple[int, torch.Tensor] | None = None

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The reshuffled order of one epoch (the `set_epoch` of this sampler is implicit in the position)."""
        if self._perm is None or self._perm[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * SEED_STRIDE + epoch)
                self._perm = (epoch, torch.randperm(self.num_samples, generator=g))
            else:
                self._perm = (epoch, torch.arange(self.num_samples))
        return self._perm[1]

    def indices_at(self, first: int, count: int) -> torch.Tensor:
        """Sample indices at stream positions [first, first + count), crossing epochs as needed."""
        parts = []
        while count > 0:
            epoch, offset = divmod(first, self.num_samples)
            take = min(count, self.num_samples - offset)
            parts.append(self.epoch_order(epoch)[offset : offset + take])
            first, count = first + take, count - take
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def __iter__(self) -> Iterator[torch.Tensor]:
        b, k = self.batch_size, 0
        while True:
            first = self.start + k * b * self.world_size + self.rank * b
            yield self.indices_at(first, b)
            k += 1


@dataclass
class DataBundle:
    train: Dataset
    val: Dataset
    is_lm: bool  # language model: tokens/s and perplexity make sense
    seq_len: int  # tokens per sample (1 for non-sequence data)


def build_datasets(cfg: DictConfig, model_cfg: DictConfig) -> DataBundle:
    """Train and held-out datasets shaped for the model."""
    if cfg.kind == "text":
        seq_len = int(cfg.seq_len)
        tokens = load_tokens(cfg)
        split = int(len(tokens) * (1 - cfg.val_fraction))
        need = seq_len + 1
        if split < need or len(tokens) - split < need:
            raise DataError(
                f"data.paths: the corpus has {len(tokens)} bytes, too short for one training and one "
                f"validation sequence of {need} bytes (val_fraction={cfg.val_fraction}); "
                "add text or lower data.seq_len"
            )
        return DataBundle(TokenWindows(tokens[:split], seq_len), TokenWindows(tokens[split:], seq_len), True, seq_len)
    if "vocab_size" in model_cfg:
        seq_len = int(cfg.seq_len)
        make = lambda n, s: SyntheticTokens(n, model_cfg.vocab_size, seq_len, s)  # noqa: E731
        return DataBundle(make(cfg.num_samples, cfg.data_seed), make(1024, cfg.data_seed + 1), True, seq_len)
    in_f, classes = model_cfg.get("in_features", 100), model_cfg.get("out_features", 10)
    seed = cfg.data_seed
    train = SyntheticClassification(cfg.num_samples, in_f, classes, task_seed=seed, input_seed=seed + 1)
    val = SyntheticClassification(4096, in_f, classes, task_seed=seed, input_seed=seed + 2)
    return DataBundle(train, val, False, 1)


class VariableLengths:
    """Micro-batch k of the stream cut to `seq_lens[k % n]` tokens: the varying shapes real data has.

    k counts micro-batches of the whole stream (all ranks take theirs at the same k), so the length of a
    micro-batch depends only on its stream position: the same after a resume and on any number of ranks.
    """

    def __init__(self, loader: Iterable[Batch], seq_lens: list[int], sampler: StreamSampler) -> None:
        self.loader = loader
        self.seq_lens = seq_lens
        self.first = sampler.start // (sampler.batch_size * sampler.world_size)

    def __iter__(self) -> Iterator[Batch]:
        for k, (inputs, targets) in enumerate(self.loader, start=self.first):
            n = self.seq_lens[k % len(self.seq_lens)]
            yield inputs[:, :n].contiguous(), targets[:, :n].contiguous()


class Pinned:
    """Batches copied into page-locked memory, so that `.to(cuda, non_blocking=True)` does not wait."""

    def __init__(self, loader: Iterable[Batch]) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.loader:
            yield tuple(t.pin_memory() for t in batch)


class InProcessBatches:
    """Micro-batches gathered in this process: with no workers, DataLoader's machinery only adds ~0.1 ms a
    batch (7% of the seed MLP's step), so it is left out."""

    def __init__(self, dataset: Dataset, sampler: StreamSampler) -> None:
        self.dataset = dataset
        self.sampler = sampler

    def __iter__(self) -> Iterator[Batch]:
        for indices in self.sampler:
            yield self.dataset[indices]


def make_loader(
    dataset: Dataset, sampler: StreamSampler, cfg: DictConfig, pin_memory: bool
) -> Iterable[Batch]:
    """A loader over whole micro-batches: the sampler yields index lists the dataset gathers at once.

    Pinning comes last (cutting a pinned batch to a length would copy it back into pageable memory); with
    workers and no cutting, DataLoader pins in its own thread instead.
    """
    loader: Iterable[Batch]
    seq_lens = cfg.get("seq_lens")
    if cfg.num_workers == 0:
        loader = InProcessBatches(dataset, sampler)
    else:
        loader = DataLoader(
            dataset,
            batch_size=None,
            sampler=sampler,
            num_workers=cfg.num_workers,
            pin_memory=pin_memory and not seq_lens,
            persistent_workers=cfg.persistent_workers,
            prefetch_factor=cfg.prefetch_factor,
        )
    if seq_lens:
        loader = VariableLengths(loader, list(seq_lens), sampler)
    if pin_memory and (cfg.num_workers == 0 or seq_lens):
        loader = Pinned(loader)
    return loader
