"""data=hf: local json/jsonl/csv/parquet/text files read by the Hugging Face `datasets` library, as token windows.

Nothing is downloaded (HF_DATASETS_OFFLINE is set unless the environment sets it). One column's text is tokenized
once with the run's tokenizer into a token cache keyed by the files, the column and the tokenizer, memory-mapped
and cut into windows of `seq_len` tokens; a second run, and every other rank, reads the cache without `datasets`.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from trainflow.data.identity import cache_checksum
from trainflow.data.tokenizers import Tokenizer, build_once, build_tokenizer
from trainflow.errors import ConfigError, DataError
from trainflow.util.optional import import_hf

log = logging.getLogger(__name__)

FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
ITEMS = ("tuple", "dict")
ROWS_AT_ONCE = 1000  # rows read and encoded at a time: memory stays bounded whatever the size of the files


class Windows(Dataset):
    """Non-overlapping windows of a token array.

    items=tuple: item i is (inputs, next-token targets), `seq_len` tokens each, as the lm task's loss takes them.
    items=dict: item i is {"input_ids", "labels"}, both the same `seq_len` tokens: a Hugging Face causal LM given
    `labels` shifts them itself.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, items: str,
                 data_identity: dict[str, str] | None = None) -> None:
        self.tokens = tokens
        self.data_identity = data_identity  # what a checkpoint records of the data (trainflow.data.identity)
        self.as_dict = items == "dict"
        self.span = seq_len if self.as_dict else seq_len + 1  # tokens an item reads
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - self.span + self.seq_len) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        start = index * self.seq_len
        window = torch.from_numpy(self.tokens[start:start + self.span].astype(np.int64))
        if self.as_dict:
            return {"input_ids": window, "labels": window.clone()}
        return window[:-1], window[1:]


def token_windows(paths: list[str] | None, seq_len: int, column: str = "text", format: str | None = None,  # noqa: A002
                  val_paths: list[str] | None = None, val_fraction: float = 0.05, items: str = "tuple",
                  cache_dir: str = "~/.cache/trainflow/hf", tokenizer: Mapping[str, Any] | None = None,
                  model_vocab_size: int | None = None) -> dict[str, Windows]:
    """The train and validation windows of the `column` of local files (the keys of conf/data/hf.yaml)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only; a user's own setting is kept
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if items not in ITEMS:
        raise ConfigError(f"data.items: must be one of {', '.join(ITEMS)}; got {items!r}")
    if not 0 < val_fraction < 1:
        raise ConfigError(f"data.val_fraction: must be in (0, 1); got {val_fraction}")
    if seq_len <= 0:
        raise ConfigError(f"data.seq_len: must be a positive number of tokens; got {seq_len}")
    cache = Path(cache_dir).expanduser()
    train = Split(_files(paths, "data.paths"), format, column, cache, cache_dir)
    tok = build_tokenizer(tokenizer, f"hf\0{train.key}", train.texts)
    tok.check_fits(model_vocab_size)
    tokens = train.tokens(tok)
    span = seq_len if items == "dict" else seq_len + 1
    identity = {"tokens": cache_checksum(train.cache_file(tok))}  # the split's tokens: the held-out ones move with it
    if val_paths is None:
        cut = int(len(tokens) * (1 - val_fraction))
        train_tokens, val_tokens = tokens[:cut], tokens[cut:]
        _require_window(train_tokens, span, tok, "the training split", f" (val_fraction={val_fraction})")
        _require_window(val_tokens, span, tok, "the validation split", f" (val_fraction={val_fraction})")
    else:
        train_tokens = tokens
        val = Split(_files(val_paths, "data.val_paths"), format, column, cache, cache_dir)
        val_tokens = val.tokens(tok)
        identity["val_tokens"] = cache_checksum(val.cache_file(tok))
        _require_window(train_tokens, span, tok, "the training split", "", "data.paths")
        _require_window(val_tokens, span, tok, "the validation split", "", "data.val_paths")
    return {"train": Windows(train_tokens, seq_len, items, identity), "val": Windows(val_tokens, seq_len, items)}


def _require_window(tokens: np.ndarray, span: int, tok: Tokenizer, what: str, note: str,
                    key: str = "data.paths") -> None:
    if len(tokens) < span:
        raise DataError(f"{key}: {what} has {len(tokens)} {tok.unit}{note}, too short for one sequence of {span} "
                        f"{tok.unit}; add text or lower data.seq_len")


def _files(patterns: list[str] | None, key: str) -> list[Path]:
    """The files `patterns` name (paths or globs), in order; one line for a pattern that names none."""
    if not patterns:
        raise ConfigError(f"{key}: no files given; name local files, e.g. {key}=[corpus.jsonl]")
    files: list[Path] = []
    for pattern in patterns:
        expanded = os.path.expanduser(str(pattern))
        found = sorted(glob.glob(expanded)) if glob.has_magic(expanded) else [expanded]
        for name in found:
            path = Path(name)
            if not path.is_file():
                what = "is not a file" if path.exists() else "does not exist"
                raise DataError(f"{key}: {path} {what}; give json, jsonl, csv, parquet or text files")
            files.append(path)
        if not found:
            raise DataError(f"{key}: {pattern} matches no file; give json, jsonl, csv, parquet or text files")
    return files


class Split:
    """One split's files: read by `datasets` only when a cache is missing, tokenized once, memory-mapped."""

    def __init__(self, files: list[Path], format: str | None, column: str, cache: Path,  # noqa: A002
                 configured: str) -> None:
        self.files, self.column, self.cache, self.configured = files, column, cache, configured
        if format is not None and format not in set(FORMATS.values()):
            raise ConfigError(f"data.format: must be null (from the suffixes) or one of json, csv, parquet, text; "
                              f"got {format!r}")
        self.format = format or _format_of(files)
        key = hashlib.sha256(f"{self.format}\0{column}\n".encode())
        for f in files:
            st = f.stat()
            key.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        self.key = key.hexdigest()
        self._rows: Any = None

    def rows(self) -> Any:
        """The files as a `datasets.Dataset` (Arrow, memory-mapped, cached in the cache folder), column checked."""
        if self._rows is None:
            datasets = import_hf("datasets", "data=hf")
            datasets.disable_progress_bars()
            datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a reader's failure is told below, in one line
            try:
                rows = datasets.load_dataset(self.format, data_files=[str(f) for f in self.files], split="train",
                                             cache_dir=str(self.cache / "datasets"))
            except Exception as exc:  # noqa: BLE001 (datasets wraps the reader's error; its innermost says what)
                while exc.__cause__ is not None:
                    exc = exc.__cause__
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise DataError(f"data.paths: datasets cannot read {_names(self.files)} as {self.format} ({reason}); "
                                "fix the files, or set data.format to what they are") from None
            if self.column not in rows.column_names:
                raise ConfigError(f"data.column: {_names(self.files)} has no column {self.column!r}; the columns "
                                  f"there are {', '.join(rows.column_names)}: set data.column to one of them")
            kind = getattr(rows.features[self.column], "dtype", None)
            if kind not in ("string", "large_string"):
                raise ConfigError(f"data.column: column {self.column!r} of {_names(self.files)} holds {kind or 'lists'}"
                                  ", not text; set data.column to a column of text")
            self._rows = rows
        return self._rows

    def texts(self) -> Iterator[str]:
        """The column's text, row by row (an empty cell is skipped)."""
        for batch in self.rows().iter(batch_size=ROWS_AT_ONCE):
            yield from (text for text in batch[self.column] if text)

    def tokens(self, tok: Tokenizer) -> np.ndarray:
        """The column's tokens (each row followed by the tokenizer's separator), cached once and memory-mapped."""
        path = self.cache_file(tok)
        if build_once(path, lambda tmp: self._encode(tmp, tok), "data.cache_dir", self.configured):
            log.info("tokenized %s (column %r) into %d tokens in %s", _names(self.files), self.column,
                     path.stat().st_size // tok.dtype.itemsize, path)
        return np.memmap(path, dtype=tok.dtype, mode="r") if path.stat().st_size else np.zeros(0, tok.dtype)

    def cache_file(self, tok: Tokenizer) -> Path:
        """The split's token cache: keyed by its files (names, sizes, times), the column and the tokenizer."""
        return self.cache / "tokens" / f"{self.key[:20]}-{tok.name}.bin"

    def _encode(self, out_path: Path, tok: Tokenizer) -> None:
        texts = self.texts()
        with open(out_path, "wb") as out:
            while batch := list(itertools.islice(texts, ROWS_AT_ONCE)):
                for ids in tok.encode(batch):
                    np.asarray([*ids, *tok.separator], dtype=tok.dtype).tofile(out)


def _format_of(files: list[Path]) -> str:
    """The datasets builder the files' suffixes name; one line when they name none, or several."""
    found = {FORMATS.get(f.suffix.lower()) for f in files}
    if None in found or len(found) > 1:
        suffixes = ", ".join(sorted({f.suffix or "(none)" for f in files}))
        raise ConfigError(f"data.format: cannot tell one format from the suffixes {suffixes}; set data.format to "
                          "json, csv, parquet or text")
    return found.pop()


def _names(files: list[Path]) -> str:
    return str(files[0]) if len(files) == 1 else f"{files[0]} (and {len(files) - 1} more)"
