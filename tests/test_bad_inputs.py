"""Every bad input we know of, tried in a real process, as a table.

For each row: the exact one-line message (some line of stderr matches it whole), the exit code, no traceback,
and every committed checkpoint on disk byte-identical afterwards. Every `train.py` row runs beside two committed
checkpoints of an earlier run (steps 2 and 4) in `checkpoint.dir`, so a bad input that got as far as touching
them would show. docs/reliability.md is rendered from this table (see test_reliability_readme.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY_GPT, can_mount, tmpfs, train
from helpers.processes import run_process

# 8 steps, a save every 2; the committed checkpoints of the reference run (steps 2 and 4) sit in checkpoint.dir.
BASE = [*TINY_GPT, "trainer.max_steps=8", "trainer.eval_every=0", "trainer.eval_steps=2", "checkpoint=dcp",
        "checkpoint.every_steps=2", "checkpoint.dir={ckpts}"]

# an iterable dataset by data._target_ (tests/streams.py), with checkpoints of its own (the base's are a GPT's)
STREAM = (f"hydra.searchpath=[file://{ROOT}/tests/conf]", "model=mlp", "data=vector_stream",
          "checkpoint.dir={tmp}/own")


@dataclass
class Ctx:
    """What a row's arguments and setup may refer to: {tmp}, {ckpts}, {port}."""

    tmp: Path
    ckpts: Path
    port: int
    hold: contextlib.ExitStack  # resources a setup keeps alive while the run goes (mounts, locks, sockets)

    def fill(self, text: str) -> str:
        """The placeholders only: a row's own braces (an interpolation such as ${trainer.seed}) stay as typed."""
        for name, value in (("tmp", self.tmp), ("ckpts", self.ckpts), ("port", self.port)):
            text = text.replace(f"{{{name}}}", str(value))
        return text


@dataclass(frozen=True)
class Case:
    id: str
    area: str
    what: str  # the bad input, in words (docs/reliability.md)
    args: tuple[str, ...]
    message: str  # the whole line; {tmp} {ckpts} {port} are filled in, {n} stands for a number, {any} for text
    exit: int = 2
    tool: str = "train"  # train: python train.py; multirun: python train.py -m; trainflow: the console command
    setup: Callable[[Ctx], None] | None = None
    env: tuple[tuple[str, str], ...] = ()
    needs: str | None = None  # "mount": a filesystem of our own; "no-gpu": a machine without CUDA
    after: Callable[[Ctx], None] | None = None  # checks on what the run left behind


OTHER_SWEEP = "hydra:\n  overrides:\n    task:\n    - optim.lr=1e-3,2e-3\n"  # the multirun.yaml of another sweep


def another_sweep_in_the_folder(ctx: Ctx) -> None:
    (ctx.tmp / "sweep").mkdir()
    (ctx.tmp / "sweep" / "multirun.yaml").write_text(OTHER_SWEEP)


def other_sweep_untouched(ctx: Ctx) -> None:
    assert sorted(p.name for p in (ctx.tmp / "sweep").iterdir()) == ["multirun.yaml"]
    assert (ctx.tmp / "sweep" / "multirun.yaml").read_text() == OTHER_SWEEP


def no_rung_ran(ctx: Ctx) -> None:
    """The ladder stopped before its first rung: no job folder, no training."""
    assert sorted(p.name for p in (ctx.tmp / "sweep").iterdir()) == ["multirun.yaml"]


# -- setups -----------------------------------------------------------------------------------------------------


def tiny_corpus(ctx: Ctx) -> None:
    (ctx.tmp / "tiny.txt").write_text("print('hi')\n")


def source_corpus(ctx: Ctx) -> None:
    shutil.copy(ROOT / "src" / "trainflow" / "data" / "text.py", ctx.tmp / "source.py")  # ~9 kB of real text


def empty_corpus(ctx: Ctx) -> None:
    (ctx.tmp / "empty.txt").write_text("")


def torchft_hidden(ctx: Ctx) -> None:
    """A Python that cannot import torchft (a sitecustomize on PYTHONPATH blocks it): as if it were not installed."""
    (ctx.tmp / "no_torchft").mkdir()
    (ctx.tmp / "no_torchft" / "sitecustomize.py").write_text("import sys\nsys.modules['torchft'] = None\n")


def file_in_the_way(ctx: Ctx) -> None:
    (ctx.tmp / "notes").write_text("not a folder")


def truncate_newest_shard(ctx: Ctx) -> None:
    shard = ctx.ckpts / "step_00000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def remove_newest_metadata(ctx: Ctx) -> None:
    (ctx.ckpts / "step_00000004" / ".metadata").unlink()


def garble_newest_manifest(ctx: Ctx) -> None:
    (ctx.ckpts / "step_00000004" / "manifest.json").write_text("{not json")


def flip_a_byte_of_the_newest_shard(ctx: Ctx) -> None:
    shard = ctx.ckpts / "step_00000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def garble_the_newest_metadata(ctx: Ctx) -> None:
    metadata = ctx.ckpts / "step_00000004" / ".metadata"
    metadata.write_bytes(b"x" * metadata.stat().st_size)


def newest_step_folder_without_manifest(ctx: Ctx) -> None:
    shutil.copytree(ctx.ckpts / "step_00000004", ctx.ckpts / "step_00000006")
    (ctx.ckpts / "step_00000006" / "manifest.json").unlink()


def booby_trap_the_newest_metadata(ctx: Ctx) -> None:
    """A .metadata that would create {tmp}/ran if unpickled, with sizes and checksums made to match."""
    import json
    import pickle

    from trainflow.checkpoint.safe_io import file_checksum

    class Trap:
        def __reduce__(self):
            return exec, (f"open({str(ctx.tmp / 'ran')!r}, 'w').close()",)

    folder = ctx.ckpts / "step_00000004"
    (folder / ".metadata").write_bytes(pickle.dumps(Trap()))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][".metadata"] = (folder / ".metadata").stat().st_size
    manifest["checksums"][".metadata"] = file_checksum(folder / ".metadata")
    (folder / "manifest.json").write_text(json.dumps(manifest))


def edit_newest_manifest(ctx: Ctx, **changes: object) -> dict:
    """Change the newest checkpoint's manifest as a tamperer (or a newer trainflow) could; returns it."""
    path = ctx.ckpts / "step_00000004" / "manifest.json"
    manifest = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps(manifest))
    return manifest


def list_a_fifo_in_the_newest_manifest(ctx: Ctx) -> None:
    """A FIFO no one writes to, listed with a size and a checksum: reading it would wait forever."""
    os.mkfifo(ctx.ckpts / "step_00000004" / "extra.bin")
    manifest = json.loads((ctx.ckpts / "step_00000004" / "manifest.json").read_text())
    edit_newest_manifest(ctx, files={**manifest["files"], "extra.bin": 0},
                         checksums={**manifest["checksums"], "extra.bin": "0"})


def list_dev_zero_in_the_newest_manifest(ctx: Ctx) -> None:
    """A checksum of /dev/zero: hashing it would never end."""
    manifest = json.loads((ctx.ckpts / "step_00000004" / "manifest.json").read_text())
    edit_newest_manifest(ctx, checksums={**manifest["checksums"], "/dev/zero": "0"})


def newer_format_in_the_newest_manifest(ctx: Ctx) -> None:
    edit_newest_manifest(ctx, format=4, trainflow_version="9.0.0")


def unknown_stream_version_in_the_newest_state(ctx: Ctx) -> None:
    """A data position counted in a sample stream order this trainflow does not know (sizes and checksums kept)."""
    from trainflow.checkpoint.safe_io import file_checksum

    folder = ctx.ckpts / "step_00000004"
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({**state, "stream_version": 3}))
    manifest = json.loads((folder / "manifest.json").read_text())
    edit_newest_manifest(ctx, files={**manifest["files"], "state.json": (folder / "state.json").stat().st_size},
                         checksums={**manifest["checksums"], "state.json": file_checksum(folder / "state.json")})


def foreign_folder_where_a_save_goes(ctx: Ctx) -> None:
    """A folder of trainflow's naming that another program made (no marker inside), where step 6 will be saved."""
    (ctx.ckpts / ".tmp-step_00000006").mkdir()
    (ctx.ckpts / ".tmp-step_00000006" / "data.csv").write_text("someone's data")


def foreign_folder_kept(ctx: Ctx) -> None:
    assert (ctx.ckpts / ".tmp-step_00000006" / "data.csv").read_text() == "someone's data"


def another_runs_results(ctx: Ctx) -> None:
    """The run directory holds what a run of another model left: its config, its summary, its saved overrides."""
    (ctx.tmp / "run" / ".hydra").mkdir(parents=True)
    (ctx.tmp / "run" / ".hydra" / "overrides.yaml").write_text("- model=gpt_small\n- trainer.max_steps=4\n")
    (ctx.tmp / "run" / "config.yaml").write_text("model:\n  n_layer: 12\n")
    (ctx.tmp / "run" / "summary.json").write_text('{"steps": 4}')


def another_runs_results_kept(ctx: Ctx) -> None:
    assert (ctx.tmp / "run" / "config.yaml").read_text() == "model:\n  n_layer: 12\n"
    assert (ctx.tmp / "run" / "summary.json").read_text() == '{"steps": 4}'
    assert "gpt_small" in (ctx.tmp / "run" / ".hydra" / "overrides.yaml").read_text()


def file_where_tensorboard_writes(ctx: Ctx) -> None:
    (ctx.tmp / "run").mkdir()
    (ctx.tmp / "run" / "tensorboard").write_text("not a folder")


def read_only_tensorboard_folder(ctx: Ctx) -> None:
    ctx.hold.enter_context(tmpfs(ctx.tmp / "run" / "tensorboard", "1m", read_only=True))


def mlflow_not_installed(ctx: Ctx) -> None:
    """A Python path on which `import mlflow` fails as it does where the extra is not installed."""
    (ctx.tmp / "no_mlflow" / "mlflow").mkdir(parents=True)
    (ctx.tmp / "no_mlflow" / "mlflow" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'mlflow'\", name='mlflow')\n")


def wandb_not_installed(ctx: Ctx) -> None:
    """A Python path on which `import wandb` fails as it does where the extra is not installed."""
    (ctx.tmp / "no_wandb" / "wandb").mkdir(parents=True)
    (ctx.tmp / "no_wandb" / "wandb" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'wandb'\", name='wandb')\n")


def fifo_corpus(ctx: Ctx) -> None:
    os.mkfifo(ctx.tmp / "pipe")


def lock_checkpoint_dir(ctx: Ctx) -> None:
    from trainflow.locks import DirLock

    ctx.hold.callback(DirLock(ctx.ckpts).release)  # this test process plays the other run


def lock_run_dir(ctx: Ctx) -> None:
    from trainflow.locks import DirLock

    (ctx.tmp / "run").mkdir()
    ctx.hold.callback(DirLock(ctx.tmp / "run").release)  # this test process plays the live run


def read_only_disk(ctx: Ctx) -> None:
    ctx.hold.enter_context(tmpfs(ctx.tmp / "ro", "1m", read_only=True))


def nearly_full_disk(ctx: Ctx) -> None:
    """A 4 MB filesystem holding the step-4 checkpoint, with room for logs but not for the next save."""
    disk = ctx.hold.enter_context(tmpfs(ctx.tmp / "small", "4m"))
    shutil.copytree(ctx.ckpts / "step_00000004", disk / "ckpts" / "step_00000004")
    (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - 300_000))


def hide_sklearn(ctx: Ctx) -> None:
    """An interpreter on which `import sklearn` fails, as without the extra (a sitecustomize on PYTHONPATH)."""
    (ctx.tmp / "site").mkdir()
    (ctx.tmp / "site" / "sitecustomize.py").write_text("import sys\nsys.modules['sklearn'] = None\n")


def hide_torchdata(ctx: Ctx) -> None:
    """An interpreter on which `import torchdata` fails, as without the extra (a sitecustomize on PYTHONPATH)."""
    (ctx.tmp / "site").mkdir()
    (ctx.tmp / "site" / "sitecustomize.py").write_text("import sys\nsys.modules['torchdata'] = None\n")


def small_corpus(ctx: Ctx) -> None:
    """2000 bytes: 59 training samples of 33 bytes (95% of them, in non-overlapping windows)."""
    (ctx.tmp / "small.txt").write_text("x = 1\n" * 333 + "yy")


def corpus_with_broken_link(ctx: Ctx) -> None:
    (ctx.tmp / "corpus").mkdir()
    (ctx.tmp / "corpus" / "a.py").write_text("print('hi')\n" * 400)
    (ctx.tmp / "corpus" / "b.py").symlink_to(ctx.tmp / "gone.py")


def disk_filling_under_the_run(ctx: Ctx) -> None:
    """A 1 MB filesystem for the run directory with 64 KB free: metrics.jsonl and train.log fill it within the run."""
    disk = ctx.hold.enter_context(tmpfs(ctx.tmp / "small", "1m"))
    (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - 64_000))


def metrics_lines_are_whole(ctx: Ctx) -> None:
    text = (ctx.tmp / "small" / "run" / "metrics.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines()]
    assert text.endswith("\n") and len(records) >= 10, text[-300:]
    assert [r["step"] for r in records] == list(range(5, 5 + len(records)))  # resumed at 4, one line a step


def busy_port(ctx: Ctx) -> None:
    sock = ctx.hold.enter_context(socket.socket())
    sock.bind(("127.0.0.1", ctx.port))
    sock.listen()


def unfinished_save(ctx: Ctx) -> None:
    shutil.copytree(ctx.ckpts / "step_00000004", ctx.tmp / ".tmp-step_00000006")
    (ctx.tmp / ".tmp-step_00000006" / "manifest.json").unlink()


PRECIOUS = "weights of another run\n"


def earlier_output(ctx: Ctx) -> None:
    """A file where an export will go, and a folder of the user's that trainflow did not export."""
    (ctx.tmp / "model.pt").write_text(PRECIOUS)
    (ctx.tmp / "mine").mkdir()
    (ctx.tmp / "mine" / "notes.txt").write_text(PRECIOUS)


def earlier_output_kept(ctx: Ctx) -> None:
    assert (ctx.tmp / "model.pt").read_text() == PRECIOUS
    assert (ctx.tmp / "mine" / "notes.txt").read_text() == PRECIOUS


def mlp_config(ctx: Ctx) -> None:
    """A run config naming a model that has no Hugging Face counterpart."""
    (ctx.tmp / "config.yaml").write_text("model:\n  _target_: trainflow.models.mlp.MLP\ncheckpoint:\n  dir: null\n")


def narrower_weights(ctx: Ctx) -> None:
    """Exported weights of a GPT narrower than the base's (n_embd 32, not 64)."""
    from safetensors.torch import save_file

    from trainflow.models.gpt import GPT

    model = GPT(n_layer=2, n_embd=32, n_head=2, block_size=32)
    save_file({k: v.clone() for k, v in model.state_dict().items()}, ctx.tmp / "w.safetensors")


# -- the table --------------------------------------------------------------------------------------------------

RANK_ENV = (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"))
CASES = [
    # config keys and values
    Case("unknown-option", "config", "an option a group does not have", ("model=nope",),
         "In 'train': Could not find 'model/nope'", exit=1),
    Case("unknown-key", "config", "a key no schema has", ("trainer.foo=1",),
         "Could not override 'trainer.foo'.", exit=1),
    Case("wrong-type", "config", "a value of the wrong type", ("trainer.max_steps=abc",),
         "Value 'abc' of type 'str' could not be converted to Integer", exit=1),
    Case("zero-steps", "config", "no training steps", ("trainer.max_steps=0",),
         "Error: trainer.max_steps: must be a positive integer; got 0"),
    Case("negative-batch", "config", "a negative batch size", ("trainer.batch_size=-2",),
         "Error: trainer.batch_size: must be a positive integer; got -2"),
    Case("zero-accumulation", "config", "zero accumulation steps", ("trainer.grad_accum=0",),
         "Error: trainer.grad_accum: must be a positive integer; got 0"),
    Case("zero-lr", "config", "a zero learning rate", ("optim.lr=0",),
         "Error: optim.lr: must be > 0; got 0.0"),
    Case("unknown-precision", "config", "a precision trainflow does not train in", ("trainer.precision=fp16",),
         "Error: trainer.precision: must be one of fp32, bf16; got 'fp16'"),
    Case("unknown-eval-schedule", "config", "an evaluation schedule that is neither auto nor a step count",
         ("trainer.eval_every=often",),
         "Error: trainer.eval_every: must be auto or a number of steps >= 0 (0: only at the end); got 'often'"),
    Case("model-not-importable", "config", "a model class that cannot be imported", ("model._target_=nosuch.Net",),
         "Error: model._target_: cannot import 'nosuch.Net'; give the import path of an nn.Module class, e.g. "
         "mypackage.models.MyNet (its folder on PYTHONPATH)"),
    Case("model-arguments-refused", "config", "model arguments the model refuses", ("model.n_head=3",),
         "Error: model: trainflow.models.gpt.GPT(vocab_size=256, block_size=32, n_layer=2, n_head=3, n_embd=64, "
         "dropout=0.0, bias=True) failed: ValueError: n_embd (64) must be divisible by n_head (3); fix the model.* "
         "values"),
    Case("model-not-a-module", "config", "a model target that is not an nn.Module",
         ("model._target_=collections.OrderedDict",),
         "Error: model._target_: collections.OrderedDict is not an nn.Module (it made a OrderedDict object); point "
         "it at an nn.Module class"),
    Case("model-key-unknown", "config", "a key the built-in model option does not have", ("model.n_heads=3",),
         "Error: model.n_heads: model=gpt_tiny has no such key (it has vocab_size, block_size, n_layer, n_head, "
         "n_embd, dropout, bias); fix the name, or for your own code use model=custom model._target_=<import path> "
         "model.n_heads=<value>"),
    Case("custom-model-without-target", "config", "model=custom without the model's import path", ("model=custom",),
         "Error: model._target_: missing: model=custom calls your own code; set model._target_ to the import path "
         "of an nn.Module class, e.g. mypackage.models.MyNet"),
    Case("custom-data-without-target", "data", "data=custom without the factory's import path", ("data=custom",),
         "Error: data._target_: missing: data=custom calls your own code; set data._target_ to the import path of "
         "a function or class returning (train, val) datasets"),
    Case("reduce-overhead-on-cpu", "compile", "CUDA graphs on a CPU", ("compile=reduce_overhead",),
         "Error: compile.mode: reduce-overhead uses CUDA graphs, which need a GPU, and this run is on CPU: use "
         "compile=default (inductor without CUDA graphs)"),
    Case("profiler-nothing-recorded", "profile", "a profiler window that records no step",
         ("profiler=schedule", "profiler.active=0", "trainer.max_steps=20"),
         "Error: profiler.active: must be a positive number of recorded steps; got 0"),
    Case("profiler-window-past-end", "profile", "a profiler window that ends after the run", ("profiler=schedule",),
         "Error: trainer.max_steps: is 8 but the profiler window ends at step 12 (skip_first 2 + 1 x (wait 5 + "
         "warmup 2 + active 3)); raise trainer.max_steps to >= 12 or shorten the window "
         "(profiler.skip_first/wait/warmup/active)"),
    Case("ddp-one-process", "scale", "ddp with one process", ("parallelism=ddp", "parallelism.nproc_per_node=1"),
         "Error: parallelism.nproc_per_node: ddp needs 2 or more processes, got 1 (one was asked for); set "
         "parallelism.nproc_per_node=2 or more, or use parallelism=single"),
    Case("nccl-on-cpu", "scale", "the NCCL backend without GPUs",
         ("parallelism=ddp", "parallelism.nproc_per_node=2", "parallelism.backend=nccl"),
         "Error: parallelism.backend: nccl needs CUDA GPUs, but this run is on cpu; use parallelism.backend=gloo "
         "(or auto)"),
    Case("global-batch-indivisible", "scale", "a global batch the ranks cannot share",
         ("parallelism=ddp", "parallelism.nproc_per_node=2", "trainer.grad_accum=2", "parallelism.global_batch=30"),
         "Error: parallelism.global_batch: 30 does not divide into 2 ranks x 2 accumulation steps; use a multiple "
         "of 4, e.g. 28 or 32"),
    Case("watchdog-after-timeout", "scale", "a hang watchdog that would speak after the collective timeout",
         ("parallelism=ddp", "parallelism.nproc_per_node=2", "parallelism.timeout_s=30",
          "parallelism.watchdog.min_s=60"),
         "Error: parallelism.watchdog.min_s: must be > 0 and below parallelism.timeout_s (30), which ends a hung run "
         "before the watchdog could say where it hangs; got 60.0; lower it or raise parallelism.timeout_s"),
    Case("straggler-factor-one", "scale", "a straggler factor that would name a rank no slower than the others",
         ("parallelism=ddp", "parallelism.nproc_per_node=2", "parallelism.straggler.factor=1"),
         "Error: parallelism.straggler.factor: must be > 1 (a rank this many times slower than the others is named); "
         "got 1.0"),
    Case("straggler-intervals-zero", "scale", "a straggler named after no log interval at all",
         ("parallelism=ddp", "parallelism.nproc_per_node=2", "parallelism.straggler.intervals=0"),
         "Error: parallelism.straggler.intervals: must be a positive integer (log intervals in a row); got 0"),
    Case("torchft-missing", "scale", "fault tolerance asked for without torchft installed",
         ("parallelism.fault_tolerance=torchft",),
         "Error: parallelism.fault_tolerance: torchft needs torchft, which is not installed: pip install "
         "'trainflow[ft]', or set it to off", setup=torchft_hidden, env=(("PYTHONPATH", "{tmp}/no_torchft"),)),
    Case("torchft-with-fsdp", "scale", "fault tolerance with a strategy it does not run (FSDP over 2 ranks)",
         ("parallelism=fsdp", "parallelism.nproc_per_node=2", "parallelism.fault_tolerance=torchft"),
         "Error: parallelism.fault_tolerance: torchft trains replica groups of DDP ranks or of one rank "
         "(parallelism=ddp or single, one job per group); got parallelism=fsdp: run each group as parallelism=ddp, "
         "or set it to off"),
    Case("torchft-replica-id-outside", "scale", "a replica group id outside the groups",
         ("parallelism.fault_tolerance=torchft", "parallelism.ft.replica_id=2"),
         "Error: parallelism.ft.replica_id: must be in [0, 1] (parallelism.ft.replica_groups=2); got 2"),
    Case("fsdp-blocks-without-blocks", "scale", "FSDP per-block wrapping of a model without blocks",
         ("model=mlp", "data=synthetic", "parallelism=fsdp", "parallelism.nproc_per_node=2",
          "parallelism.fsdp.wrap=blocks"),
         "Error: parallelism.fsdp.wrap: blocks shards each module of model.blocks, and MLP has none; use "
         "parallelism.fsdp.wrap=size (or auto) (rank {n})"),  # found in the workers, where the model is built
    Case("zero-keep-last", "checkpoint", "retention that keeps nothing", ("checkpoint.keep_last=0",),
         "Error: checkpoint.keep_last: must be >= 1 (the newest committed checkpoint is always kept); got 0"),
    Case("export-without-final-save", "checkpoint", "export without a final save",
         ("checkpoint.export=true", "checkpoint.save_final=false"),
         "Error: checkpoint.export: exports the final weights, which needs checkpoint.save_final=true"),
    # files and paths
    Case("missing-corpus", "data", "a corpus path that does not exist", ("data.paths=[/no/such/corpus]",),
         "Error: data.paths: /no/such/corpus does not exist; give existing files or folders"),
    Case("empty-corpus-list", "data", "an empty corpus list", ("data.paths=[]",),
         "Error: data.paths: is empty: give files or folders, e.g. data.paths=[/path/to/corpus], or null for the "
         "default"),
    Case("empty-corpus-file", "data", "a corpus of empty files", ("data.paths=[{tmp}/empty.txt]",),
         "Error: data.paths: the corpus (1 file(s)) is empty; point data.paths at text",
         setup=empty_corpus),
    Case("corpus-too-short", "data", "a corpus shorter than one sequence",
         ("data.paths=[{tmp}/tiny.txt]", "data.cache_dir={tmp}/cache"),
         "Error: data.paths: the corpus has 12 bytes, too short for one training and one validation sequence of "
         "33 bytes (val_fraction=0.05); add text or lower data.seq_len", setup=tiny_corpus),
    Case("tokenizer-larger-than-model", "data", "a tokenizer with more tokens than the model's vocabulary",
         ("tokenizer=bpe", "tokenizer.vocab_size=400", "model.vocab_size=300", "data.paths=[{tmp}/source.py]",
          "data.cache_dir={tmp}/cache", "tokenizer.cache_dir={tmp}/tokenizers"),
         "Error: model.vocab_size: is 300, but the tokenizer (tokenizer=bpe) has {n} tokens; set model.vocab_size to "
         "{n} or more (its default follows tokenizer.vocab_size), or pick a smaller tokenizer.vocab_size",
         setup=source_corpus),
    Case("bpe-vocab-too-small", "config", "a BPE vocabulary smaller than the bytes it starts from",
         ("tokenizer=bpe", "tokenizer.vocab_size=100", "data.paths=[{tmp}/source.py]"),
         "Error: tokenizer.vocab_size: is 100, but a byte-level BPE holds the 256 bytes and <|endoftext|>; set it to "
         "257 or more (e.g. 4096)", setup=source_corpus),
    Case("tokenizer-file-missing", "data", "a tokenizer.json that does not exist",
         ("tokenizer=file", "tokenizer.path={tmp}/tokenizer.json", "tokenizer.vocab_size=1000",
          "data.paths=[{tmp}/source.py]"),
         "Error: tokenizer.path: {tmp}/tokenizer.json does not exist; give the tokenizer.json written by tokenizers' "
         "Tokenizer.save (or pick tokenizer=bpe to train one here)", setup=source_corpus),
    Case("seq-lens-too-long", "data", "varied lengths longer than the model's context", ("data.seq_lens=[8,64]",),
         "Error: data.seq_lens: each length must be in [1, data.seq_len=32]; got [8, 64]"),
    # data by _target_ and the task (experiment=digits: scikit-learn's digits through data._target_, a small CNN)
    Case("data-target-not-importable", "data", "a data factory that cannot be imported",
         ("experiment=digits", "model=cnn", "data._target_=nosuch.make_datasets"),
         "Error: data._target_: cannot import 'nosuch.make_datasets'; give the import path of a function or class "
         "returning (train, val) datasets (its folder on PYTHONPATH)"),
    Case("data-target-not-datasets", "data", "a data factory that returns something other than datasets",
         ("experiment=digits", "model=cnn", "data._target_=collections.OrderedDict"),
         "Error: data._target_: collections.OrderedDict returned a OrderedDict, not datasets; return (train, val) or "
         "a dict with train, val (None: no evaluation) and optionally collate_fn"),
    Case("items-cannot-collate", "data", "items of different shapes that the collate cannot batch",
         (f"hydra.searchpath=[file://{ROOT}/examples/my_project/conf]", "experiment=my_project", "model=set_regressor",
          "data.collate_fn=null"),
         "Error: data: default_collate cannot batch the items of my_project.data.point_sets (RuntimeError: stack "
         "expects each tensor to be equal size, but got {any}); give items of one shape (tensors, or tuples or dicts "
         "of them), or a data.collate_fn that batches them",
         env=(("PYTHONPATH", str(ROOT / "examples/my_project")),)),
    # an IterableDataset by data._target_ (tests/streams.py: 20 items a pass unless data.size says otherwise)
    Case("iterable-stream-too-short", "data", "an iterable dataset that ends before one micro-batch",
         (*STREAM, "data.size=6"),
         "Error: trainer.batch_size: the train stream of streams.vector_stream ends after 6 items, before one "
         "micro-batch per rank (1 rank(s) x 8 items); lower trainer.batch_size to at most 6, or give more data",
         env=(("PYTHONPATH", str(ROOT / "tests")),)),
    Case("iterable-global-batch", "data", "an iterable dataset with a parallelism.global_batch it cannot honour",
         (*STREAM, "data.size=6", "parallelism.global_batch=16"),
         "Error: parallelism.global_batch: 16 cannot be honoured: the train stream of streams.vector_stream ends "
         "after 6 items, before one micro-batch per rank (1 rank(s) x 16 items); set parallelism.global_batch to at "
         "most 6 (1 rank(s) x 6 items x trainer.grad_accum=1), or give more data",
         env=(("PYTHONPATH", str(ROOT / "tests")),)),
    Case("iterable-workers-share-too-short", "data", "an iterable dataset too short for a micro-batch of any worker",
         (*STREAM, "data.size=6", "trainer.batch_size=4", "data.num_workers=2"),
         "Error: trainer.batch_size: a pass of the train stream of streams.vector_stream gave this rank no "
         "micro-batch of 4 items (its share, split among 2 workers); lower trainer.batch_size or data.num_workers, "
         "or give more data", env=(("PYTHONPATH", str(ROOT / "tests")),)),
    Case("iterable-extra-missing", "data", "an iterable dataset without torchdata installed", STREAM,
         "Error: data._target_: streams.vector_stream returned an IterableDataset, which trainflow reads through "
         "torchdata, and torchdata is not installed; run pip install 'trainflow[iterable]'", setup=hide_torchdata,
         env=(("PYTHONPATH", f"{{tmp}}/site{os.pathsep}{ROOT / 'tests'}"),)),
    Case("batch-model-mismatch", "data", "batches the model cannot take", ("experiment=digits", "model=mlp"),
         "Error: data: trainflow.data.digits.digits gives batches of ([2, 1, 8, 8] float32, [2] int64), which the "
         "task Classification cannot put through model trainflow.models.mlp.MLP (RuntimeError: mat1 and mat2 shapes "
         "cannot be multiplied (16x8 and 100x256)); make the data's items what the model's forward takes, or change "
         "model.*"),
    Case("monitor-not-a-metric", "data", "a task.monitor the task does not produce",
         ("experiment=digits", "model=cnn", "task.monitor=f1"),
         "Error: task.monitor: 'f1' is not a metric of this task (loss, accuracy, top5_accuracy); set task.monitor "
         "to one of them"),
    Case("train-metrics-unknown", "config", "a task.train_metrics that is not a choice",
         ("task.train_metrics=sometimes",), "Error: task.train_metrics: must be log_step or every_step; got "
         "'sometimes'"),
    Case("vision-extra-missing", "data", "data=digits without scikit-learn installed",
         ("experiment=digits", "model=cnn"),
         "Error: data: data=digits reads scikit-learn's digits, and scikit-learn is not installed; run pip install "
         "'trainflow[vision]'", setup=hide_sklearn, env=(("PYTHONPATH", "{tmp}/site"),)),
    # more config, data and environment values
    Case("interpolation-to-missing-key", "config", "an interpolation to a key that does not exist",
         ("optim.lr=${trainer.nonexistent}",),
         "Error: optim.lr: interpolation key 'trainer.nonexistent' not found; fix the ${...} or give the value "
         "directly"),
    Case("interpolation-of-wrong-type", "config", "an interpolation to a value of the wrong type",
         ("optim.lr=${trainer.device}",),
         "Error: optim.lr: while dereferencing interpolation '${trainer.device}': Value 'auto' of type 'str' could "
         "not be converted to Float; fix the ${...} or give the value directly"),
    Case("infinite-lr", "config", "an infinite learning rate", ("optim.lr=inf",),
         "Error: optim.lr: must be a finite number; got inf"),
    Case("nan-grad-clip", "config", "a NaN clipping threshold", ("trainer.grad_clip=nan",),
         "Error: trainer.grad_clip: must be a finite number; got nan"),
    Case("betas-out-of-range", "config", "Adam betas outside [0, 1)", ("optim.betas=[1.5,0.9]",),
         "Error: optim.betas: each must be in [0, 1), e.g. [0.9,0.95]; got [1.5, 0.9]"),
    Case("huge-seed", "config", "a seed beyond 64 bits", ("trainer.seed=1180591620717411303424",),
         "Error: trainer.seed: must be an integer in [0, 4294967295]; got 1180591620717411303424"),
    Case("zero-width-model", "config", "a model of width 0", ("model.n_embd=0",),
         "Error: model.n_embd: must be a positive integer; got 0"),
    Case("no-layers", "config", "a model with no layers", ("model.n_layer=0",),
         "Error: model.n_layer: must be a positive integer; got 0"),
    Case("zero-seq-len", "data", "sequences of no tokens", ("data.seq_len=0",),
         "Error: data.seq_len: must be a positive number of tokens; got 0"),
    Case("seq-len-over-context", "data", "sequences longer than the model's context", ("data.seq_len=64",),
         "Error: data.seq_len: 64 is longer than the model's context, model.block_size=32; lower data.seq_len to "
         "<= 32 or raise model.block_size"),
    Case("vocab-below-bytes", "data", "a vocabulary smaller than the data's tokens", ("model.vocab_size=100",),
         "Error: model.vocab_size: is 100, but data=text is byte-level: its tokens go up to 255; set "
         "model.vocab_size=256 or more"),
    Case("batch-over-dataset", "data", "a micro-batch larger than the training set",
         ("data.paths=[{tmp}/small.txt]", "data.cache_dir={tmp}/cache", "trainer.batch_size=64"),
         "Error: trainer.batch_size: a micro-batch of 64 samples is more than the training set holds (59 samples); "
         "lower trainer.batch_size so that each rank's micro-batch is <= 59, or give more data", setup=small_corpus),
    Case("batch-over-memory", "data", "a micro-batch whose activations cannot fit in memory",
         ("trainer.batch_size=100000", "model.vocab_size=262144"),
         "Error: trainer.batch_size: a micro-batch of 100000 samples needs about {n} TB for its inputs and "
         "activations, and {n} {any} of {any} memory is available; lower trainer.batch_size (about {n} samples "
         "fit), raising trainer.grad_accum to keep the global batch"),
    Case("broken-link-in-corpus", "data", "a dangling symlink in a corpus folder",
         ("data.paths=[{tmp}/corpus]", "data.cache_dir={tmp}/cache"),
         "Error: data.paths: {tmp}/corpus/b.py is a broken symbolic link (to {tmp}/gone.py, which does not exist); "
         "remove it, or fix it, or narrow data.suffixes", setup=corpus_with_broken_link),
    Case("fifo-corpus", "data", "a FIFO given as the corpus", ("data.paths=[{tmp}/pipe]",),
         "Error: data.paths: {tmp}/pipe is a FIFO (named pipe), not a regular file or a folder; give text files or "
         "folders", setup=fifo_corpus),
    Case("tensorboard-blocked", "environment", "TensorBoard's folder replaced by a file", ("logger=tensorboard",),
         "Error: logger.tensorboard: cannot write TensorBoard's events in {tmp}/run/tensorboard ({tmp}/run/tensorboard "
         "is a file, not a folder); make that a writable folder, or run with logger=none",
         setup=file_where_tensorboard_writes),
    Case("tensorboard-read-only", "environment", "TensorBoard's folder on a read-only filesystem",
         ("logger=tensorboard",),
         "Error: logger.tensorboard: cannot write TensorBoard's events in {tmp}/run/tensorboard (Read-only file "
         "system); make that a writable folder, or run with logger=none", setup=read_only_tensorboard_folder,
         needs="mount"),
    Case("mlflow-server-down", "environment", "an MLflow server that does not answer",
         ("logger=mlflow", "logger.mlflow.tracking_uri=http://127.0.0.1:{port}"),
         "Error: logger.mlflow.tracking_uri: no MLflow server answers at http://127.0.0.1:{port} (ConnectionError); "
         "start it (mlflow server --backend-store-uri sqlite:///mlflow.db), or leave logger.mlflow.tracking_uri unset "
         "for the local store outputs/mlflow.db"),
    Case("mlflow-store-blocked", "environment", "MLflow's SQLite store where a file stands in for its folder",
         ("logger=mlflow", "logger.mlflow.tracking_uri=sqlite:///{tmp}/notes/mlflow.db"),
         "Error: logger.mlflow.tracking_uri: cannot write the MLflow store in {tmp}/notes ({tmp}/notes is a file, "
         "not a folder); point logger.mlflow.tracking_uri at sqlite:///<a writable path>, or run with a writable "
         "outputs/", setup=file_in_the_way),
    Case("mlflow-not-installed", "environment", "logger=mlflow without the mlflow extra installed",
         ("logger=[tensorboard,mlflow]",),
         "Error: logger.mlflow: the mlflow package is not installed; pip install 'trainflow[mlflow]', or leave mlflow "
         "out of logger=[...]", setup=mlflow_not_installed, env=(("PYTHONPATH", "{tmp}/no_mlflow"),)),
    Case("wandb-not-installed", "environment", "logger=wandb without the wandb extra installed",
         ("logger=[tensorboard,wandb]",),
         "Error: logger.wandb: the wandb package is not installed; pip install 'trainflow[wandb]', or leave wandb "
         "out of logger=[...]", setup=wandb_not_installed, env=(("PYTHONPATH", "{tmp}/no_wandb"),)),
    Case("logger-target-unknown", "config", "a logger of one's own whose _target_ cannot be imported",
         ("+logger.mine._target_=nowhere.Logger",),
         "Error: logger.mine._target_: cannot import 'nowhere.Logger'; give the import path of a logger class (see "
         "docs/loggers.md) (its folder on PYTHONPATH)"),
    Case("data-cache-blocked", "environment", "a token cache folder blocked by a file",
         ("data.cache_dir={tmp}/notes/cache",),
         "Error: data.cache_dir: cannot write the token cache in {tmp}/notes/cache ({tmp}/notes is a file, not a "
         "folder); point data.cache_dir at a writable folder with room for the corpus", setup=file_in_the_way),
    Case("data-cache-read-only", "environment", "a token cache folder on a read-only filesystem",
         ("data.cache_dir={tmp}/ro/cache",),
         "Error: data.cache_dir: cannot write the token cache in {tmp}/ro/cache (Read-only file system); point "
         "data.cache_dir at a writable folder with room for the corpus", setup=read_only_disk, needs="mount"),
    Case("home-blocked", "environment", "a HOME that is a file (the default caches live under ~)", (),
         "Error: data.cache_dir: cannot write the token cache in {tmp}/notes/.cache/trainflow/tokens (~ is "
         "HOME={tmp}/notes) ({tmp}/notes is a file, not a folder); point data.cache_dir at a writable folder with "
         "room for the corpus", setup=file_in_the_way, env=(("HOME", "{tmp}/notes"),)),
    Case("compile-cache-blocked", "compile", "an inductor cache folder blocked by a file",
         ("compile=default", "compile.cache_dir={tmp}/notes/inductor"),
         "Error: compile.cache_dir: cannot write the inductor cache in {tmp}/notes/inductor ({tmp}/notes is a file, "
         "not a folder); point compile.cache_dir at a writable folder", setup=file_in_the_way),
    Case("compile-cache-read-only", "compile", "an inductor cache on a read-only filesystem",
         ("compile=default", "compile.cache_dir={tmp}/ro"),
         "Error: compile.cache_dir: cannot write the inductor cache in {tmp}/ro (Read-only file system); point "
         "compile.cache_dir at a writable folder", setup=read_only_disk, needs="mount"),
    Case("home-read-only", "environment", "a HOME on a read-only filesystem, compiling with the default cache",
         ("compile=default", "data.cache_dir={tmp}/cache"),
         "Error: compile.cache_dir: cannot write the inductor cache in {tmp}/ro/.cache/trainflow/inductor (~ is "
         "HOME={tmp}/ro) (Read-only file system); point compile.cache_dir at a writable folder",
         setup=read_only_disk, env=(("HOME", "{tmp}/ro"),), needs="mount"),
    Case("disk-fills-while-training", "environment", "a run directory whose disk fills during training",
         ("hydra.run.dir={tmp}/small/run", "trainer.max_steps=600", "checkpoint.every_steps=1000"),
         "Error: hydra.run.dir: writing metrics.jsonl in {tmp}/small/run failed (No space left on device); free "
         "space or point hydra.run.dir at a writable disk", setup=disk_filling_under_the_run,
         after=metrics_lines_are_whole, needs="mount"),
    # checkpoints
    Case("resume-missing", "checkpoint", "a resume path that does not exist", ("checkpoint.resume={tmp}/nope",),
         "Error: checkpoint.resume: {tmp}/nope does not exist; give a committed checkpoint (a step_N folder), a "
         "checkpoint dir holding some, or a run dir"),
    Case("resume-older-into-newer", "checkpoint", "resuming an older checkpoint into a folder with newer ones",
         ("checkpoint.resume={ckpts}/step_00000002",),
         "Error: checkpoint.resume: {ckpts} already holds checkpoints up to step_00000004; continuing from "
         "{ckpts}/step_00000002 there would mix two histories; point checkpoint.dir at a new folder to branch off"),
    Case("fresh-start-over-history", "checkpoint", "resume=never in a folder with checkpoints",
         ("checkpoint.resume=never",),
         "Error: checkpoint.resume=never: {ckpts} already holds committed checkpoints (up to step_00000004) of an "
         "earlier run, and a fresh start there would mix two histories; point checkpoint.dir at an empty folder, "
         "or resume=auto to continue"),
    Case("truncated-shard", "checkpoint", "a truncated shard in the newest checkpoint", (),
         "Error: {ckpts}/step_00000004: corrupt checkpoint (__0_0.distcp is {n} bytes, the manifest says {n} "
         "(truncated)); nothing was changed: move it out of {ckpts} to resume from step_00000002 (the previous "
         "committed checkpoint)", setup=truncate_newest_shard),
    Case("missing-metadata", "checkpoint", "a newest checkpoint without .metadata", (),
         "Error: {ckpts}/step_00000004: corrupt checkpoint (.metadata is missing); nothing was changed: move it "
         "out of {ckpts} to resume from step_00000002 (the previous committed checkpoint)",
         setup=remove_newest_metadata),
    Case("garbled-manifest", "checkpoint", "an unreadable manifest in the newest checkpoint", (),
         "Error: {ckpts}/step_00000004: corrupt checkpoint (manifest.json is unreadable); nothing was changed: "
         "move it out of {ckpts} to resume from step_00000002 (the previous committed checkpoint)",
         setup=garble_newest_manifest),
    Case("other-model-shape", "checkpoint", "a checkpoint of another model shape", ("model.n_embd=32",),
         "Error: {ckpts}/step_00000004 was saved from another model shape: 29 mismatched key(s): "
         "blocks.0.attn.proj.bias [64] float32 saved vs [32] float32 here; blocks.0.attn.proj.weight [64, 64] "
         "float32 saved vs [32, 32] float32 here; blocks.0.attn.qkv.bias [192] float32 saved vs [96] float32 here; "
         "blocks.0.attn.qkv.weight [192, 64] float32 saved vs [96, 32] float32 here; blocks.0.ln1.bias [64] float32 "
         "saved vs [32] float32 here; blocks.0.ln1.weight [64] float32 saved vs [32] float32 here and 23 more; "
         "resume with the model config it was saved with, or set checkpoint.dir to a new folder to start fresh"),
    Case("flipped-byte", "checkpoint", "a flipped byte in the newest checkpoint's shard", (),
         "Error: {ckpts}/step_00000004: corrupt checkpoint (__0_0.distcp has checksum {any}, the manifest says {any} "
         "(its bytes changed after the save)); nothing was changed: move it out of {ckpts} to resume from "
         "step_00000002 (the previous committed checkpoint)", setup=flip_a_byte_of_the_newest_shard),
    Case("step-folder-without-manifest", "checkpoint", "a newest step_N folder without a manifest", (),
         "Error: {ckpts}/step_00000006: a checkpoint folder without manifest.json, newer than every committed one (a "
         "save that never committed, or a manifest that was lost); nothing was changed: move it out of {ckpts} to "
         "resume from step_00000004", setup=newest_step_folder_without_manifest),
    Case("booby-trapped-metadata", "checkpoint", "a .metadata that would run code when unpickled", (),
         "Error: {ckpts}/step_00000004/.metadata: refused without running it: it refers to builtins.exec, which DCP "
         "metadata never holds; the checkpoint is damaged or was tampered with: do not use it",
         setup=booby_trap_the_newest_metadata),
    Case("manifest-lists-a-fifo", "checkpoint", "a newest checkpoint whose manifest lists a FIFO", (),
         "Error: {ckpts}/step_00000004: corrupt checkpoint (extra.bin is a FIFO (named pipe), not a regular file); "
         "nothing was changed: move it out of {ckpts} to resume from step_00000002 (the previous committed "
         "checkpoint)", setup=list_a_fifo_in_the_newest_manifest),
    Case("manifest-lists-a-path", "checkpoint", "a newest checkpoint whose manifest lists /dev/zero", (),
         "Error: {ckpts}/step_00000004: corrupt checkpoint (manifest.json lists '/dev/zero', which is not a file name "
         "inside the checkpoint folder); nothing was changed: move it out of {ckpts} to resume from step_00000002 "
         "(the previous committed checkpoint)", setup=list_dev_zero_in_the_newest_manifest),
    Case("newer-format", "checkpoint", "resuming a checkpoint of a newer format", (),
         "Error: {ckpts}/step_00000004: saved in checkpoint format 4 by trainflow 9.0.0, a newer format: this "
         "trainflow ({any}) reads format 3 only; nothing was changed: resume or export it with that trainflow or a "
         "newer one", setup=newer_format_in_the_newest_manifest),
    Case("shards-not-prepared", "data", "data=shards at a folder nothing was prepared in",
         ("data=shards", "data.path={tmp}", "model.vocab_size=512"),
         "Error: data.path: {tmp}/manifest.json does not exist; prepare the corpus first with `trainflow prepare "
         "data=text data.paths=[...] --out {tmp}`, or point data.path at a prepared folder"),
    Case("prepare-without-conf", "data", "trainflow prepare where no conf/ folder is",
         ("prepare", "--out", "{tmp}/shards", "--config-dir", "{tmp}/conf", "data.paths=[{tmp}]"),
         "Error: --config-dir: {tmp}/conf holds no train.yaml; run trainflow prepare from the folder holding conf/ "
         "(the repository's root), or pass --config-dir", tool="trainflow"),
    Case("unknown-stream-version", "checkpoint", "resuming a data position of an unknown sample stream order", (),
         "Error: {ckpts}/step_00000004: its data position counts in sample stream version 3, and this trainflow "
         "knows versions 1, 2; resume it with the trainflow that saved it, or keep its weights only (a fresh data "
         "stream) with checkpoint.load=model checkpoint.resume={ckpts}/step_00000004 and checkpoint.dir at a new "
         "folder", setup=unknown_stream_version_in_the_newest_state),
    Case("export-newer-format", "checkpoint", "exporting a checkpoint of a newer format",
         ("export", "{ckpts}/step_00000004", "{tmp}/model.pt"),
         "Error: {ckpts}/step_00000004: saved in checkpoint format 4 by trainflow 9.0.0, a newer format: this "
         "trainflow ({any}) reads format 3 only; nothing was changed: resume or export it with that trainflow or a "
         "newer one", tool="trainflow", setup=newer_format_in_the_newest_manifest),
    Case("optimizer-changed", "checkpoint", "resuming with another optimizer", ("optim=sgd",),
         "Error: {ckpts}/step_00000004: saved with the AdamW optimizer, this run builds SGD (optim.name); its "
         "optimizer state does not fit: to continue from its weights only (fresh optimizer and LR schedule from "
         "step 0), run with checkpoint.load=model checkpoint.resume={ckpts}/step_00000004 and checkpoint.dir at a "
         "new folder, or set optim.name back"),
    Case("load-exported-other-shape", "checkpoint", "fine-tuning from exported weights of another model shape",
         ("checkpoint.load=model", "checkpoint.resume={tmp}/w.safetensors", "checkpoint.dir={tmp}/fresh"),
         "Error: checkpoint.resume: {tmp}/w.safetensors: tok_emb.weight is [256, 32] there, [256, 64] in this model; "
         "give weights exported from a model of this config, or set the model config they were trained with",
         setup=narrower_weights),
    Case("load-model-without-source", "checkpoint", "weights only, but from no named checkpoint",
         ("checkpoint.load=model",),
         "Error: checkpoint.load: model loads the weights of the checkpoint named by checkpoint.resume, which is "
         "auto; set checkpoint.resume=<a step_N folder or run dir>"),
    Case("export-garbled-metadata", "checkpoint", "exporting a checkpoint whose .metadata is garbled",
         ("export", "{ckpts}/step_00000004", "{tmp}/model.pt"),
         "Error: {ckpts}/step_00000004: corrupt checkpoint (.metadata has checksum {any}, the manifest says {any} "
         "(its bytes changed after the save)); nothing was changed: move it out of {ckpts} to resume from "
         "step_00000002 (the previous committed checkpoint)", tool="trainflow", setup=garble_the_newest_metadata),
    Case("checkpoint-dir-is-a-file", "checkpoint", "a checkpoint dir that is a file", ("checkpoint.dir={tmp}/notes",),
         "Error: checkpoint.dir: {tmp}/notes is a file, not a folder; point checkpoint.dir at a folder",
         setup=file_in_the_way),
    Case("foreign-folder-in-the-way", "checkpoint", "a folder trainflow did not make where a save must go", (),
         "Error: checkpoint.dir: {ckpts}/.tmp-step_00000006 is in the way of a save and trainflow did not make it (no "
         ".trainflow-unfinished inside); nothing was changed: move it away, or point checkpoint.dir at a folder of "
         "trainflow's own", setup=foreign_folder_where_a_save_goes, after=foreign_folder_kept),
    Case("checkpoint-dir-in-use", "checkpoint", "a checkpoint dir another run holds", (),
         "Error: checkpoint.dir: {ckpts} is in use by another run (pid {n} on {any}, since {any}); wait for it to "
         "end, or point checkpoint.dir at another folder", setup=lock_checkpoint_dir),
    Case("read-only-checkpoint-dir", "environment", "a checkpoint dir on a read-only filesystem",
         ("checkpoint.dir={tmp}/ro/ckpts",),
         "Error: checkpoint.dir: cannot write to {tmp}/ro/ckpts (Read-only file system); point checkpoint.dir at "
         "a writable folder", setup=read_only_disk, needs="mount"),
    Case("full-disk-sync", "environment", "a disk that fills up during a save",
         ("checkpoint.dir={tmp}/small/ckpts",),
         "Error: checkpoint.dir: saving step 6 to {tmp}/small/ckpts failed (the disk is full: {n} MB free, a "
         "checkpoint needs about {n} MB); free space or point checkpoint.dir at a writable disk; committed "
         "checkpoints are untouched (newest: step_00000004)", setup=nearly_full_disk, needs="mount"),
    Case("full-disk-async", "environment", "a disk that fills up during an async save",
         ("checkpoint.dir={tmp}/small/ckpts", "checkpoint.mode=async"),
         "Error: checkpoint.dir: saving step 6 to {tmp}/small/ckpts failed (the disk is full: {n} MB free, a "
         "checkpoint needs about {n} MB); free space or point checkpoint.dir at a writable disk; committed "
         "checkpoints are untouched (newest: step_00000004)", setup=nearly_full_disk, needs="mount"),
    Case("read-only-output-dir", "environment", "a run directory on a read-only filesystem",
         ("hydra.run.dir={tmp}/ro/run",),
         "Error: hydra.run.dir: cannot create {tmp}/ro/run (Read-only file system); point hydra.run.dir at a "
         "writable folder", setup=read_only_disk, needs="mount"),
    Case("cuda-without-gpu", "environment", "trainer.device=cuda on a machine without a GPU",
         ("trainer.device=cuda",),
         "Error: trainer.device: cuda was asked for but no GPU is visible; use trainer.device=cpu or auto",
         needs="no-gpu"),
    Case("port-in-use", "environment", "a rendezvous port another process listens on", ("parallelism=ddp",),
         "Error: environment: MASTER_PORT={port} on 127.0.0.1 is in use by another process; pick a free port "
         "(or let torchrun choose one)", setup=busy_port, env=(*RANK_ENV, ("MASTER_PORT", "{port}"))),
    Case("rank-without-master", "environment", "RANK and WORLD_SIZE without MASTER_ADDR", ("parallelism=ddp",),
         "Error: environment: RANK and WORLD_SIZE are set but MASTER_ADDR is not; a launcher must export "
         "MASTER_ADDR and MASTER_PORT too (torchrun does)", env=RANK_ENV[:4]),
    Case("run-dir-in-use", "environment", "a run directory a live run holds", (),
         "Error: hydra.run.dir: {tmp}/run is in use by another run (pid {n} on {any}, since {any}); wait for it to "
         "end, or give this run its own directory (another trainer.run_name, or hydra.run.dir=<folder>)",
         setup=lock_run_dir),
    Case("run-dir-of-another-run", "environment", "a run directory holding another run's config and summary", (),
         "Error: hydra.run.dir: {tmp}/run holds the config.yaml and summary.json of another run "
         "(model=gpt_small-{any}; this one is {any}); nothing was changed: give this run its own directory "
         "(hydra.run.dir=<new folder>), or continue that run with trainer.run_name='model=gpt_small-{any}'",
         setup=another_runs_results, after=another_runs_results_kept),
    # scale decisions
    Case("hsdp-shard-size", "scale", "an HSDP shard size that does not divide the world size",
         ("parallelism=hsdp", "parallelism.nproc_per_node=4", "parallelism.hsdp.shard_size=3"),
         "Error: parallelism.hsdp.shard_size: 3 does not divide the world size 4; use one of 1, 2 or 4"),
    Case("hsdp-replicate-size", "scale", "HSDP replicas x shard size other than the world size",
         ("parallelism=hsdp", "parallelism.nproc_per_node=4", "parallelism.hsdp.shard_size=2",
          "parallelism.hsdp.replicate_size=3"),
         "Error: parallelism.hsdp.replicate_size: 3 x shard_size 2 = 6 ranks, but the world has 4; set "
         "parallelism.hsdp.replicate_size=2 (or null)"),
    Case("hsdp-one-rank", "scale", "HSDP on one rank", ("parallelism=hsdp", "parallelism.nproc_per_node=1"),
         "Error: parallelism.nproc_per_node: hsdp needs 2 or more processes, got 1 (one was asked for); set "
         "parallelism.nproc_per_node=2 or more, or use parallelism=single"),
    Case("tp-heads-not-divisible", "scale", "a tensor-parallel degree that does not divide the GPT's heads",
         ("parallelism=fsdp", "parallelism.tp=4", "parallelism.nproc_per_node=4"),
         "Error: parallelism.tp: 4 does not divide model.n_head=2: each TP rank takes whole heads and an equal share "
         "of the hidden units; use a parallelism.tp that divides both, or change the model"),
    Case("tp-no-plan", "scale", "tensor parallel for a model without a TP plan",
         ("model=mlp", "data=synthetic", "parallelism=fsdp", "parallelism.tp=2", "parallelism.nproc_per_node=2"),
         "Error: parallelism.tp: 2 splits each layer by the model's plan, and MLP has none; give the model a "
         "`tp_plan` ({module name: ParallelStyle}), set parallelism.tp_plan._target_ to a function of the model "
         "returning one, or set parallelism.tp=1 (rank {n})"),
    Case("tp-larger-than-node", "scale", "a tensor-parallel degree larger than the ranks of one node",
         ("parallelism=fsdp", "parallelism.tp=4", "model.n_head=4", "parallelism.nproc_per_node=2"),
         "Error: parallelism.tp: 4 is larger than the 2 ranks of one node, and tensor parallelism gathers activations "
         "every layer over its group; set parallelism.tp to 2 or less (parallelism.dp_shard / dp_replicate for the "
         "rest)"),
    Case("tp-checkpointing-compile", "scale", "tensor parallel with activation checkpointing and compile together",
         ("parallelism=fsdp", "parallelism.tp=2", "parallelism.nproc_per_node=2", "compile=default",
          "parallelism.activation_checkpointing=full"),
         "Error: parallelism.activation_checkpointing: full with compile under parallelism.tp=2 fails inside torch "
         "(its compiled backward cannot save a checkpointed block's tensor-parallel mesh); set compile=off or "
         "parallelism.activation_checkpointing=off"),
    Case("degrees-not-world-size", "scale", "mesh degrees whose product is not the world size",
         ("parallelism=fsdp", "parallelism.dp_shard=3", "parallelism.nproc_per_node=4"),
         "Error: parallelism.dp_replicate x dp_shard x tp: 1 x 3 x 1 does not make the world size 4 (-1: the rest of "
         "the world); set degrees whose product is 4"),
    Case("auto-budget-too-small", "scale", "a memory budget too small for any strategy",
         ("parallelism=auto", "parallelism.memory_budget_gb=0.000001"),
         "Error: parallelism.memory_budget_gb: no strategy fits: the leanest, single + activation checkpointing, "
         "needs {any} GB per rank (parameters, gradients and optimizer state {any} GB, activations {any} GB), and "
         "the budget is {any} GB (parallelism.memory_budget_gb=1e-06); only a device with more memory would fit it"),
    # launch combinations
    Case("launcher-without-multirun", "launch", "a sweep launcher without -m", ("hydra/launcher=torchrun",),
         "Error: hydra/launcher=torchrun: the torchrun launcher runs sweeps, and this is a single run; add -m "
         "(python train.py -m hydra/launcher=torchrun ...) to run it as a one-job sweep"),
    Case("launcher-zero-processes", "launch", "a torchrun launcher with no processes",
         ("hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=0"),
         "Error: hydra.launcher.nproc_per_node: must be a positive integer or one of auto, cpu, gpu, xpu; got '0'",
         tool="multirun"),
    Case("launcher-ranks-disagree", "launch", "torchrun's ranks per node set unlike parallelism's",
         ("hydra/launcher=torchrun", "parallelism=ddp", "parallelism.nproc_per_node=2",
          "hydra.launcher.nproc_per_node=3"),
         "Error: hydra.launcher.nproc_per_node: is 3 but parallelism.nproc_per_node is 2 (job #0), and ranks per "
         "node is one number; drop hydra.launcher.nproc_per_node (the launcher follows parallelism.nproc_per_node) "
         "or give both the same value", tool="multirun"),
    Case("slurm-ranks-disagree", "launch", "SLURM's tasks per node set unlike parallelism's ranks per node",
         ("hydra/launcher=slurm", "parallelism=ddp", "parallelism.nproc_per_node=2",
          "hydra.launcher.tasks_per_node=4"),
         "Error: hydra.launcher.tasks_per_node: is 4 but parallelism.nproc_per_node is 2 (job #0), and ranks per "
         "node is one number; drop hydra.launcher.tasks_per_node (the launcher follows parallelism.nproc_per_node) "
         "or give both the same value", tool="multirun"),
    Case("ladder-rung-cannot-run", "launch", "a ladder too short for its profile rung",
         ("experiment=ladder", "trainer.max_steps=8"),
         "Error: ladder=profile (job #2): trainer.max_steps: is 8 but the profiler window ends at step 12 "
         "(skip_first 2 + 1 x (wait 5 + warmup 2 + active 3)); raise trainer.max_steps to >= 12 or shorten the "
         "window (profiler.skip_first/wait/warmup/active)", tool="multirun", after=no_rung_ran),
    Case("sweep-folder-of-another-sweep", "launch", "a sweep folder that holds another sweep", (),
         "Error: hydra.sweep.dir: {tmp}/sweep holds another sweep (optim.lr=1e-3,2e-3-{any}; this one is {any}); "
         "nothing was changed: give this sweep its own folder (trainer.sweep_name=<new name> or "
         "hydra.sweep.dir=<new folder>)", tool="multirun", setup=another_sweep_in_the_folder,
         after=other_sweep_untouched),
    # tools
    Case("export-unfinished-save", "tools", "exporting a save that never finished",
         ("export", "{tmp}/.tmp-step_00000006", "{tmp}/model.pt"),
         "Error: {tmp}/.tmp-step_00000006 is not a committed checkpoint (no manifest.json: a save that never "
         "finished); pick a step_N folder that has one", tool="trainflow", setup=unfinished_save),
    Case("export-into-checkpoint", "tools", "an export written into the checkpoint it reads",
         ("export", "{ckpts}/step_00000004", "{ckpts}/step_00000004/__0_0.distcp"),
         "Error: {ckpts}/step_00000004/__0_0.distcp: inside the checkpoint folder {ckpts}/step_00000004; an export "
         "never writes into a checkpoint folder (it would damage the checkpoints): give a path outside it",
         tool="trainflow"),
    Case("export-into-checkpoint-dir", "tools", "an export written into a checkpoint dir, even with --force",
         ("export", "{ckpts}", "{ckpts}/model.pt", "--force"),
         "Error: {ckpts}/model.pt: inside the checkpoint folder {ckpts}; an export never writes into a checkpoint "
         "folder (it would damage the checkpoints): give a path outside it", tool="trainflow"),
    Case("export-existing-output", "tools", "an export onto an existing file",
         ("export", "{ckpts}", "{tmp}/model.pt"),
         "Error: {tmp}/model.pt already exists; nothing was changed: give a new path, or add --force to replace it",
         tool="trainflow", setup=earlier_output, after=earlier_output_kept),
    Case("export-force-foreign-folder", "tools", "--force onto a folder that is no export",
         ("export", "{ckpts}", "{tmp}/mine", "--force"),
         "Error: {tmp}/mine is a folder trainflow did not export (no trainflow_export.json inside); --force replaces "
         "only a file or an earlier export: give a new path", tool="trainflow", setup=earlier_output,
         after=earlier_output_kept),
    Case("export-empty-output", "tools", "an export to an empty path", ("export", "{ckpts}", ""),
         "Error: export: the output path is empty; give the file or folder to write, e.g. model.safetensors",
         tool="trainflow"),
    Case("export-to-proc", "tools", "an export into /proc", ("export", "{ckpts}", "/proc/model.pt"),
         "Error: /proc/model.pt: cannot write the export (No such file or directory); give a path on a writable "
         "disk", tool="trainflow"),
    Case("export-read-only", "tools", "an export onto a read-only disk", ("export", "{ckpts}", "{tmp}/ro/model.pt"),
         "Error: {tmp}/ro/model.pt: cannot write the export (Read-only file system); give a path on a writable disk",
         tool="trainflow", setup=read_only_disk, needs="mount"),
    Case("export-hf-unmappable", "tools", "a Hugging Face export of a model that has no mapping",
         ("export", "{ckpts}", "{tmp}/hf", "--format", "hf", "--config", "{tmp}/config.yaml"),
         "Error: export --format hf: model._target_ trainflow.models.mlp.MLP has no Hugging Face mapping (only "
         "trainflow.models.gpt.GPT and trainflow.models.hf.gpt2 have); export --format safetensors instead",
         tool="trainflow", setup=mlp_config),
    Case("export-hf-without-config", "tools", "a Hugging Face export of a checkpoint dir kept outside its run",
         ("export", "{ckpts}", "{tmp}/hf", "--format", "hf"),
         "Error: export --format hf: needs the config of the run that saved {ckpts}/step_00000004, and "
         "{tmp}/config.yaml is not it; give --config <run dir>/config.yaml", tool="trainflow"),
    Case("report-missing-folder", "tools", "a report on a folder that does not exist", ("report", "{tmp}/nope"),
         "Error: {tmp}/nope: no such folder; give a run folder, a sweep folder (multirun/<sweep name>) or a folder "
         "holding them (e.g. outputs)", tool="trainflow"),
]


# -- running a row ----------------------------------------------------------------------------------------------


def committed_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file of every committed checkpoint (a step_N folder with a manifest) under `root`."""
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for manifest in sorted(root.rglob("step_*/manifest.json"))
            for f in sorted(manifest.parent.rglob("*")) if f.is_file()}


def pattern(ctx: Ctx, message: str) -> re.Pattern:
    parts = re.split(r"(\{n\}|\{any\})", message)
    wild = {"{n}": r"[0-9.]+", "{any}": r".+?"}
    return re.compile("".join(wild.get(p) or re.escape(ctx.fill(p)) for p in parts))


def command(case: Case, ctx: Ctx) -> list[str]:
    args = [ctx.fill(a) for a in case.args]
    if case.tool == "trainflow":
        return [str(Path(sys.executable).parent / "trainflow"), *args]
    keys = {a.split("=")[0] for a in args}
    # a row's own value wins; a row choosing another model drops the base's model.* settings
    base = [ctx.fill(a) for a in BASE if a.split("=")[0] not in keys and a.split(".")[0] not in keys]
    run_dir = [] if "hydra.run.dir" in keys else [f"hydra.run.dir={ctx.tmp / 'run'}"]
    multirun = ["-m", f"hydra.sweep.dir={ctx.tmp / 'sweep'}"] if case.tool == "multirun" else []
    return [sys.executable, str(ROOT / "train.py"), *multirun, *base, *args, *run_dir]


@pytest.fixture(scope="module")
def reference_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = train(tmp_path_factory.mktemp("reference") / "run", *TINY_GPT, "trainer.max_steps=4",
                "trainer.eval_every=0", "trainer.eval_steps=2", "checkpoint=dcp", "checkpoint.every_steps=2")
    assert run.returncode == 0, run.stderr[-3000:]
    return run.run_dir / "checkpoints"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, reference_checkpoints: Path, tmp_path: Path) -> None:
    if case.needs == "mount" and not can_mount():
        pytest.skip("needs a filesystem of its own (root with mount rights)")
    if case.needs == "no-gpu" and torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    with contextlib.ExitStack() as hold:
        ctx = Ctx(tmp_path, tmp_path / "ckpts", free_port(), hold)
        shutil.copytree(reference_checkpoints, ctx.ckpts)
        if case.setup:
            case.setup(ctx)
        before = committed_hashes(tmp_path)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **{k: ctx.fill(v) for k, v in case.env}}
        for key in ("HYDRA_FULL_ERROR", *(k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                                          if k not in dict(case.env))):
            env.pop(key, None)
        proc = run_process(command(case, ctx), ROOT, env, timeout=300)
        after = committed_hashes(tmp_path)
        if case.after:
            case.after(ctx)
    lines = proc.stderr.splitlines()
    assert proc.returncode == case.exit, proc.stderr[-3000:]
    expected = pattern(ctx, case.message)
    assert any(expected.fullmatch(line) for line in lines), f"{expected.pattern}\nnot in\n{proc.stderr[-3000:]}"
    if case.exit == 2:
        assert sum(line.startswith("Error:") for line in lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert any(name.startswith("ckpts/step_00000002/") for name in before)  # the hashes cover the reference run's
    assert after == before
    assert not (tmp_path / "ran").exists()  # no row's checkpoint ran code


def test_full_error_shows_the_traceback_when_asked(tmp_path: Path) -> None:
    run = train(tmp_path / "run", *TINY_GPT, "trainer.max_steps=0", env={"HYDRA_FULL_ERROR": "1"})
    assert run.returncode != 0 and "Traceback" in run.stderr and "ConfigError" in run.stderr


def markdown_rows() -> list[str]:
    """The table as docs/reliability.md shows it: {tmp} and {ckpts} are test folders, {n} a number, {any} text."""
    rows = ["| area | bad input | try it | exit | what trainflow says |", "|---|---|---|---|---|"]
    for c in CASES:
        shown = " ".join(c.args)
        shown = {"trainflow": f"trainflow {shown}", "multirun": f"-m {shown}"}.get(c.tool, shown)
        shown = " ".join([*(f"{k}={v}" for k, v in c.env), *([shown] if shown else [])])
        shown = shown.replace("{ckpts}", "<ckpts>").replace("{tmp}", "<dir>").replace("{port}", "<port>")
        shown = shown.replace(str(ROOT), "$PWD")  # run from the repository root: the page names no machine's path
        message = (c.message.replace("{any}", "…").replace("{n}", "N").replace("{ckpts}", "<ckpts>")
                   .replace("{tmp}", "<dir>").replace("{port}", "<port>").replace("|", "\\|"))
        rows.append(f"| {c.area} | {c.what} | {f'`{shown}`' if shown else '-'} | {c.exit} | {message} |")
    return rows
