"""The data path's cost on an experiment: data-wait fraction and steady-state throughput, data.num_workers 0 vs 2.

Both settings train the same experiment for the same steps in one process, alternating round by round, so that
the machine's load falls on both alike; each round's steady state (after warm-up) comes from the run's own
summary. Reported: the median samples/s and data-wait fraction of each, and the median of the per-round ratios
(workers 2 / workers 0). With 0 workers, items are gathered and collated in the training process, between steps;
with 2, worker processes prepare the next batches while the step runs.

    python benchmarks/data_path.py [--experiment digits] [--rounds 3] [--steps 150] [--threads N] [override ...]
    python benchmarks/data_path.py --what sampler     # the stream's order: per-index permutation vs randperm
    python benchmarks/data_path.py --what prepare     # trainflow prepare vs a plain tokenizers batch-encode loop
    python benchmarks/data_path.py --what loader      # data=shards' windows vs datasets and Mosaic streaming
    python benchmarks/data_path.py --what gather      # a data=shards micro-batch's CPU time, alone and after a step

--what sampler: the memory (RSS growth) and time per micro-batch of the sample stream at n = 1e6, 1e9, 1e12
samples, the per-index permutation (stream version 2) beside the stored torch.randperm (version 1) where it fits
in memory (n = 1e6: 8 bytes a sample, so 1e9 would take 8 GB a rank). --what prepare: tokens/s of `trainflow
prepare` with one worker (encode, write the shard, checksum it) against a loop that only encodes the same pieces
with the same BPE, on the same corpus, alternating round by round. --what loader: tokens/s, of wall time and per
CPU-second of the process (all its threads), of micro-batches of 32 windows of 129 tokens from 8 copies of
trainflow's src/ prepared into shards: ShardWindows gathering the shuffled stream's indices from the memory maps;
`datasets.load_dataset("parquet", streaming=True)` over one parquet file per shard holding the same windows, read
in order and stacked into the same batch tensor; Mosaic `streaming.StreamingDataset` over the same windows written
by its `MDSWriter` (local, no remote), shuffled as its users do (`shuffle=True`, its py1e default) and batched by
its `StreamingDataLoader`; the three in turn within each round, no loader workers. Mosaic is measured only when it
is installed (it is no dependency of trainflow's). Its requirements pull another torch (a CUDA build), so install
it without them, with the few its import needs:

    pip install --no-deps mosaicml-streaming==0.13.0 brotli python-snappy cramjam zstd catalogue

(its package imports torchvision for its vision datasets; PyPI's torchvision is a CUDA build that does not load
beside torch's CPU wheel, so without torchvision this script leaves that subpackage out). --what gather: the CPU
time of one micro-batch of 8 windows of 33 tokens, alone and right after a backward pass: what the training
process pays between two steps with data.num_workers=0.

--threads sets torch's intra-op threads: on a machine whose cores other processes also use, two threads of a
small model's step wait on each other (measured here: 7 ms a step with one thread, 40-80 ms with two), which
would drown the data path's own cost.

A user's project: add its conf folder and its package, e.g.
`PYTHONPATH=examples/my_project python benchmarks/data_path.py --experiment my_project
--config-dir examples/my_project/conf`.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from trainflow.cli import register_with_hydra
from trainflow.conf import CONFIG_DIR
from trainflow.config.checks import check_config
from trainflow.run.training import train

ROOT = Path(__file__).resolve().parents[1]
register_with_hydra()  # before composing configs, as train.py does
COMMON = ["compile=off", "logger=none", "trainer.eval_every=0", "trainer.eval_steps=1", "trainer.excluded_steps=10",
          "trainer.log_every=50"]
WORKERS = {0: ["data.num_workers=0"], 2: ["data.num_workers=2", "data.persistent_workers=true"]}


def steady(cfg_dir: Path, extra_dir: Path | None, overrides: list[str]) -> dict[str, float]:
    """One run's steady-state samples/s and data-wait fraction, from its summary."""
    with initialize_config_dir(str(cfg_dir), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, *([f"hydra.searchpath=[file://{extra_dir}]"] if extra_dir
                                                        else [])])
    cfg = check_config(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        summary = train(cfg, Path(tmp))
    return {"samples_per_sec": summary["steady_state"]["samples_per_sec"],
            "data_wait_fraction": summary["data_wait_fraction"]}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def sampler_costs(batches: int) -> None:
    """Per-batch time and RSS growth of this rank's stream (rank 0 of 8, 32 samples a micro-batch)."""
    from trainflow.data.stream import StreamSampler

    for n in (10**6, 10**9, 10**12):
        for version in (1, 2) if n <= 10**6 else (2,):
            before, started = rss(), time.perf_counter()
            stream = iter(StreamSampler(n, 32, 0, 8, seed=0, version=version))
            next(stream)  # the epoch's start: randperm draws the whole order here
            first = time.perf_counter() - started
            started = time.perf_counter()
            for _ in range(batches):
                next(stream)
            per_batch = (time.perf_counter() - started) / batches
            name = "randperm (v1)" if version == 1 else "per-index (v2)"
            print(f"n={n:.0e} {name:15s}: first batch {first * 1e3:8.1f} ms, then {per_batch * 1e6:7.1f} us/batch, "
                  f"RSS +{(rss() - before) / 2**20:7.1f} MiB")


def prepare_throughput(rounds: int) -> None:
    """trainflow prepare (1 worker) against encode_batch over the same pieces, tokens/s, alternating."""
    from omegaconf import OmegaConf

    from trainflow.data.shards import prepare
    from trainflow.data.text import PIECES_AT_ONCE, Corpus, _pieces

    corpus = Corpus.of(OmegaConf.create({"paths": [str(ROOT / "src")], "suffixes": [".py"]}))
    with tempfile.TemporaryDirectory() as tmp:
        tok = corpus.tokenizer(OmegaConf.create({"kind": "bpe", "vocab_size": 4096, "cache_dir": f"{tmp}/tok"}))
        ours, plain = [], []
        for r in range(rounds):
            started = time.perf_counter()
            manifest = prepare(corpus, tok, Path(tmp) / f"out{r}", workers=1, progress=False).manifest
            ours.append(manifest["tokens"] / (time.perf_counter() - started))
            started, tokens = time.perf_counter(), 0
            for f in corpus.files:
                pieces = list(_pieces(f))
                for i in range(0, len(pieces), PIECES_AT_ONCE):
                    tokens += sum(len(e.ids) for e in tok.encoder.encode_batch(pieces[i:i + PIECES_AT_ONCE]))
            plain.append(tokens / (time.perf_counter() - started))
    print(f"corpus: {len(corpus.files)} files of src/, {manifest['tokens']} tokens (BPE 4096)")
    print(f"trainflow prepare, 1 worker: median {statistics.median(ours) / 1e3:8.0f}k tokens/s")
    print(f"tokenizers encode_batch loop: median {statistics.median(plain) / 1e3:8.0f}k tokens/s")
    ratios = [a / b for a, b in zip(ours, plain, strict=True)]
    print(f"prepare / plain loop: median {statistics.median(ratios):.3f} (rounds: "
          f"{', '.join(f'{r:.3f}' for r in ratios)})")


def _timed(read: Callable[[], int]) -> tuple[float, float]:
    """(tokens per second of wall time, tokens per CPU-second of this process, all its threads) of one read."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = read()
    return tokens / (time.perf_counter() - wall), tokens / (time.process_time() - cpu)


def _import_mosaic() -> Any | None:
    """Mosaic's `streaming`, or None when it is not installed. Its package imports its vision datasets, hence
    torchvision, at import; PyPI's torchvision is a CUDA build that does not load beside torch's CPU wheel, so
    when torchvision is absent that one subpackage (unused here) is left out."""
    import importlib.util

    if importlib.util.find_spec("streaming") is None:
        return None
    if importlib.util.find_spec("torchvision") is None:
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


def loader_throughput(rounds: int, batches: int = 1200, copies: int = 8) -> None:
    """Tokens/s (wall and per CPU-second) of data=shards' windows against Hugging Face datasets streaming and Mosaic
    streaming over the same windows, alternating within each round."""
    import datasets
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from omegaconf import OmegaConf

    from trainflow.data.shards import ShardWindows, prepare, read_manifest
    from trainflow.data.stream import StreamSampler
    from trainflow.data.text import Corpus

    seq_len, b = 128, 32
    tokens_a_batch = b * (seq_len + 1)
    streaming = _import_mosaic()
    with tempfile.TemporaryDirectory() as tmp:
        for copy in range(copies):  # a corpus of several epochs' worth of micro-batches: epoch starts stay rare
            shutil.copytree(ROOT / "src", f"{tmp}/corpus/{copy}", ignore=shutil.ignore_patterns("__pycache__"))
        corpus = Corpus.of(OmegaConf.create({"paths": [f"{tmp}/corpus"], "suffixes": [".py"]}))
        tok = corpus.tokenizer(OmegaConf.create({"kind": "bpe", "vocab_size": 4096, "cache_dir": f"{tmp}/tok"}))
        out = Path(tmp) / "shards"
        prepare(corpus, tok, out, workers=1, shard_bytes=1 << 20, progress=False)
        manifest = read_manifest(out)
        files, windows_of = [], []
        for i, shard in enumerate(manifest["shards"]):  # the same windows, a parquet file (and an MDS shard) a shard
            tokens = np.fromfile(out / shard["name"], dtype=manifest["dtype"])
            rows = [tokens[k * seq_len:k * seq_len + seq_len + 1] for k in range((len(tokens) - 1) // seq_len)]
            windows_of.append(rows)
            if rows:
                files.append(f"{tmp}/p{i}.parquet")
                pq.write_table(pa.table({"ids": [r.astype(np.int64).tolist() for r in rows]}), files[-1])
        windows = ShardWindows(out, manifest, seq_len)

        def ours() -> int:
            stream = iter(StreamSampler(len(windows), b, 0, 1, seed=0))
            for _ in range(batches):
                windows[next(stream)]
            return batches * tokens_a_batch

        rows = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)

        def hf() -> int:
            taken = 0
            while taken < batches:  # pass after pass over the windows (a streaming dataset restarts when iterated)
                batch = []
                for row in rows:
                    batch.append(row["ids"])
                    if len(batch) == b:
                        _split(torch.tensor(batch))
                        batch, taken = [], taken + 1
                        if taken == batches:
                            break
            return batches * tokens_a_batch

        mosaic = None
        if streaming is not None:
            mds = f"{tmp}/mds"
            shard_limit = max(s["bytes"] for s in manifest["shards"]) + 1024  # about one MDS shard per shard
            with streaming.MDSWriter(out=mds, columns={"tokens": f"ndarray:{manifest['dtype']}"},
                                     size_limit=shard_limit) as writer:
                for rows_of_shard in windows_of:
                    for row in rows_of_shard:
                        writer.write({"tokens": row})
            # as its users read it: shuffled (its default py1e algorithm), its loader collating dicts of arrays
            dataset = streaming.StreamingDataset(local=mds, shuffle=True, shuffle_seed=0, batch_size=b)
            loader = streaming.StreamingDataLoader(dataset, batch_size=b, num_workers=0, collate_fn=_stack_tokens)

            def mosaic() -> int:
                tokens = 0
                while tokens < batches * tokens_a_batch:  # whole epochs (its reader threads end with an epoch)
                    for batch in loader:
                        tokens += _split(batch)[0].numel() // seq_len * (seq_len + 1)
                return tokens

        readers = {"data=shards (shuffled, memory-mapped)": ours, "datasets streaming (in order, parquet)": hf}
        if mosaic is not None:
            readers["Mosaic StreamingDataset (shuffled py1e, MDS)"] = mosaic
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in readers}
        for _ in range(rounds):
            for name, read in readers.items():
                results[name].append(_timed(read))
    print(f"{len(manifest['shards'])} shards, {manifest['tokens']} tokens, {len(windows)} windows; "
          f"{batches} micro-batches of {b} x {seq_len + 1} a round, {rounds} rounds; one process, no workers")
    for name, figures in results.items():
        print(f"{name:46s}: median {statistics.median(w for w, _ in figures) / 1e6:6.2f}M tokens/s, "
              f"{statistics.median(c for _, c in figures) / 1e6:6.2f}M tokens per CPU-second")
    baseline = results.pop("data=shards (shuffled, memory-mapped)")
    for name, figures in results.items():
        ratios = [a[1] / c[1] for a, c in zip(baseline, figures, strict=True)]
        print(f"data=shards / {name.split(' (')[0]}, per CPU-second: median {statistics.median(ratios):.2f} (rounds: "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")
    if streaming is None:
        print("Mosaic streaming: not installed (see this script's docstring to install it): skipped")


def gather_costs(batches: int = 400, b: int = 8, seq_len: int = 32) -> None:
    """CPU time of one data=shards micro-batch alone and right after a backward pass (what the training process
    pays between two steps with data.num_workers=0), in one process, alternating."""
    from omegaconf import OmegaConf

    from trainflow.data.shards import prepare, shard_datasets
    from trainflow.data.stream import StreamSampler
    from trainflow.data.text import Corpus

    torch.set_num_threads(1)
    corpus = Corpus.of(OmegaConf.create({"paths": [str(ROOT / "src")], "suffixes": [".py"]}))
    with tempfile.TemporaryDirectory() as tmp:
        tok = corpus.tokenizer(OmegaConf.create({"kind": "bpe", "vocab_size": 512, "cache_dir": f"{tmp}/tok"}))
        prepare(corpus, tok, Path(tmp) / "shards", workers=1, progress=False)
        train, _, _ = shard_datasets(Path(tmp) / "shards", seq_len, 0.05)
        stream = iter(StreamSampler(len(train), b, 0, 1, seed=0))
        weights = torch.randn(256, 256, requires_grad=True)
        alone, after = [], []
        for _ in range(batches):
            indices = next(stream)
            started = time.thread_time()
            train[indices]
            alone.append(time.thread_time() - started)
            for _ in range(20):
                (weights @ weights).sum().backward()
            started = time.thread_time()
            train[indices]
            after.append(time.thread_time() - started)
    print(f"data=shards micro-batch of {b} x {seq_len + 1}, {batches} of them: median "
          f"{statistics.median(alone) * 1e6:.0f} us of CPU alone, {statistics.median(after) * 1e6:.0f} us right after "
          "a backward pass (20 of a 256 x 256 matmul)")


def _split(window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a batch of windows, as ShardWindows returns them."""
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def _stack_tokens(samples: list[dict[str, Any]]) -> torch.Tensor:
    """A Mosaic loader's collate: the samples' token arrays as one int64 tensor."""
    import numpy as np

    return torch.from_numpy(np.stack([s["tokens"] for s in samples]).astype(np.int64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default="digits")
    parser.add_argument("--config-dir", type=Path, default=None, help="a user's conf folder, searched after conf/")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads; default: torch's")
    parser.add_argument("--what", choices=("workers", "sampler", "prepare", "loader", "gather"),
                        default="workers")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.what == "sampler":
        return sampler_costs(batches=2000)
    if args.what == "prepare":
        return prepare_throughput(args.rounds)
    if args.what == "loader":
        return loader_throughput(args.rounds)
    if args.what == "gather":
        return gather_costs()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("trainflow").setLevel(logging.WARNING)
    base = [f"experiment={args.experiment}", *COMMON, f"trainer.max_steps={args.steps}", *args.overrides]
    extra = args.config_dir.resolve() if args.config_dir else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; experiment={args.experiment}, "
          f"{args.rounds} rounds x {args.steps} steps (steady state after 10 warm-up steps)")
    results: dict[int, list[dict[str, float]]] = {n: [] for n in WORKERS}
    for _ in range(args.rounds):
        for n, loader in WORKERS.items():
            results[n].append(steady(CONFIG_DIR, extra, [*base, *loader]))
    for n, rounds in results.items():
        print(f"num_workers={n}: {statistics.median(r['samples_per_sec'] for r in rounds):8.1f} samples/s, "
              f"data wait {statistics.median(r['data_wait_fraction'] for r in rounds) * 100:5.1f}% of the step "
              f"(median of {len(rounds)})")
    ratios = [b["samples_per_sec"] / a["samples_per_sec"] for a, b in zip(results[0], results[2], strict=True)]
    print(f"throughput num_workers=2 / num_workers=0: median {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
