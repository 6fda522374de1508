"""Resuming: which committed checkpoint `checkpoint.resume` names, whether it fits this model, and loading it.

On resume the config's optimizer hyperparameters win (each change logged and listed in the summary); another
optimizer type is refused, with `checkpoint.load=model` (weights only, step 0) as the way to keep the weights.
A checkpoint on other data than this run's (data/identity.py: the corpus's files and tokens, the shards, the split)
is refused, naming what changed, unless `checkpoint.on_data_change=restart` (the data position restarts at 0); the
micro-batch, gradient accumulation, global batch and world size may change, and each change is said.
A checkpoint loads on any number of ranks and the sample stream continues exactly; RNG states are restored when
the world size is the same (on another world size each rank keeps its fresh per-rank seed, and a warning says so).
An iterable dataset's stream position (one JSON file per rank) is read here and restored by its loader.

`checkpoint.load=model` also starts from exported weights (fine-tuning): a `.safetensors` file, or a folder
holding `model.safetensors` (`trainflow export --format safetensors|hf`, any Hugging Face GPT-2 folder). Tensors
are matched by name: the model's own names, or for trainflow's GPT the GPT-2 names (hf_names.py); a tensor
missing or of another shape is refused in one line, naming the first such key.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from trainflow.checkpoint.hf_names import as_stored, from_gpt2, gpt_names
from trainflow.checkpoint.safe_io import (
    SafeReader,
    failure_cause,
    read_json,
    read_metadata,
    reraise_interrupt,
    root_error,
)
from trainflow.checkpoint.state import (
    TrainState,
    data_file,
    hyperparameter_changes,
    merge_tensors,
    model_shapes,
    restore_schedule,
    rng_file,
    saved_stream_version,
    set_rng_state,
    split_state,
    split_tensors,
)
from trainflow.checkpoint.store import (
    MANIFEST,
    MAX_LISTED,
    MODEL_PREFIX,
    Committed,
    corrupt_fix,
    list_committed,
    read_state,
    resolve_checkpoint,
    uncommitted_newer,
)
from trainflow.config.schema import CheckpointConfig
from trainflow.data.identity import differences
from trainflow.data.stream import STREAM_VERSION
from trainflow.distributed import DistEnv
from trainflow.distributed.pipeline import shared_as_own
from trainflow.errors import CheckpointError, ConfigError, DataError
from trainflow.models.gpt import CausalSelfAttention

log = logging.getLogger(__package__)  # one name for the package: lines read [trainflow.checkpoint]


WEIGHTS = "model.safetensors"  # in an export folder or a Hugging Face folder
_TIED = {"head.weight": "tok_emb.weight", "lm_head.weight": "transformer.wte.weight"}  # stored once when tied


def pick(ckpt_dir: Path, cfg: CheckpointConfig) -> tuple[Committed | Path | None, bool]:
    """Rank 0: (the checkpoint to resume from, as checkpoint.resume says, or the safetensors file of exported
    weights; whether to load its weights only)."""
    own = list_committed(ckpt_dir)
    unfinished = uncommitted_newer(ckpt_dir, own)
    if unfinished is not None:
        older = f"resume from {own[-1].path.name}" if own else "start fresh"
        raise CheckpointError(f"{unfinished}: a checkpoint folder without {MANIFEST}, newer than every committed "
                              f"one (a save that never committed, or a manifest that was lost); nothing was "
                              f"changed: move it out of {ckpt_dir} to {older}")
    for c in own:
        if c.manifest is not None and c.renamed:
            log.warning("checkpoint: %s holds step %d (its manifest says so): a renamed folder; it is ordered "
                        "by step %d and never deleted", c.path, c.step, c.step)
    resume = cfg.resume
    if resume == "auto":
        return (own[-1] if own else None), False
    if resume == "never":
        if own:
            raise ConfigError(f"checkpoint.resume=never: {ckpt_dir} already holds committed checkpoints (up to "
                              f"{own[-1].path.name}) of an earlier run, and a fresh start there would mix two "
                              "histories; point checkpoint.dir at an empty folder, or resume=auto to continue")
        return None, False
    if own and cfg.load == "model":  # this run's own checkpoints exist: the same command continues them
        log.info("checkpoint.load=model: %s already holds this run's checkpoints (up to %s): resuming them in "
                 "full", ckpt_dir, own[-1].path.name)
        return own[-1], False
    if cfg.load == "model" and (weights := exported_weights(Path(resume))) is not None:
        return weights, True
    try:
        target = resolve_checkpoint(Path(resume))
    except CheckpointError as exc:
        raise ConfigError(f"checkpoint.resume: {exc}") from None
    if own and own[-1].path.resolve() != target.path.resolve():
        raise ConfigError(f"checkpoint.resume: {ckpt_dir} already holds checkpoints up to {own[-1].path.name}; "
                          f"continuing from {target.path} there would mix two histories; point checkpoint.dir "
                          "at a new folder to branch off")
    return target, cfg.load == "model" and not own


def check_fits(target: Committed, model: nn.Module, model_fingerprint: str, layout: int | None) -> None:
    """Refuse a checkpoint of another model shape, listing the keys that differ (and unreadable metadata), or of
    another weights layout (a model that declares one: saved before it, the checkpoint holds layout 1)."""
    metadata = read_metadata(target.path)  # here, not inside DCP, which would wrap its one-line error
    saved_layout = target.manifest.get("weights_layout", None if layout is None else 1)
    if saved_layout != layout:
        raise CheckpointError(f"{target.path} holds the model's weights in layout {saved_layout}, and this "
                              f"trainflow's model reads layout {layout} (the same names "
                              "and shapes, their numbers in another order); resume it with the trainflow that "
                              "saved it, or set checkpoint.dir to a new folder to start fresh")
    if target.manifest.get("model_fingerprint") == model_fingerprint:
        return
    shapes = model_shapes(model)
    saved = {k.removeprefix(MODEL_PREFIX): (tuple(m.size), str(m.properties.dtype).removeprefix("torch."))
             for k, m in metadata.state_dict_metadata.items()
             if k.startswith(MODEL_PREFIX) and isinstance(m, TensorStorageMetadata)}
    diffs = []
    for key in sorted(saved.keys() | shapes.keys()):
        if key not in shapes:
            diffs.append(f"{key} only in the checkpoint")
        elif key not in saved:
            diffs.append(f"{key} missing from the checkpoint")
        elif saved[key] != shapes[key]:
            diffs.append(f"{key} {list(saved[key][0])} {saved[key][1]} saved vs {list(shapes[key][0])} "
                         f"{shapes[key][1]} here")
    if diffs:
        more = f" and {len(diffs) - MAX_LISTED} more" if len(diffs) > MAX_LISTED else ""
        raise CheckpointError(f"{target.path} was saved from another model shape: {len(diffs)} mismatched "
                              f"key(s): {'; '.join(diffs[:MAX_LISTED])}{more}; resume with the model config it "
                              "was saved with, or set checkpoint.dir to a new folder to start fresh")


def load_tensors(target: Committed, tensors: dict[str, Any], group: Any) -> None:
    """Read the checkpoint's tensors into `tensors` in place (any world size; no pickle, no code)."""
    try:
        dcp.load({"app": tensors}, storage_reader=SafeReader(target.path, set(target.manifest["files"])),
                 process_group=group)
    except BaseException as exc:
        reraise_interrupt(exc)
        if isinstance(root_error(exc), CheckpointError):
            raise root_error(exc) from None
        raise CheckpointError(f"{target.path}: corrupt checkpoint, cannot be read ({failure_cause(exc)}); "
                              f"{corrupt_fix(target, list_committed(target.path.parent))}") from exc


def load_all(target: Committed, state: TrainState, env: DistEnv, group: Any,
             on_data_change: str = "refuse") -> list[dict[str, Any]]:
    """Model, optimizer, LR schedule, step, data position and (same world size) every rank's RNG; what this run
    changes of the checkpoint's settings (optimizer hyperparameters, batch, world size, data), each said once."""
    plain = read_state(target.path)
    here = type(state.optimizer).__name__
    if plain.get("optimizer") != here:
        raise CheckpointError(
            f"{target.path}: saved with the {plain.get('optimizer')} optimizer, this run builds {here} "
            f"(optim._target_); its optimizer state does not fit: to continue from its weights only (fresh "
            f"optimizer and LR schedule from step 0), run with checkpoint.load=model "
            f"checkpoint.resume={target.path} and checkpoint.dir at a new folder, or set optim._target_ back")
    data_changes = data_changed(plain, state, target, on_data_change)
    tensors, live = split_state(state)
    saved_stages = (plain.get("non_tensor") or {}).get("stages") or {}
    if "stages" in tensors:  # only what the checkpoint holds: a stage added since starts afresh
        tensors["stages"] = {name: v for name, v in tensors["stages"].items() if name in saved_stages}
    load_tensors(target, tensors, group)
    loaded = merge_tensors(tensors, plain.get("non_tensor") or {})
    restore_stages(state, loaded.get("stages") or {}, target, env)
    changes = hyperparameter_changes(plain["param_groups"], live["param_groups"])
    # the config's groups (their number follows optim.weight_decay); the optimizer state is keyed by parameter
    # name, so it fits either way; the LR is the schedule's, recomputed at the step by restore_schedule
    set_state_dict(state.model, state.optimizer, model_state_dict=loaded["model"],
                   optim_state_dict={"state": shared_as_own(loaded["optim"]["state"], state.model),
                                     "param_groups": live["param_groups"]})
    state.step, state.samples_seen = int(plain["step"]), int(plain["samples_seen"])
    state.stream_version = saved_stream_version(plain, target.path)
    state.tracked_runs = dict(plain.get("tracked_runs") or {})
    restore_schedule(state, plain["scheduler"], live["scheduler"], state.step)
    same_world = target.manifest.get("world_size") == env.world_size
    listed = target.manifest["files"]  # checked by check_intact: regular files of the folder
    if same_world:
        rng = target.path / rng_file(env.rank)
        if rng.name not in listed:
            raise CheckpointError(f"{target.path}: its manifest lists no {rng.name} although {env.world_size} "
                                  f"rank(s) saved it; {corrupt_fix(target, list_committed(target.path.parent))}")
        set_rng_state(read_json(rng), rng)
    position = target.path / data_file(env.rank)  # an iterable dataset's stream (its loader checks the split)
    state.data_state = read_json(position) if position.name in listed else None
    state.data_states = [read_json(target.path / name) for name in sorted(listed) if name.startswith("data_rank")]
    changes += layout_changes(plain.get("layout"), state.layout, target.manifest.get("world_size"), env.world_size)
    if data_changes:  # checkpoint.on_data_change=restart: the position counted in the old data means nothing here
        saved_position = state.samples_seen
        state.samples_seen, state.stream_version, state.data_state, state.data_states = 0, STREAM_VERSION, None, []
        note = (f"checkpoint.on_data_change=restart: the data position restarts at sample 0 of this data (it was "
                f"at {saved_position} of the checkpoint's)")
        changes += [{**change, "note": note} for change in data_changes]
    if env.is_main:
        log.info("resumed from step %d (%s, saved on %d rank(s); data position %d samples)", state.step,
                 target.path, target.manifest.get("world_size"), state.samples_seen)
        if state.data_identity is not None and plain.get("data") is None:
            log.warning("resume: %s records no identity of its data (saved by an earlier trainflow): resumed "
                        "without checking that the data is the same", target.path)
        for c in changes:
            log.warning("resume: %s", said(c))
    return changes


def restore_stages(state: TrainState, saved: dict[str, Any], target: Committed, env: DistEnv) -> None:
    """Each stage's own state (its tensors already read into the live ones); a stage the checkpoint was saved
    without starts afresh, and a line says so."""
    for name, stage in state.stage_states.items():
        if name in saved:
            stage.load_state_dict(saved[name])
        elif env.is_main:
            log.warning("resume: %s holds no state of stage %s (saved without it): it starts afresh", target.path,
                        name)


def data_changed(plain: dict[str, Any], state: TrainState, target: Committed,
                 on_data_change: str) -> list[dict[str, Any]]:
    """What changed of the data since the checkpoint (empty: the same data, or either side's identity unknown);
    refused in one line unless checkpoint.on_data_change=restart."""
    saved = plain.get("data")
    if not isinstance(saved, dict) or state.data_identity is None:  # saved before it was recorded, or unknown here
        return []
    found = differences(saved, state.data_identity, int(plain["step"]))
    if found and on_data_change != "restart":
        raise DataError(f"{'; '.join(c['said'] for c in found)}; {target.path} was saved on the data as it was "
                        "then, and its data position counts in that data: resume with that data, or set "
                        "checkpoint.on_data_change=restart to train on this data from the checkpoint (the data "
                        "position restarts at sample 0; the step, weights, optimizer and LR schedule go on)")
    return found


def layout_changes(saved: dict[str, int] | None, live: dict[str, int] | None, saved_world: int | None,
                   world: int) -> list[dict[str, Any]]:
    """The micro-batch, accumulation and global batch this run changes (a checkpoint without them: none), and the
    world size."""
    changes = [{"key": key, "checkpoint": saved[key], "used": value} for key, value in (live or {}).items()
               if saved and saved.get(key, value) != value]
    if saved_world is not None and saved_world != world:
        changes.append({"key": "world size", "checkpoint": saved_world, "used": world,
                        "note": "model, optimizer and data position are resharded exactly; the per-rank RNG states "
                                "are not restored (fresh per-rank seeds)"})
    return changes


def said(change: dict[str, Any]) -> str:
    """A resume change in words, after `resume: `."""
    if "said" in change:
        return f"{change['said']}; {change['note']}"
    if change["key"] == "world size":
        return f"world size is {change['used']} here, {change['checkpoint']} in the checkpoint: {change['note']}"
    return (f"{change['key']} is {change['used']} in the config, {change['checkpoint']} in the checkpoint; using "
            f"the config's {change['used']}")


def load_weights(target: Committed, state: TrainState, env: DistEnv, group: Any) -> None:
    """checkpoint.load=model: the model's weights only; optimizer, schedule, step and data start fresh."""
    tensors, _ = split_tensors({"model": get_model_state_dict(state.model)})
    load_tensors(target, tensors, group)
    set_model_state_dict(state.model, tensors["model"])
    if env.is_main:
        log.warning("checkpoint.load=model: loaded the weights of step %d (%s); optimizer, LR schedule, step "
                    "and data position start fresh at step 0", target.step, target.path)


def exported_weights(path: Path) -> Path | None:
    """The safetensors file of exported weights that `path` names (the file, or a folder holding WEIGHTS); None
    for anything else (a checkpoint)."""
    path = path.expanduser()
    if path.is_file() and path.suffix == ".safetensors":
        return path
    return path / WEIGHTS if (path / WEIGHTS).is_file() else None


def load_exported(path: Path, state: TrainState, env: DistEnv) -> None:
    """checkpoint.load=model from exported weights: every rank reads the file and keeps its own shard."""
    from safetensors import SafetensorError, safe_open  # lazy: safetensors is the hf extra

    shapes = model_shapes(state.model)
    fix = "give weights exported from a model of this config, or set the model config they were trained with"
    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            plan = {k: (k, False) for k in shapes if k in names}
            as_gpt2 = gpt_names(names)
            from_gpt2_plan = {k: as_gpt2[k] for k in shapes if k in as_gpt2}
            if len(from_gpt2_plan) > len(plan):  # a GPT-2 folder loaded into trainflow's GPT
                plan = from_gpt2_plan
            for key, stored in _TIED.items():
                if key in shapes and key not in plan and stored in plan:
                    plan[key] = plan[stored]
            missing = [k for k in shapes if k not in plan]
            if missing:
                raise ConfigError(f"checkpoint.resume: {path} holds no tensor for {missing[0]} of this model "
                                  f"({len(missing)} of {len(shapes)} missing); {fix}")
            n_head = next((m.n_head for m in state.model.modules() if isinstance(m, CausalSelfAttention)), 0)
            layout = functools.partial(from_gpt2, n_head=n_head) if plan is from_gpt2_plan else as_stored
            loaded = {}
            for key, (name, transposed) in plan.items():
                want = list(shapes[key][0])
                got = list(f.get_slice(name).get_shape())
                if transposed:
                    got = got[::-1]
                if got != want:
                    raise ConfigError(f"checkpoint.resume: {path}: {key} is {got} there, {want} in this model; {fix}")
                tensor = f.get_tensor(name)
                loaded[key] = layout(key, tensor, transposed).contiguous().to(getattr(torch, shapes[key][1]))
    except SafetensorError as exc:
        raise ConfigError(f"checkpoint.resume: {path} is not a readable safetensors file ({exc}); give a file "
                          "written by trainflow export or save_pretrained") from None
    set_model_state_dict(state.model, loaded, options=StateDictOptions(full_state_dict=True))
    if env.is_main:
        log.warning("checkpoint.load=model: loaded the weights of %s; optimizer, LR schedule, step and data "
                    "position start fresh at step 0", path)
