"""Loss parallel for trainflow's GPT under TP 2: the logits left split by vocabulary for the loss (GPT's plan), against
the output projection's logits gathered whole on every TP rank (the plan without loss parallel), side by side in
one pair of gloo ranks.

Each variant builds the same GPT (same seed), splits it with trainflow's `tp_plan` over 2 CPU ranks (one thread
each), and times forward + cross-entropy + backward + an SGD step on the same batches, the variants alternating
step by step so that a busy machine slows them alike. Memory: the bytes of the logits each rank holds, and
all the bytes autograd saves for backward in one forward (saved-tensor hooks, each storage once), rank 0's.
The loss-parallel variant is GPT's plan (`head`: `ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`)
with the loss and backward inside `torch.distributed.tensor.parallel.loss_parallel()` (what torchtitan does); the
gathered one sets `head` to `output_layouts=Replicate()`; the losses of the two are compared too.

    flock /tmp/trainflow-bench.lock .venv/bin/python benchmarks/loss_parallel.py [--steps 20] [--vocab 256 8192]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from trainflow.distributed.tensor import apply_tensor_parallel
from trainflow.models.gpt import GPT

TP = 2


def saved_bytes(fn: Any) -> int:
    """Bytes autograd saves for backward while `fn` runs (each storage once, a DTensor by its local shard)."""
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def build(variant: str, vocab: int, mesh: Any) -> GPT:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    torch.manual_seed(0)
    model = GPT(vocab_size=vocab, block_size=128, n_layer=4, n_head=4, n_embd=256)
    plan = model.tp_plan()
    if variant == "gathered":
        plan["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    model.tp_plan = lambda: plan  # type: ignore[method-assign]  # trainflow's apply function, this plan
    apply_tensor_parallel(model, mesh)
    return model


def worker(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    results = {}
    for vocab in args.vocab:
        models = {v: build(v, vocab, mesh) for v in ("gathered", "loss_parallel")}
        optims = {v: torch.optim.SGD(m.parameters(), lr=0.1) for v, m in models.items()}
        gen = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, vocab, (args.batch, 129), generator=gen) for _ in range(args.steps)]
        times: dict[str, list[float]] = {v: [] for v in models}
        losses: dict[str, list[float]] = {v: [] for v in models}
        memory = {}
        for v, model in models.items():
            x, y = batches[0][:, :-1], batches[0][:, 1:]
            ctx = loss_parallel if v == "loss_parallel" else contextlib.nullcontext
            logits = model(x)
            local = logits.to_local() if hasattr(logits, "to_local") else logits
            memory[v] = {"logits_bytes": local.numel() * local.element_size(),
                         "saved_bytes": saved_bytes(functools.partial(_loss, model, x, y, ctx))}
            del logits
        for step, batch in enumerate(batches):
            x, y = batch[:, :-1], batch[:, 1:]
            for v, model in models.items():
                ctx = loss_parallel if v == "loss_parallel" else contextlib.nullcontext
                dist.barrier()
                start = time.perf_counter()
                with ctx():
                    loss = _loss(model, x, y, contextlib.nullcontext)
                    loss.backward()
                optims[v].step()
                optims[v].zero_grad()
                if step >= args.warmup:
                    times[v].append(time.perf_counter() - start)
                done = loss.detach()
                losses[v].append(float(done.full_tensor() if hasattr(done, "full_tensor") else done))
        results[vocab] = {v: {**memory[v], "step_s": statistics.median(times[v]), "last_loss": losses[v][-1]}
                          for v in models}
        results[vocab]["max_loss_diff"] = max(abs(a - b) for a, b in
                                              zip(losses["gathered"], losses["loss_parallel"], strict=True))
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def _loss(model: GPT, x: torch.Tensor, y: torch.Tensor, ctx: Any) -> torch.Tensor:
    with ctx():
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, nargs="+", default=[256, 8192])
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, port, args, out)) for r in range(TP)]
    for p in procs:
        p.start()
    results = out.get()
    for p in procs:
        p.join()
    print(f"GPT 4 x 256 (4 heads), block 128, batch {args.batch}, TP 2 on 2 gloo CPU ranks (1 thread each), "
          f"{args.steps} steps ({args.warmup} warm-up), median step; rank 0's memory\n")
    print("| vocab | variant | logits per rank MiB | saved for backward MiB | step ms | vs gathered | last loss |")
    print("|---|---|---|---|---|---|---|")
    for vocab, rows in results.items():
        base = rows["gathered"]["step_s"]
        for v in ("gathered", "loss_parallel"):
            r = rows[v]
            print(f"| {vocab} | {v} | {r['logits_bytes'] / 2**20:.2f} | {r['saved_bytes'] / 2**20:.2f} | "
                  f"{r['step_s'] * 1e3:.1f} | {base / r['step_s']:.2f}x | {r['last_loss']:.4f} |")
        print(f"| {vocab} | max loss difference | | | | | {rows['max_loss_diff']:.2e} |")


if __name__ == "__main__":
    main()
