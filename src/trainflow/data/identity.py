"""What data a run trains on, as its checkpoints record it, and what changed between two such records.

A checkpoint's position in the sample stream means something only on the data it was counted on: the same samples
in the same order, the same held-out split. So each checkpoint records an identity of its data (a JSON dict), and
a resume compares it with the data of the run resuming it:

- `kind`: data=text, data=shards, data=synthetic, or the `_target_` of a user's data;
- `settings`: what decides which samples the stream serves and which are held out, under the config key that sets
  it (the tokenizer, `data.seq_len`, `data.val_fraction`, a synthetic set's size and seed, a user's split lengths);
- `content`: a hash of the samples where one is cheap to keep (text: the token cache's, computed once per cache and
  kept beside it; shards: the manifest's index of shards and checksums), else None;
- `parts`: what the content is made of, to name a change ("2 files added (a.txt, b.txt)"): the corpus's files
  and their sizes, or the shards and their checksums (up to MAX_PARTS of them; above, only their count and hash).

Two records describe the same data when their kind, settings and content are equal: a corpus moved to another
folder, or its files touched, is the same data (same tokens); a file edited to the same size is not (other tokens).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from trainflow.util.files import write_atomic

MAX_PARTS = 10_000  # parts listed by name in a record (a checkpoint's state.json): ~0.5 MB at most
SHOWN = 3  # names shown of each kind of change

Identity = dict[str, Any]


def file_checksum(path: Path) -> str:
    """xxh3-64 of the file, as the checkpoints hash theirs (not their helper: trainflow.checkpoint imports the
    sample stream's version from this package)."""
    with open(path, "rb") as f:
        return checksum_of(f)


def checksum_of(f: BinaryIO) -> str:
    """xxh3-64 of an open file's bytes, from its start (read with pread: its position is left alone)."""
    digest, offset = xxhash.xxh3_64(), 0
    while chunk := os.pread(f.fileno(), 16 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def cache_checksum(cache: Path) -> str:
    """The token cache's xxh3-64, kept beside it (`<cache>.xxh3.json`, valid while the cache's size and time are the
    ones it names): a cache is hashed once, not at every start."""
    side = cache.with_name(cache.name + ".xxh3.json")
    st = cache.stat()
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        kept = json.loads(side.read_text())
        if {k: kept.get(k) for k in stamp} == stamp:
            return str(kept["xxh3"])
    except (OSError, ValueError, KeyError):
        pass
    checksum = file_checksum(cache)
    with contextlib.suppress(OSError):  # a folder that took the cache takes this; if not, it is hashed next time
        write_atomic(side, json.dumps({**stamp, "xxh3": checksum}))
    return checksum


def parts_record(parts: Sequence[tuple[str, Any]], unit: str, root: str = "") -> dict[str, Any]:
    """The parts' count and hash, and their list while it is short enough to keep in every checkpoint; `unit` is
    what a part is (file, shard), `root` the folder their names are relative to."""
    digest = xxhash.xxh3_64()
    for name, value in parts:
        digest.update(f"{name}\0{value}\n".encode())
    listed = [[name, value] for name, value in parts] if len(parts) <= MAX_PARTS else None
    return {"unit": unit, "root": root, "count": len(parts), "hash": digest.hexdigest(), "list": listed}


def text_identity(files: Sequence[Path], tokens_checksum: str, tokenizer: str, seq_len: int,
                  val_fraction: float) -> Identity:
    """data=text: the corpus's files (names under their common folder, sizes) and the hash of its tokens."""
    names = [os.path.abspath(f) for f in files]
    root = os.path.commonpath(names) if len(names) > 1 else os.path.dirname(names[0])
    parts = [(os.path.relpath(n, root), f.stat().st_size) for n, f in zip(names, files, strict=True)]
    return {"kind": "data=text", "key": "data.paths", "content": tokens_checksum,
            "parts": parts_record(parts, "file", root),
            "settings": {"tokenizer": tokenizer, "data.seq_len": seq_len, "data.val_fraction": val_fraction}}


def shards_identity(manifest: dict[str, Any], seq_len: int, val_fraction: float) -> Identity:
    """data=shards: the manifest's shards and their checksums (where the folder is does not matter)."""
    parts = [(s["name"], s["checksum"]) for s in manifest["shards"]]
    record = parts_record(parts, "shard")
    return {"kind": "data=shards", "key": "data.path", "content": record["hash"], "parts": record,
            "settings": {"tokenizer": manifest["tokenizer"], "data.seq_len": seq_len,
                         "data.val_fraction": val_fraction}}


def settings_identity(kind: str, settings: dict[str, Any], content: Any = None) -> Identity:
    """Data known by its settings: synthetic data (its size, seeds and shapes), a user's factory (its target and the
    lengths of its splits; its items are not read, which would cost a pass over them, but a train dataset may give
    its own `data_identity`, JSON values that change with its samples, as data=hf gives its token cache's hash)."""
    return {"kind": kind, "key": "data", "content": content, "parts": None, "settings": settings}


def differences(saved: Identity, live: Identity, step: int) -> list[dict[str, Any]]:
    """What changed from the data of a checkpoint of `step` to this run's, each as {key, checkpoint, used, said}
    (`said`: a sentence that begins with the key); empty when they are the same data."""
    if saved.get("kind") != live["kind"]:
        return [_change("data", saved.get("kind"), live["kind"], f"data: {live['kind']} here, {saved.get('kind')} at "
                        f"step {step}")]
    found = []
    old_settings = saved.get("settings") or {}
    for key, value in live["settings"].items():
        old = old_settings.get(key, value)
        if old != value:
            moves = " (the held-out split moves)" if key in ("data.val_fraction", "data.seq_len") else ""
            found.append(_change(key, old, value, f"{key}: {value} here, {old} at step {step}{moves}"))
    if saved.get("content") != live["content"]:
        said = f"{live['key']}: {_parts_change(saved.get('parts'), live['parts'], step)}"
        found.append(_change(live["key"], saved.get("content"), live["content"], said))
    return found


def _change(key: str, checkpoint: Any, used: Any, said: str) -> dict[str, Any]:
    return {"key": key, "checkpoint": checkpoint, "used": used, "said": said}


def _parts_change(saved: dict[str, Any] | None, live: dict[str, Any] | None, step: int) -> str:
    """The change of the content in words: the parts added, removed and changed, or why they cannot be named."""
    if not saved or not live:
        return f"other samples than at step {step}"
    unit = live["unit"]
    if saved["list"] is None or live["list"] is None:
        return f"{live['count']} {unit}s here, {saved['count']} at step {step} (too many to name the ones that differ)"
    old = dict(map(tuple, saved["list"]))
    new = dict(map(tuple, live["list"]))
    if old == new:  # text: the same names and sizes (shards: the same checksums would be the same content)
        return f"the same files and sizes as at step {step}, other tokens: a file's content changed"
    added = [n for n in new if n not in old]
    removed = [n for n in old if n not in new]
    changed = [n for n in new if n in old and new[n] != old[n]]
    said = []
    for names, what in ((added, "added"), (removed, "removed"), (changed, "changed")):
        if names:
            shown = ", ".join(names[:SHOWN]) + (f", and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
            said.append(f"{len(names)} {unit}{'s' if len(names) > 1 else ''} {what} ({shown})")
    moved = f" (the files are under {live['root']} here, {saved['root']} then)" if live["root"] != saved["root"] else ""
    return f"{', '.join(said)} since step {step}{moved}"
