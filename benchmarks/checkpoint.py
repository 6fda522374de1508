"""What a checkpoint costs: DCP against torch.save and a raw write, async against sync, and memory over many saves.

One process, one GPT-shaped state (default 19M parameters + AdamW moments = ~230 MB), measured side by side:

1. bandwidth: a synchronous trainflow save (DCP shards of raw tensor bytes with an xxh3-64 checksum per file,
   fsync, manifest, atomic rename, retention), `torch.save` of the same state dicts (+ fsync), and a raw sequential
   write of as many bytes (+ fsync); retention's deletion of the oldest checkpoint runs in a thread after the save:
   it is waited for outside the timings and reported apart; then the writer alone, stock DCP (a torch.save archive
   per tensor) against trainflow's writer (raw bytes, checksums), with 1 and 2 writer threads; and the checksum
   functions over the same bytes in memory (what choosing one costs); medians of --repeats, interleaved;
2. async vs sync, while training: the same loop twice (a save every --every steps), once with `checkpoint.mode=sync`
   and once `async`; per save, the time the loop was blocked, and the extra time of the steps that ran while the
   background upload was writing (on few cores the writer competes with training);
3. memory: process RSS over --rss-saves async saves (after 10 warm-up saves), the growth in percent.

    flock /tmp/trainflow-bench.lock .venv/bin/python benchmarks/checkpoint.py [--layers 6 --width 512]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import xxhash

from trainflow.checkpoint import Checkpointer, TrainState, split_state
from trainflow.checkpoint.safe_io import ChecksummingWriter
from trainflow.config.schema import CheckpointConfig, typed_section
from trainflow.distributed import DistEnv
from trainflow.models.gpt import GPT
from trainflow.optim import build_optimizer

OPTIM = {"_target_": "torch.optim.AdamW", "lr": 1e-4, "weight_decay": 0.1, "betas": [0.9, 0.95],
         "warmup_steps": 0, "min_lr_ratio": 0.1, "schedule": "constant"}


def build(layers: int, width: int) -> TrainState:
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=128, n_layer=layers, n_head=8, n_embd=width)
    optimizer, scheduler = build_optimizer(model, typed_section("optim", OPTIM), 10_000, torch.device("cpu"))
    state = TrainState(model, optimizer, scheduler)
    train_step(state, batch(4))  # AdamW allocates its moments on the first step
    return state


def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(256, (size, 129))
    return tokens[:, :-1], tokens[:, 1:]


def train_step(state: TrainState, data: tuple[torch.Tensor, torch.Tensor]) -> None:
    inputs, targets = data
    logits = state.model(inputs)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1


def checkpointer(folder: Path, mode: str, every: int, keep_last: int = 2) -> Checkpointer:
    cfg = CheckpointConfig(enabled=True, mode=mode, dir=str(folder), every_steps=every, keep_last=keep_last,
                           resume="never", save_final=False, verify=False, export=False, load="all")
    return Checkpointer(cfg, DistEnv(0, 1, 0, torch.device("cpu")), folder)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def bandwidth(state: TrainState, tmp: Path, repeats: int) -> dict:
    """Median seconds of a trainflow sync save, torch.save and a raw write of the same bytes, interleaved."""
    ck = checkpointer(tmp / "dcp", "sync", every=1, keep_last=1)
    ck.resume(state)
    times: dict[str, list[float]] = {"dcp_sync": [], "torch_save": [], "raw_write": []}
    deletes = []
    nbytes = 0
    for _ in range(repeats):
        state.step += 1
        t0 = time.perf_counter()
        ck.after_step(state)
        times["dcp_sync"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ck._deleter.wait()  # retention's deletion, in a thread: not left to run into the next timing
        deletes.append(time.perf_counter() - t0)
        nbytes = ck.summary()["bytes"]

        t0 = time.perf_counter()
        path = tmp / "state.pt"
        torch.save({"model": state.model.state_dict(), "optim": state.optimizer.state_dict()}, path)
        fsync_file(path)
        times["torch_save"].append(time.perf_counter() - t0)
        path.unlink()

        payload = os.urandom(1 << 20) * (nbytes >> 20) + os.urandom(nbytes % (1 << 20))
        t0 = time.perf_counter()
        with open(tmp / "raw.bin", "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        times["raw_write"].append(time.perf_counter() - t0)
        (tmp / "raw.bin").unlink()
        del payload
    ck.close(state)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"bytes": nbytes, "median_s": med, "all_s": times,
            "retention_delete_s": statistics.median(deletes[1:] or deletes),  # the first save deletes nothing
            "mb_per_s": {k: nbytes / v / 1e6 for k, v in med.items()},
            "vs_raw": {k: med["raw_write"] / v for k, v in med.items()}}


def writers(state: TrainState, tmp: Path, repeats: int) -> dict:
    """Median seconds of dcp.save alone (no manifest, no commit) with DCP's writer (a torch.save archive per tensor)
    and trainflow's (raw bytes and checksums), 1 or 2 threads."""
    import torch.distributed.checkpoint as dcp

    tensors, _ = split_state(state)
    variants = {
        "dcp_stock": lambda path: dcp.FileSystemWriter(path),
        "dcp_stock_2_threads": lambda path: dcp.FileSystemWriter(path, thread_count=2),
        "trainflow_raw": lambda path: ChecksummingWriter(path),
        "trainflow_raw_2_threads": lambda path: ChecksummingWriter(path, thread_count=2),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, make in variants.items():
            path = tmp / f"writer-{name}"
            t0 = time.perf_counter()
            dcp.save({"app": tensors}, storage_writer=make(path), no_dist=True)
            times[name].append(time.perf_counter() - t0)
            shutil.rmtree(path)
    return {name: statistics.median(v) for name, v in times.items()}


def checksums(nbytes: int, repeats: int) -> dict:
    """Median seconds of each candidate checksum over `nbytes` in memory (8 MB chunks, as the reader feeds it)."""
    payload = os.urandom(1 << 23) * max(1, nbytes >> 23)

    def chunked(update) -> None:
        view = memoryview(payload)
        for i in range(0, len(view), 1 << 23):
            update(view[i:i + (1 << 23)])

    def running(fn, start: int):
        """A zlib checksum carried over the chunks, as a stream would update it."""
        def run() -> None:
            value = start

            def update(b) -> None:
                nonlocal value
                value = fn(b, value)
            chunked(update)
        return run

    crc32, adler32 = running(zlib.crc32, 0), running(zlib.adler32, 1)

    candidates = {"xxh3_64 (used)": lambda: chunked(xxhash.xxh3_64().update),
                  "xxh3_128": lambda: chunked(xxhash.xxh3_128().update),
                  "crc32": crc32, "adler32": adler32, "blake2b": lambda: chunked(hashlib.blake2b().update),
                  "sha256": lambda: chunked(hashlib.sha256().update), "md5": lambda: chunked(hashlib.md5().update)}
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * nbytes / len(payload))
    return {name: statistics.median(v) for name, v in times.items()}


def training_with_saves(state: TrainState, tmp: Path, mode: str, steps: int, every: int, size: int) -> dict:
    """Step times and blocked times of a loop that saves every `every` steps."""
    ck = checkpointer(tmp / mode, mode, every)
    ck.resume(state)
    data = batch(size)
    starts, durations, save_starts, hook_s, saved = [], [], [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        train_step(state, data)
        durations.append(time.perf_counter() - t0)
        starts.append(t0)
        t0 = time.perf_counter()
        saved.append(state.step % every == 0)
        if saved[-1]:
            save_starts.append(t0)
        ck.after_step(state)
        hook_s.append(time.perf_counter() - t0)
    ck.close(state)
    summary = ck.summary()  # per save: blocked = staging + waits + commit, wherever the loop paid them
    write_s = summary["write_s"]["per_save"]
    # a step overlaps an upload when it started before that save's write finished (write_s counts from its start)
    overlapped = [any(s0 <= start < s0 + w for s0, w in zip(save_starts, write_s, strict=False)) for start in starts]
    at_save = [h for h, s in zip(hook_s, saved, strict=True) if s]  # staging (async) or the whole save (sync)
    between = sorted((h for h, s in zip(hook_s, saved, strict=True) if not s), reverse=True)[:len(at_save)]
    return {"durations": durations, "overlapped": overlapped, "blocked_s": summary["blocked_s"]["per_save"],
            "write_s": write_s, "saves": summary["saves"], "hook_at_save_s": at_save,
            "hook_commit_s": between}  # async: the longest other hooks are the commits of finished uploads


def async_vs_sync(state: TrainState, tmp: Path, steps: int, every: int, size: int) -> dict:
    sync = training_with_saves(state, tmp, "sync", steps, every, size)
    asyn = training_with_saves(state, tmp, "async", steps, every, size)
    warm = every  # the first steps warm up the allocator and threads: not compared
    clean = statistics.median(sync["durations"][warm:])
    during = [d for d, o in zip(asyn["durations"][warm:], asyn["overlapped"][warm:], strict=True) if o]
    saves = max(1, len(asyn["blocked_s"]) - 1)
    extra_per_save = sum(d - clean for d in during) / saves
    sync_save = statistics.median(sync["blocked_s"])
    async_blocked = statistics.median(asyn["blocked_s"][1:]) if len(asyn["blocked_s"]) > 1 else asyn["blocked_s"][0]
    return {
        "step_s_clean": clean,
        "sync_save_s": sync_save,
        "async_blocked_s": async_blocked,
        "async_blocked_over_sync": async_blocked / sync_save,
        "async_staging_s": statistics.median(asyn["hook_at_save_s"][1:] or asyn["hook_at_save_s"]),
        "async_commit_s": statistics.median(asyn["hook_commit_s"]),
        "async_write_s": statistics.median(asyn["write_s"]),
        "steps_during_upload_per_save": len(during) / saves,
        "step_s_during_upload": statistics.median(during) if during else None,
        "slowdown_during_upload": statistics.median(during) / clean if during else None,
        "async_extra_step_time_per_save_s": extra_per_save,
        "async_total_cost_over_sync": (async_blocked + extra_per_save) / sync_save,
        "raw": {"sync": sync, "async": asyn},
    }


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def rss_over_saves(state: TrainState, tmp: Path, saves: int) -> dict:
    """RSS after 10 warm-up async saves and after `saves` more (each waits for the previous: one in flight)."""
    ck = checkpointer(tmp / "rss", "async", every=1, keep_last=1)
    ck.resume(state)
    samples = []
    for i in range(10 + saves):
        state.step += 1
        ck.after_step(state)
        if i == 9:
            samples.append(rss_bytes())
    ck.close(state)
    samples.append(rss_bytes())
    return {"saves": saves, "rss_after_warmup": samples[0], "rss_after": samples[-1],
            "growth_pct": 100 * (samples[-1] - samples[0]) / samples[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="training steps of each async/sync loop")
    parser.add_argument("--every", type=int, default=10, help="a save every this many steps")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rss-saves", type=int, default=100)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    state = build(args.layers, args.width)
    params = sum(p.numel() for p in state.model.parameters())
    with tempfile.TemporaryDirectory(prefix="trainflow-ckpt-bench-", dir=args.dir) as folder:
        tmp = Path(folder)
        progress("1/3 bandwidth: trainflow sync save vs torch.save vs raw write")
        bw = bandwidth(state, tmp, args.repeats)
        progress("1b/3 the writer alone: stock DCP vs trainflow's, 1 and 2 threads; checksum functions")
        wr = writers(state, tmp, args.repeats)
        sums = checksums(bw["bytes"], args.repeats)
        progress("2/3 training with sync, then async saves")
        av = async_vs_sync(state, tmp, args.steps, args.every, args.batch)
        progress(f"3/3 RSS over {args.rss_saves} async saves")
        rss = rss_over_saves(state, tmp, args.rss_saves) if args.rss_saves else None

    mb = bw["bytes"] / 1e6
    print(f"state: {params / 1e6:.1f}M parameters + AdamW = {mb:.0f} MB on disk; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("\nsave (fsync'd)          median s    MB/s   fraction of raw-write speed")
    for name in ("raw_write", "torch_save", "dcp_sync"):
        print(f"  {name:20s} {bw['median_s'][name]:9.3f} {bw['mb_per_s'][name]:7.0f}   {bw['vs_raw'][name]:.2f}")
    print(f"  then, in a thread: retention deleting the oldest checkpoint {bw['retention_delete_s']:.3f} s")
    print("\ndcp.save alone (fsync'd)  median s   fraction of raw-write speed")
    for name, sec in wr.items():
        print(f"  {name:22s} {sec:8.3f}   {bw['median_s']['raw_write'] / sec:.2f}")
    sync_s = bw["median_s"]["dcp_sync"]
    print(f"\nchecksum of the {mb:.0f} MB in memory   s       fraction of a sync save ({sync_s:.3f} s)")
    for name, sec in sums.items():
        print(f"  {name:22s} {sec:8.3f}   {sec / sync_s:.2f}")
    print(f"\nwhile training ({args.steps} steps, a save every {args.every}; clean step {av['step_s_clean']:.3f} s):")
    print(f"  sync save, loop blocked          {av['sync_save_s']:.3f} s")
    print(f"  async save, loop blocked         {av['async_blocked_s']:.3f} s   "
          f"= {av['async_blocked_over_sync']:.3f} x sync")
    print(f"    of which staging (copy)        {av['async_staging_s']:.3f} s, commit at a later step "
          f"{av['async_commit_s']:.3f} s")
    print(f"  async background write           {av['async_write_s']:.3f} s, over "
          f"{av['steps_during_upload_per_save']:.1f} steps per save")
    if av["slowdown_during_upload"] is not None:
        print(f"  steps during the write           {av['step_s_during_upload']:.3f} s "
              f"= {av['slowdown_during_upload']:.2f} x a clean step")
    print(f"  async extra step time per save   {av['async_extra_step_time_per_save_s']:.3f} s")
    print(f"  async total cost / sync save     {av['async_total_cost_over_sync']:.2f}")
    if rss:
        print(f"\nRSS over {rss['saves']} async saves: {rss['rss_after_warmup'] / 1e6:.0f} MB -> "
              f"{rss['rss_after'] / 1e6:.0f} MB ({rss['growth_pct']:+.1f}%)")
    if args.json:
        args.json.write_text(json.dumps({"parameters": params, "bandwidth": bw, "writers": wr, "checksums": sums,
                                         "async_vs_sync": av, "rss": rss,
                                         "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))


if __name__ == "__main__":
    main()
