"""Text files: a corpus tokenized once (bytes, or the run's tokenizer) into a memory-mapped cache, cut into windows."""

from __future__ import annotations

import codecs
import hashlib
import itertools
import logging
import os
import sysconfig
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils.data import Dataset

from trainflow.data.tokenizers import Tokenizer, build_once, build_tokenizer
from trainflow.errors import DataError, home_note, unwritable_reason
from trainflow.util.files import atomic_path, kind_of

log = logging.getLogger(__name__)

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
        if not path.is_dir():  # a FIFO would wait for a writer, a device might never end
            raise DataError(f"data.paths: {path} is {kind_of(path.stat().st_mode)}, not a regular file or a folder; "
                            "give text files or folders")
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
PIECE_BYTES = 1 << 16  # a tokenizer encodes text in pieces of about this size, cut at a line's end where one is near
PIECES_AT_ONCE = 16  # pieces encoded in one call (the tokenizers library encodes a batch in parallel)


@dataclass(frozen=True)
class Corpus:
    """The corpus's files, and a key that changes when any of them (its name, size or time) does."""

    files: list[Path]
    key: str

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Corpus:
        """The files of a data=text section (its `paths`, `suffixes`)."""
        paths = [Path(p).expanduser() for p in data["paths"]] if data["paths"] is not None else default_corpus()
        files = list_files(paths, list(data["suffixes"]))
        key = hashlib.sha256()
        for f in files:
            st = f.stat()
            key.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return cls(files, key.hexdigest())

    def tokenizer(self, settings: Mapping[str, Any] | None) -> Tokenizer:
        """The run's tokenizer; a BPE is trained on (the start of) this corpus."""
        return build_tokenizer(settings, f"text\0{self.key}", lambda: (p for f in self.files for p in _pieces(f)))

    def tokens(self, tokenizer: Tokenizer, data: Mapping[str, Any]) -> np.ndarray:
        """The corpus's tokens, cached once as a file (keyed by the corpus and the tokenizer) and memory-mapped.

        The cache is written a bounded piece at a time, so a corpus larger than memory is tokenized in bounded
        memory; training then reads it through the memory map, page by page. Bytes are cached as the files' bytes.
        """
        cache_dir = Path(data["cache_dir"]).expanduser()
        if tokenizer.encoder is None:
            cache = cache_dir / f"{self.key[:20]}.bin"
            if not cache.exists():
                _write_cache(self.files, cache, data["cache_dir"])
        else:
            cache = cache_dir / f"{self.key[:20]}-{tokenizer.name}.bin"
            if build_once(cache, lambda tmp: _encode(self.files, tmp, tokenizer), "data.cache_dir", data["cache_dir"]):
                log.info("tokenized %d files into %d tokens in %s", len(self.files),
                         cache.stat().st_size // tokenizer.dtype.itemsize, cache)
        if cache.stat().st_size == 0:
            raise DataError(f"data.paths: the corpus ({len(self.files)} file(s)) is empty; point data.paths at text")
        return np.memmap(cache, dtype=tokenizer.dtype, mode="r")


def load_tokens(data: Mapping[str, Any]) -> np.ndarray:
    """The corpus of a data=text section, tokenized with its tokenizer (bytes when it names none)."""
    corpus = Corpus.of(data)
    return corpus.tokens(corpus.tokenizer(data.get("tokenizer")), data)


def _pieces(path: Path) -> Iterator[str]:
    """The text of `path` in pieces of about PIECE_BYTES, each ending at a line's end when one is within reach.

    Bytes that are not UTF-8 become U+FFFD; a character split between two reads is decoded whole.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        with open(path, "rb") as src:
            while chunk := src.read(PIECE_BYTES):
                yield decoder.decode(chunk + src.readline(PIECE_BYTES))
            yield decoder.decode(b"", final=True)
    except OSError as exc:
        raise _unreadable(path, exc) from None


def _encode(files: list[Path], out_path: Path, tokenizer: Tokenizer) -> None:
    """Write the files' token ids (each file followed by the tokenizer's separator) to `out_path`."""
    separator = np.asarray(tokenizer.separator, dtype=tokenizer.dtype)
    with open(out_path, "wb") as out:
        for f in files:
            pieces = _pieces(f)
            while batch := list(itertools.islice(pieces, PIECES_AT_ONCE)):
                for ids in tokenizer.encode(batch):
                    np.asarray(ids, dtype=tokenizer.dtype).tofile(out)
            separator.tofile(out)


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
