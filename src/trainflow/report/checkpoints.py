"""Two checkpoints compared tensor by tensor: the model's weights and the optimizer's state, read through DCP in this
one process whatever world size and strategy saved them (trainflow.checkpoint.export.Source), without running code.

Each tensor's difference is the relative error of tolerance.py (the norm of the difference over the norm of A's);
one beyond the tolerance of the runs' arithmetic (TOLERANCE["compare.rtol"], or --rtol) differs. Equal checkpoints
are not read twice: both are checked against their manifests (every byte read once, as any trusted read does), and a
tensor stored in the same records of files whose checksums match is equal without reading it again. The page names
the first differing tensor (in the state's order: the model's, then the optimizer's), the largest, the steps and the
data positions.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainflow.checkpoint.export import BATCH_BYTES, Source
from trainflow.checkpoint.store import MANIFEST, list_committed, read_state
from trainflow.errors import CheckpointError, ReceivedFileError
from trainflow.record.summary_file import read_summary
from trainflow.report.gates import FAIL, NOT_EVALUATED, PASS, Gate
from trainflow.util.tolerance import TOLERANCE, relative_error

_STEP_DIR = re.compile(r"step_\d+")


def is_checkpoint(text: str) -> bool:
    """A step_N folder, or a checkpoint dir holding committed ones (a run folder is a run, not its checkpoints)."""
    path = Path(text).expanduser()
    if not path.is_dir() or (path / "summary.json").exists():
        return False
    return bool(_STEP_DIR.fullmatch(path.name) or (path / MANIFEST).is_file() or list_committed(path))


def default_rtol(source: Source) -> float:
    """The tolerance of the arithmetic of the run that saved `source` (its summary.json beside the checkpoint dir),
    fp32's where that is unknown."""
    summary = source.ck.path.parent.parent / "summary.json"
    math_of = "fp32"
    with contextlib.suppress(OSError, ReceivedFileError):  # none, or not one trainflow wrote whole: fp32's
        math_of = read_summary(summary).get("matmul_math") or "fp32"
    table = TOLERANCE["compare.rtol"]
    return table.get(math_of, table["fp32"])


def _records(source: Source) -> dict[str, list[tuple[str, int, int, str]]]:
    """Each tensor's stored records: (file, offset, length, the file's checksum), in order."""
    sums = source.ck.manifest["checksums"]
    out: dict[str, list[tuple[str, int, int, str]]] = {}
    for index, info in sorted(source.metadata.storage_data.items(), key=lambda kv: (kv[0].fqn, tuple(kv[0].offset))):
        out.setdefault(index.fqn, []).append((info.relative_path, info.offset, info.length,
                                              sums.get(info.relative_path, "")))
    return out


def _same_records(a: list[tuple[str, int, int, str]] | None, b: list[tuple[str, int, int, str]] | None) -> bool:
    return bool(a) and a == b and all(checksum for *_, checksum in a)


def _difference(ta: torch.Tensor, tb: torch.Tensor) -> tuple[float, float]:
    """(relative error, largest absolute difference) of two tensors of one shape."""
    if torch.equal(ta, tb):
        return 0.0, 0.0
    if not ta.is_floating_point():
        return math.inf, float((ta.double() - tb.double()).abs().max())
    a, b = ta.double(), tb.double()
    return relative_error(b, a), float((b - a).abs().max())


def _batches(keys: list[str], source: Source) -> Iterator[list[str]]:
    """`keys` in order, in batches of at most BATCH_BYTES (a larger tensor alone): both sides' are read at once."""
    batch: list[str] = []
    size = 0
    for key in keys:
        if batch and size + source.nbytes(key) > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += source.nbytes(key)
    if batch:
        yield batch


def compare_sources(a: Source, b: Source, rtol: float) -> dict[str, Any]:
    """Every tensor of A against B's of the same name."""
    keys_a, keys_b = list(a.tensors), set(b.tensors)
    common = [k for k in keys_a if k in keys_b]
    records_a, records_b = _records(a), _records(b)
    rows: list[dict[str, Any]] = []
    by_checksum = 0
    to_read: list[str] = []
    for key in common:
        ma, mb = a.tensors[key], b.tensors[key]
        if list(ma.size) != list(mb.size) or ma.properties.dtype != mb.properties.dtype:
            rows.append({"tensor": key, "rel": math.inf, "max_abs": math.inf,  # no difference to measure: say why
                         "why": f"shape {list(ma.size)} {ma.properties.dtype} in A, {list(mb.size)} "
                                f"{mb.properties.dtype} in B"})
        elif _same_records(records_a.get(key), records_b.get(key)):
            by_checksum += 1
            rows.append({"tensor": key, "rel": 0.0, "max_abs": 0.0, "why": "same bytes (checksums)"})
        else:
            to_read.append(key)
    for batch in _batches(to_read, a):
        read_a, read_b = a.read(batch), b.read(batch)
        for k in batch:
            rel, max_abs = _difference(read_a[k], read_b[k])
            rows.append({"tensor": k, "rel": rel, "max_abs": max_abs, "why": None})
    order = {k: i for i, k in enumerate(keys_a)}
    rows.sort(key=lambda r: order[r["tensor"]])
    differing = [r for r in rows if r["rel"] > rtol]
    return {"tensors": len(common), "equal_by_checksum": by_checksum, "read": len(to_read),
            "bit_equal": sum(r["rel"] == 0.0 for r in rows), "differing": len(differing),
            "first": differing[0] if differing else None,
            "largest": max(differing, key=lambda r: r["rel"]) if differing else None,
            "only_in_a": [k for k in keys_a if k not in keys_b],
            "only_in_b": [k for k in b.tensors if k not in a.tensors],
            "rows": rows}


def side(source: Source) -> dict[str, Any]:
    state = read_state(source.ck.path)
    manifest = source.ck.manifest
    return {"path": str(source.ck.path), "step": source.ck.step, "samples_seen": state["samples_seen"],
            "world_size": manifest.get("world_size"), "model_hash": manifest.get("model_fingerprint"),
            "trainflow": manifest.get("trainflow_version"), "torch": manifest.get("torch_version")}


def verdict(result: dict[str, Any]) -> str:
    if result["only_in_a"] or result["only_in_b"]:
        return "different tensors"
    if result["differing"]:
        return "differ"
    return "equal" if result["bit_equal"] == result["tensors"] else "equal within the tolerance"


def compare(a: Path, b: Path, rtol: float | None) -> dict[str, Any]:
    """The page's content for two checkpoints."""
    sources = []
    for path, name in ((a, "compare A"), (b, "compare B")):
        try:
            sources.append(Source(path))
        except CheckpointError as exc:
            raise CheckpointError(f"{name}: {exc}") from None
    sa, sb = sources
    tolerance = rtol if rtol is not None else default_rtol(sa)
    result = compare_sources(sa, sb, tolerance)
    return {"kind": "checkpoints", "written": time.strftime("%Y-%m-%d %H:%M:%S"), "rtol": tolerance,
            "a": side(sa), "b": side(sb), **result, "verdict": verdict(result), "warnings": []}


def evaluate_gate(gate: Gate, report: dict[str, Any]) -> dict[str, Any]:
    """`tensors=RTOL`: FAIL when a tensor differs by more than RTOL or the tensors themselves differ."""
    if gate.name != "tensors":
        return {"gate": gate.text, "status": NOT_EVALUATED, "pair": "checkpoints",
                "detail": f"{gate.name} is a figure of runs; checkpoints take tensors=RTOL"}
    worst = max((r["rel"] for r in report["rows"]), default=0.0)
    apart = report["only_in_a"] or report["only_in_b"] or worst > gate.value
    detail = (f"tensors only in one checkpoint: {(report['only_in_a'] + report['only_in_b'])[0]}"
              if report["only_in_a"] or report["only_in_b"] else
              f"largest relative difference {worst:.3g} ({'past' if apart else 'within'} {gate.value:g})")
    return {"gate": gate.text, "status": FAIL if apart else PASS, "pair": "checkpoints", "detail": detail}
