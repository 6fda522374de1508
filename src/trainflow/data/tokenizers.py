"""Tokenizers: bytes (a token is a byte), a byte-level BPE trained here, or a user's tokenizer.json.

`tokenizer=bytes` needs nothing and keeps the text data's byte cache as it always was. `tokenizer=bpe` trains a
byte-level BPE with the `tokenizers` library on the training text, once per corpus and settings: the result is
cached as a tokenizer.json, and the run's ranks wait on a file lock while the first of them trains it.
`tokenizer=file` loads a tokenizer.json of the user's. Token caches built with a tokenizer are keyed by its name.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from trainflow.config.choices import BYTE_VOCAB
from trainflow.config.schema import TokenizerConfig, typed
from trainflow.errors import ConfigError, DataError, home_note, unwritable_reason
from trainflow.util.files import atomic_path
from trainflow.util.locks import flock_unsupported
from trainflow.util.optional import import_hf

log = logging.getLogger(__name__)

END_OF_TEXT = "<|endoftext|>"  # bpe: the special token between documents (id 0)
# What a user's tokenizer.json may call the token that ends a document.
END_TOKENS = (END_OF_TEXT, "</s>", "<eos>", "[SEP]")


@dataclass(frozen=True)
class Tokenizer:
    """What the data needs of a tokenizer: token ids of text, the vocabulary's size, a name to key caches by."""

    kind: str  # bytes | bpe | file
    vocab_size: int
    separator: tuple[int, ...]  # appended after each document (a file, a row) so that they do not run together
    encoder: Any = None  # a tokenizers.Tokenizer; None for bytes
    digest: str = ""  # of the tokenizer.json: a token cache built with another tokenizer never matches

    @property
    def name(self) -> str:
        """What token caches are keyed by: bytes, or the kind and the digest."""
        return f"{self.kind}-{self.digest}" if self.digest else self.kind

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned integer that holds every token id: caches take 1, 2 or 4 bytes a token."""
        for dtype in (np.uint8, np.uint16):
            if self.vocab_size <= np.iinfo(dtype).max + 1:
                return np.dtype(dtype)
        return np.dtype(np.uint32)

    @property
    def unit(self) -> str:
        """What messages count in: bytes for bytes, tokens otherwise."""
        return "bytes" if self.encoder is None else "tokens"

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.encoder is None:
            return [list(text.encode()) for text in texts]
        return [e.ids for e in self.encoder.encode_batch(texts, add_special_tokens=False)]

    def check_fits(self, model_vocab_size: int | None) -> None:
        """Every token id must have a row in the model's embedding: one line naming both keys when it does not."""
        if model_vocab_size is not None and self.vocab_size > model_vocab_size:
            raise ConfigError(
                f"model.vocab_size: is {model_vocab_size}, but the tokenizer (tokenizer={self.kind}) has "
                f"{self.vocab_size} tokens; set model.vocab_size to {self.vocab_size} or more (its default follows "
                "tokenizer.vocab_size), or pick a smaller tokenizer.vocab_size")


def byte_tokenizer(lib: ModuleType) -> Any:
    """tokenizer=bytes as a tokenizers.Tokenizer (for other tools: an exported Hugging Face folder): id = the byte,
    as trainflow encodes text (UTF-8, one token a byte). Bytes are shown as the printable characters of the
    byte-level convention (the ByteLevel pre-tokenizer and decoder), so text round-trips exactly."""
    shown = _printable_bytes()
    vocab = {shown[b]: b for b in range(BYTE_VOCAB)}
    tokenizer = lib.Tokenizer(lib.models.BPE(vocab=vocab, merges=[]))  # no merges: one token a byte
    tokenizer.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = lib.decoders.ByteLevel()
    return tokenizer


def _printable_bytes() -> dict[int, str]:
    """Each byte's character in the byte-level convention: the printable ones stand for themselves, the others are
    the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(BYTE_VOCAB) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(BYTE_VOCAB + i) for i, b in enumerate(others)}}


def build_tokenizer(settings: TokenizerConfig | Mapping[str, Any] | None, corpus_key: str,
                    training_text: Callable[[], Iterable[str]]) -> Tokenizer:
    """The tokenizer the settings (the `tokenizer` section; None: bytes) describe.

    `corpus_key` names the training text (its files, sizes and times, and what is read of them); `training_text`
    yields it, and is called only when a BPE for that corpus and these settings is not cached yet.
    """
    settings = typed(settings or {}, TokenizerConfig, "tokenizer")  # the schema's defaults fill what it leaves out
    kind = settings.kind
    if kind == "bytes":
        vocab = settings.vocab_size
        if vocab != BYTE_VOCAB:
            raise ConfigError(f"tokenizer.vocab_size: is {vocab}, but tokenizer=bytes has {BYTE_VOCAB} tokens (one a "
                              f"byte); leave it at {BYTE_VOCAB}, or pick tokenizer=bpe for a vocabulary of your size")
        return Tokenizer("bytes", BYTE_VOCAB, (ord("\n"),))
    lib = import_hf("tokenizers", f"tokenizer={kind}")
    path = _trained_bpe(lib, settings, corpus_key, training_text) if kind == "bpe" else _user_file(settings)
    try:
        encoder = lib.Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 (the library raises plain Exceptions for files it cannot parse)
        raise DataError(f"tokenizer.path: {path} is not a tokenizer.json the tokenizers library can read "
                        f"({str(exc).splitlines()[0]}); give a file written by tokenizers' Tokenizer.save") from None
    vocab = encoder.get_vocab_size(with_added_tokens=True)
    if kind == "file" and vocab != settings.vocab_size:
        raise ConfigError(f"tokenizer.vocab_size: is {settings.vocab_size}, but {path} has {vocab} tokens; "
                          f"set tokenizer.vocab_size={vocab} (the model's vocabulary follows it)")
    ends = [i for i in (encoder.token_to_id(t) for t in END_TOKENS) if i is not None]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return Tokenizer(kind, vocab, tuple(ends[:1]), encoder, digest)


def _user_file(settings: TokenizerConfig) -> Path:
    if not settings.path:
        raise ConfigError("tokenizer.path: not set; give your tokenizer.json, e.g. "
                          "tokenizer.path=/data/tokenizer.json tokenizer.vocab_size=50257")
    path = Path(settings.path).expanduser()
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise DataError(f"tokenizer.path: {path} {what}; give the tokenizer.json written by tokenizers' "
                        "Tokenizer.save (or pick tokenizer=bpe to train one here)")
    return path


def bpe_cache_path(lib: ModuleType, settings: TokenizerConfig, corpus_key: str) -> Path:
    """Where the tokenizer.json of a byte-level BPE for this corpus and these settings is cached (nothing is
    created: it may not be there)."""
    vocab, min_frequency, train_bytes = settings.vocab_size, settings.min_frequency, settings.train_bytes
    least = BYTE_VOCAB + 1  # every byte, and the end-of-text token
    if not isinstance(vocab, int) or vocab < least:
        raise ConfigError(f"tokenizer.vocab_size: is {vocab}, but a byte-level BPE holds the {BYTE_VOCAB} bytes and "
                          f"{END_OF_TEXT}; set it to {least} or more (e.g. 4096)")
    for key, value in (("min_frequency", min_frequency), ("train_bytes", train_bytes)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"tokenizer.{key}: must be a positive integer; got {value}")
    key = hashlib.sha256(f"{corpus_key}\0{vocab}\0{min_frequency}\0{train_bytes}\0{lib.__version__}".encode())
    return Path(settings.cache_dir).expanduser() / f"bpe-{key.hexdigest()[:20]}.json"


def _trained_bpe(lib: ModuleType, settings: TokenizerConfig, corpus_key: str,
                 training_text: Callable[[], Iterable[str]]) -> Path:
    """The cached tokenizer.json of a byte-level BPE for this corpus and these settings, trained if missing."""
    vocab, min_frequency, train_bytes = settings.vocab_size, settings.min_frequency, settings.train_bytes
    path = bpe_cache_path(lib, settings, corpus_key)

    def train(tmp: Path) -> None:
        tokenizer = lib.Tokenizer(lib.models.BPE())
        tokenizer.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = lib.decoders.ByteLevel()
        trainer = lib.trainers.BpeTrainer(
            vocab_size=vocab, min_frequency=min_frequency, special_tokens=[END_OF_TEXT], show_progress=False,
            initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet())
        tokenizer.train_from_iterator(_at_most(training_text(), train_bytes), trainer)
        tokenizer.save(str(tmp))
        log.info("trained a byte-level BPE of %d tokens into %s", tokenizer.get_vocab_size(), path)

    build_once(path, train, "tokenizer.cache_dir", settings.cache_dir)
    return path


def _at_most(texts: Iterable[str], limit: int) -> Iterator[str]:
    """The texts until `limit` bytes (UTF-8) are given, the last one cut at a character's end."""
    left = limit
    for text in texts:
        if left <= 0:
            return
        data = text.encode()
        yield text if len(data) <= left else data[:left].decode(errors="ignore")
        left -= len(data)


def build_once(path: Path, build: Callable[[Path], None], key: str, configured: str) -> bool:
    """Build the file `path` unless it exists; whether this process built it.

    Processes that need the same file (the ranks of a run, runs started together) take an exclusive file lock
    beside it first: one builds while the others wait, then find the file. `build` writes a temporary path that
    is renamed into place when it returns, so a failed build leaves nothing behind. `key`/`configured` name the
    setting of the folder in a message when it cannot be written.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise _unwritable(path, exc, key, configured) from None
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as exc:
            if not flock_unsupported(exc):
                raise
            # no flock on this filesystem: concurrent builders each write a whole file of their own (atomic_path)
        if path.exists():
            return False
        try:
            with atomic_path(path) as tmp:
                build(tmp)
        except OSError as exc:  # readers of the input raise DataError naming their file: this is the output
            raise _unwritable(path, exc, key, configured) from None
        return True
    finally:
        os.close(lock)  # releases the flock


def _unwritable(path: Path, exc: OSError, key: str, configured: str) -> DataError:
    return DataError(f"{key}: cannot write {path.name} in {path.parent}{home_note(configured)} "
                     f"({unwritable_reason(path.parent, exc)}); point {key} at a writable folder with room for it")
