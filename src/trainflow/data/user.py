"""Datasets by `data._target_`: the user's factory, its map-style datasets read a micro-batch at a time.

The factory is called with the data section's own keys (all but `_target_` and trainflow's LOADER_KEYS) and
returns `(train, val)` or a mapping with `train`, `val` (None: no evaluation) and optionally `collate_fn`.
Items are tensors, tuples/lists or dicts of them; they are gathered by index and collated (default: torch's
default_collate), so the global sample stream serves them like the built-in datasets: exact resume on any world size.
An IterableDataset as train is read through torchdata's StatefulDataLoader (data/iterable.py); one as val is read
once into memory (it must end), so that every evaluation sees the same held-out items.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from trainflow.data.iterable import IterableSource
from trainflow.errors import ConfigError, DataError
from trainflow.util.targets import bound_callable


class Collated(Dataset):
    """A map-style dataset indexed by a micro-batch's indices: its items gathered and collated into one batch."""

    def __init__(self, dataset: Dataset, collate: Callable[[list], Any], name: str) -> None:
        self.dataset, self.collate, self.name = dataset, collate, name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: torch.Tensor) -> Any:
        return batched(self.collate, [self.dataset[i] for i in indices.tolist()], self.name)


def batched(collate: Callable[[list], Any], items: list, name: str) -> Any:
    """`collate(items)`, or one line naming the collate and the data when it cannot batch them."""
    try:
        return collate(items)
    except Exception as exc:
        collate_name = getattr(collate, "__qualname__", type(collate).__name__)
        raise DataError(f"data: {collate_name} cannot batch the items of {name} ({_first_line(exc)}); give "
                        "items of one shape (tensors, or tuples or dicts of them), or a data.collate_fn that "
                        "batches them") from None


def user_datasets(made: Any, target: str, collate_fn: Any) -> tuple[Collated | IterableSource, Collated | None]:
    """What the factory `target` returned, as datasets read a micro-batch at a time (`collate_fn`: the data
    section's, a section with its own `_target_`); a return that is not datasets is one line naming the key."""
    train, val, collate = _parts(made, target)
    if collate_fn is not None:
        collate = _configured_collate(collate_fn)
    collate = collate or default_collate
    if isinstance(val, IterableDataset):
        val = list(val)  # read once: every evaluation takes the same held-out items, by index
    for split, dataset in (("train", train), ("val", val)):
        if dataset is not None and not isinstance(dataset, IterableDataset):
            _check_dataset(dataset, split, target)
    val_set = Collated(val, collate, target) if val is not None else None
    if isinstance(train, IterableDataset):
        return IterableSource(train, partial(batched, collate, name=target), target), val_set
    return Collated(train, collate, target), val_set


def _parts(made: Any, target: str) -> tuple[Any, Any, Callable | None]:
    if isinstance(made, Mapping) and "train" in made:
        return made["train"], made.get("val"), made.get("collate_fn")
    if isinstance(made, tuple | list) and len(made) == 2:
        return made[0], made[1], None
    raise DataError(f"data._target_: {target} returned a {type(made).__name__}, not datasets; return (train, val) "
                    "or a dict with train, val (None: no evaluation) and optionally collate_fn")


def _check_dataset(dataset: Any, split: str, target: str) -> None:
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise DataError(f"data._target_: {target} returned a {type(dataset).__name__} as {split}, which is not a "
                        "dataset; return map-style datasets (with __len__ and __getitem__ of an index) or "
                        "IterableDatasets")
    if len(dataset) == 0:
        raise DataError(f"data._target_: the {split} dataset of {target} is empty; give it samples")


def _configured_collate(section: Any) -> Callable:
    """data.collate_fn: a section with its own _target_ (a function, or a class whose instances collate)."""
    if not isinstance(section, Mapping) or not section.get("_target_"):
        raise ConfigError("data.collate_fn: give a section with _target_, e.g. data.collate_fn._target_="
                          "mypackage.data.collate")
    kwargs = {k: v for k, v in section.items() if k != "_target_"}
    return bound_callable("data.collate_fn", section["_target_"], kwargs, "a function of a list of items")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
