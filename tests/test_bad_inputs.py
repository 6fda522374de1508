"""Every bad input we know of, tried in a real process, as a table.

For each row: one line of stderr names the key (or path) and says the row's decisive words (the cause, the fix) in
their order; the exit code; no traceback; every committed checkpoint on disk byte-identical afterwards; and nothing
new left on disk: the row's folder, the repository's outputs/ and multirun/ hold what they held before, byte for byte
(a row whose point is an existing folder finds it as it was), unless the row says why it `leaves` files. A row
holds only those words, not the whole message, so rewording a message is one edit, in the source. Every
`train.py` row runs beside two committed checkpoints of an earlier run (steps 2 and 4) in `checkpoint.dir`, so a bad
input that got as far as touching them would show. docs/reliability.md is rendered from this table (see
test_reliability_readme.py).
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
from helpers.processes import run_process
from helpers.runs import ROOT, TINY_GPT, can_mount, tmpfs, train

from trainflow.util.rundir import MARKER

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
    key: str  # the config key or path the line names; exit 2: the line begins `Error: <key>`
    says: tuple[str, ...]  # the decisive words in order; {tmp} {ckpts} {port} are filled in, {n} a number, {any} text
    exit: int = 2
    tool: str = "train"  # train: python train.py; multirun: python train.py -m; trainflow: the console command
    setup: Callable[[Ctx], None] | None = None
    env: tuple[tuple[str, str], ...] = ()
    needs: str | None = None  # "mount": a filesystem of our own; "no-gpu": a machine without CUDA
    after: Callable[[Ctx], None] | None = None  # checks on what the run left behind
    cwd: str | None = None  # where the command runs (placeholders filled); None: the repository's root
    # what the row may leave in its folder (paths under {tmp}; each row says why): a run directory whose training
    # began (it keeps what the run wrote and the log saying why it stopped), a cache the next run reuses; all else
    # is a refusal's, which leaves nothing on disk
    leaves: tuple[str, ...] = ()


OTHER_SWEEP = "hydra:\n  overrides:\n    task:\n    - optim.lr=1e-3,2e-3\n"  # the multirun.yaml of another sweep


def another_sweep_in_the_folder(ctx: Ctx) -> None:
    (ctx.tmp / "sweep").mkdir()
    (ctx.tmp / "sweep" / "multirun.yaml").write_text(OTHER_SWEEP)


def other_sweep_untouched(ctx: Ctx) -> None:
    assert sorted(p.name for p in (ctx.tmp / "sweep").iterdir()) == ["multirun.yaml"]
    assert (ctx.tmp / "sweep" / "multirun.yaml").read_text() == OTHER_SWEEP


def no_rung_ran(ctx: Ctx) -> None:
    """The ladder stopped before its first rung: no job folder, no training; the sweep folder it made is gone."""
    assert not (ctx.tmp / "sweep").exists()


# -- setups -----------------------------------------------------------------------------------------------------


def tiny_corpus(ctx: Ctx) -> None:
    (ctx.tmp / "tiny.txt").write_text("print('hi')\n")


def source_corpus(ctx: Ctx) -> None:
    shutil.copy(ROOT / "src" / "trainflow" / "data" / "text.py", ctx.tmp / "source.py")  # ~9 kB of real text


def another_corpus(ctx: Ctx) -> None:
    """Two files of real text: not the corpus the reference checkpoints were saved on (the standard library)."""
    (ctx.tmp / "corpus").mkdir()
    for name, source in (("a.py", "text.py"), ("b.py", "stream.py")):
        shutil.copy(ROOT / "src" / "trainflow" / "data" / source, ctx.tmp / "corpus" / name)


def empty_corpus(ctx: Ctx) -> None:
    (ctx.tmp / "empty.txt").write_text("")


def broken_datasets(ctx: Ctx) -> None:
    """A `datasets` that raises as it is imported (a broken install), first on PYTHONPATH; and a corpus for data=hf."""
    (ctx.tmp / "broken" / "datasets").mkdir(parents=True)
    (ctx.tmp / "broken" / "datasets" / "__init__.py").write_text("raise RuntimeError('half-installed: no arrow')\n")
    (ctx.tmp / "corpus.jsonl").write_text('{"text": "hello"}\n')


def torchft_hidden(ctx: Ctx) -> None:
    """A Python that cannot import torchft (a sitecustomize on PYTHONPATH blocks it): as if it were not installed."""
    (ctx.tmp / "no_torchft").mkdir()
    (ctx.tmp / "no_torchft" / "sitecustomize.py").write_text("import sys\nsys.modules['torchft'] = None\n")


def file_in_the_way(ctx: Ctx) -> None:
    (ctx.tmp / "notes").write_text("not a folder")


def file_in_the_way_of_wandb(ctx: Ctx) -> None:
    """A file where WANDB_DIR's folder must be, and a system temporary folder of the row's own to watch."""
    file_in_the_way(ctx)
    (ctx.tmp / "systmp").mkdir()


def nothing_in_the_system_temporary_folder(ctx: Ctx) -> None:
    # W&B's fallback would be <TMPDIR>/wandb; its own temporary folders go when its process exits by itself
    assert [p.name for p in (ctx.tmp / "systmp").iterdir() if "wandb" in p.name] == []


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
    (ctx.tmp / "run" / MARKER).write_text("")
    (ctx.tmp / "run" / ".hydra" / "overrides.yaml").write_text("- model=gpt_small\n- trainer.max_steps=4\n")
    (ctx.tmp / "run" / "config.yaml").write_text("model:\n  n_layer: 12\n")
    (ctx.tmp / "run" / "summary.json").write_text('{"steps": 4}')


def another_runs_results_kept(ctx: Ctx) -> None:
    assert (ctx.tmp / "run" / "config.yaml").read_text() == "model:\n  n_layer: 12\n"
    assert (ctx.tmp / "run" / "summary.json").read_text() == '{"steps": 4}'
    assert "gpt_small" in (ctx.tmp / "run" / ".hydra" / "overrides.yaml").read_text()


def file_where_tensorboard_writes(ctx: Ctx) -> None:
    """In a run directory of trainflow's (an earlier run of the same command)."""
    (ctx.tmp / "run").mkdir()
    (ctx.tmp / "run" / MARKER).write_text("")
    (ctx.tmp / "run" / "tensorboard").write_text("not a folder")


def read_only_tensorboard_folder(ctx: Ctx) -> None:
    ctx.hold.enter_context(tmpfs(ctx.tmp / "run" / "tensorboard", "1m", read_only=True))
    (ctx.tmp / "run" / MARKER).write_text("")


USERS = {"metrics.jsonl": '{"mine": 1}\n', "train.log": "my own log\n", "notes.txt": "my notes\n"}


def users_files(folder: Path) -> None:
    """A folder of the user's, holding files of the names a run writes, and one of its own."""
    folder.mkdir(parents=True)
    for name, text in USERS.items():
        (folder / name).write_text(text)


def users_files_kept(folder: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(USERS)  # nothing added
    assert {name: (folder / name).read_text() for name in USERS} == USERS  # nothing changed


def users_folder_as_run_dir(ctx: Ctx) -> None:
    users_files(ctx.tmp / "run")


def users_run_dir_kept(ctx: Ctx) -> None:
    users_files_kept(ctx.tmp / "run")


def users_folder_as_cwd(ctx: Ctx) -> None:
    users_files(ctx.tmp / "here")


def users_cwd_kept(ctx: Ctx) -> None:
    users_files_kept(ctx.tmp / "here")


def users_folder_as_sweep_dir(ctx: Ctx) -> None:
    users_files(ctx.tmp / "sweep")


def users_sweep_dir_kept(ctx: Ctx) -> None:
    users_files_kept(ctx.tmp / "sweep")


def users_model_in_the_run_dir(ctx: Ctx) -> None:
    """A run directory of trainflow's (an earlier run of the same command) where the user put a model.pt."""
    (ctx.tmp / "run").mkdir()
    (ctx.tmp / "run" / MARKER).write_text("")
    (ctx.tmp / "run" / "model.pt").write_text(PRECIOUS)


def users_model_kept(ctx: Ctx) -> None:
    assert (ctx.tmp / "run" / "model.pt").read_text() == PRECIOUS
    assert not (ctx.tmp / "run" / "metrics.jsonl").exists()  # refused before the first step: nothing added


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
    from trainflow.util.locks import DirLock

    ctx.hold.callback(DirLock(ctx.ckpts).release)  # this test process plays the other run


def lock_run_dir(ctx: Ctx) -> None:
    from trainflow.util.locks import DirLock

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


def failed_run(ctx: Ctx) -> None:
    """A sweep job's folder whose run failed: Hydra's config and the failure's line, no summary."""
    (ctx.tmp / "failed" / ".hydra").mkdir(parents=True)
    (ctx.tmp / "failed" / ".hydra" / "config.yaml").write_text("trainer:\n  max_steps: 8\n")
    (ctx.tmp / "failed" / "failure.txt").write_text("RuntimeError: boom\n")


def empty_ledger(ctx: Ctx) -> None:
    (ctx.tmp / "ledger.jsonl").write_text("")


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


def gpt_config(ctx: Ctx, tokenizer: dict) -> None:
    """The config of the reference run (the GPT of TINY_GPT) with `tokenizer`, for `export --config`."""
    model = {"_target_": "trainflow.models.gpt.GPT", "vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2,
             "n_embd": 64, "dropout": 0.0, "bias": True}
    data = {"_target_": "trainflow.data.text_data", "paths": [str(ctx.tmp / "source.py")], "suffixes": [".py"]}
    (ctx.tmp / "config.yaml").write_text(json.dumps({"model": model, "data": data, "tokenizer": tokenizer}))


def bpe_cached_elsewhere(ctx: Ctx) -> None:
    """A run of tokenizer=bpe whose config names a cache folder that does not exist (the run ran elsewhere)."""
    source_corpus(ctx)
    gpt_config(ctx, {"kind": "bpe", "vocab_size": 300, "cache_dir": str(ctx.tmp / "elsewhere" / "tokenizers")})


def nothing_made_elsewhere(ctx: Ctx) -> None:
    assert not (ctx.tmp / "elsewhere").exists() and not (ctx.tmp / "hf").exists()


def tokenizer_file_config(ctx: Ctx, name: str) -> None:
    gpt_config(ctx, {"kind": "file", "vocab_size": 300, "path": str(ctx.tmp / name)})


def fifo_tokenizer(ctx: Ctx) -> None:
    os.mkfifo(ctx.tmp / "pipe")
    tokenizer_file_config(ctx, "pipe")


def moved_tokenizer(ctx: Ctx) -> None:
    tokenizer_file_config(ctx, "tokenizer.json")


def text_as_tokenizer(ctx: Ctx) -> None:
    (ctx.tmp / "tokenizer.json").write_text("not json\n")
    tokenizer_file_config(ctx, "tokenizer.json")


def broken_transformers(ctx: Ctx) -> None:
    """A Python path on which `import transformers` raises, as a broken installation does."""
    (ctx.tmp / "broken" / "transformers").mkdir(parents=True)
    (ctx.tmp / "broken" / "transformers" / "__init__.py").write_text(
        "raise RuntimeError('Failed to import transformers.models.gpt2: a broken installation')\n")
    gpt_config(ctx, {"kind": "bytes"})


def no_hf_output(ctx: Ctx) -> None:
    assert sorted(p.name for p in ctx.tmp.iterdir() if p.name.startswith((".hf", "hf"))) == []


def broken_experiment_yaml(ctx: Ctx) -> None:
    """An experiment of one's own (--config-dir) whose YAML does not parse: an indentation slip on line 3."""
    (ctx.tmp / "conf" / "experiment").mkdir(parents=True)
    (ctx.tmp / "conf" / "experiment" / "mine.yaml").write_text("# @package _global_\ntrainer:\n max_steps: 4\n"
                                                               "  log_every: 1\n")


def own_model_options(ctx: Ctx) -> None:
    """A project's own model options (--config-dir): one that names its class, one that names none."""
    (ctx.tmp / "conf" / "model").mkdir(parents=True)
    (ctx.tmp / "conf" / "model" / "mine_net.yaml").write_text("_target_: trainflow.models.mlp.MLP\nhidden: 8\n")
    (ctx.tmp / "conf" / "model" / "mine.yaml").write_text("hidden: 8\n")


def own_experiments_with_old_and_misspelt_keys(ctx: Ctx) -> None:
    """Experiments of one's own (--config-dir) written with a key's former name and with a misspelt key."""
    (ctx.tmp / "conf" / "experiment").mkdir(parents=True)
    (ctx.tmp / "conf" / "experiment" / "old.yaml").write_text("# @package _global_\ntrainer:\n  warmup_steps: 1\n")
    (ctx.tmp / "conf" / "experiment" / "typo.yaml").write_text("# @package _global_\ntrainer:\n  max_step: 3\n")


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
         "model/nope", ("Could not find",), exit=1),
    Case("unknown-key", "config", "a key no schema has", ("trainer.foo=1",),
         "trainer.foo", ("Could not override",), exit=1),
    Case("wrong-type", "config", "a value of the wrong type", ("trainer.max_steps=abc",),
         "'abc'", ("could not be converted to Integer",), exit=1),
    Case("misspelt-key", "config", "a misspelt key", ("trainer.max_step=30",),
         "trainer.max_step", ("Could not override", "did you mean trainer.max_steps=30?"), exit=1),
    Case("renamed-key", "config", "a key by its former name", ("trainer.warmup_steps=3",),
         "trainer.warmup_steps", ("the key is now trainer.excluded_steps", "optim.warmup_steps"), exit=1),
    Case("renamed-key-in-yaml", "config", "a key by its former name in an experiment of one's own",
         ("--config-dir", "{tmp}/conf", "experiment=old"), "experiment/old",
         ("trainer.warmup_steps: the key is now trainer.excluded_steps",), exit=1,
         setup=own_experiments_with_old_and_misspelt_keys),
    Case("misspelt-key-in-yaml", "config", "a misspelt key in an experiment of one's own",
         ("--config-dir", "{tmp}/conf", "experiment=typo"), "experiment/typo",
         ("trainer.max_step: the config has no such key", "did you mean trainer.max_steps?"), exit=1,
         setup=own_experiments_with_old_and_misspelt_keys),
    Case("misspelt-key-added", "config", "a misspelt key added with Hydra's `+` (as its own hint suggests)",
         ("+trainer.max_step=30",), "trainer.max_step", ("has no such key", "did you mean trainer.max_steps=30?"),
         exit=1),
    Case("misspelt-key-forced", "config", "a misspelt key forced with Hydra's `++`", ("++trainer.max_step=30",),
         "trainer.max_step", ("has no such key", "did you mean trainer.max_steps=30?"), exit=1),
    Case("misspelt-section-added", "config", "a misspelt section added with `+` (no schema has it)",
         ("+optimizer.lr=1e-3",), "optimizer.lr",
         ("has no such key", "+ adds keys only to", "model, data, task, optim, logger", "did you mean optim.lr=1e-3?"),
         exit=1),
    Case("misspelt-section-forced", "config", "a misspelt section forced with `++`", ("++optimizer.lr=1e-3",),
         "optimizer.lr", ("has no such key", "did you mean optim.lr=1e-3?"), exit=1),
    Case("new-section-added", "config", "a section of its own added with `+`", ("+foo.bar=1",),
         "foo.bar", ("has no such key", "python train.py --cfg job lists every key"), exit=1),
    Case("new-top-level-key-added", "config", "a top-level key added with `+`", ("+widgetz=[1]",),
         "widgetz", ("has no such key", "python train.py --cfg job lists every key"), exit=1),
    Case("misspelt-top-level-key-added", "config", "a misspelt top-level section added with `+`", ("+stagez=[1]",),
         "stagez", ("has no such key", "did you mean stages=[1]?"), exit=1),
    Case("new-nested-key-added", "config", "a key added with `+` inside a section of a schema",
         ("+parallelism.fsdp.reshard=true",), "parallelism.fsdp.reshard", ("has no such key",), exit=1),
    Case("misspelt-section-added-in-sweep", "config", "a misspelt section added with `+` in a sweep",
         ("+optimizer.lr=1e-3,2e-3",), "optimizer.lr", ("has no such key", "did you mean optim.lr=1e-3,2e-3?"),
         exit=1, tool="multirun"),
    Case("group-added-twice", "config", "a group of the defaults added again with `+` (as Hydra's docs write it)",
         ("+experiment=seed_mlp",), "+experiment=seed_mlp", ("a group of the defaults already", "experiment=seed_mlp"),
         exit=1),
    Case("sweep-with-cfg", "config", "a sweep's config asked for with --cfg",
         ("-m", "--cfg", "hydra", "optim.lr=1e-3,2e-3"), "-m and --cfg",
         ("one of -m, --cfg, --info at a time", "drop -m", "python train.py --cfg job"), exit=1),
    Case("new-section-added-installed", "config", "a section of its own added with `+`, as the installed command",
         ("train", "+foo.bar=1"), "foo.bar", ("has no such key", "trainflow train --cfg job lists every key"),
         exit=1, tool="trainflow", cwd="{tmp}"),
    Case("misspelt-section", "config", "a misspelt section", ("tranier.max_steps=3",),
         "tranier.max_steps", ("Could not override", "did you mean trainer.max_steps=3?"), exit=1),
    Case("misspelt-option", "config", "a misspelt option", ("model=gpt_tiney",),
         "model/gpt_tiney", ("Could not find", "did you mean model=gpt_tiny?", "gpt_small, gpt_tiny, mlp"), exit=1),
    Case("misspelt-own-option", "config", "a misspelt option of one's own (--config-dir)",
         ("--config-dir", "{tmp}/conf", "model=mine_nett"),
         "model/mine_nett", ("Could not find", "did you mean model=mine_net?", "gpt_tiny, mine, mine_net, mlp"),
         exit=1, setup=own_model_options),
    Case("own-option-without-target", "config", "a model option of one's own that names no class",
         ("--config-dir", "{tmp}/conf", "model=mine"),
         "model._target_", ("missing", "pick one of model=cnn,custom,gpt_medium,gpt_small,gpt_tiny,mine,mine_net,mlp",
                            "set model._target_"), setup=own_model_options),
    Case("misspelt-group", "config", "a misspelt group", ("modle=mlp",),
         "modle", ("Could not override", "did you mean model=mlp?"), exit=1),
    Case("misspelt-list-option", "config", "a misspelt option in a list", ("logger=[tensorboard,mlfow]",),
         "logger/mlfow", ("Could not find", "did you mean logger=mlflow?"), exit=1),
    Case("unparsable-override", "config", "an override Hydra cannot parse", ("trainer.max_steps=[",),
         "trainer.max_steps=[", ("cannot parse", "key=value"), exit=1),
    Case("zero-steps", "config", "no training steps", ("trainer.max_steps=0",),
         "trainer.max_steps", ("positive integer", "got 0")),
    Case("negative-batch", "config", "a negative batch size", ("trainer.batch_size=-2",),
         "trainer.batch_size", ("positive integer", "got -2")),
    Case("zero-accumulation", "config", "zero accumulation steps", ("trainer.grad_accum=0",),
         "trainer.grad_accum", ("positive integer", "got 0")),
    Case("zero-lr", "config", "a zero learning rate", ("optim.lr=0",),
         "optim.lr", ("> 0", "got 0.0")),
    Case("unknown-precision", "config", "a precision trainflow does not train in", ("trainer.precision=fp16",),
         "trainer.precision", ("fp32, bf16", "got 'fp16'"), exit=1),
    Case("unknown-eval-schedule", "config", "an evaluation schedule that is neither auto nor a step count",
         ("trainer.eval_every=often",),
         "trainer.eval_every", ("auto or an integer", "got 'often'"), exit=1),
    Case("negative-cost", "config", "a negative price of a device hour", ("trainer.cost_per_hour=-1",),
         "trainer.cost_per_hour", (">= 0", "got -1.0")),
    Case("ledger-is-a-folder", "config", "a ledger path that is a folder", ("metrics.ledger={tmp}",),
         "metrics.ledger", ("{tmp} is a folder", "give a file in it")),
    Case("ledger-read-only", "environment", "a ledger on a read-only filesystem",
         ("metrics.ledger={tmp}/ro/ledger.jsonl",), "metrics.ledger", ("cannot write to", "a writable file", "off"),
         setup=read_only_disk, needs="mount"),
    Case("model-not-importable", "config", "a model class that cannot be imported", ("model._target_=nosuch.Net",),
         "model._target_", ("cannot import 'nosuch.Net'", "import path of an nn.Module class")),
    Case("model-arguments-refused", "config", "model arguments the model refuses", ("model.n_head=3",),
         "model", ("n_embd (64) must be divisible by n_head (3)", "fix the model.* values")),
    Case("model-not-a-module", "config", "a model target that is not an nn.Module",
         ("model._target_=collections.OrderedDict",),
         "model._target_", ("is not an nn.Module", "point it at an nn.Module class")),
    Case("model-key-unknown", "config", "a key the built-in model option does not have", ("model.n_heads=3",),
         "model.n_heads", ("has no such key", "n_head", "model=custom model._target_=<import path>"), exit=1),
    Case("custom-model-without-target", "config", "model=custom without the model's import path", ("model=custom",),
         "model._target_", ("missing", "set model._target_")),
    Case("custom-data-without-target", "data", "data=custom without the factory's import path", ("data=custom",),
         "data._target_", ("missing", "set data._target_")),
    Case("reduce-overhead-on-cpu", "compile", "CUDA graphs on a CPU", ("compile=reduce_overhead",),
         "compile.mode", ("need a GPU", "compile=default")),
    Case("profiler-nothing-recorded", "profile", "a profiler window that records no step",
         ("profiler=schedule", "profiler.active=0", "trainer.max_steps=20"),
         "profiler.active", ("positive number", "got 0")),
    Case("profiler-window-past-end", "profile", "a profiler window that ends after the run", ("profiler=schedule",),
         "trainer.max_steps", ("ends at step 12", "raise trainer.max_steps to >= 12")),
    Case("nccl-on-cpu", "scale", "the NCCL backend without GPUs",
         ("parallelism=ddp", "parallelism.nproc_per_node=2", "parallelism.backend=nccl"),
         "parallelism.backend", ("needs CUDA GPUs", "parallelism.backend=gloo")),
    Case("global-batch-indivisible", "scale", "a global batch the ranks cannot share",
         ("parallelism=ddp", "parallelism.nproc_per_node=2", "trainer.grad_accum=2", "parallelism.global_batch=30"),
         "parallelism.global_batch", ("2 ranks x 2 accumulation steps", "a multiple of 4")),
    Case("auto-with-tp", "scale", "a TP degree with parallelism=auto, which chooses it",
         ("parallelism=auto", "parallelism.tp=2"),
         "parallelism.tp", ("parallelism=auto chooses the TP degree itself", "parallelism=fsdp, ddp or hsdp")),
    Case("auto-global-batch-no-layout", "scale", "parallelism=auto with a global batch no layout's ranks divide",
         ("model=mlp", "data=synthetic", "parallelism=auto", "parallelism.nproc_per_node=2",
          "parallelism.global_batch=3"),
         "parallelism.global_batch", ("does not split over the data-parallel ranks of any layout of 2 ranks",
                                      "left out: ddp, fsdp", "a multiple of 2"),
         leaves=("run",)),  # found by the workers the run started: the run directory keeps their logs
    Case("watchdog-after-timeout", "scale", "a hang watchdog that would speak after the collective timeout",
         ("parallelism=ddp", "parallelism.nproc_per_node=2", "parallelism.timeout_s=30",
          "parallelism.watchdog.min_s=60"),
         "parallelism.watchdog.min_s", ("below parallelism.timeout_s (30)", "got 60.0",
                                        "lower it or raise parallelism.timeout_s")),
    Case("straggler-factor-one", "scale", "a straggler factor that would name a rank no slower than the others",
         ("parallelism=ddp", "parallelism.nproc_per_node=2", "parallelism.straggler.factor=1"),
         "parallelism.straggler.factor", ("> 1", "got 1.0")),
    Case("straggler-intervals-zero", "scale", "a straggler named after no log interval at all",
         ("parallelism=ddp", "parallelism.nproc_per_node=2", "parallelism.straggler.intervals=0"),
         "parallelism.straggler.intervals", ("positive integer", "got 0")),
    Case("torchft-missing", "scale", "fault tolerance asked for without torchft installed",
         ("parallelism.fault_tolerance=torchft",),
         "parallelism.fault_tolerance", ("torchft is not installed", "pip install 'trainflow[ft]'", "set it to off"),
         setup=torchft_hidden, env=(("PYTHONPATH", "{tmp}/no_torchft"),)),
    Case("broken-optional-library", "data", "an optional library that is installed but raises as it is imported",
         ("data=hf", "data.paths=[{tmp}/corpus.jsonl]"),
         "data=hf", ("datasets is installed but fails to import", "RuntimeError: half-installed: no arrow",
                     "pip install --force-reinstall 'trainflow[hf]'"),
         setup=broken_datasets, env=(("PYTHONPATH", "{tmp}/broken"),)),
    Case("torchft-with-hsdp", "scale", "fault tolerance with a strategy it does not run (HSDP inside a group)",
         ("parallelism=hsdp", "parallelism.nproc_per_node=4", "parallelism.fault_tolerance=torchft"),
         "parallelism.fault_tolerance", ("replica groups of one rank, of DDP ranks or of FSDP ranks",
                                         "got parallelism=hsdp", "run each group as parallelism=fsdp")),
    Case("torchft-lighthouse-idle-zero", "scale", "a lighthouse=auto that would end before any group talks to it",
         ("parallelism.fault_tolerance=torchft", "parallelism.ft.lighthouse_idle_s=0"),
         "parallelism.ft.lighthouse_idle_s", ("must be > 0", "got 0.0")),
    Case("torchft-lighthouse-port-busy", "scale", "lighthouse=auto on a port another program holds",
         ("parallelism.fault_tolerance=torchft", "parallelism.ft.lighthouse_port={port}"),
         "parallelism.ft.lighthouse", ("no lighthouse answers at http://localhost:{port}", "lighthouse.log",
                                       "free port {port}", "parallelism.ft.lighthouse_port"), setup=busy_port),
    Case("torchft-lighthouse-not-answering", "scale", "a lighthouse address where none answers",
         ("parallelism.fault_tolerance=torchft", "parallelism.ft.lighthouse=http://localhost:{port}"),
         "parallelism.ft.lighthouse", ("no lighthouse answers at http://localhost:{port}", "trainflow lighthouse",
                                       "set it to auto")),
    Case("torchft-no-quorum-without-checkpoints", "scale", "a replica group whose quorum never comes (fewer than "
         "ft.min_replicas groups reach the lighthouse, as when it is lost) with checkpoints off: nothing to stop with",
         ("parallelism.fault_tolerance=torchft", "parallelism.ft.min_replicas=2", "parallelism.ft.timeout_s=3",
          "parallelism.ft.lighthouse_port={port}", "parallelism.ft.lighthouse_idle_s=1", "checkpoint=off"),
         "parallelism.ft.no_quorum", ("no quorum for step 1 within parallelism.ft.timeout_s (3 s)",
                                      "answers but gave this group none", "parallelism.ft.min_replicas=2",
                                      "stops with nothing saved", "checkpoints are off",
                                      "parallelism.ft.no_quorum=alone"), exit=1),
    Case("torchft-no-quorum-unknown", "scale", "an unknown choice of what a group does without a quorum",
         ("parallelism.fault_tolerance=torchft", "parallelism.ft.no_quorum=retry"),
         "parallelism.ft.no_quorum", ("must be one of stop, alone", "got 'retry'"), exit=1),
    Case("lighthouse-port-busy", "scale", "trainflow lighthouse on a port another program holds",
         ("lighthouse", "--port", "{port}"),
         "--port", ("cannot listen on port {port}", "Address already in use", "give another port"),
         tool="trainflow", setup=busy_port),
    Case("torchft-replica-id-outside", "scale", "a replica group id outside the groups",
         ("parallelism.fault_tolerance=torchft", "parallelism.ft.replica_id=2"),
         "parallelism.ft.replica_id", ("must be in [0, 1]", "got 2")),
    Case("fsdp-blocks-without-blocks", "scale", "FSDP per-block wrapping of a model without blocks",
         ("model=mlp", "data=synthetic", "parallelism=fsdp", "parallelism.nproc_per_node=2",
          "parallelism.fsdp.wrap=blocks"),
         "parallelism.fsdp.wrap", ("MLP has none", "parallelism.fsdp.wrap=size", "(rank {n})"),
         leaves=("run",)),  # found by the workers the run started: the run directory keeps their logs
    Case("zero-keep-last", "checkpoint", "retention that keeps nothing", ("checkpoint.keep_last=0",),
         "checkpoint.keep_last", (">= 1", "got 0")),
    Case("export-without-final-save", "checkpoint", "export without a final save",
         ("checkpoint.export=true", "checkpoint.save_final=false"),
         "checkpoint.export", ("checkpoint.save_final=true",)),
    Case("checkpoint-saves-nothing", "checkpoint", "a save interval longer than the run, and no final save",
         ("checkpoint.every_steps=100", "checkpoint.save_final=false"),
         "checkpoint.every_steps", ("is 100, more than trainer.max_steps=8", "save no checkpoint",
                                    "checkpoint.every_steps to 8 or less", "checkpoint.save_final=true")),
    Case("checkpoint-key-while-off", "checkpoint", "a checkpoint key given while checkpoints are off",
         ("checkpoint=off", "checkpoint.resume={ckpts}/step_00000004"),
         "checkpoint.resume", ("checkpoints are off", "save nothing and resume nothing", "add checkpoint=dcp")),
    Case("on-data-change-unknown", "checkpoint", "an unknown answer to a resume on other data",
         ("checkpoint.on_data_change=continue",),
         "checkpoint.on_data_change", ("must be one of refuse, restart", "got 'continue'"), exit=1),
    Case("export-at-end-over-users-file", "checkpoint", "checkpoint.export=true where the user's model.pt lies",
         ("checkpoint.export=true",),
         "checkpoint.export", ("{tmp}/run/model.pt is a file trainflow did not export", "nothing was changed",
                               "move it away", "checkpoint.export=false"),
         setup=users_model_in_the_run_dir, after=users_model_kept),
    Case("stop-signal-uncatchable", "checkpoint", "a stop signal no process can catch",
         ("checkpoint=dcp", "checkpoint.stop_signals=[SIGTERM,SIGKILL]"),
         "checkpoint.stop_signals", ("SIGKILL cannot be caught", "SIGTERM, SIGUSR1, SIGUSR2, SIGHUP"), exit=1),
    Case("stop-signal-not-a-signal", "checkpoint", "a stop signal named as SLURM's --signal writes it",
         ("checkpoint.stop_signals=[USR1]",),
         "checkpoint.stop_signals", ("'USR1' is not a signal's name: write SIGUSR1",), exit=1),
    Case("stop-signal-ctrl-c", "checkpoint", "Ctrl-C as a stop signal", ("checkpoint.stop_signals=[SIGINT]",),
         "checkpoint.stop_signals", ("SIGINT is Ctrl-C", "exit code 130"), exit=1),
    # files and paths
    Case("missing-corpus", "data", "a corpus path that does not exist", ("data.paths=[/no/such/corpus]",),
         "data.paths", ("/no/such/corpus does not exist", "existing files or folders")),
    Case("empty-corpus-list", "data", "an empty corpus list", ("data.paths=[]",),
         "data.paths", ("is empty", "data.paths=[/path/to/corpus]")),
    Case("empty-corpus-file", "data", "a corpus of empty files", ("data.paths=[{tmp}/empty.txt]",),
         "data.paths", ("is empty", "point data.paths at text"),
         setup=empty_corpus),
    Case("corpus-too-short", "data", "a corpus shorter than one sequence",
         ("data.paths=[{tmp}/tiny.txt]", "data.cache_dir={tmp}/cache"),
         "data.paths", ("12 bytes", "33 bytes", "add text or lower data.seq_len"), setup=tiny_corpus,
         leaves=("cache",)),  # the corpus's token cache, which the next run reuses
    Case("resume-on-other-data", "data", "resuming a checkpoint on another corpus than it was saved on",
         ("data.paths=[{tmp}/corpus]", "data.cache_dir={tmp}/cache"),
         "data.paths", ("2 files added (a.py, b.py)", "{n} files removed", "since step 4",
                        "(the files are under {tmp}/corpus here", "{ckpts}/step_00000004 was saved on the data as it "
                        "was then", "checkpoint.on_data_change=restart"), setup=another_corpus,
         leaves=("cache",)),  # the corpus's token cache, which the next run reuses
    Case("tokenizer-larger-than-model", "data", "a tokenizer with more tokens than the model's vocabulary",
         ("tokenizer=bpe", "tokenizer.vocab_size=400", "model.vocab_size=300", "data.paths=[{tmp}/source.py]",
          "data.cache_dir={tmp}/cache", "tokenizer.cache_dir={tmp}/tokenizers"),
         "model.vocab_size", ("is 300", "{n} tokens", "set model.vocab_size to {n} or more"),
         setup=source_corpus,
         leaves=("cache", "tokenizers")),  # the trained tokenizer and token caches, reused next
    Case("bpe-vocab-too-small", "config", "a BPE vocabulary smaller than the bytes it starts from",
         ("tokenizer=bpe", "tokenizer.vocab_size=100", "data.paths=[{tmp}/source.py]"),
         "tokenizer.vocab_size", ("is 100", "257 or more"), setup=source_corpus),
    Case("tokenizer-file-missing", "data", "a tokenizer.json that does not exist",
         ("tokenizer=file", "tokenizer.path={tmp}/tokenizer.json", "tokenizer.vocab_size=1000",
          "data.paths=[{tmp}/source.py]"),
         "tokenizer.path", ("{tmp}/tokenizer.json does not exist", "tokenizer=bpe"), setup=source_corpus),
    Case("seq-lens-too-long", "data", "varied lengths longer than the model's context", ("data.seq_lens=[8,64]",),
         "data.seq_lens", ("[1, data.seq_len=32]", "got [8, 64]")),
    # data by _target_ and the task (experiment=digits: scikit-learn's digits through data._target_, a small CNN)
    Case("data-target-not-importable", "data", "a data factory that cannot be imported",
         ("experiment=digits", "model=cnn", "data._target_=nosuch.make_datasets"),
         "data._target_", ("cannot import 'nosuch.make_datasets'", "returning (train, val) datasets")),
    Case("data-target-not-datasets", "data", "a data factory that returns something other than datasets",
         ("experiment=digits", "model=cnn", "data._target_=collections.OrderedDict"),
         "data._target_", ("not datasets", "return (train, val)")),
    Case("items-cannot-collate", "data", "items of different shapes that the collate cannot batch",
         (f"hydra.searchpath=[file://{ROOT}/examples/my_project/conf]", "experiment=my_project", "model=set_regressor",
          "data.collate_fn=null"),
         "data", ("cannot batch the items of my_project.data.point_sets", "items of one shape", "data.collate_fn"),
         env=(("PYTHONPATH", str(ROOT / "examples/my_project")),)),
    # an IterableDataset by data._target_ (tests/streams.py: 20 items a pass unless data.size says otherwise)
    Case("iterable-stream-too-short", "data", "an iterable dataset that ends before one micro-batch",
         (*STREAM, "data.size=6"),
         "trainer.batch_size", ("ends after 6 items", "lower trainer.batch_size to at most 6"),
         env=(("PYTHONPATH", str(ROOT / "tests")),)),
    Case("iterable-global-batch", "data", "an iterable dataset with a parallelism.global_batch it cannot honour",
         (*STREAM, "data.size=6", "parallelism.global_batch=16"),
         "parallelism.global_batch", ("ends after 6 items", "set parallelism.global_batch to at most 6"),
         env=(("PYTHONPATH", str(ROOT / "tests")),)),
    Case("iterable-workers-share-too-short", "data", "an iterable dataset too short for a micro-batch of any worker",
         (*STREAM, "data.size=6", "trainer.batch_size=4", "data.num_workers=2"),
         "trainer.batch_size", ("no micro-batch of 4 items", "2 workers",
                                "lower trainer.batch_size or data.num_workers"),
         env=(("PYTHONPATH", str(ROOT / "tests")),),
         leaves=("run", "own")),  # found as the first batch is read: training began
    Case("iterable-extra-missing", "data", "an iterable dataset without torchdata installed", STREAM,
         "data._target_", ("torchdata is not installed", "pip install 'trainflow[iterable]'"), setup=hide_torchdata,
         env=(("PYTHONPATH", f"{{tmp}}/site{os.pathsep}{ROOT / 'tests'}"),)),
    Case("batch-model-mismatch", "data", "batches the model cannot take", ("experiment=digits", "model=mlp"),
         "data", ("cannot put through model trainflow.models.mlp.MLP", "mat1 and mat2 shapes", "change model.*")),
    Case("monitor-not-a-metric", "data", "a task.monitor the task does not produce",
         ("experiment=digits", "model=cnn", "task.monitor=f1"),
         "task.monitor", ("'f1' is not a metric", "loss, accuracy, top5_accuracy")),
    Case("train-metrics-unknown", "config", "a task.train_metrics that is not a choice",
         ("task.train_metrics=sometimes",), "task.train_metrics", ("log_step, every_step", "got 'sometimes'"),
         exit=1),
    Case("vision-extra-missing", "data", "data=digits without scikit-learn installed",
         ("experiment=digits", "model=cnn"),
         "data", ("scikit-learn is not installed", "pip install 'trainflow[vision]'"),
         setup=hide_sklearn, env=(("PYTHONPATH", "{tmp}/site"),)),
    # more config, data and environment values
    Case("interpolation-to-missing-key", "config", "an interpolation to a key that does not exist",
         ("optim.lr=${trainer.nonexistent}",),
         "optim.lr", ("'trainer.nonexistent' not found", "fix the ${...}")),
    Case("interpolation-of-wrong-type", "config", "an interpolation to a value of the wrong type",
         ("optim.lr=${trainer.device}",),
         "optim.lr", ("'${trainer.device}'", "converted to Float", "fix the ${...}")),
    Case("config-dir-yaml-syntax", "config", "an experiment YAML of one's own (--config-dir) that does not parse",
         ("--config-dir", "{tmp}/conf", "experiment=mine"),
         "--config-dir", ("{tmp}/conf/experiment/mine.yaml is not valid YAML", "line 4, column 12", "fix the file"),
         setup=broken_experiment_yaml),
    Case("infinite-lr", "config", "an infinite learning rate", ("optim.lr=inf",),
         "optim.lr", ("finite", "got inf")),
    Case("nan-grad-clip", "config", "a NaN clipping threshold", ("trainer.grad_clip=nan",),
         "trainer.grad_clip", ("finite", "got nan")),
    Case("betas-out-of-range", "config", "Adam betas outside [0, 1)", ("optim.betas=[1.5,0.9]",),
         "optim.betas", ("[0, 1)", "got [1.5, 0.9]")),
    Case("optimizer-not-an-optimizer", "config", "an optimizer target that is no torch.optim.Optimizer",
         ("optim._target_=torch.nn.Linear",), "optim._target_",
         ("torch.nn.Linear is not a torch.optim.Optimizer class", "torch.optim.AdamW")),
    Case("optimizer-unimportable", "config", "an optimizer that cannot be imported",
         ("optim=custom", "optim._target_=torch.optim.Nope"), "optim._target_",
         ("cannot import 'torch.optim.Nope'", "torch.optim.Optimizer class")),
    Case("optimizer-custom-without-target", "config", "optim=custom without the optimizer's import path",
         ("optim=custom",), "optim._target_", ("missing", "set optim._target_")),
    Case("optimizer-misspelt-argument", "config", "an argument the optimizer does not take",
         ("optim=custom", "optim._target_=torch.optim.RMSprop", "+optim.alpah=0.9"), "optim.alpah",
         ("torch.optim.RMSprop takes no such argument", "did you mean optim.alpha?"), exit=1),
    Case("optimizer-preset-misspelt-key", "config", "a key the optimizer preset does not have",
         ("optim.betass=[0.9,0.9]",), "optim.betass", ("optim=adamw has no such key", "betas", "optim=custom"),
         exit=1),
    Case("huge-seed", "config", "a seed beyond 64 bits", ("trainer.seed=1180591620717411303424",),
         "trainer.seed", ("[0, 4294967295]", "got 1180591620717411303424")),
    Case("zero-width-model", "config", "a model of width 0", ("model.n_embd=0",),
         "model.n_embd", ("positive integer", "got 0")),
    Case("no-layers", "config", "a model with no layers", ("model.n_layer=0",),
         "model.n_layer", ("positive integer", "got 0")),
    Case("zero-seq-len", "data", "sequences of no tokens", ("data.seq_len=0",),
         "data.seq_len", ("positive number", "got 0")),
    Case("seq-len-over-context", "data", "sequences longer than the model's context", ("data.seq_len=64",),
         "data.seq_len", ("model.block_size=32", "lower data.seq_len to <= 32")),
    Case("vocab-below-bytes", "data", "a vocabulary smaller than the data's tokens", ("model.vocab_size=100",),
         "model.vocab_size", ("is 100", "model.vocab_size=256 or more")),
    Case("batch-over-dataset", "data", "a micro-batch larger than the training set",
         ("data.paths=[{tmp}/small.txt]", "data.cache_dir={tmp}/cache", "trainer.batch_size=64"),
         "trainer.batch_size", ("64 samples", "59 samples", "lower trainer.batch_size"), setup=small_corpus,
         leaves=("cache",)),  # the corpus's token cache, which the next run reuses
    Case("batch-over-memory", "data", "a micro-batch whose activations cannot fit in memory",
         ("trainer.batch_size=100000", "model.vocab_size=262144"),
         "trainer.batch_size", ("100000 samples", "memory is available",
                                "lower trainer.batch_size (about {n} samples fit)", "trainer.grad_accum")),
    Case("broken-link-in-corpus", "data", "a dangling symlink in a corpus folder",
         ("data.paths=[{tmp}/corpus]", "data.cache_dir={tmp}/cache"),
         "data.paths", ("{tmp}/corpus/b.py is a broken symbolic link", "data.suffixes"), setup=corpus_with_broken_link),
    Case("fifo-corpus", "data", "a FIFO given as the corpus", ("data.paths=[{tmp}/pipe]",),
         "data.paths", ("{tmp}/pipe is a FIFO", "text files or folders"), setup=fifo_corpus),
    Case("tensorboard-blocked", "environment", "TensorBoard's folder replaced by a file", ("logger=tensorboard",),
         "logger.tensorboard", ("{tmp}/run/tensorboard is a file", "logger=none"),
         setup=file_where_tensorboard_writes),
    Case("tensorboard-read-only", "environment", "TensorBoard's folder on a read-only filesystem",
         ("logger=tensorboard",),
         "logger.tensorboard", ("{tmp}/run/tensorboard", "Read-only file system", "logger=none"),
         setup=read_only_tensorboard_folder,
         needs="mount"),
    Case("mlflow-server-down", "environment", "an MLflow server that does not answer",
         ("logger=mlflow", "logger.mlflow.tracking_uri=http://127.0.0.1:{port}"),
         "logger.mlflow.tracking_uri", ("no MLflow server answers at http://127.0.0.1:{port}", "mlflow server",
                                        "unset")),
    Case("mlflow-store-blocked", "environment", "MLflow's SQLite store where a file stands in for its folder",
         ("logger=mlflow", "logger.mlflow.tracking_uri=sqlite:///{tmp}/notes/mlflow.db"),
         "logger.mlflow.tracking_uri", ("{tmp}/notes is a file", "sqlite:///<a writable path>"), setup=file_in_the_way),
    Case("mlflow-not-installed", "environment", "logger=mlflow without the mlflow extra installed",
         ("logger=[tensorboard,mlflow]",),
         "logger.mlflow", ("not installed", "pip install 'trainflow[mlflow]'"),
         setup=mlflow_not_installed, env=(("PYTHONPATH", "{tmp}/no_mlflow"),)),
    Case("wandb-not-installed", "environment", "logger=wandb without the wandb extra installed",
         ("logger=[tensorboard,wandb]",),
         "logger.wandb", ("not installed", "pip install 'trainflow[wandb]'"),
         setup=wandb_not_installed, env=(("PYTHONPATH", "{tmp}/no_wandb"),)),
    Case("wandb-dir-blocked", "environment", "a WANDB_DIR where a file stands in for its folder",
         ("logger=[tensorboard,wandb]",),
         "WANDB_DIR", ("cannot write W&B's files in {tmp}/notes/wandb", "{tmp}/notes is a file",
                       "point WANDB_DIR at a writable folder", "unset it"),
         setup=file_in_the_way_of_wandb, after=nothing_in_the_system_temporary_folder,
         env=(("WANDB_DIR", "{tmp}/notes"), ("WANDB_MODE", "offline"), ("TMPDIR", "{tmp}/systmp")),
         leaves=("systmp/torchinductor_",)),  # torch's own compile cache in the temporary folder
    Case("logger-target-unknown", "config", "a logger of one's own whose _target_ cannot be imported",
         ("+logger.mine._target_=nowhere.Logger",),
         "logger.mine._target_", ("cannot import 'nowhere.Logger'", "import path of a logger class")),
    Case("data-cache-blocked", "environment", "a token cache folder blocked by a file",
         ("data.cache_dir={tmp}/notes/cache",),
         "data.cache_dir", ("{tmp}/notes is a file", "point data.cache_dir at a writable folder"),
         setup=file_in_the_way),
    Case("data-cache-read-only", "environment", "a token cache folder on a read-only filesystem",
         ("data.cache_dir={tmp}/ro/cache",),
         "data.cache_dir", ("{tmp}/ro/cache", "Read-only file system", "point data.cache_dir at a writable folder"),
         setup=read_only_disk, needs="mount"),
    Case("home-blocked", "environment", "a HOME that is a file (the default caches live under ~)", (),
         "data.cache_dir", ("HOME={tmp}/notes", "{tmp}/notes is a file", "point data.cache_dir at a writable folder"),
         setup=file_in_the_way, env=(("HOME", "{tmp}/notes"),)),
    Case("compile-cache-blocked", "compile", "an inductor cache folder blocked by a file",
         ("compile=default", "compile.cache_dir={tmp}/notes/inductor"),
         "compile.cache_dir", ("{tmp}/notes is a file", "point compile.cache_dir at a writable folder"),
         setup=file_in_the_way),
    Case("compile-cache-read-only", "compile", "an inductor cache on a read-only filesystem",
         ("compile=default", "compile.cache_dir={tmp}/ro"),
         "compile.cache_dir", ("{tmp}/ro", "Read-only file system", "point compile.cache_dir at a writable folder"),
         setup=read_only_disk, needs="mount"),
    Case("home-read-only", "environment", "a HOME on a read-only filesystem, compiling with the default cache",
         ("compile=default", "data.cache_dir={tmp}/cache"),
         "compile.cache_dir", ("HOME={tmp}/ro", "Read-only file system",
                               "point compile.cache_dir at a writable folder"),
         setup=read_only_disk, env=(("HOME", "{tmp}/ro"),), needs="mount",
         leaves=("cache",)),  # the corpus's token cache, which the next run reuses
    Case("disk-fills-while-training", "environment", "a run directory whose disk fills during training",
         ("hydra.run.dir={tmp}/small/run", "trainer.max_steps=600", "checkpoint.every_steps=1000"),
         "hydra.run.dir", ("metrics.jsonl", "No space left on device", "free space"), setup=disk_filling_under_the_run,
         after=metrics_lines_are_whole, needs="mount",
         leaves=("small/run", "ckpts/.lock")),  # training began: the run directory keeps what the run wrote
    # checkpoints
    Case("resume-missing", "checkpoint", "a resume path that does not exist", ("checkpoint.resume={tmp}/nope",),
         "checkpoint.resume", ("{tmp}/nope does not exist", "a committed checkpoint")),
    Case("resume-older-into-newer", "checkpoint", "resuming an older checkpoint into a folder with newer ones",
         ("checkpoint.resume={ckpts}/step_00000002",),
         "checkpoint.resume", ("up to step_00000004", "mix two histories", "point checkpoint.dir at a new folder")),
    Case("fresh-start-over-history", "checkpoint", "resume=never in a folder with checkpoints",
         ("checkpoint.resume=never",),
         "checkpoint.resume=never", ("mix two histories", "point checkpoint.dir at an empty folder", "resume=auto")),
    Case("truncated-shard", "checkpoint", "a truncated shard in the newest checkpoint", (),
         "{ckpts}/step_00000004", ("corrupt checkpoint", "(truncated)", "nothing was changed",
                                   "move it out of {ckpts}", "step_00000002"), setup=truncate_newest_shard),
    Case("missing-metadata", "checkpoint", "a newest checkpoint without .metadata", (),
         "{ckpts}/step_00000004", ("corrupt checkpoint", ".metadata is missing", "nothing was changed",
                                   "move it out of {ckpts}", "step_00000002"),
         setup=remove_newest_metadata),
    Case("garbled-manifest", "checkpoint", "an unreadable manifest in the newest checkpoint", (),
         "{ckpts}/step_00000004", ("corrupt checkpoint", "manifest.json is unreadable", "nothing was changed",
                                   "move it out of {ckpts}", "step_00000002"),
         setup=garble_newest_manifest),
    Case("other-model-shape", "checkpoint", "a checkpoint of another model shape", ("model.n_embd=32",),
         "{ckpts}/step_00000004", ("another model shape", "29 mismatched key(s)",
                                   "[64] float32 saved vs [32] float32 here", "and 23 more",
                                   "the model config it was saved with", "checkpoint.dir")),
    Case("flipped-byte", "checkpoint", "a flipped byte in the newest checkpoint's shard", (),
         "{ckpts}/step_00000004", ("corrupt checkpoint", "__0_0.distcp has checksum",
                                   "its bytes changed after the save", "nothing was changed", "move it out of {ckpts}",
                                   "step_00000002"), setup=flip_a_byte_of_the_newest_shard),
    Case("step-folder-without-manifest", "checkpoint", "a newest step_N folder without a manifest", (),
         "{ckpts}/step_00000006", ("without manifest.json", "nothing was changed", "move it out of {ckpts}",
                                   "step_00000004"), setup=newest_step_folder_without_manifest),
    Case("booby-trapped-metadata", "checkpoint", "a .metadata that would run code when unpickled", (),
         "{ckpts}/step_00000004/.metadata", ("refused without running it", "builtins.exec", "do not use it"),
         setup=booby_trap_the_newest_metadata),
    Case("manifest-lists-a-fifo", "checkpoint", "a newest checkpoint whose manifest lists a FIFO", (),
         "{ckpts}/step_00000004", ("corrupt checkpoint", "extra.bin is a FIFO", "nothing was changed",
                                   "move it out of {ckpts}", "step_00000002"),
         setup=list_a_fifo_in_the_newest_manifest),
    Case("manifest-lists-a-path", "checkpoint", "a newest checkpoint whose manifest lists /dev/zero", (),
         "{ckpts}/step_00000004", ("corrupt checkpoint", "'/dev/zero'", "nothing was changed",
                                   "move it out of {ckpts}", "step_00000002"),
         setup=list_dev_zero_in_the_newest_manifest),
    Case("newer-format", "checkpoint", "resuming a checkpoint of a newer format", (),
         "{ckpts}/step_00000004", ("checkpoint format 4 by trainflow 9.0.0", "reads format 3", "nothing was changed",
                                   "that trainflow or a newer one"), setup=newer_format_in_the_newest_manifest),
    Case("shards-not-prepared", "data", "data=shards at a folder nothing was prepared in",
         ("data=shards", "data.path={tmp}", "model.vocab_size=512"),
         "data.path", ("{tmp}/manifest.json does not exist", "trainflow prepare", "--out {tmp}")),
    Case("prepare-without-conf", "data", "trainflow prepare with a project config folder that does not exist",
         ("prepare", "--out", "{tmp}/shards", "--config-dir", "{tmp}/conf", "data.paths=[{tmp}]"),
         "--config-dir", ("{tmp}/conf is not a folder", "leave --config-dir out"), tool="trainflow"),
    Case("unknown-stream-version", "checkpoint", "resuming a data position of an unknown sample stream order", (),
         "{ckpts}/step_00000004", ("sample stream version 3", "versions 1, 2",
                                   "checkpoint.load=model checkpoint.resume={ckpts}/step_00000004"),
         setup=unknown_stream_version_in_the_newest_state),
    Case("export-newer-format", "checkpoint", "exporting a checkpoint of a newer format",
         ("export", "{ckpts}/step_00000004", "{tmp}/model.pt"),
         "{ckpts}/step_00000004", ("checkpoint format 4 by trainflow 9.0.0", "reads format 3", "nothing was changed",
                                   "that trainflow or a newer one"),
         tool="trainflow", setup=newer_format_in_the_newest_manifest),
    Case("optimizer-changed", "checkpoint", "resuming with another optimizer", ("optim=sgd",),
         "{ckpts}/step_00000004", ("AdamW", "SGD (optim._target_)",
                                   "checkpoint.load=model checkpoint.resume={ckpts}/step_00000004",
                                   "set optim._target_ back")),
    Case("load-exported-other-shape", "checkpoint", "fine-tuning from exported weights of another model shape",
         ("checkpoint.load=model", "checkpoint.resume={tmp}/w.safetensors", "checkpoint.dir={tmp}/fresh"),
         "checkpoint.resume", ("{tmp}/w.safetensors", "tok_emb.weight is [256, 32] there", "[256, 64] in this model",
                               "the model config"),
         setup=narrower_weights),
    Case("load-model-without-source", "checkpoint", "weights only, but from no named checkpoint",
         ("checkpoint.load=model",),
         "checkpoint.load", ("checkpoint.resume", "auto", "set checkpoint.resume=<a step_N folder or run dir>")),
    Case("export-garbled-metadata", "checkpoint", "exporting a checkpoint whose .metadata is garbled",
         ("export", "{ckpts}/step_00000004", "{tmp}/model.pt"),
         "{ckpts}/step_00000004", ("corrupt checkpoint", ".metadata has checksum", "nothing was changed",
                                   "move it out of {ckpts}", "step_00000002"),
         tool="trainflow", setup=garble_the_newest_metadata),
    Case("checkpoint-dir-is-a-file", "checkpoint", "a checkpoint dir that is a file", ("checkpoint.dir={tmp}/notes",),
         "checkpoint.dir", ("{tmp}/notes is a file", "point checkpoint.dir at a folder"),
         setup=file_in_the_way),
    Case("foreign-folder-in-the-way", "checkpoint", "a folder trainflow did not make where a save must go", (),
         "checkpoint.dir", ("{ckpts}/.tmp-step_00000006", "did not make it", "nothing was changed", "move it away"),
         setup=foreign_folder_where_a_save_goes, after=foreign_folder_kept,
         leaves=("run", "ckpts/.lock")),  # found at the save of step 6: training began
    Case("checkpoint-dir-in-use", "checkpoint", "a checkpoint dir another run holds", (),
         "checkpoint.dir", ("{ckpts} is in use by another run (pid {n}", "wait for it to end", "another folder"),
         setup=lock_checkpoint_dir),
    Case("read-only-checkpoint-dir", "environment", "a checkpoint dir on a read-only filesystem",
         ("checkpoint.dir={tmp}/ro/ckpts",),
         "checkpoint.dir", ("{tmp}/ro/ckpts", "Read-only file system", "a writable folder"),
         setup=read_only_disk, needs="mount"),
    Case("full-disk-sync", "environment", "a disk that fills up during a save",
         ("checkpoint.dir={tmp}/small/ckpts",),
         "checkpoint.dir", ("saving step 6", "the disk is full", "free space",
                            "committed checkpoints are untouched (newest: step_00000004)"),
         setup=nearly_full_disk, needs="mount",
         leaves=("run", "small/ckpts")),  # training began: the run directory keeps what the run wrote
    Case("full-disk-async", "environment", "a disk that fills up during an async save",
         ("checkpoint.dir={tmp}/small/ckpts", "checkpoint.mode=async"),
         "checkpoint.dir", ("saving step 6", "the disk is full", "free space",
                            "committed checkpoints are untouched (newest: step_00000004)"),
         setup=nearly_full_disk, needs="mount",
         leaves=("run", "small/ckpts")),  # training began: the run directory keeps what the run wrote
    Case("read-only-output-dir", "environment", "a run directory on a read-only filesystem",
         ("hydra.run.dir={tmp}/ro/run",),
         "hydra.run.dir", ("{tmp}/ro/run", "Read-only file system", "a writable folder"),
         setup=read_only_disk, needs="mount"),
    Case("cuda-without-gpu", "environment", "trainer.device=cuda on a machine without a GPU",
         ("trainer.device=cuda",),
         "trainer.device", ("no GPU is visible", "trainer.device=cpu"),
         needs="no-gpu"),
    Case("port-in-use", "environment", "a rendezvous port another process listens on", ("parallelism=ddp",),
         "environment", ("MASTER_PORT={port}", "in use", "a free port"),
         setup=busy_port, env=(*RANK_ENV, ("MASTER_PORT", "{port}"))),
    Case("rank-without-master", "environment", "RANK and WORLD_SIZE without MASTER_ADDR", ("parallelism=ddp",),
         "environment", ("MASTER_ADDR is not", "export MASTER_ADDR and MASTER_PORT"), env=RANK_ENV[:4]),
    Case("run-dir-in-use", "environment", "a run directory a live run holds", (),
         "hydra.run.dir", ("{tmp}/run is in use by another run (pid {n}", "wait for it to end", "its own directory"),
         setup=lock_run_dir),
    Case("run-dir-of-another-run", "environment", "a run directory holding another run's config and summary", (),
         "hydra.run.dir", ("{tmp}/run holds the config.yaml and summary.json of another run", "model=gpt_small",
                           "nothing was changed", "hydra.run.dir=<new folder>", "trainer.run_name="),
         setup=another_runs_results, after=another_runs_results_kept),
    Case("run-dir-of-the-user", "environment", "a run directory holding files trainflow did not write", (),
         "hydra.run.dir", ("{tmp}/run holds files trainflow did not write", "metrics.jsonl, notes.txt, train.log",
                           "no .trainflow", "nothing was changed", "hydra.run.dir=<new folder>"),
         setup=users_folder_as_run_dir, after=users_run_dir_kept),
    Case("run-dir-empty", "environment", "an empty hydra.run.dir (an unset $VAR) in a folder of the user's",
         ("hydra.run.dir=",),
         "hydra.run.dir", ("is empty", "the current folder {tmp}/here", "nothing was written",
                           "hydra.run.dir=<new folder>"),
         setup=users_folder_as_cwd, after=users_cwd_kept, cwd="{tmp}/here"),
    # scale decisions
    Case("hsdp-shard-size", "scale", "an HSDP shard size that does not divide the world size",
         ("parallelism=hsdp", "parallelism.nproc_per_node=4", "parallelism.hsdp.shard_size=3"),
         "parallelism.hsdp.shard_size", ("world size 4", "1, 2 or 4")),
    Case("hsdp-replicate-size", "scale", "HSDP replicas x shard size other than the world size",
         ("parallelism=hsdp", "parallelism.nproc_per_node=4", "parallelism.hsdp.shard_size=2",
          "parallelism.hsdp.replicate_size=3"),
         "parallelism.hsdp.replicate_size", ("6 ranks", "the world has 4", "parallelism.hsdp.replicate_size=2")),
    Case("tp-heads-not-divisible", "scale", "a tensor-parallel degree that does not divide the GPT's heads",
         ("parallelism=fsdp", "parallelism.tp=4", "parallelism.nproc_per_node=4"),
         "parallelism.tp", ("4 does not divide model.n_head=2", "divides both")),
    Case("tp-no-plan", "scale", "tensor parallel for a model without a TP plan",
         ("model=mlp", "data=synthetic", "parallelism=fsdp", "parallelism.tp=2", "parallelism.nproc_per_node=2"),
         "parallelism.tp", ("MLP has none", "tp_plan", "parallelism.tp_plan._target_", "parallelism.tp=1",
                            "(rank {n})"),
         leaves=("run",)),  # found by the workers the run started: the run directory keeps their logs
    Case("tp-larger-than-node", "scale", "a tensor-parallel degree larger than the ranks of one node",
         ("parallelism=fsdp", "parallelism.tp=4", "model.n_head=4", "parallelism.nproc_per_node=2"),
         "parallelism.tp", ("the 2 ranks of one node", "parallelism.tp to 2 or less")),
    Case("tp-checkpointing-compile", "scale", "tensor parallel with activation checkpointing and compile together",
         ("parallelism=fsdp", "parallelism.tp=2", "parallelism.nproc_per_node=2", "compile=default",
          "parallelism.activation_checkpointing=full"),
         "parallelism.activation_checkpointing", ("parallelism.tp=2", "fails inside torch", "compile=off",
                                                  "parallelism.activation_checkpointing=off")),
    Case("pp-not-dividing-blocks", "scale", "pipeline stages that do not divide the model's blocks",
         ("parallelism=fsdp", "parallelism.pp=2", "parallelism.nproc_per_node=2", "model.n_layer=3"),
         "parallelism.pp", ("2 stages do not divide the model's 3 blocks", "parallelism.pp in 1, 3",
                            "(rank {n})"),
         leaves=("run",)),  # found by the workers the run started: the run directory keeps their logs
    Case("pp-not-dividing-world", "scale", "a pipeline degree that does not divide the world size",
         ("parallelism=fsdp", "parallelism.pp=2", "parallelism.nproc_per_node=3"),
         "parallelism.pp", ("2 does not divide the world size 3", "1 or 3", "a multiple of 2")),
    Case("pp-microbatches-not-dividing", "scale", "pipeline micro-batches that do not divide the per-rank batch",
         ("parallelism=fsdp", "parallelism.pp=2", "parallelism.nproc_per_node=2", "parallelism.microbatches=3"),
         "parallelism.microbatches", ("3 pipeline micro-batches do not divide the per-rank batch of 8",
                                      "use one of 2, 4, 8, or", "(rank {n})"),
         leaves=("run",)),  # found by the workers the run started: the run directory keeps their logs
    Case("pp-without-blocks", "scale", "pipeline parallel for a model without `blocks`",
         ("model=mlp", "data=synthetic", "parallelism=fsdp", "parallelism.pp=2", "parallelism.nproc_per_node=2"),
         "parallelism.pp", ("MLP has no `blocks` list", "parallelism.pp=1", "(rank {n})"),
         leaves=("run",)),  # found by the workers the run started: the run directory keeps their logs
    Case("pp-with-tp", "scale", "pipeline parallel with tensor parallel (fails inside torch 2.13)",
         ("parallelism=fsdp", "parallelism.pp=2", "parallelism.tp=2", "parallelism.nproc_per_node=4"),
         "parallelism.pp", ("parallelism.tp=2 fail in torch 2.13", "16384 vs 8192", "parallelism.tp=1 with pp",
                            "(rank {n})"),
         leaves=("run",)),  # found by the workers the run started: the run directory keeps their logs
    Case("pp-single", "scale", "a pipeline degree with parallelism=single", ("parallelism.pp=2",),
         "parallelism.pp", ("parallelism=single trains one process", "parallelism=fsdp with parallelism.pp=2")),
    Case("pp-zero-bubble-fsdp", "scale", "a zero-bubble schedule with data-parallel ranks (FSDP)",
         ("parallelism=fsdp", "parallelism.pp=2", "parallelism.nproc_per_node=4", "model.n_layer=4",
          "parallelism.pp_schedule=zbv"),
         "parallelism.pp_schedule", ("zbv with 2 data-parallel ranks", "weight gradients unset", "1f1b",
                                     "(rank {n})"),
         leaves=("run",)),  # found by the workers the run started: the run directory keeps their logs
    Case("pp-compile-check", "scale", "compile.check on a pipelined model",
         ("parallelism=fsdp", "parallelism.pp=2", "compile=default", "compile.check=true"),
         "compile.check", ("parallelism.pp=2 runs the model as stages", "compile.check=false",
                           "parallelism.check=true")),
    Case("pp-unknown-schedule", "scale", "a pipeline schedule trainflow does not run",
         ("parallelism=fsdp", "parallelism.pp=2", "parallelism.pp_schedule=dualpipe"),
         "parallelism.pp_schedule", ("1f1b, gpipe, interleaved_1f1b, interleaved_zb, zbv", "got 'dualpipe'"),
         exit=1),
    Case("ac-budget-without-compile", "scale", "a compiler's activation budget without compile",
         ("parallelism.activation_checkpointing=budget",),
         "parallelism.activation_checkpointing", ("torch.compile's partitioner", "compile.enabled=true",
                                                  "full or selective")),
    Case("ac-selective-without-blocks", "scale", "selective activation checkpointing on a model without `blocks`",
         ("model=mlp", "data=synthetic", "parallelism.activation_checkpointing=selective"),
         "parallelism.activation_checkpointing", ("selective recomputes each module of model.blocks",
                                                  "MLP has no `blocks` list", "set it to off")),
    Case("fp8-on-cpu", "scale", "float8 training on a CPU", ("trainer.precision=fp8",),
         "trainer.precision", ("compute capability 8.9 or newer", "pip install 'trainflow[fp8]'", "on cpu",
                               "trainer.precision=bf16")),
    Case("degrees-not-world-size", "scale", "mesh degrees whose product is not the world size",
         ("parallelism=fsdp", "parallelism.dp_shard=3", "parallelism.nproc_per_node=4"),
         "parallelism.dp_replicate x dp_shard x tp", ("1 x 3 x 1", "world size 4", "product is 4")),
    Case("auto-budget-too-small", "scale", "a memory budget too small for any strategy",
         ("parallelism=auto", "parallelism.memory_budget_gb=0.000001"),
         "parallelism.memory_budget_gb", ("no strategy fits", "single + activation checkpointing",
                                          "parallelism.memory_budget_gb=1e-06", "a device with more memory")),
    # launch combinations
    Case("launcher-without-multirun", "launch", "a sweep launcher without -m", ("hydra/launcher=torchrun",),
         "hydra/launcher=torchrun", ("a single run", "add -m")),
    Case("launcher-zero-processes", "launch", "a torchrun launcher with no processes",
         ("hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=0"),
         "hydra.launcher.nproc_per_node", ("positive integer", "got '0'"),
         tool="multirun"),
    Case("launcher-ranks-of-its-own", "launch", "torchrun's ranks per node set for a trainflow job, which sets its own",
         ("hydra/launcher=torchrun", "parallelism=ddp", "parallelism.nproc_per_node=2",
          "hydra.launcher.nproc_per_node=3"),
         "hydra.launcher.nproc_per_node", ("for Hydra apps other than trainflow", "job #0 is a trainflow run",
                                           "drop hydra.launcher.nproc_per_node", "set parallelism.nproc_per_node"),
         tool="multirun"),
    Case("launcher-restarts-of-its-own", "launch", "torchrun's restarts set for a trainflow job, which sets its own",
         ("hydra/launcher=torchrun", "hydra.launcher.max_restarts=2"),
         "hydra.launcher.max_restarts", ("for Hydra apps other than trainflow", "drop hydra.launcher.max_restarts",
                                         "set parallelism.max_restarts"), tool="multirun"),
    Case("slurm-ranks-of-its-own", "launch", "SLURM's tasks per node set for a trainflow job, which sets its own",
         ("hydra/launcher=slurm", "parallelism=ddp", "parallelism.nproc_per_node=2",
          "hydra.launcher.tasks_per_node=4"),
         "hydra.launcher.tasks_per_node", ("for Hydra apps other than trainflow", "job #0 is a trainflow run",
                                           "drop hydra.launcher.tasks_per_node", "set parallelism.nproc_per_node"),
         tool="multirun"),
    Case("ladder-rung-cannot-run", "launch", "a ladder too short for its profile rung",
         ("experiment=ladder", "trainer.max_steps=8"),
         "ladder=profile (job #2)", ("trainer.max_steps", "ends at step 12", "raise trainer.max_steps to >= 12"),
         tool="multirun", after=no_rung_ran),
    Case("sweep-folder-of-another-sweep", "launch", "a sweep folder that holds another sweep", (),
         "hydra.sweep.dir", ("{tmp}/sweep holds another sweep", "optim.lr=1e-3,2e-3", "nothing was changed",
                             "trainer.sweep_name=<new name>", "hydra.sweep.dir=<new folder>"),
         tool="multirun", setup=another_sweep_in_the_folder,
         after=other_sweep_untouched),
    Case("sweep-folder-of-the-user", "launch", "a sweep folder holding files trainflow did not write", (),
         "hydra.sweep.dir", ("{tmp}/sweep holds files trainflow did not write", "no .trainflow",
                             "nothing was changed", "hydra.sweep.dir=<new folder>"),
         tool="multirun", setup=users_folder_as_sweep_dir, after=users_sweep_dir_kept),
    # tools
    Case("export-unfinished-save", "tools", "exporting a save that never finished",
         ("export", "{tmp}/.tmp-step_00000006", "{tmp}/model.pt"),
         "{tmp}/.tmp-step_00000006", ("not a committed checkpoint", "no manifest.json", "a step_N folder"),
         tool="trainflow", setup=unfinished_save),
    Case("export-into-checkpoint", "tools", "an export written into the checkpoint it reads",
         ("export", "{ckpts}/step_00000004", "{ckpts}/step_00000004/__0_0.distcp"),
         "{ckpts}/step_00000004/__0_0.distcp", ("inside the checkpoint folder", "a path outside it"),
         tool="trainflow"),
    Case("export-into-checkpoint-dir", "tools", "an export written into a checkpoint dir, even with --force",
         ("export", "{ckpts}", "{ckpts}/model.pt", "--force"),
         "{ckpts}/model.pt", ("inside the checkpoint folder {ckpts}", "a path outside it"), tool="trainflow"),
    Case("export-existing-output", "tools", "an export onto an existing file",
         ("export", "{ckpts}", "{tmp}/model.pt"),
         "{tmp}/model.pt", ("already exists", "nothing was changed", "--force"),
         tool="trainflow", setup=earlier_output, after=earlier_output_kept),
    Case("export-force-foreign-folder", "tools", "--force onto a folder that is no export",
         ("export", "{ckpts}", "{tmp}/mine", "--force"),
         "{tmp}/mine", ("did not export", "trainflow_export.json", "a new path"),
         tool="trainflow", setup=earlier_output,
         after=earlier_output_kept),
    Case("export-force-foreign-file", "tools", "--force onto a file trainflow did not export",
         ("export", "{ckpts}", "{tmp}/model.pt", "--force"),
         "{tmp}/model.pt", ("is a file trainflow did not export", "trainflow_export.json", "nothing was changed",
                            "only an earlier export"),
         tool="trainflow", setup=earlier_output, after=earlier_output_kept),
    Case("export-empty-output", "tools", "an export to an empty path", ("export", "{ckpts}", ""),
         "export", ("output path is empty", "model.safetensors"),
         tool="trainflow"),
    Case("export-to-proc", "tools", "an export into /proc", ("export", "{ckpts}", "/proc/model.pt"),
         "/proc/model.pt", ("cannot write the export", "a writable disk"), tool="trainflow"),
    Case("export-read-only", "tools", "an export onto a read-only disk", ("export", "{ckpts}", "{tmp}/ro/model.pt"),
         "{tmp}/ro/model.pt", ("Read-only file system", "a writable disk"),
         tool="trainflow", setup=read_only_disk, needs="mount"),
    Case("export-hf-unmappable", "tools", "a Hugging Face export of a model that has no mapping",
         ("export", "{ckpts}", "{tmp}/hf", "--format", "hf", "--config", "{tmp}/config.yaml"),
         "export --format hf", ("trainflow.models.mlp.MLP has no Hugging Face mapping", "--format safetensors"),
         tool="trainflow", setup=mlp_config),
    Case("export-hf-without-config", "tools", "a Hugging Face export of a checkpoint dir kept outside its run",
         ("export", "{ckpts}", "{tmp}/hf", "--format", "hf"),
         "export --format hf", ("{ckpts}/step_00000004", "{tmp}/config.yaml is not it",
                                "--config <run dir>/config.yaml"), tool="trainflow"),
    Case("export-hf-bpe-not-cached", "tools", "a Hugging Face export of a BPE run whose tokenizer cache is not here",
         ("export", "{ckpts}", "{tmp}/hf", "--format", "hf", "--config", "{tmp}/config.yaml"),
         "export --format hf", ("no longer in tokenizer.cache_dir ({tmp}/elsewhere/tokenizers)", "nothing was written",
                                "export from where the run ran"),
         tool="trainflow", setup=bpe_cached_elsewhere, after=nothing_made_elsewhere),
    Case("export-hf-tokenizer-fifo", "tools", "a Hugging Face export whose tokenizer.path is a FIFO",
         ("export", "{ckpts}", "{tmp}/hf", "--format", "hf", "--config", "{tmp}/config.yaml"),
         "export --format hf", ("tokenizer.path {tmp}/pipe is a FIFO", "nothing was written",
                                "the run's tokenizer.json"),
         tool="trainflow", setup=fifo_tokenizer, after=no_hf_output),
    Case("export-hf-tokenizer-moved", "tools", "a Hugging Face export whose tokenizer.json was moved away",
         ("export", "{ckpts}", "{tmp}/hf", "--format", "hf", "--config", "{tmp}/config.yaml"),
         "export --format hf", ("tokenizer.path {tmp}/tokenizer.json does not exist", "nothing was written",
                                "put the run's tokenizer.json there"),
         tool="trainflow", setup=moved_tokenizer, after=no_hf_output),
    Case("export-hf-tokenizer-not-json", "tools", "a Hugging Face export whose tokenizer.json is not one",
         ("export", "{ckpts}", "{tmp}/hf", "--format", "hf", "--config", "{tmp}/config.yaml"),
         "export --format hf", ("tokenizer.path {tmp}/tokenizer.json is not a tokenizer.json", "nothing was written"),
         tool="trainflow", setup=text_as_tokenizer, after=no_hf_output),
    Case("export-hf-transformers-broken", "tools", "a Hugging Face export where importing transformers fails",
         ("export", "{ckpts}", "{tmp}/hf", "--format", "hf", "--config", "{tmp}/config.yaml"),
         "export --format hf", ("transformers is installed but fails to import", "RuntimeError", "reinstall it"),
         tool="trainflow", setup=broken_transformers, env=(("PYTHONPATH", "{tmp}/broken"),), after=no_hf_output),
    Case("report-missing-folder", "tools", "a report on a folder that does not exist", ("report", "{tmp}/nope"),
         "{tmp}/nope", ("no such folder", "a run folder", "a sweep folder"), tool="trainflow"),
    Case("compare-missing-folder", "tools", "a comparison of a folder that does not exist",
         ("compare", "{tmp}/nope", "{tmp}/nope2"), "compare A", ("{tmp}/nope: no such folder", "a run folder"),
         tool="trainflow"),
    Case("compare-checkpoint-with-run", "tools", "a checkpoint compared with a run",
         ("compare", "{tmp}/failed", "{ckpts}"),
         "compare", ("{ckpts} is a checkpoint and {tmp}/failed is not", "a checkpoint with a checkpoint"),
         tool="trainflow", setup=failed_run),
    Case("compare-failed-run", "tools", "a comparison of a run that failed",
         ("compare", "{tmp}/failed", "{tmp}/failed"),
         "compare A", ("has not finished (failed: RuntimeError: boom)", "compare finished runs"), tool="trainflow",
         setup=failed_run),
    Case("compare-unknown-gate", "tools", "a gate on a figure compare does not have",
         ("compare", "{ckpts}", "{ckpts}", "--fail-on", "speed=+5%"), "--fail-on speed=+5%",
         ("'speed' is no figure", "step_time", "val_<metric>"), tool="trainflow"),
    Case("compare-unknown-ledger-filter", "tools", "a ledger selection by a filter that does not exist",
         ("compare", "ledger:colour=red", "ledger:last=1"), "compare A", ("ledger:colour: no such filter", "config"),
         tool="trainflow"),
    Case("compare-out-unwritable", "tools", "a comparison written into /proc",
         ("compare", "{ckpts}", "{ckpts}", "--out", "/proc/compare"), "--out /proc/compare",
         ("cannot write the comparison", "a writable folder"), tool="trainflow"),
    Case("ledger-missing", "tools", "a ledger that does not exist", ("ledger", "{tmp}/ledger.jsonl"),
         "{tmp}/ledger.jsonl", ("no ledger there", "give the ledger's path"), tool="trainflow"),
    Case("ledger-bad-date", "tools", "a ledger listing since a day that is no date",
         ("ledger", "{tmp}/ledger.jsonl", "--since", "yesterday"), "since=yesterday",
         ("not a date", "YYYY-MM-DD"), tool="trainflow", setup=empty_ledger),
]


# -- running a row ----------------------------------------------------------------------------------------------


def everything(root: Path) -> dict[str, str]:
    """Every entry under `root`, links not followed: a regular file's sha256, a link's target, else its kind."""
    found = {}
    for folder, folders, files in os.walk(root):
        for name in folders + files:
            path = Path(folder) / name
            if path.is_symlink():
                kind = f"link to {os.readlink(path)}"
            elif path.is_file():
                kind = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                kind = "folder" if path.is_dir() else "other"
            found[str(path.relative_to(root))] = kind
    return found


def on_disk(ctx: Ctx) -> dict[str, dict[str, str]]:
    """What a row could leave behind: its own folder, and the outputs of a run or sweep that ignored the row's."""
    return {str(root): everything(root) for root in (ctx.tmp, ROOT / "outputs", ROOT / "multirun")}


def committed_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file of every committed checkpoint (a step_N folder with a manifest) under `root`."""
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for manifest in sorted(root.rglob("step_*/manifest.json"))
            for f in sorted(manifest.parent.rglob("*")) if f.is_file()}


def words(ctx: Ctx, text: str) -> str:
    """A regular expression for a row's words: placeholders filled, {n} any number, {any} any text."""
    parts = re.split(r"(\{n\}|\{any\})", text)
    wild = {"{n}": r"[0-9.]+", "{any}": r".+?"}
    return "".join(wild.get(p) or re.escape(ctx.fill(p)) for p in parts)


def pattern(ctx: Ctx, case: Case) -> re.Pattern:
    """A whole line naming the key (trainflow's own errors: first, after `Error: `), then each of the words in order."""
    key = words(ctx, case.key)
    head = rf"Error: {key}(?=[: ])" if case.exit == 2 else rf"(?=.*{key})"
    return re.compile(head + "".join(f".*?{words(ctx, w)}" for w in case.says) + ".*")


def command(case: Case, ctx: Ctx) -> list[str]:
    args = [ctx.fill(a) for a in case.args]
    if case.tool == "trainflow":
        return [str(Path(sys.executable).parent / "trainflow"), *args]
    keys = {a.split("=")[0] for a in args}
    # a row's own value wins; a row choosing another model drops the base's model.* settings
    base = [ctx.fill(a) for a in BASE if a.split("=")[0] not in keys and a.split(".")[0] not in keys]
    run_dir = [] if "hydra.run.dir" in keys else [f"hydra.run.dir={ctx.tmp / 'run'}"]
    multirun = ["-m", f"hydra.sweep.dir={ctx.tmp / 'sweep'}"] if case.tool == "multirun" else []
    options, overrides = [], []  # Hydra's own options (--config-dir DIR) come before the overrides
    for i, arg in enumerate(args):
        takes_value = i > 0 and args[i - 1].startswith("-") and "=" not in args[i - 1] and not arg.startswith("-")
        (options if arg.startswith("-") or takes_value else overrides).append(arg)
    return [sys.executable, str(ROOT / "train.py"), *multirun, *options, *base, *overrides, *run_dir]


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
        disk_before = on_disk(ctx)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **{k: ctx.fill(v) for k, v in case.env}}
        if "PYTHONPATH" in dict(case.env) and os.environ.get("PYTHONPATH"):  # the row's folder first, then ours
            env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
        for key in ("HYDRA_FULL_ERROR", *(k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                                          if k not in dict(case.env))):
            env.pop(key, None)
        proc = run_process(command(case, ctx), ctx.fill(case.cwd) if case.cwd else ROOT, env, timeout=300)
        after = committed_hashes(tmp_path)
        disk_after = on_disk(ctx)
        if case.after:
            case.after(ctx)
    lines = proc.stderr.splitlines()
    assert proc.returncode == case.exit, proc.stderr[-3000:]
    expected = pattern(ctx, case)
    assert any(expected.fullmatch(line) for line in lines), f"{expected.pattern}\nnot in\n{proc.stderr[-3000:]}"
    assert sum(line.startswith("Error:") for line in lines) == 1, proc.stderr[-3000:]
    if case.exit == 1:  # a command line that did not compose: that one line and nothing else
        assert [line for line in lines if line.strip()] == [next(line for line in lines if line.startswith("Error:"))]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert any(name.startswith("ckpts/step_00000002/") for name in before)  # the hashes cover the reference run's
    assert after == before
    assert not (tmp_path / "ran").exists()  # no row's checkpoint ran code
    for root, entries in disk_after.items():  # a refused command leaves nothing on disk
        was = disk_before[root]
        allowed = tuple(str(ctx.tmp / path) for path in case.leaves) if root == str(ctx.tmp) else ()
        left = {k: v for k, v in entries.items() if was.get(k) != v and not str(Path(root, k)).startswith(allowed)}
        assert left == {}, f"left in {root}"
        assert sorted(was.keys() - entries.keys()) == [], f"removed from {root}"


def test_full_error_shows_the_traceback_when_asked(tmp_path: Path) -> None:
    run = train(tmp_path / "run", *TINY_GPT, "trainer.max_steps=0", env={"HYDRA_FULL_ERROR": "1"})
    assert run.returncode != 0 and "Traceback" in run.stderr and "ConfigError" in run.stderr


def shown_words(text: str) -> str:
    """A row's words as the page shows them: {tmp} and {ckpts} are test folders, {n} a number, {any} text."""
    return (text.replace("{any}", "…").replace("{n}", "N").replace("{ckpts}", "<ckpts>").replace("{tmp}", "<dir>")
            .replace("{port}", "<port>").replace("|", "\\|"))


def markdown_rows() -> list[str]:
    """The table as docs/reliability.md shows it: {tmp} and {ckpts} are test folders, {n} a number, {any} text."""
    rows = ["| area | bad input | try it | exit | names | says (among other words) |", "|---|---|---|---|---|---|"]
    for c in CASES:
        shown = " ".join(c.args)
        shown = {"trainflow": f"trainflow {shown}", "multirun": f"-m {shown}"}.get(c.tool, shown)
        shown = " ".join([*(f"{k}={v}" for k, v in c.env), *([shown] if shown else [])])
        shown = shown.replace("{ckpts}", "<ckpts>").replace("{tmp}", "<dir>").replace("{port}", "<port>")
        shown = shown.replace(str(ROOT), "$PWD")  # run from the repository root: the page names no machine's path
        key, says = (shown_words(text) for text in (c.key, " … ".join(c.says) or "-"))
        rows.append(f"| {c.area} | {c.what} | {f'`{shown}`' if shown else '-'} | {c.exit} | `{key}` | {says} |")
    return rows
