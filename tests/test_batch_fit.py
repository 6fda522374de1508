"""Sizes and environments at their limits: a corpus larger than memory, batches that cannot fit, caches that
cannot be written. The one-line messages are rows of test_bad_inputs.py; these tests check the mechanics."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from trainflow.data import load_tokens
from trainflow.data import text as data_module
from trainflow.errors import ConfigError
from trainflow.metrics.batch_fit import micro_batch_bytes
from trainflow.models.gpt import GPT
from trainflow.models.mlp import MLP
from trainflow.tasks import LanguageModel, cross_entropy

CORPUS_BYTES = 1 << 30  # 1 GiB: far above what tokenizing may hold in memory

PEAK_RSS = """
import resource, sys
from omegaconf import OmegaConf
from trainflow.data import load_tokens

def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

before = peak()
tokens = load_tokens(OmegaConf.create({"paths": [sys.argv[1]], "suffixes": [".txt"], "cache_dir": sys.argv[2]}))
print(len(tokens), before, peak())
"""


def test_a_corpus_larger_than_memory_is_tokenized_in_bounded_memory(tmp_path: Path) -> None:
    corpus = tmp_path / "big.txt"
    with open(corpus, "wb") as f:  # sparse: 1 GiB of zero bytes that take no disk until the cache is written
        f.truncate(CORPUS_BYTES)
    out = subprocess.run([sys.executable, "-c", PEAK_RSS, str(corpus), str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    tokens, before, after = map(int, out.stdout.split())
    assert tokens == CORPUS_BYTES
    growth = after - before
    assert growth < 4 * data_module.CHUNK_BYTES, f"peak RSS grew by {growth / 1e6:.0f} MB while tokenizing"
    cache = next((tmp_path / "cache").glob("*.bin"))
    assert cache.stat().st_size == CORPUS_BYTES and not list((tmp_path / "cache").glob("*.tmp*"))


def test_the_chunked_cache_holds_exactly_the_files_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_module, "CHUNK_BYTES", 1000)  # files of several chunks, and chunks ending mid-file
    corpus = tmp_path / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    texts = {"a.py": "print('a')\n" * 500, "pkg/b.py": "é = 'ü'\n" * 301, "pkg/c.py": "", "z.py": "x" * 999}
    for name, text in texts.items():
        (corpus / name).write_text(text)
    cfg = OmegaConf.create({"paths": [str(corpus)], "suffixes": [".py"], "cache_dir": str(tmp_path / "cache")})
    tokens = load_tokens(cfg)
    # what the corpus was cached as before chunking: each file's bytes whole, in the walk's order
    whole = b"".join((corpus / name).read_bytes() for name in ("a.py", "z.py", "pkg/b.py", "pkg/c.py"))
    assert bytes(tokens) == whole and len(whole) == 5500 + 999 + 301 * len("é = 'ü'\n".encode())


def saved_bytes(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """The batch plus every non-weight tensor autograd keeps for backward in a real forward and loss."""
    weights = {id(p) for p in model.parameters()}
    saved = inputs.numel() * inputs.element_size() + targets.numel() * targets.element_size()

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if id(t) not in weights and id(t._base) not in weights:
            saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cross_entropy(model(inputs), targets)
    return saved


def test_meta_estimate_counts_what_autograd_keeps() -> None:
    """Exact for the MLP; for the GPT at least what a real forward saves (the meta attention is the math path)."""
    torch.manual_seed(0)
    for model, sample, rtol in ((MLP(), (torch.randn(1, 100), torch.tensor([3])), 0.0),
                                (GPT(256, 32, 2, 2, 64), (torch.randint(256, (1, 32)),) * 2, 0.5)):
        for batch in (1, 8, 32):
            real = saved_bytes(model, *(t.repeat(batch, *[1] * (t.dim() - 1)) for t in sample))
            estimate = micro_batch_bytes(model, sample, batch, LanguageModel())
            assert real <= estimate <= real * (1 + rtol), (type(model).__name__, batch, real, estimate)


def test_activation_checkpointing_lowers_the_estimate_to_block_inputs_and_one_block() -> None:
    model, sample = GPT(256, 32, 4, 2, 64), (torch.randint(256, (1, 32)),) * 2
    full = micro_batch_bytes(model, sample, 16, LanguageModel())
    checkpointed = micro_batch_bytes(model, sample, 16, LanguageModel(), activation_checkpointing=True)
    one_block_input = 16 * 32 * 64 * 4
    two_layer = micro_batch_bytes(GPT(256, 32, 2, 2, 64), sample, 16, LanguageModel())
    per_block = (full - two_layer) / 2  # each block adds the same activations
    assert checkpointed == pytest.approx(full - 3 * per_block + 4 * one_block_input)  # 4 inputs kept, 1 block live


def test_a_compile_failure_in_the_inductor_cache_names_the_cache(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo.exc import BackendCompilerFailed

    from trainflow.compile.compiler import CACHE_ENV, _explain_compile_failure

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    inner = OSError(errno.EROFS, "Read-only file system", str(tmp_path / "73"))
    error = _explain_compile_failure(BackendCompilerFailed("inductor", inner, None), "inductor")
    assert isinstance(error, ConfigError)
    assert str(error) == (f"compile.cache_dir: cannot write the inductor cache in {tmp_path} (Read-only file "
                          "system); point compile.cache_dir at a writable folder")
    elsewhere = OSError(errno.EROFS, "Read-only file system", "/somewhere/else")
    assert str(_explain_compile_failure(BackendCompilerFailed("inductor", elsewhere, None), "inductor")).startswith(
        "compile.backend: the inductor backend failed")
