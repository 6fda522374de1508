"""`trainflow export`: a committed checkpoint's weights in a format other tools load, never at a checkpoint's cost.

Formats:
- `torch`: one `torch.load(weights_only=True)` file of the model's tensors.
- `safetensors`: a folder of `model.safetensors` and EXPORT_INFO (the checkpoint and the run's config). Written
  here tensor by tensor in batches of at most BATCH_BYTES (safetensors' own save_file needs every tensor in memory
  at once); read back by `safetensors.torch.load_file`.
- `hf`: a Hugging Face folder (`save_pretrained`): trainflow's GPT as a GPT-2 (hf_names.py), or the Hugging Face
  model a run built by `_target_` (experiment=hf_gpt2). Needs the run's config.yaml (found beside the checkpoint
  dir of a run, or given).
- `dcp`: a stock torch.distributed.checkpoint folder (`model`, and with the optimizer `optimizer`) of torch's own
  records, which torch's DCP tools read without trainflow (trainflow's own shards are raw records they cannot).

Where an export goes: never inside a checkpoint folder (a step_N folder, a save in progress, a checkpoint dir
holding committed checkpoints; links followed), whatever `force` says; an existing output is refused unless
`force`, and even then only an earlier export is replaced: a folder holding EXPORT_INFO, or a torch file holding
it as a record of its archive (torch.load reads the other records only). Whatever can be refused (the output, the
model's mapping, the tokenizer) is, before anything is created. Everything is written in a staging folder beside
the output (`.<name>.tmp<pid>`, its first file STAGING naming the host and process) and renamed into place once
whole, so a failed or interrupted export leaves the old output (or nothing) behind; the staging folder of an
export that was killed (its process gone) is removed by the next export into that folder, which also puts back an
earlier output it had stepped aside.

The checkpoint is read in this one process (no process group), whatever the world size and strategy that saved
it: the keys are the model's own names (DCP's get_model_state_dict strips compile, DDP and FSDP wrappers at save).
A checkpoint that the run's retention removes while it is read is said so, not called corrupt.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import shutil
import socket
import stat
import struct
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainflow.checkpoint.hf_names import GPT_TARGET, HF_TARGET, TIED, as_stored, gpt2_config, hf_name, to_gpt2
from trainflow.checkpoint.safe_io import (
    SafeReader,
    failure_cause,
    read_metadata,
    reraise_interrupt,
    root_error,
    tensor_bytes,
)
from trainflow.checkpoint.store import (
    MANIFEST,
    MODEL_PREFIX,
    TMP_PREFIX,
    Committed,
    check_intact,
    list_committed,
    read_state,
    resolve_checkpoint,
)
from trainflow.config.schema import HFDataConfig, TextDataConfig, TokenizerConfig, typed
from trainflow.data.hf import Split, _files
from trainflow.data.text import Corpus
from trainflow.data.tokenizers import END_TOKENS, bpe_cache_path, byte_tokenizer
from trainflow.errors import CheckpointError, ConfigError, unwritable_reason
from trainflow.models.gpt import GPT
from trainflow.models.hf import gpt2
from trainflow.util.files import kind_of, not_a_file
from trainflow.util.locks import pid_alive
from trainflow.util.optional import import_hf

FORMATS = ("torch", "safetensors", "hf", "dcp")
WEIGHTS = "model.safetensors"
BATCH_BYTES = 256 << 20  # tensors read at once by a safetensors or hf export (a larger tensor is read alone)
OPTIM_PREFIX = "app.optim."
EXPORT_INFO = "trainflow_export.json"  # in an export (folder, or torch archive): what it was exported from
STAGING = "trainflow_export_staging"  # the first file of a staging folder: "<host> <pid>" of the export writing it
EMA_PREFIX = "app.stages.ema.weights."  # where stages=[ema] keeps the average of each weight, by the weight's name
_STAGED = re.compile(r"\.(.+)\.tmp(\d+)")  # a staging folder's name: .<output name>.tmp<pid>
_OLD = "old"  # in a staging folder: the earlier output, stepped aside until the new one is in place


class Source:
    """A committed, intact checkpoint and the tensors it holds, read on demand without running code."""

    def __init__(self, checkpoint: Path, ema: bool = False) -> None:
        self.ck: Committed = resolve_checkpoint(checkpoint)
        self.ema = ema  # the average of the weights (stages=[ema]) in place of the trained weights
        try:
            check_intact(self.ck, list_committed(self.ck.path.parent))
            self.metadata = read_metadata(self.ck.path)
        except CheckpointError:
            self.unless_deleted()
            raise
        entries = self.metadata.state_dict_metadata
        pickled = [k for k, m in entries.items() if not isinstance(m, TensorStorageMetadata)]
        if pickled:
            raise CheckpointError(f"{self.ck.path}: {pickled[0]} is stored as a pickled object, which trainflow "
                                  "does not load (it could run code); the checkpoint was tampered with or is not "
                                  "trainflow's")
        self.tensors = dict(entries)  # DCP key (app.model.<name>, app.optim.state.<name>.<slot>) -> metadata
        if ema and not any(k.startswith(EMA_PREFIX) for k in self.tensors):
            raise CheckpointError(f"export --ema: {self.ck.path} holds no average of the weights (its run had no "
                                  "stages=[ema]); export without --ema")

    @property
    def model_keys(self) -> dict[str, str]:
        """The model's tensor names -> their DCP keys (with `ema`: the average's, for the weights it averages; the
        buffers are the model's)."""
        keys = {k.removeprefix(MODEL_PREFIX): k for k in self.tensors if k.startswith(MODEL_PREFIX)}
        if self.ema:
            keys.update({name: EMA_PREFIX + name for name in keys if EMA_PREFIX + name in self.tensors})
        return keys

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """These DCP keys' tensors, whole (every rank's shards joined), in CPU memory."""
        out = {k: torch.empty(self.tensors[k].size, dtype=self.tensors[k].properties.dtype) for k in keys}
        reader = SafeReader(self.ck.path, set(self.ck.manifest["files"]), self.metadata)
        try:
            dcp.load(out, storage_reader=reader, no_dist=True)
        except BaseException as exc:  # DCP's CheckpointException derives from BaseException
            reraise_interrupt(exc)
            self.unless_deleted()
            if isinstance(root_error(exc), CheckpointError):
                raise root_error(exc) from None
            raise CheckpointError(f"{self.ck.path}: cannot be read ({failure_cause(exc)}); it is corrupt") from exc
        return out

    def unless_deleted(self) -> None:
        """A read failed: when the checkpoint is gone meanwhile (the run that saved it retired it: retention renames
        a checkpoint away, then deletes it), say that, not "corrupt"."""
        if (self.ck.path / MANIFEST).is_file():
            return
        newest = list_committed(self.ck.path.parent)
        now = f"its newest is now {newest[-1].path.name}" if newest else "it holds no committed checkpoint now"
        raise CheckpointError(f"{self.ck.path}: removed while the export read it (a run saving into "
                              f"{self.ck.path.parent} retires all but its newest checkpoint.keep_last); nothing was "
                              f"written: export again ({now})") from None

    def batches(self, keys: list[str]) -> Iterator[dict[str, torch.Tensor]]:
        """These keys' tensors, in order, a batch of at most BATCH_BYTES at a time."""
        batch: list[str] = []
        size = 0
        for key in keys:
            nbytes = self.nbytes(key)
            if batch and size + nbytes > BATCH_BYTES:
                yield self.read(batch)
                batch, size = [], 0
            batch.append(key)
            size += nbytes
        if batch:
            yield self.read(batch)

    def nbytes(self, key: str) -> int:
        meta = self.tensors[key]
        return math.prod(meta.size) * meta.properties.dtype.itemsize

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[self.model_keys[name]].size)


def export_weights(checkpoint: Path, out: str | Path, fmt: str = "torch", force: bool = False,
                   with_optimizer: bool = False, config: Path | None = None, ema: bool = False) -> dict[str, Any]:
    """Write the checkpoint's weights to `out` in format `fmt`; return what was written. `config`: the run's
    config.yaml, when it is not beside the checkpoint dir (<run dir>/config.yaml). `ema`: the average of the
    weights that stages=[ema] kept, in their place."""
    if fmt not in FORMATS:
        raise CheckpointError(f"export --format: must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if with_optimizer and fmt != "dcp":
        raise CheckpointError(f"export --with-optimizer: only --format dcp holds the optimizer state; got --format "
                              f"{fmt}: drop --with-optimizer, or use --format dcp")
    if ema and fmt == "dcp":
        raise CheckpointError("export --ema: --format dcp copies the checkpoint's tensors as saved; use --format "
                              "torch, safetensors or hf for the average of the weights")
    source = Source(Path(checkpoint), ema)
    target = check_output(out, force)
    run_cfg = run_config(source.ck, config)
    info = {"format": fmt, "checkpoint": str(source.ck.path), "step": source.ck.step, "ema": ema,
            "world_size": source.ck.manifest.get("world_size"),
            "trainflow_version": source.ck.manifest.get("trainflow_version"), "config": run_cfg}
    if fmt == "torch":
        weights = source.read(list(source.model_keys.values()))
        model = {name: weights[key] for name, key in source.model_keys.items()}
        write_whole(target, lambda tmp: write_torch(tmp, model, info))
    else:
        hf = plan_hf(source, run_cfg) if fmt == "hf" else None
        write = {"safetensors": lambda tmp: write_safetensors(source, tmp / WEIGHTS),
                 "hf": lambda tmp: write_hf(source, tmp, hf),
                 "dcp": lambda tmp: write_dcp(source, tmp, with_optimizer)}[fmt]

        def folder(tmp: Path) -> None:
            tmp.mkdir()
            write(tmp)
            save_file(tmp / EXPORT_INFO, lambda f: f.write(json.dumps(info, indent=1).encode()))

        write_whole(target, folder)
    return {"path": str(target), "format": fmt, "step": source.ck.step, "tensors": len(source.model_keys),
            "bytes": size_of(target), "checkpoint": str(source.ck.path)}


def run_config(ck: Committed, given: Path | None) -> dict[str, Any] | None:
    """The config.yaml of the run that saved `ck`: the one given, or the one of the run dir holding its checkpoint
    dir (None when there is none, or when that run kept its checkpoints elsewhere)."""
    path = Path(given).expanduser() if given else ck.path.parent.parent / "config.yaml"
    if not path.is_file():
        if given:
            raise CheckpointError(f"export --config: {path} is not a file; give the run's config.yaml")
        return None
    try:
        cfg = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as exc:  # noqa: BLE001 (yaml and omegaconf raise many kinds for a file they cannot parse)
        raise CheckpointError(f"{path}: not a readable config ({type(exc).__name__}); give the run's config.yaml "
                              "with --config") from None
    if not isinstance(cfg, dict) or (not given and (cfg.get("checkpoint") or {}).get("dir") is not None):
        return None
    return cfg


def write_torch(path: Path, model: dict[str, torch.Tensor], info: dict[str, Any]) -> None:
    """torch.save's archive of the model's tensors, with EXPORT_INFO added as one more record (which says that
    trainflow wrote the file; torch.load reads only its own records), fsynced.

    torch.save is given the path, not a Python file: an exception raised inside its writes to a Python file (the
    KeyboardInterrupt of a Ctrl-C landing there) comes out of its C++ layer as a RuntimeError; by path, a signal
    is handled once it returns.
    """
    try:
        torch.save(model, str(path))
    except RuntimeError as exc:  # torch's C++ writer: a full disk, a lost mount
        raise CheckpointError(f"{path.parent.parent / path.name}: cannot write the export (torch.save: "
                              f"{(str(exc).strip().splitlines() or [''])[-1]}); give a path on a writable disk with "
                              "room for it") from None
    with open(path, "r+b") as f:
        with zipfile.ZipFile(f, "a") as archive:
            folder = archive.namelist()[0].split("/", 1)[0]  # torch.save keeps every record in one top folder
            archive.writestr(f"{folder}/{EXPORT_INFO}", json.dumps(info, indent=1))
        f.flush()
        os.fsync(f.fileno())


_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(source: Source, path: Path) -> None:
    """The model's tensors in the safetensors layout (a little-endian u64 header size, the JSON header, the
    tensors' bytes back to back), read and written a batch at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, key in source.model_keys.items():
        dtype = source.tensors[key].properties.dtype
        if dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{source.ck.path}: {name} is {dtype}, which safetensors has no type for; "
                                  "export --format torch instead")
        end = offset + source.nbytes(key)
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": source.shape(name), "data_offsets": [offset, end]}
        offset = end
    data = json.dumps(header, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)  # the tensors start 8-byte aligned

    def write(f: Any) -> None:
        f.write(struct.pack("<Q", len(data)) + data)
        for batch in source.batches(list(source.model_keys.values())):
            for tensor in batch.values():
                f.write(tensor_bytes(tensor))

    save_file(path, write)


@dataclass
class HfPlan:
    """What a Hugging Face export writes, all of it checked before anything is: the model to fill, the Hugging Face
    name and layout of each tensor of the checkpoint, and the run's tokenizer (None for bytes)."""

    transformers: ModuleType
    model: Any
    names: dict[str, tuple[str, bool]]
    layout: Callable[[str, torch.Tensor, bool], torch.Tensor]
    tokenizer: Any


def plan_hf(source: Source, run_cfg: dict[str, Any] | None) -> HfPlan:
    """The Hugging Face model of the run's config, mapped tensor by tensor, and the run's tokenizer, or one line
    saying why it cannot be exported."""
    if run_cfg is None or not isinstance(run_cfg.get("model"), dict):
        raise CheckpointError(f"export --format hf: needs the config of the run that saved {source.ck.path}, and "
                              f"{source.ck.path.parent.parent / 'config.yaml'} is not it; give --config <run dir>/"
                              "config.yaml")
    model_cfg = run_cfg["model"]
    target = model_cfg.get("_target_")
    transformers = import_hf("transformers", "export --format hf")
    if target == GPT_TARGET:
        if (layout := source.ck.manifest.get("weights_layout", 1)) != GPT.weights_layout:
            raise CheckpointError(f"export --format hf: {source.ck.path} holds the GPT's weights in layout {layout}, "
                                  f"and this trainflow maps layout {GPT.weights_layout} to GPT-2; export it with the "
                                  "trainflow that saved it")
        kwargs, shapes = gpt2_config(model_cfg)
        for name, shape in shapes.items():
            saved = source.shape(name) if name in source.model_keys else None
            if saved != shape:
                raise CheckpointError(f"export --format hf: {name} is {saved} in {source.ck.path}, {shape} in a GPT "
                                      "of the run's config; give the config the checkpoint was saved with (--config)")
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kwargs))
        names = {k: hf_name(k) for k in source.model_keys if k != TIED}
        layout = functools.partial(to_gpt2, n_head=kwargs["n_head"])
    elif target == HF_TARGET:
        try:
            model = gpt2(**{k: v for k, v in model_cfg.items() if k != "_target_"})
        except ConfigError as exc:
            raise CheckpointError(f"export --format hf: the run's model does not build here ({exc})") from None
        names = {k: (k, False) for k in source.model_keys}
        layout = as_stored
    else:
        raise CheckpointError(f"export --format hf: model._target_ {target} has no Hugging Face mapping (only "
                              f"{GPT_TARGET} and {HF_TARGET} have); export --format safetensors instead")
    params = model.state_dict()
    unmapped = [k for k, v in names.items() if v is None or v[0] not in params]
    if unmapped:
        raise CheckpointError(f"export --format hf: {unmapped[0]} has no place in the Hugging Face model; export "
                              "--format safetensors instead")
    filled = {hf_key for hf_key, _ in names.values()}
    if target == GPT_TARGET and (missing := sorted(k for k in params.keys() - filled if not k.endswith(".bias")
                                                   and k != "lm_head.weight")):
        raise CheckpointError(f"export --format hf: {source.ck.path} holds nothing for the GPT-2 tensor "
                              f"{missing[0]}; export --format safetensors instead")
    return HfPlan(transformers, model, names, layout, run_tokenizer(run_cfg))


def write_hf(source: Source, folder: Path, plan: HfPlan) -> None:
    """A Hugging Face folder (config.json, model.safetensors) by save_pretrained, and the run's tokenizer."""
    params = plan.model.state_dict()
    with torch.no_grad():
        names = {key: name for name, key in source.model_keys.items()}
        for batch in source.batches([source.model_keys[k] for k in plan.names]):
            for key, tensor in batch.items():
                name = names[key]
                hf_key, transposed = plan.names[name]
                params[hf_key].copy_(plan.layout(name, tensor, transposed))
        filled = {hf_key for hf_key, _ in plan.names.values()}
        for key in params.keys() - filled:
            if key.endswith(".bias"):  # a GPT without biases: zero ones compute the same
                params[key].zero_()
    plan.transformers.utils.logging.disable_progress_bar()  # one line per export is what trainflow prints
    plan.model.save_pretrained(folder)
    if plan.tokenizer is not None:
        end = next((t for t in END_TOKENS if plan.tokenizer.token_to_id(t) is not None), None)
        fast = plan.transformers.PreTrainedTokenizerFast(tokenizer_object=plan.tokenizer, bos_token=end,
                                                         eos_token=end)
        fast.save_pretrained(folder)


def run_tokenizer(run_cfg: dict[str, Any]) -> Any:
    """The run's tokenizer as a tokenizers.Tokenizer: one byte a token (tokenizer=bytes), or read from its
    tokenizer.json (bpe, file). A BPE is never trained here and nothing is created: one no longer cached is refused
    in one line, and so is a file that is missing, not a regular file (never opened: a FIFO would hang) or no
    tokenizer.json."""
    settings = run_cfg.get("tokenizer") or {}
    kind = settings.get("kind", "bytes")
    lib = import_hf("tokenizers", "export --format hf")
    if kind not in ("file", "bpe"):
        return byte_tokenizer(lib)
    if kind == "file":
        fix = "put the run's tokenizer.json there, or give --config a config whose tokenizer.path names it"
        if not settings.get("path"):
            raise CheckpointError(f"export --format hf: tokenizer.path is not set in the run's config; {fix}")
        path, key = Path(settings["path"]).expanduser(), "tokenizer.path"
    else:
        path, key = bpe_cache_path(lib, typed(settings, TokenizerConfig, "tokenizer"), bpe_corpus_key(run_cfg)), \
            "tokenizer.cache_dir"
        fix = "export from where the run ran, with its data unchanged"
        if not path.exists():
            raise CheckpointError(f"export --format hf: the run's BPE tokenizer is no longer in tokenizer.cache_dir "
                                  f"({settings.get('cache_dir')}), or its data changed since; nothing was written: "
                                  f"{fix}")
    if (problem := not_a_file(path)) is not None:
        raise CheckpointError(f"export --format hf: {key} {path} {problem}; nothing was written: {fix}")
    try:
        return lib.Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 (the library raises plain Exceptions for files it cannot parse)
        raise CheckpointError(f"export --format hf: {key} {path} is not a tokenizer.json the tokenizers library "
                              f"can read ({(str(exc).splitlines() or [''])[0]}); nothing was written: {fix}") from None


def bpe_corpus_key(run_cfg: dict[str, Any]) -> str:
    """The key of the corpus the run's BPE was trained on, as the data code computes it (nothing is read)."""
    data = run_cfg.get("data") or {}
    if data.get("_target_") == HFDataConfig._target_:
        cache = data.get("cache_dir", HFDataConfig.cache_dir)  # a key the run's config.yaml lacks: the schema's default
        column = data.get("column", HFDataConfig.column)
        paths = _files(data.get("paths"), "data.paths")
        split = Split(paths, data.get("format"), column, Path(cache).expanduser(), cache)
        return f"hf\0{split.key}"
    if data.get("_target_") == TextDataConfig._target_ or data.get("kind") == "text":  # as its config.yaml names it
        return f"text\0{Corpus.of(data).key}"
    raise CheckpointError("export --format hf: the run trained a BPE tokenizer on data trainflow cannot find "
                          "again here; export --format safetensors, and save the tokenizer yourself")


def write_dcp(source: Source, folder: Path, with_optimizer: bool) -> None:
    """A stock DCP folder of `{"model": ..., "optimizer": {"state": ..., "param_groups": ...}}`, torch's records."""
    keys = [k for k in source.tensors if k.startswith(MODEL_PREFIX) or (with_optimizer and k.startswith(OPTIM_PREFIX))]
    paths = source.metadata.planner_data or {}
    tree: dict[str, Any] = {}
    for key, tensor in source.read(keys).items():
        path = paths.get(key)
        if not path or path[0] != "app" or path[1] not in ("model", "optim"):
            raise CheckpointError(f"{source.ck.path}/.metadata: no nesting recorded for {key}; the checkpoint is not "
                                  "trainflow's")
        node = tree.setdefault("model" if path[1] == "model" else "optimizer", {})
        for part in path[2:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = tensor
    if with_optimizer:
        try:
            tree.setdefault("optimizer", {})["param_groups"] = read_state(source.ck.path)["param_groups"]
        except CheckpointError:
            source.unless_deleted()
            raise
    try:
        dcp.save(tree, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    except BaseException as exc:  # DCP wraps what its writer raised: Ctrl-C stays itself, a full disk an OSError
        reraise_interrupt(exc)
        if isinstance(root_error(exc), OSError):
            raise root_error(exc) from None
        raise


def check_output(out: str | Path, force: bool) -> Path:
    """The output path, once it is known that writing it destroys nothing it must not."""
    if not str(out).strip():
        raise CheckpointError("export: the output path is empty; give the file or folder to write, e.g. "
                              "model.safetensors")
    path = Path(out).expanduser()
    real = path.resolve()  # a link into a checkpoint folder is refused like the folder itself
    for folder in (real, *real.parents):
        if is_checkpoint_folder(folder):
            raise CheckpointError(f"{path}: inside the checkpoint folder {folder}; an export never writes into a "
                                  "checkpoint folder (it would damage the checkpoints): give a path outside it")
    if path.exists() or path.is_symlink():
        if not force:
            raise CheckpointError(f"{path} already exists; nothing was changed: give a new path, or add --force to "
                                  "replace it")
        if (foreign := not_an_export(path)) is not None:
            raise CheckpointError(f"{path} {foreign}; nothing was changed: --force replaces only an earlier export: "
                                  "give a new path, or move it away")
    return path


def not_an_export(path: Path) -> str | None:
    """None when `path` (missing, or an export of trainflow's: a folder holding EXPORT_INFO, or a regular file whose
    archive holds it) may be replaced; else what it is, in words. Nothing but a regular file is opened."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(mode) and (path / EXPORT_INFO).is_file():
        return None
    if stat.S_ISREG(mode):
        with contextlib.suppress(OSError, zipfile.BadZipFile), zipfile.ZipFile(path) as archive:
            if any(name.split("/", 1)[-1] == EXPORT_INFO for name in archive.namelist()):
                return None
    what = "a file" if stat.S_ISREG(mode) else kind_of(mode)
    return f"is {what} trainflow did not export (no {EXPORT_INFO} inside)"


def is_checkpoint_folder(folder: Path) -> bool:
    """A committed checkpoint, a save in progress, or a checkpoint dir holding committed checkpoints."""
    if not folder.is_dir():
        return False
    if (folder / MANIFEST).exists() or (folder / ".metadata").exists() or folder.name.startswith(TMP_PREFIX):
        return True
    return bool(list_committed(folder))


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` writes a path in a staging folder beside `path`, renamed over it once whole (an earlier output
    goes only then); the staging folder is removed however the export ends (a signal that Python sees included).
    An OSError is one line naming the output."""
    staging = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(path.parent)
        staging.mkdir()
        (staging / STAGING).write_text(f"{socket.gethostname()} {os.getpid()}\n")
        write(staging / path.name)
        if path.is_dir() and not path.is_symlink():
            os.rename(path, staging / _OLD)  # a folder cannot be renamed over: the earlier export steps aside first
        os.replace(staging / path.name, path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot write the export ({unwritable_reason(path.parent, exc)}); give a "
                              "path on a writable disk") from None
    finally:
        _clear_staging(staging, path, os.getpid())


def remove_leftovers(folder: Path) -> None:
    """Remove the staging folders of exports into `folder` whose process is gone (killed): see _clear_staging."""
    for entry in folder.iterdir():
        match = _STAGED.fullmatch(entry.name)
        if match and not entry.is_symlink() and entry.is_dir():
            pid = int(match.group(2))
            if pid == os.getpid() or not pid_alive(pid):
                _clear_staging(entry, folder / match.group(1), pid)


def _clear_staging(staging: Path, path: Path, pid: int) -> None:
    """Remove the staging folder of export `pid` on this host: one whose STAGING file names it, after putting back
    the earlier output it holds when `path` has none (an export stopped between its two renames); or one holding
    nothing but an empty STAGING, or nothing at all (an export stopped before it said whose the folder is). Anything
    else of that name (another program's) is left alone, and so is a folder whose earlier output cannot go back."""
    marker = staging / STAGING
    with contextlib.suppress(OSError):  # a failed step skips the removal
        if not marker.is_file() or marker.stat().st_size == 0:
            if {p.name for p in staging.iterdir()} <= {STAGING}:
                marker.unlink(missing_ok=True)
                staging.rmdir()
            return
        if marker.read_text().split() != [socket.gethostname(), str(pid)]:
            return
        if (staging / _OLD).exists() and not (path.exists() or path.is_symlink()):
            os.rename(staging / _OLD, path)
        shutil.rmtree(staging)


def save_file(path: Path, write: Callable[[Any], None]) -> None:
    """Write `path` through `write(f)` and fsync it before it is renamed into place."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def size_of(path: Path) -> int:
    """Bytes of a file, or of the files of a folder."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size
