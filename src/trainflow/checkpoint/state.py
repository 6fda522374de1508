"""The app state: what goes into a checkpoint, split into tensors (DCP shards) and plain JSON values.

Nothing in a checkpoint is pickled: the model and optimizer tensors go to DCP, every other value (progress, LR
schedule, optimizer hyperparameters, RNG states) to JSON. Also here: the checks on that state (non-finite values,
a model's shape fingerprint, an exact comparison of a state with its read-back).
"""

from __future__ import annotations

import base64
import hashlib
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
from torch.distributed.tensor import DTensor

from trainflow.data.stream import STREAM_VERSIONS
from trainflow.distributed.pipeline import StageParts, shared_as_saved
from trainflow.errors import CheckpointError
from trainflow.loop.state import TrainState

FORMAT = 3  # shards of raw tensor bytes (see safe_io.py), JSON state, a checksum per file: the only one read
STATE_FILE = "state.json"  # progress, LR schedule, optimizer hyperparameters: the non-tensor state


def rng_file(rank: int) -> str:
    """The file holding one rank's random generators, beside the shards."""
    return f"rng_rank{rank:05d}.json"


def data_file(rank: int) -> str:
    """The file holding one rank's position in an iterable dataset's stream, beside the shards."""
    return f"data_rank{rank:05d}.json"


def split_state(state: TrainState) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the tensors, for the DCP shards; every other value, for state.json): nothing in a checkpoint is pickled."""
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    optim_state = shared_as_saved(optim_sd["state"], state.model)
    own = {name: stage.state_dict() for name, stage in state.stage_states.items()}  # an EMA's weights, sharded
    tensors, aside = split_tensors({"model": model_sd, "optim": {"state": optim_state},
                                    **({"stages": own} if own else {})})
    plain = {"format": FORMAT, "step": state.step, "samples_seen": state.samples_seen,
             "stream_version": state.stream_version, "tracked_runs": state.tracked_runs,
             "data": state.data_identity, "layout": state.layout,
             "optimizer": type(state.optimizer).__name__, "param_groups": optim_sd["param_groups"],
             "scheduler": state.scheduler.state_dict(), "non_tensor": aside}
    return tensors, plain


def split_tensors(tree: Any) -> tuple[Any, Any]:
    """(the tensors of a nested dict, everything else): the first goes to DCP, the second to JSON."""
    if isinstance(tree, torch.Tensor):
        return tree, None
    if isinstance(tree, dict):
        tensors, plain = {}, {}
        for key, value in tree.items():
            t, p = split_tensors(value)
            if t is not None and t != {}:
                tensors[key] = t
            if p is not None or t is None:
                plain[str(key)] = p
        return tensors, plain
    return None, tree


def merge_tensors(tensors: Any, plain: Any) -> Any:
    """The inverse of split_tensors (keys are strings: FQNs and state-dict names)."""
    if isinstance(tensors, dict) or isinstance(plain, dict):
        tensors, plain = tensors or {}, plain or {}
        return {k: merge_tensors(tensors.get(k), plain.get(k)) for k in {**tensors, **plain}}
    return tensors if tensors is not None else plain


def saved_stream_version(plain: dict[str, Any], where: Path) -> int:
    """The sample stream's version a checkpoint's position counts in (none saved: 1, the torch.randperm order)."""
    version = plain.get("stream_version", 1)
    if version not in STREAM_VERSIONS:
        raise CheckpointError(
            f"{where}: its data position counts in sample stream version {version!r}, and this trainflow knows "
            f"versions {', '.join(map(str, STREAM_VERSIONS))}; resume it with the trainflow that saved it, or keep "
            f"its weights only (a fresh data stream) with checkpoint.load=model checkpoint.resume={where} and "
            "checkpoint.dir at a new folder")
    return int(version)


# optimizer param-group keys under the config key that sets them
_OPTIM_KEYS = {"initial_lr": "optim.lr", "weight_decay": "optim.weight_decay", "betas": "optim.betas",
               "momentum": "optim.momentum"}


def hyperparameter_changes(saved: list[dict[str, Any]], live: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Optimizer hyperparameters whose value in the config differs from the checkpoint's (the config's is used)."""
    changes, seen = [], set()
    for old, new in zip(saved, live, strict=False):
        for key in sorted(new.keys() - {"params", "lr"}):  # `lr` is the schedule's; `initial_lr` is optim.lr
            before, after = old.get(key), new[key]
            if isinstance(after, tuple):
                before = tuple(before) if isinstance(before, list) else before
            if key not in seen and before != after:
                seen.add(key)
                changes.append({"key": _OPTIM_KEYS.get(key, f"optim ({key})"), "checkpoint": before, "used": after})
    return changes


def restore_schedule(state: TrainState, saved: dict[str, Any], live: dict[str, Any], step: int) -> None:
    """The LR schedule at the checkpoint's step (one schedule step per optimizer step; a constant schedule is not
    stepped, so its saved position may lag), its base LRs from the config (optim.lr as typed)."""
    sched = state.scheduler
    sched.load_state_dict({k: saved.get(k, v) for k, v in live.items()})
    sched.base_lrs, sched.last_epoch = list(live["base_lrs"]), step
    lrs = [base * fn(step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
    for group, lr in zip(state.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    sched._last_lr = lrs


def model_shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    """Global shape and dtype of every model tensor, under the names a checkpoint uses (wrappers stripped); a
    pipeline stage answers for the whole model."""
    if isinstance(model, StageParts):
        return model.whole_shapes

    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}


def state_bytes(state: TrainState) -> int:
    """Bytes of the model and optimizer tensors (whole, not this rank's shard): what a save writes, at least."""
    optim = [v for s in state.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in [*state.model.parameters(), *optim])


def weights_layout(model: nn.Module) -> int | None:
    """The layout a model declares for its weights (`weights_layout`, e.g. the GPT's): the same names and shapes
    can hold their numbers in another order, which the shapes cannot tell. None: the model declares none."""
    return next((m.weights_layout for m in model.modules() if hasattr(m, "weights_layout")), None)


def fingerprint(shapes: dict[str, tuple[tuple[int, ...], str]]) -> str:
    """A short hash of the model's tensor names, shapes and dtypes: equal fingerprints load into each other."""
    text = "\n".join(f"{k}:{list(s)}:{d}" for k, (s, d) in sorted(shapes.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def rng_state() -> dict[str, Any]:
    """This process's random generators as JSON values (no pickle): Python, NumPy, torch CPU and CUDA."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss], "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
             "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict[str, Any], where: Path) -> None:
    def byte_tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)

    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(byte_tensor(state["torch"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(byte_tensor(state["cuda"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{where}: not a random generator state ({type(exc).__name__}: {exc}); the "
                              "checkpoint is corrupt") from None


def first_nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The first key whose tensor holds a NaN or an infinity, in this rank's local shards.

    One fused L2 norm per device screens every tensor (NaN and inf propagate into it; 0.03 s for 230 MB here,
    where a max-abs norm takes 1.9 s); a norm that overflowed from large finite values is told apart by an exact
    isfinite() of that tensor alone. One host sync per device.
    """
    named = [(k, t.to_local() if hasattr(t, "to_local") else t) for k, t in tensors.items()]
    named = [(k, t.detach()) for k, t in named if t.is_floating_point() and t.numel() > 0]
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for k, t in named:
        by_device.setdefault(t.device, []).append((k, t))
    for group in by_device.values():
        norms = torch.stack([n.float() for n in torch._foreach_norm([t for _, t in group])])
        for i in (~torch.isfinite(norms)).nonzero().flatten().tolist():
            key, tensor = group[i]
            if not bool(torch.isfinite(tensor).all()):
                return key
    return None


def flatten(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensors of a nested dict under dotted keys (the names DCP gives them)."""
    if isinstance(tree, torch.Tensor):
        return {prefix.rstrip("."): tree}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in flatten(value, f"{prefix}{key}.").items()}
    return {}


def blank_like(obj: Any) -> Any:
    """The same nesting with zeroed CPU tensors and empty leaves: load targets that share nothing with the live state.

    In CPU memory, so that verifying the first save of a GPU run does not need a second copy of the state on the
    device; sharded tensors stay sharded (the same mesh and placements, a CPU local shard).
    """
    if isinstance(obj, torch.Tensor):
        if isinstance(obj, DTensor):
            local = torch.zeros(obj.to_local().shape, dtype=obj.dtype, device="cpu")
            return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
                                      stride=obj.stride())
        return torch.zeros(obj.shape, dtype=obj.dtype, device="cpu")
    if isinstance(obj, dict):
        return {k: blank_like(v) for k, v in obj.items()}
    if isinstance(obj, list) and any(isinstance(v, dict | list | torch.Tensor) for v in obj):
        return [blank_like(v) for v in obj]
    return None


def differences(live: Any, loaded: Any, path: str = "") -> list[str]:
    """Keys whose reloaded value is not exactly the live one (bit for bit, NaN equal to NaN, shard by shard)."""
    if isinstance(live, dict):
        return [d for k, v in live.items() for d in differences(v, loaded.get(k), f"{path}{k}.")]
    if isinstance(live, list) and isinstance(loaded, list) and len(live) == len(loaded):
        return [d for i, (a, b) in enumerate(zip(live, loaded, strict=True)) for d in differences(a, b, f"{path}{i}.")]
    if isinstance(live, torch.Tensor):
        a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (live, loaded))
        a = a.to(b.device)  # the live tensor, one at a time, next to the CPU copy read back
        if a.dtype != b.dtype or a.shape != b.shape:
            return [path.rstrip(".")]
        same = bool(torch.isclose(a, b, 0, 0, equal_nan=True).all()) if a.is_floating_point() else torch.equal(a, b)
        return [] if same else [path.rstrip(".")]
    return [] if live == loaded else [path.rstrip(".")]
