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
`force`, and even then only a file or an earlier export folder (one holding EXPORT_INFO) is replaced. Everything is
written beside the output under a temporary name and renamed into place once whole, so a failed export leaves the
old output (or nothing) behind.

The checkpoint is read in this one process (no process group), whatever the world size and strategy that saved
it: the keys are the model's own names (DCP's get_model_state_dict strips compile, DDP and FSDP wrappers at save).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

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
from trainflow.errors import CheckpointError, ConfigError, unwritable_reason
from trainflow.models.gpt import GPT

FORMATS = ("torch", "safetensors", "hf", "dcp")
WEIGHTS = "model.safetensors"
BATCH_BYTES = 256 << 20  # tensors read at once by a safetensors or hf export (a larger tensor is read alone)
OPTIM_PREFIX = "app.optim."
EXPORT_INFO = "trainflow_export.json"  # in an export folder: what it was exported from (and the run's config)


class Source:
    """A committed, intact checkpoint and the tensors it holds, read on demand without running code."""

    def __init__(self, checkpoint: Path) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.ck: Committed = resolve_checkpoint(checkpoint)
        check_intact(self.ck, list_committed(self.ck.path.parent))
        self.metadata = read_metadata(self.ck.path)
        entries = self.metadata.state_dict_metadata
        pickled = [k for k, m in entries.items() if not isinstance(m, TensorStorageMetadata)]
        if pickled:
            raise CheckpointError(f"{self.ck.path}: {pickled[0]} is stored as a pickled object, which trainflow "
                                  "does not load (it could run code); the checkpoint was tampered with or is not "
                                  "trainflow's")
        self.tensors = dict(entries)  # DCP key (app.model.<name>, app.optim.state.<name>.<slot>) -> metadata

    @property
    def model_keys(self) -> dict[str, str]:
        """The model's tensor names -> their DCP keys."""
        return {k.removeprefix(MODEL_PREFIX): k for k in self.tensors if k.startswith(MODEL_PREFIX)}

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """These DCP keys' tensors, whole (every rank's shards joined), in CPU memory."""
        import torch.distributed.checkpoint as dcp

        out = {k: torch.empty(self.tensors[k].size, dtype=self.tensors[k].properties.dtype) for k in keys}
        try:
            dcp.load(out, storage_reader=SafeReader(self.ck.path, set(self.ck.manifest["files"])), no_dist=True)
        except BaseException as exc:  # DCP's CheckpointException derives from BaseException
            reraise_interrupt(exc)
            if isinstance(root_error(exc), CheckpointError):
                raise root_error(exc) from None
            raise CheckpointError(f"{self.ck.path}: cannot be read ({failure_cause(exc)}); it is corrupt") from exc
        return out

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
                   with_optimizer: bool = False, config: Path | None = None) -> dict[str, Any]:
    """Write the checkpoint's weights to `out` in format `fmt`; return what was written. `config`: the run's
    config.yaml, when it is not beside the checkpoint dir (<run dir>/config.yaml)."""
    if fmt not in FORMATS:
        raise CheckpointError(f"export --format: must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if with_optimizer and fmt != "dcp":
        raise CheckpointError(f"export --with-optimizer: only --format dcp holds the optimizer state; got --format "
                              f"{fmt}: drop --with-optimizer, or use --format dcp")
    source = Source(Path(checkpoint))
    target = check_output(out, force)
    run_cfg = run_config(source.ck, config)
    if fmt == "torch":
        weights = source.read(list(source.model_keys.values()))
        model = {name: weights[key] for name, key in source.model_keys.items()}
        write_whole(target, lambda tmp: save_file(tmp, lambda f: torch.save(model, f)))
    else:
        write = {"safetensors": lambda tmp: write_safetensors(source, tmp / WEIGHTS),
                 "hf": lambda tmp: write_hf(source, tmp, run_cfg),
                 "dcp": lambda tmp: write_dcp(source, tmp, with_optimizer)}[fmt]
        info = {"format": fmt, "checkpoint": str(source.ck.path), "step": source.ck.step,
                "world_size": source.ck.manifest.get("world_size"),
                "trainflow_version": source.ck.manifest.get("trainflow_version"), "config": run_cfg}

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
    from omegaconf import OmegaConf

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


def write_hf(source: Source, folder: Path, run_cfg: dict[str, Any] | None) -> None:
    """A Hugging Face folder (config.json, model.safetensors) by save_pretrained."""
    from trainflow.data.tokenizers import import_hf

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
        from trainflow.models.hf import gpt2

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
    filled = set()
    with torch.no_grad():
        for batch in source.batches([source.model_keys[k] for k in names]):
            for key, tensor in batch.items():
                name = key.removeprefix(MODEL_PREFIX)
                hf_key, transposed = names[name]
                params[hf_key].copy_(layout(name, tensor, transposed))
                filled.add(hf_key)
        for key in params.keys() - filled:
            if key.endswith(".bias"):  # a GPT without biases: zero ones compute the same
                params[key].zero_()
    if target == GPT_TARGET and (missing := sorted(k for k in params.keys() - filled if not k.endswith(".bias")
                                                   and k != "lm_head.weight")):
        raise CheckpointError(f"export --format hf: {source.ck.path} holds nothing for the GPT-2 tensor "
                              f"{missing[0]}; export --format safetensors instead")
    transformers.utils.logging.disable_progress_bar()  # one line per export is what trainflow prints
    model.save_pretrained(folder)
    tokenizer = tokenizer_file(run_cfg)
    if tokenizer is not None:
        write_tokenizer(tokenizer, folder)


def tokenizer_file(run_cfg: dict[str, Any]) -> Path | None:
    """The tokenizer.json of a run of tokenizer=bpe|file (None for bytes), found where the data code keeps it;
    a BPE is never trained here: one no longer cached is refused in one line."""
    from trainflow.config.schema import TokenizerConfig, typed
    from trainflow.data.tokenizers import _trained_bpe, import_hf

    settings = run_cfg.get("tokenizer") or {}
    kind = settings.get("kind", "bytes")
    if kind == "file":
        return Path(settings["path"]).expanduser()
    if kind != "bpe":
        return None
    data = run_cfg.get("data") or {}
    if data.get("_target_") == "trainflow.data.hf.token_windows":
        from trainflow.data.hf import Split, _files

        cache = data.get("cache_dir", "~/.cache/trainflow/hf")
        split = Split(_files(data.get("paths"), "data.paths"), data.get("format"), data.get("column", "text"),
                      Path(cache).expanduser(), cache)
        corpus_key = f"hf\0{split.key}"
    elif data.get("kind") == "text":
        from omegaconf import OmegaConf

        from trainflow.data.text import Corpus

        corpus_key = f"text\0{Corpus.of(OmegaConf.create(data)).key}"
    else:
        raise CheckpointError("export --format hf: the run trained a BPE tokenizer on data trainflow cannot find "
                              "again here; export --format safetensors, and save the tokenizer yourself")

    def not_cached() -> Any:
        raise CheckpointError("export --format hf: the run's BPE tokenizer is no longer in tokenizer.cache_dir "
                              f"({settings.get('cache_dir')}), or its data changed since; export from where the run "
                              "ran, with its data unchanged")

    return _trained_bpe(import_hf("tokenizers", "export --format hf"), typed(settings, TokenizerConfig), corpus_key,
                        not_cached)


def write_tokenizer(path: Path, folder: Path) -> None:
    """The tokenizer.json as a Hugging Face fast tokenizer, for AutoTokenizer.from_pretrained(folder)."""
    from trainflow.data.tokenizers import END_TOKENS, import_hf

    encoder = import_hf("tokenizers", "export --format hf").Tokenizer.from_file(str(path))
    end = next((t for t in END_TOKENS if encoder.token_to_id(t) is not None), None)
    fast = import_hf("transformers", "export --format hf").PreTrainedTokenizerFast(
        tokenizer_object=encoder, bos_token=end, eos_token=end)
    fast.save_pretrained(folder)


def write_dcp(source: Source, folder: Path, with_optimizer: bool) -> None:
    """A stock DCP folder of `{"model": ..., "optimizer": {"state": ..., "param_groups": ...}}`, torch's records."""
    import torch.distributed.checkpoint as dcp

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
        tree.setdefault("optimizer", {})["param_groups"] = read_state(source.ck.path)["param_groups"]
    dcp.save(tree, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)


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
        if path.is_dir() and not (path / EXPORT_INFO).is_file():
            raise CheckpointError(f"{path} is a folder trainflow did not export (no {EXPORT_INFO} inside); "
                                  "--force replaces only a file or an earlier export: give a new path")
    return path


def is_checkpoint_folder(folder: Path) -> bool:
    """A committed checkpoint, a save in progress, or a checkpoint dir holding committed checkpoints."""
    if not folder.is_dir():
        return False
    if (folder / MANIFEST).exists() or (folder / ".metadata").exists() or folder.name.startswith(TMP_PREFIX):
        return True
    return bool(list_committed(folder))


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` writes a temporary path beside `path`, renamed over it once whole (an earlier output goes only
    then); nothing is left behind when it fails. An OSError is one line naming the output."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    old = path.with_name(f".{path.name}.old{os.getpid()}")
    stepped_aside = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        if path.is_dir() and not path.is_symlink():
            os.rename(path, old)  # a folder cannot be renamed over: the earlier export steps aside first
            stepped_aside = True
        os.replace(tmp, path)
        stepped_aside = False
    except OSError as exc:
        if stepped_aside:
            os.rename(old, path)
        raise CheckpointError(f"{path}: cannot write the export ({unwritable_reason(path.parent, exc)}); give a "
                              "path on a writable disk") from None
    finally:
        for leftover in (tmp, old):
            _remove(leftover)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def save_file(path: Path, write: Callable[[Any], None]) -> None:
    """Open `path` for writing ourselves, so that an unwritable place is an OSError (torch.save raises a
    RuntimeError of its C++ layer for a path it cannot open), and fsync it before it is renamed into place."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def size_of(path: Path) -> int:
    """Bytes of a file, or of the files of a folder."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size
