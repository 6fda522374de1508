"""Tokenizers (trainflow.data.tokenizers) on real files with the real `tokenizers` library, and data=text with them.

Bytes stay what they were (the same cache, uint8); a BPE is trained once per corpus and settings, shared by the
ranks (one trains, under a file lock), and keys the token cache; a user's tokenizer.json is loaded as it is.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers.runs import TINY_GPT, train
from omegaconf import OmegaConf

from trainflow.conf import CONFIG_DIR
from trainflow.data import text as text_module
from trainflow.data.text import Corpus, load_tokens
from trainflow.data.tokenizers import END_OF_TEXT, Tokenizer, build_tokenizer
from trainflow.errors import ConfigError, DataError

SOURCE = Path(text_module.__file__)  # real text: Python source


def corpus(tmp_path: Path) -> Path:
    """Three real source files (one with characters outside ASCII), about 40 kB."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for path in (SOURCE, SOURCE.parent / "loaders.py", SOURCE.parent / "stream.py"):
        (folder / path.name).write_text(path.read_text())
    (folder / "stream.py").write_text((folder / "stream.py").read_text() + "# déjà vu: ünïcödé ✓\n" * 50)
    return folder


def text_cfg(folder: Path, tmp_path: Path, tokenizer: dict | None) -> OmegaConf:
    return OmegaConf.create({"paths": [str(folder)], "suffixes": [".py"], "cache_dir": str(tmp_path / "tokens"),
                             "tokenizer": tokenizer})


def bpe(tmp_path: Path, vocab_size: int = 600) -> dict:
    return {"kind": "bpe", "vocab_size": vocab_size, "min_frequency": 2, "train_bytes": 10**8,
            "cache_dir": str(tmp_path / "tokenizers")}


def test_bytes_keep_the_byte_cache_as_it_was(tmp_path: Path) -> None:
    folder = corpus(tmp_path)
    plain = load_tokens(text_cfg(folder, tmp_path, None))
    named = load_tokens(text_cfg(folder, tmp_path, {"kind": "bytes", "vocab_size": 256}))
    files = Corpus.of(text_cfg(folder, tmp_path, None)).files
    assert plain.dtype == named.dtype == np.uint8
    assert bytes(named) == bytes(plain) == b"".join(f.read_bytes() for f in files)  # no separator: as before
    cache, = (tmp_path / "tokens").glob("*.bin")  # one cache for both, named by the corpus alone
    assert cache.name == f"{Corpus.of(text_cfg(folder, tmp_path, None)).key[:20]}.bin"


def test_the_bpe_is_trained_once_per_corpus_and_settings(tmp_path: Path) -> None:
    texts = [path.read_text() for path in (SOURCE, SOURCE.parent / "loaders.py", SOURCE.parent / "stream.py")]
    calls = []

    def training_text() -> list[str]:
        calls.append(1)
        return texts

    first = build_tokenizer(bpe(tmp_path), "corpus-a", training_text)
    again = build_tokenizer(bpe(tmp_path), "corpus-a", training_text)
    other = build_tokenizer(bpe(tmp_path, 300), "corpus-a", training_text)
    assert len(calls) == 2  # the second build read the cached tokenizer.json; another vocab_size trained anew
    assert first.name == again.name != other.name and first.name.startswith("bpe-")
    assert first.vocab_size <= 600 and other.vocab_size <= 300 and first.vocab_size > other.vocab_size > 257
    assert first.encoder.token_to_id(END_OF_TEXT) == 0 and first.separator == (0,)
    ids = first.encode([texts[0]])[0]
    assert first.encoder.decode(ids) == texts[0] and len(ids) < len(texts[0]) / 2  # merges learnt from the text
    assert len(list((tmp_path / "tokenizers").glob("bpe-*.json"))) == 2


def test_the_bpe_learns_from_the_first_train_bytes_only(tmp_path: Path) -> None:
    first, later = "ab ab ab ab é\n" * 100, "xy xy xy xy\n" * 100
    settings = {**bpe(tmp_path, 300), "train_bytes": len(first.encode())}
    tok = build_tokenizer(settings, "corpus", lambda: [first, later])
    assert tok.encoder.token_to_id("ab") is not None and tok.encoder.token_to_id("xy") is None
    everything = build_tokenizer(bpe(tmp_path, 300), "corpus", lambda: [first, later])
    assert everything.encoder.token_to_id("xy") is not None  # the same text without the limit: merged


RACE = """
import sys, time
from trainflow.data.tokenizers import build_tokenizer
trained = []
def text():
    trained.append(1)
    time.sleep(1.0)  # a slow training: the other process arrives while this one trains
    return ["def f(x):\\n    return x + 1\\n" * 40]
start = float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))
tok = build_tokenizer({"kind": "bpe", "vocab_size": 300, "min_frequency": 2, "train_bytes": 10**8,
                       "cache_dir": sys.argv[1]}, "corpus", text)
print(len(trained), tok.name)
"""


def test_ranks_starting_together_train_the_bpe_once(tmp_path: Path) -> None:
    import time

    start = time.time() + 3  # both processes are imported and waiting by then
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(tmp_path), str(start)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    results = [out.split() for out, _ in outs]
    assert sorted(int(trained) for trained, _ in results) == [0, 1]  # one trained, the other waited and loaded
    assert results[0][1] == results[1][1]
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == 1  # one tokenizer.json, no leftovers


def test_text_with_bpe_caches_tokens_keyed_by_the_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(text_module, "PIECE_BYTES", 1000)  # many pieces, cut inside lines and inside characters
    folder = corpus(tmp_path)
    cfg = text_cfg(folder, tmp_path, bpe(tmp_path))
    c = Corpus.of(cfg)
    tok = c.tokenizer(cfg.tokenizer)
    tokens = c.tokens(tok, cfg)
    assert tokens.dtype == np.uint16 and isinstance(tokens, np.memmap)
    # the cache holds each file's text, then the end-of-text token, and nothing else
    decoded = tok.encoder.decode(tokens.tolist(), skip_special_tokens=False)
    assert decoded == "".join(f.read_text() + END_OF_TEXT for f in c.files)
    assert int((tokens == 0).sum()) == len(c.files)
    smaller = text_cfg(folder, tmp_path, bpe(tmp_path, 300))
    other = Corpus.of(smaller).tokens(Corpus.of(smaller).tokenizer(smaller.tokenizer), smaller)
    assert len(other) > len(tokens)  # fewer merges, more tokens: a cache of its own
    names = sorted(p.name for p in (tmp_path / "tokens").glob("*.bin"))
    assert len(names) == 2 and all(n.startswith(f"{c.key[:20]}-bpe-") for n in names)


def test_token_dtypes_follow_the_vocabulary() -> None:
    sizes = {256: np.uint8, 257: np.uint16, 65536: np.uint16, 65537: np.uint32}
    for size, dtype in sizes.items():
        assert Tokenizer("bpe", size, ()).dtype == dtype


def test_a_users_tokenizer_json_is_loaded_as_it_is(tmp_path: Path) -> None:
    trained = build_tokenizer(bpe(tmp_path, 400), "corpus", lambda: ["for i in range(10):\n    print(i)\n" * 50])
    path = tmp_path / "mine.json"
    trained.encoder.save(str(path))
    mine = build_tokenizer({"kind": "file", "path": str(path), "vocab_size": trained.vocab_size}, "unused",
                           lambda: pytest.fail("a file tokenizer is never trained"))
    text = "for j in range(3):\n    print(j)\n"
    assert mine.encode([text]) == trained.encode([text]) and mine.name.startswith("file-")
    with pytest.raises(ConfigError) as wrong:
        build_tokenizer({"kind": "file", "path": str(path), "vocab_size": 256}, "", list)
    assert str(wrong.value) == (f"tokenizer.vocab_size: is 256, but {path} has {trained.vocab_size} tokens; set "
                                f"tokenizer.vocab_size={trained.vocab_size} (the model's vocabulary follows it)")
    with pytest.raises(DataError) as missing:
        build_tokenizer({"kind": "file", "path": str(tmp_path / "nope.json"), "vocab_size": 9}, "", list)
    assert str(missing.value) == (f"tokenizer.path: {tmp_path / 'nope.json'} does not exist; give the tokenizer.json "
                                  "written by tokenizers' Tokenizer.save (or pick tokenizer=bpe to train one here)")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(DataError, match=r"^tokenizer.path: .*junk.json is not a tokenizer.json the tokenizers "
                                        r"library can read \(.+\); give a file written by tokenizers' Tokenizer.save$"):
        build_tokenizer({"kind": "file", "path": str(tmp_path / "junk.json"), "vocab_size": 9}, "", list)


@pytest.mark.parametrize(("settings", "message"), [
    ({"kind": "words"}, "tokenizer.kind: must be one of bytes, bpe, file; got 'words'"),
    ({"kind": "bytes", "vocab_size": 1000}, "tokenizer.vocab_size: is 1000, but tokenizer=bytes has 256 tokens (one a "
     "byte); leave it at 256, or pick tokenizer=bpe for a vocabulary of your size"),
    ({"kind": "bpe", "vocab_size": 100, "min_frequency": 2, "train_bytes": 1}, "tokenizer.vocab_size: is 100, but a "
     "byte-level BPE holds the 256 bytes and <|endoftext|>; set it to 257 or more (e.g. 4096)"),
    ({"kind": "bpe", "vocab_size": 300, "min_frequency": 0, "train_bytes": 1},
     "tokenizer.min_frequency: must be a positive integer; got 0"),
    ({"kind": "file", "vocab_size": 300}, "tokenizer.path: not set; give your tokenizer.json, e.g. "
     "tokenizer.path=/data/tokenizer.json tokenizer.vocab_size=50257"),
])
def test_bad_tokenizer_settings_are_one_line(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_tokenizer(settings, "", list)
    assert str(err.value) == message


def test_a_tokenizer_larger_than_the_model_names_both_keys() -> None:
    with pytest.raises(ConfigError) as err:
        Tokenizer("bpe", 4096, (0,)).check_fits(1000)
    assert str(err.value) == ("model.vocab_size: is 1000, but the tokenizer (tokenizer=bpe) has 4096 tokens; set "
                              "model.vocab_size to 4096 or more (its default follows tokenizer.vocab_size), or pick a "
                              "smaller tokenizer.vocab_size")
    Tokenizer("bpe", 4096, (0,)).check_fits(4096)  # equal fits


MISSING_EXTRA = textwrap.dedent("""
    import sys
    sys.modules["tokenizers"] = None  # as if trainflow[hf] were not installed: importing it raises ImportError
    sys.argv = ["train.py", *sys.argv[1:]]
    import runpy
    runpy.run_path("train.py", run_name="__main__")
""")


def test_bpe_without_the_hf_extra_is_one_line(tmp_path: Path) -> None:
    folder = corpus(tmp_path)
    out = train(tmp_path / "run", *TINY_GPT, "trainer.max_steps=2", "tokenizer=bpe", f"data.paths=[{folder}]",
                f"data.cache_dir={tmp_path}/tokens", command=[sys.executable, "-c", MISSING_EXTRA])
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Error: tokenizer=bpe: needs the tokenizers library, which is not installed; run pip install " \
           "'trainflow[hf]'" in out.stderr.splitlines()
    assert "Traceback" not in out.stderr


def test_gpt_on_text_with_bpe_trains_end_to_end_and_reuses_its_caches(tmp_path: Path) -> None:
    """model=gpt_tiny tokenizer=bpe: the model's vocabulary follows the tokenizer's (first loss ~ ln 512)."""
    folder = corpus(tmp_path)
    args = [*TINY_GPT, "trainer.max_steps=30", "trainer.eval_every=0", "trainer.eval_steps=2", "tokenizer=bpe",
            "tokenizer.vocab_size=512", f"tokenizer.cache_dir={tmp_path}/tokenizers", f"data.paths=[{folder}]",
            f"data.cache_dir={tmp_path}/tokens", "optim.warmup_steps=5"]
    first = train(tmp_path / "run1", *args, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    log = (tmp_path / "run1" / "train.log").read_text()
    assert "trained a byte-level BPE" in log and "tokenized 3 files into" in log
    losses = first.losses()
    assert abs(losses[0] - math.log(512)) < 0.15 * math.log(512), losses[:3]  # 512 logits, not 256
    assert sum(losses[-5:]) / 5 < losses[0] - 0.4, losses  # it learns
    cache, = (tmp_path / "tokens").glob("*-bpe-*.bin")
    assert cache.stat().st_size % 2 == 0  # uint16 tokens
    second = train(tmp_path / "run2", *args, "trainer.max_steps=2", timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    log = (tmp_path / "run2" / "train.log").read_text()
    assert "trained a byte-level BPE" not in log and "tokenized" not in log  # both caches reused
    assert second.losses()[0] == losses[0]  # the same tokens, the same model: the same first loss


def test_every_gpt_follows_the_tokenizers_vocabulary() -> None:
    from hydra import compose, initialize_config_dir

    from trainflow.config.checks import check_config

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        for model in ("gpt_tiny", "gpt_small", "gpt_medium"):
            default = compose("train", overrides=[f"model={model}"])
            assert default.model.vocab_size == 256 and default.tokenizer.kind == "bytes"
            cfg = compose("train", overrides=[f"model={model}", "tokenizer=bpe"])
            check_config(cfg)
            assert cfg.model.vocab_size == cfg.tokenizer.vocab_size == 4096
        small = compose("train", overrides=["tokenizer=file", "tokenizer.path=/t.json", "tokenizer.vocab_size=100"])
        check_config(small)  # a small vocabulary of one's own is not held to the byte vocabulary of tokenizer=bytes
        assert small.model.vocab_size == 100


PEAK_RSS = """
import resource, sys
from omegaconf import OmegaConf
from trainflow.data import load_tokens

def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

settings = {"kind": "bpe", "vocab_size": 1000, "min_frequency": 2, "train_bytes": 1 << 20, "cache_dir": sys.argv[2]}
cfg = OmegaConf.create({"paths": [sys.argv[1]], "suffixes": [".py"], "cache_dir": sys.argv[2], "tokenizer": settings})
import tokenizers  # the library's own memory is not the corpus's
before = peak()
tokens = load_tokens(cfg)
print(len(tokens), before, peak())
"""


@pytest.mark.slow
def test_a_large_corpus_is_encoded_in_bounded_memory(tmp_path: Path) -> None:
    """32 MB of source through a BPE: held whole (text, encodings, ids) it would take far more than the bound."""
    big = tmp_path / "big.py"
    line_blocks = SOURCE.read_text().splitlines(keepends=True)
    with open(big, "w") as f:
        for i in range((32 << 20) // len(SOURCE.read_bytes()) + 1):
            f.write(f"# copy {i}\n")
            f.writelines(line_blocks)
    size = big.stat().st_size
    out = subprocess.run([sys.executable, "-c", PEAK_RSS, str(big), str(tmp_path / "cache")], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    tokens, before, after = map(int, out.stdout.split())
    assert size / 8 < tokens < size / 2  # merges learnt from the first MB carry over
    assert after - before < 200 << 20, f"peak RSS grew by {(after - before) / 1e6:.0f} MB encoding {size / 1e6:.0f} MB"
