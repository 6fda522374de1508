"""data=hf (trainflow.data.hf.token_windows) on real files read by the real `datasets` library.

The factory is what `data._target_` calls; these tests call it as trainflow does (the data section's keys) and
check what it gives: windows in either convention, the same tokens from every file format, a cache that later
runs read without `datasets`, and one line for each bad input. A Hugging Face GPT-2 learns from its windows.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from trainflow.data.hf import token_windows
from trainflow.data.tokenizers import END_OF_TEXT
from trainflow.errors import ConfigError, DataError

ROWS = [f"Row {i}: the quick brown fox jumps over {i % 7} lazy dogs; ünïcödé ✓." for i in range(200)]


def write(folder: Path, fmt: str, rows: list[str] = ROWS) -> Path:
    """The rows as a file of format `fmt` (with a second, numeric column), written by real writers."""
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path = folder / "rows.jsonl"
        path.write_text("".join(json.dumps({"text": r, "n": i}) + "\n" for i, r in enumerate(rows)))
    elif fmt == "json":
        path = folder / "rows.json"
        path.write_text(json.dumps([{"text": r, "n": i} for i, r in enumerate(rows)]))
    elif fmt == "csv":
        import csv

        path = folder / "rows.csv"
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "n"])
            writer.writerows([r, i] for i, r in enumerate(rows))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "rows.parquet"
        pq.write_table(pa.table({"text": rows, "n": list(range(len(rows)))}), path)
    else:
        path = folder / "rows.txt"
        path.write_text("".join(r + "\n" for r in rows))
    return path


def bpe(tmp_path: Path, vocab_size: int = 400) -> dict:
    return {"kind": "bpe", "vocab_size": vocab_size, "min_frequency": 2, "train_bytes": 10**8,
            "cache_dir": str(tmp_path / "tokenizers")}


def windows(tmp_path: Path, paths: list, **keys) -> dict:
    return token_windows([str(p) for p in paths], keys.pop("seq_len", 16), cache_dir=str(tmp_path / "hf"), **keys)


def test_windows_in_either_convention_hold_the_rows_text(tmp_path: Path) -> None:
    path = write(tmp_path / "data", "jsonl")
    data = windows(tmp_path, [path], tokenizer=bpe(tmp_path), model_vocab_size=400)
    train, val = data["train"], data["val"]
    tokens = np.concatenate([train.tokens, val.tokens])
    tok_file, = (tmp_path / "tokenizers").glob("bpe-*.json")
    from tokenizers import Tokenizer

    decoded = Tokenizer.from_file(str(tok_file)).decode(tokens.tolist(), skip_special_tokens=False)
    assert decoded == "".join(r + END_OF_TEXT for r in ROWS)  # every row, in order, each ended by end-of-text
    assert train.tokens.dtype == np.uint16 and len(val.tokens) == len(tokens) - int(len(tokens) * 0.95)
    assert len(train) == (len(train.tokens) - 1) // 16
    inputs, targets = train[3]
    assert inputs.dtype == torch.int64 and inputs.shape == targets.shape == (16,)
    assert torch.equal(inputs[1:], targets[:-1]) and inputs[0] == int(train.tokens[48])
    as_dict = windows(tmp_path, [path], tokenizer=bpe(tmp_path), items="dict")["train"]
    item = as_dict[3]
    assert set(item) == {"input_ids", "labels"} and torch.equal(item["input_ids"], item["labels"])
    assert torch.equal(item["input_ids"], torch.from_numpy(train.tokens[48:64].astype(np.int64)))
    assert len(as_dict) == len(train.tokens) // 16
    batch = default_collate([as_dict[i] for i in range(4)])
    assert batch["input_ids"].shape == (4, 16)
    with pytest.raises(IndexError):
        train[len(train)]


@pytest.mark.parametrize("fmt", ["json", "csv", "parquet", "text"])
def test_every_format_gives_the_same_tokens(tmp_path: Path, fmt: str) -> None:
    reference = windows(tmp_path, [write(tmp_path / "ref", "jsonl")])["train"].tokens
    got = windows(tmp_path, [write(tmp_path / fmt, fmt)])["train"].tokens
    assert got.dtype == np.uint8 and np.array_equal(got, reference)  # bytes: each row's UTF-8 then a newline
    assert bytes(reference[:40]) == (ROWS[0] + "\n").encode()[:40]


def test_a_validation_split_given_as_files(tmp_path: Path) -> None:
    train_path = write(tmp_path / "train", "jsonl")
    val_path = write(tmp_path / "val", "csv", ROWS[:20])
    data = windows(tmp_path, [train_path], val_paths=[str(val_path)])
    assert bytes(data["train"].tokens) == "".join(r + "\n" for r in ROWS).encode()
    assert bytes(data["val"].tokens) == "".join(r + "\n" for r in ROWS[:20]).encode()


CACHED = """
import sys
sys.modules["datasets"] = None  # importing datasets now fails: the cache must be enough
from trainflow.data.hf import token_windows
data = token_windows([sys.argv[1]], 16, cache_dir=sys.argv[2], tokenizer={"kind": "bpe", "vocab_size": 400,
                     "min_frequency": 2, "train_bytes": 10**8, "cache_dir": sys.argv[3]})
print(len(data["train"]), int(data["train"].tokens.sum()))
"""


def test_later_runs_read_the_cache_without_datasets(tmp_path: Path) -> None:
    path = write(tmp_path / "data", "jsonl")
    first = windows(tmp_path, [path], tokenizer=bpe(tmp_path))["train"]
    out = subprocess.run([sys.executable, "-c", CACHED, str(path), str(tmp_path / "hf"), str(tmp_path / "tokenizers")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [str(len(first)), str(int(first.tokens.sum()))]
    os.utime(path, ns=(1, 1))  # the file changed (its time): read and tokenized again, the old cache unused
    again = subprocess.run([sys.executable, "-c", CACHED, str(path), str(tmp_path / "hf"),
                            str(tmp_path / "tokenizers")], capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "datasets" in again.stderr


def test_the_hub_is_off_unless_the_environment_says_otherwise(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "data", "jsonl")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    windows(tmp_path, [path])
    assert os.environ["HF_DATASETS_OFFLINE"] == "1" and os.environ["HF_HUB_OFFLINE"] == "0"


def bad(tmp_path: Path) -> dict:
    """Files for the bad inputs below."""
    folder = tmp_path / "data"
    return {"good": write(folder, "jsonl"), "short": write(tmp_path / "short", "csv", ["tiny"]),
            "mixed": [write(tmp_path / "m", "jsonl"), write(tmp_path / "m", "csv")]}


@pytest.mark.parametrize(("keys", "error", "message"), [
    ({"paths": ["{tmp}/nope.jsonl"]}, DataError,
     "data.paths: {tmp}/nope.jsonl does not exist; give json, jsonl, csv, parquet or text files"),
    ({"paths": ["{tmp}/data/*.parquet"]}, DataError,
     "data.paths: {tmp}/data/*.parquet matches no file; give json, jsonl, csv, parquet or text files"),
    ({"paths": []}, ConfigError, "data.paths: no files given; name local files, e.g. data.paths=[corpus.jsonl]"),
    ({"column": "body"}, ConfigError, "data.column: {tmp}/data/rows.jsonl has no column 'body'; the columns there "
     "are text, n: set data.column to one of them"),
    ({"column": "n"}, ConfigError,
     "data.column: column 'n' of {tmp}/data/rows.jsonl holds int64, not text; set data.column to a column of text"),
    ({"paths": ["{tmp}/short/rows.csv"]}, DataError, "data.paths: the training split has 4 bytes (val_fraction=0.05), "
     "too short for one sequence of 17 bytes; add text or lower data.seq_len"),
    ({"val_paths": ["{tmp}/short/rows.csv"]}, DataError, "data.val_paths: the validation split has 5 bytes, too short "
     "for one sequence of 17 bytes; add text or lower data.seq_len"),
    ({"paths": ["{tmp}/m/rows.jsonl", "{tmp}/m/rows.csv"]}, ConfigError, "data.format: cannot tell one format from "
     "the suffixes .csv, .jsonl; set data.format to json, csv, parquet or text"),
    ({"format": "xml"}, ConfigError,
     "data.format: must be null (from the suffixes) or one of json, csv, parquet, text; got 'xml'"),
    ({"items": "list"}, ConfigError, "data.items: must be one of tuple, dict; got 'list'"),
    ({"val_fraction": 1.5}, ConfigError, "data.val_fraction: must be in (0, 1); got 1.5"),
    ({"model_vocab_size": 100}, ConfigError, "model.vocab_size: is 100, but the tokenizer (tokenizer=bytes) has 256 "
     "tokens; set model.vocab_size to 256 or more (its default follows tokenizer.vocab_size), or pick a smaller "
     "tokenizer.vocab_size"),
])
def test_bad_inputs_are_one_line(tmp_path: Path, keys: dict, error: type, message: str) -> None:
    files = bad(tmp_path)
    fill = lambda v: [p.replace("{tmp}", str(tmp_path)) for p in v] if isinstance(v, list) else v  # noqa: E731
    keys = {"paths": [str(files["good"])], **{k: fill(v) for k, v in keys.items()}}
    with pytest.raises(error) as err:
        windows(tmp_path, keys.pop("paths"), **keys)
    assert str(err.value) == message.replace("{tmp}", str(tmp_path))


def test_a_file_datasets_cannot_parse_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(DataError) as err:
        windows(tmp_path, [path])
    assert str(err.value).startswith(f"data.paths: datasets cannot read {path} as json (")
    assert str(err.value).endswith("); fix the files, or set data.format to what they are")
    assert "\n" not in str(err.value)


NO_DATASETS = """
import sys
sys.modules["datasets"] = None  # as if trainflow[hf] were not installed
from trainflow.data.hf import token_windows
from trainflow.errors import TrainflowError
try:
    token_windows([sys.argv[1]], 16, cache_dir=sys.argv[2])
except TrainflowError as exc:
    print(exc)
"""


def test_data_hf_without_the_extra_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path / "data", "jsonl")
    out = subprocess.run([sys.executable, "-c", NO_DATASETS, str(path), str(tmp_path / "hf")], capture_output=True,
                         text=True, timeout=300)
    assert out.stdout.strip() == "data=hf: needs the datasets library, which is not installed; run pip install " \
                                 "'trainflow[hf]'", out.stderr[-2000:]


def test_a_hf_gpt2_learns_from_the_windows(tmp_path: Path) -> None:
    """What experiment=hf_gpt2 trains, step by step: dict windows, collated, the model's own loss."""
    from trainflow.models.hf import gpt2

    corpus = Path(__file__).resolve().parents[1] / "examples" / "data" / "stdlib_docstrings.jsonl"
    data = token_windows([str(corpus)], 32, items="dict", cache_dir=str(tmp_path / "hf"),
                         tokenizer={**bpe(tmp_path, 1024), "train_bytes": 200_000}, model_vocab_size=1024)
    torch.manual_seed(0)
    model = gpt2(vocab_size=1024, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    order = torch.randperm(len(data["train"]), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(40):
        batch = default_collate([data["train"][int(i)] for i in order[step * 16:(step + 1) * 16]])
        loss = model(**batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(1024)) < 0.1 * math.log(1024), losses[:3]  # random init over 1024 tokens
    assert sum(losses[-5:]) / 5 < losses[0] - 0.6, losses
    with torch.no_grad():
        val = default_collate([data["val"][i] for i in range(8)])
        assert model(**val).loss.item() < losses[0] - 0.5  # held-out text too


NO_TRANSFORMERS = """
import sys
sys.modules["transformers"] = None  # as if trainflow[hf] were not installed
from trainflow.errors import TrainflowError
from trainflow.models.hf import gpt2
try:
    gpt2(vocab_size=300)
except TrainflowError as exc:
    print(exc)
"""


def test_the_hf_model_without_the_extra_is_one_line() -> None:
    out = subprocess.run([sys.executable, "-c", NO_TRANSFORMERS], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "model._target_: needs the transformers library, which is not installed; run pip " \
                                 "install 'trainflow[hf]'", out.stderr[-2000:]


def test_a_misspelt_gpt2_key_is_one_line_not_an_ignored_attribute() -> None:
    from trainflow.models.hf import gpt2

    with pytest.raises(ConfigError) as err:
        gpt2(vocab_size=300, n_embed=64)
    assert str(err.value) == ("model.n_embed: not a GPT2Config key; use GPT2Config's names, e.g. n_embd, n_layer, "
                              "n_head, n_positions, vocab_size")
    model = gpt2(vocab_size=300, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    assert model.config.vocab_size == 300 and model.config.use_cache is False
    assert model.transformer.wte.weight.shape == (300, 32)
