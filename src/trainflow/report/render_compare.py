"""compare's pages: compare.md, compare.json and compare.png (the aligned curves and the figures side by side, or the
tensors' differences), and the lines it prints; drawn from what trainflow.report.compare, .checkpoints and .bisect
build."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainflow.errors import ConfigError
from trainflow.report.render import plot_label, quiet_glyphs
from trainflow.report.sides import CompareError
from trainflow.util.files import atomic_path, write_atomic
from trainflow.util.optional import require
from trainflow.util.shown import shown

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FILES = ("compare.md", "compare.json", "compare.png")
DEFAULT_OUT = Path("outputs") / "compare"  # under the working folder, beside the runs trainflow train writes there
MAX_BARS = 40  # differing tensors drawn


def value(v: float | None, unit: str) -> str:
    """A figure's value in its unit: times in ms or s, bytes in MiB or GiB, shares in %."""
    if v is None:
        return "-"
    if unit == "s":
        return f"{v * 1e3:.2f} ms" if abs(v) < 1 else f"{v:.2f} s"
    if unit == "B":
        return f"{v / 2**30:.2f} GiB" if abs(v) >= 2**30 else f"{v / 2**20:.1f} MiB"
    if unit == "of the step":
        return f"{v * 100:.2f}%"
    return f"{v:.4g}" + (f" {unit}" if unit else "")


def change(row: dict[str, Any]) -> str:
    return f"{row['change'] * 100:+.1f}%" if math.isfinite(row["change"]) else f"{row['diff']:+.3g}"


def confidence(row: dict[str, Any]) -> str:
    return "-" if row["confidence"] is None else f"{row['confidence']:.2f}"


def _pair_title(pair: dict[str, Any]) -> str:
    return f"{', '.join(pair['a'])} -> {', '.join(pair['b'])}"


# --- the console -------------------------------------------------------------------------------------------------


def console_lines(report: dict[str, Any]) -> list[str]:
    lines = {"runs": _run_lines, "checkpoints": _checkpoint_lines, "bisect": _bisect_lines}[report["kind"]](report)
    lines += [f"WARNING {w}" for w in report.get("warnings", [])]
    lines += [f"GATE {g['status']} {g['gate']} ({g['pair']}): {g['detail']}" for g in report.get("gates", [])]
    return [shown(line) for line in lines]  # a run name holding a newline or an escape stays on its line, inert


def _run_lines(report: dict[str, Any]) -> list[str]:
    a, b = report["a"], report["b"]
    lines = [f"A: {a['text']} ({a['kind']}, {len(a['runs'])} run(s)); B: {b['text']} ({b['kind']}, "
             f"{len(b['runs'])} run(s))"]
    for pair in report["pairs"]:
        lines.append(f"{_pair_title(pair)}:")
        for row in pair["figures"]:
            band = f"band ±{row['band'] * 100:.1f}%" + (f" {row['band_from']}" if row["band_from"] else "")
            conf = f", confidence {confidence(row)}" if row["confidence"] is not None else ""
            cause = f"; likely cause: {row['likely_cause']}" if row["likely_cause"] else ""
            values = f"{value(row['a'], row['unit']):>12} -> {value(row['b'], row['unit']):>12}"
            lines.append(f"  {row['label']:<24} {values}  {change(row):>8}  {row['verdict']} ({band}{conf}){cause}")
        for curve in pair["curves"]:
            lines.append(f"  curve {curve['curve']}: {curve['verdict']} over {curve['steps']} common steps (max |diff| "
                         f"{curve['max_abs_diff']:.3g} at step {curve['at_step']}, final {curve['final_diff']:+.3g})")
        if pair["profiler"]:
            p = pair["profiler"]
            lines.append(f"  profiler: {p['bound'][0]} -> {p['bound'][1]}; " + ", ".join(
                f"{k} {v['points'] * 100:+.1f} pts" for k, v in p["shares"].items() if abs(v["points"]) >= 0.01))
        lines += [f"  note: {n['text']}" for n in pair["notes"]]
    return lines


def _checkpoint_lines(report: dict[str, Any]) -> list[str]:
    lines = [f"{name}: {s['path']} (step {s['step']}, {s['samples_seen']} samples seen, world size {s['world_size']})"
             for name, s in (("A", report["a"]), ("B", report["b"]))]
    lines.append(f"{report['verdict']}: {report['tensors']} tensors compared ({report['equal_by_checksum']} equal by "
                 f"checksum, {report['read']} read), {report['differing']} differ beyond {report['rtol']:.3g}")
    for label in ("first", "largest"):
        if report[label]:
            lines.append(f"  {label} differing tensor: {report[label]['tensor']} ({_difference(report[label])})")
    lines += [f"  only in {x.upper()[-1]}: {', '.join(report[x][:6])}" for x in ("only_in_a", "only_in_b") if report[x]]
    return lines


def _difference(row: dict[str, Any]) -> str:
    """A differing tensor's relative error and largest difference, or why it has none (shapes that differ)."""
    if row.get("why") and math.isinf(row["rel"]):
        return row["why"]
    return f"relative {row['rel']:.3g}, max |diff| {row['max_abs']:.3g}"


def _bisect_lines(report: dict[str, Any]) -> list[str]:
    return [report["conclusion"], *(f"  {line}" for line in report["details"])]


# --- compare.md --------------------------------------------------------------------------------------------------


def _cell(text: Any) -> str:
    """Text from a file in a Markdown table cell or list item: control characters escaped, `|` too."""
    return shown(text).replace("|", "\\|")


def markdown(report: dict[str, Any]) -> str:
    body = {"runs": _run_markdown, "checkpoints": _checkpoint_markdown, "bisect": _bisect_markdown}[report["kind"]]
    lines = body(report)
    if report.get("warnings"):
        lines += ["## Warnings", "", *(f"- {_cell(w)}" for w in report["warnings"]), ""]
    if report.get("gates"):
        lines += ["## Gates", "", "| gate | pair | status | numbers |", "| --- | --- | --- | --- |"]
        lines += [f"| `{_cell(g['gate'])}` | {_cell(g['pair'])} | **{g['status']}** | {_cell(g['detail'])} |"
                  for g in report["gates"]]
        lines += ["", f"Result: {'a gate FAILED: exit code 1' if not report['passed'] else 'no gate failed'}.", ""]
    if report.get("picture"):
        lines += ["![compare](compare.png)", ""]
    return "\n".join(shown(line) for line in lines)  # a name holding a newline stays on its line


def _run_markdown(report: dict[str, Any]) -> list[str]:
    a, b = report["a"], report["b"]
    lines = [f"# Compare: {a['text']} -> {b['text']}", "",
             f"Written {report['written']}. A is the reference. Each figure: A's and B's own (a run's, as its summary "
             "gives it; a ledger selection's median), its samples (a run's steady log intervals, or a selection's "
             "runs), B's change, the band it must leave to count "
             "(both runs' own spread; for speed, at least the run-to-run noise: the ledger's runs of the config, "
             "else 15%) and the confidence (the share of interval pairs in which one run beats the other).", ""]
    for pair in report["pairs"]:
        lines += [f"## {_cell(_pair_title(pair))}", ""]
        if pair["notes"]:
            lines += ["What differs between their fingerprints:", "", *(f"- {_cell(n['text'])}" for n in pair["notes"]),
                      ""]
        lines += ["| figure | A | B | change | band | confidence | verdict | likely cause |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
        for row in pair["figures"]:
            band = f"±{row['band'] * 100:.1f}%" + (f" ({row['band_from']})" if row["band_from"] else "")
            lines.append(f"| {_cell(row['label'])} | {value(row['a'], row['unit'])} | {value(row['b'], row['unit'])} | "
                         f"{change(row)} | {band} | {confidence(row)} | **{row['verdict']}** | "
                         f"{_cell(row['likely_cause'] or '')} |")
        if pair["curves"]:
            lines += ["", f"Curves aligned by step (apart: beyond {pair['loss_rtol']:g} of A's value):", "",
                      "| curve | common steps | max abs diff | at step | final diff | verdict |",
                      "| --- | ---: | ---: | ---: | ---: | --- |"]
            lines += [f"| {_cell(c['curve'])} | {c['steps']} | {c['max_abs_diff']:.4g} | {c['at_step']} | "
                      f"{c['final_diff']:+.4g} | {c['verdict']} |" for c in pair["curves"]]
        if pair["profiler"]:
            p = pair["profiler"]
            lines += ["", f"Profiler verdict: {p['bound'][0]} -> {p['bound'][1]}.", "",
                      "| share of the step | A | B | change (points) |", "| --- | ---: | ---: | ---: |"]
            lines += [f"| {_cell(k)} | {_pct(v['a'])} | {_pct(v['b'])} | {v['points'] * 100:+.1f} |"
                      for k, v in p["shares"].items()]
            lines += ["", "| operator (self time per step) | A (ms) | B (ms) | change (ms) |",
                      "| --- | ---: | ---: | ---: |"]
            lines += [f"| `{_cell(o['name'])}` | {_num(o['a_ms'])} | {_num(o['b_ms'])} | {o['change_ms']:+.3f} |"
                      for o in p["ops"]]
        lines.append("")
    return lines


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _checkpoint_markdown(report: dict[str, Any]) -> list[str]:
    a, b = report["a"], report["b"]
    lines = [f"# Compare checkpoints: {a['path']} -> {b['path']}", "", f"Written {report['written']}.", "",
             "| | step | samples seen | world size | model hash | trainflow | torch |",
             "| --- | ---: | ---: | ---: | --- | --- | --- |"]
    lines += [f"| {n} | {s['step']} | {s['samples_seen']} | {s['world_size']} | `{_cell(s['model_hash'])}` | "
              f"{_cell(s['trainflow'])} | {_cell(s['torch'])} |" for n, s in (("A", a), ("B", b))]
    lines += ["", f"**{report['verdict']}**: {report['tensors']} tensors compared, {report['equal_by_checksum']} equal "
                  f"by their files' checksums, {report['read']} read; {report['differing']} differ by more than "
                  f"{report['rtol']:g} (relative error: the norm of the difference over the norm of A's).", ""]
    for label in ("first", "largest"):
        if report[label]:
            lines.append(f"- {label} differing tensor: `{_cell(report[label]['tensor'])}`: "
                         f"{_difference(report[label])}")
    lines += [f"- only in {x[-1].upper()}: " + ", ".join(f"`{_cell(k)}`" for k in report[x])
              for x in ("only_in_a", "only_in_b") if report[x]]
    differing = [r for r in report["rows"] if r["rel"] > 0]
    if differing:
        lines += ["", "| tensor | relative error | max abs diff |", "| --- | ---: | ---: |"]
        lines += [f"| `{_cell(r['tensor'])}` | {r['rel']:.3g} | {r['max_abs']:.3g} |" for r in differing]
    lines.append("")
    return lines


def _bisect_markdown(report: dict[str, Any]) -> list[str]:
    lines = [f"# Bisect: {report['a']['run']} -> {report['b']['run']}", "", f"Written {report['written']}.", "",
             f"**{report['conclusion']}**", "", *(f"- {_cell(d)}" for d in report["details"]), "",
             "| step | tensors differing | first differing tensor | largest relative error |",
             "| ---: | ---: | --- | ---: |"]
    for s in report["steps"]:
        first = f"`{_cell(s['first']['tensor'])}`" if s["first"] else "-"
        lines.append(f"| {s['step']} | {s['differing']} | {first} | {s['largest_rel']:.3g} |")
    lines += ["", "Replayed with:", ""]
    lines += [f"- {name}: `{r['shown']}`" + (f" (with PYTHONPATH={r['pythonpath']} first)" if r["pythonpath"] else "")
              for name, r in report["replays"].items()]
    lines.append("")
    return lines


# --- compare.png -------------------------------------------------------------------------------------------------


def figure(report: dict[str, Any]) -> Figure:
    """Runs: the curves aligned by step (A solid, B dashed) and B's change per figure with its band; checkpoints:
    each differing tensor's relative error; bisect: the largest relative error at each replayed step."""
    require("matplotlib", "plots", "compare.png")
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: matplotlib is the plots extra
    from matplotlib.figure import Figure  # lazy: matplotlib is the plots extra

    fig = Figure(figsize=(13, 5), layout="constrained")
    FigureCanvasAgg(fig)
    if report["kind"] == "runs":
        left, right = fig.subplots(1, 2)
        _draw_curves(left, report)
        _draw_changes(right, report)
        title = f"compare: {report['title']}"
    elif report["kind"] == "checkpoints":
        rows = [r for r in report["rows"] if r["rel"] > 0][:MAX_BARS]
        _draw_errors(fig.subplots(), [r["tensor"] for r in rows], [r["rel"] for r in rows], report["rtol"], "tensor")
        title = _checkpoint_lines(report)[2]
    else:
        steps = report["steps"]
        _draw_errors(fig.subplots(), [str(s["step"]) for s in steps], [s["largest_rel"] for s in steps],
                     report["rtol"], "replayed step (the largest of its tensors)")
        title = report["conclusion"]
    fig.suptitle(textwrap.fill(plot_label(title), 160), fontsize=9)
    return fig


def _draw_curves(ax: Any, report: dict[str, Any]) -> None:
    styles = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
    drawn = False
    for i, (ca, cb) in enumerate(report["_curves"]):
        for curves, style, side in ((ca, "-", "A"), (cb, "--", "B")):
            losses = curves.get("train/loss") or {}
            if losses:
                steps = sorted(losses)
                ax.plot(steps, [losses[s] for s in steps], style, color=styles[i % len(styles)], linewidth=1.3,
                        label=plot_label(f"{side} {', '.join(report['pairs'][i][side.lower()])}"))
                drawn = True
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_title("loss curves aligned by step (A solid, B dashed)")
    if drawn:
        ax.legend(fontsize=7)


def _draw_changes(ax: Any, report: dict[str, Any]) -> None:
    """One pair: each figure's change with its band; several (two sweeps): each pair's step time."""
    if len(report["pairs"]) == 1:
        shown = [(r["label"], r) for r in report["pairs"][0]["figures"]]
    else:
        shown = [(f"{_pair_title(p)} step time", r) for p in report["pairs"] for r in p["figures"]
                 if r["figure"] == "step_time"]
    shown = [(label, r) for label, r in shown if math.isfinite(r["change"])]
    labels, rows = [label for label, _ in shown], [r for _, r in shown]
    colors = {None: "tab:gray", True: "tab:green", False: "tab:red"}
    ax.barh(range(len(rows)), [r["change"] * 100 for r in rows], xerr=[r["band"] * 100 for r in rows],
            color=[colors[r["better"]] for r in rows], capsize=3)
    ax.set_yticks(range(len(rows)), [plot_label(text) for text in labels], fontsize=8)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("B against A (%), with the noise band: green better, red worse, gray the same or no direction")
    ax.set_title("figures side by side")


def _draw_errors(ax: Any, labels: list[str], errors: list[float], rtol: float, what: str) -> None:
    """Relative errors on a log scale against the tolerance, one bar per row; bit-equal ones at the floor, in gray."""
    floor = rtol / 1e4
    shown = [max(e, floor) if math.isfinite(e) else 1.0 for e in errors]
    ax.barh(range(len(shown)), shown, left=floor / 10, color=["tab:red" if e > rtol else "tab:gray" for e in errors])
    ax.axvline(rtol, color="black", linestyle="--", linewidth=0.8, label=f"tolerance {rtol:g}")
    ax.set_xscale("log")
    ax.set_yticks(range(len(labels)), [plot_label(text.removeprefix("app.")) for text in labels], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"relative error (bit-equal: drawn at {floor:g})")
    ax.set_ylabel(what)
    ax.legend(fontsize=8)


def as_json(report: dict[str, Any]) -> str:
    """compare.json: the report less what only the picture uses (keys starting with _)."""
    return json.dumps({k: v for k, v in report.items() if not k.startswith("_")}, indent=2, default=str)


# --- writing -----------------------------------------------------------------------------------------------------


def out_folder(given: Path | None, replace: bool) -> Path:
    """Where a comparison goes, absolute: --out against the working folder, else the next free outputs/compare/N
    here (a comparison never replaces an earlier one unasked); an --out holding one is refused without --force.
    outputs/compare is a folder trainflow makes: a link there (planted in a shared working folder) is refused, and N
    is past every name there, a link's too, so no page is written through one."""
    if given is None:
        root = Path.cwd() / DEFAULT_OUT
        if root.is_symlink():
            raise CompareError(f"{shown(root)}: is a symbolic link; compare writes its pages into folders it makes, "
                               "never through a link it did not make, and nothing was written: remove the link, or "
                               "give --out DIR")
        taken = [int(p.name) for p in root.iterdir() if p.name.isascii() and p.name.isdigit()] if root.is_dir() else []
        return root / str(max(taken, default=0) + 1)
    out = Path.cwd() / given
    held = [name for name in (*FILES, "bisect") if (out / name).exists() or (out / name).is_symlink()]
    if held and not replace:
        raise CompareError(f"--out {shown(out)}: holds an earlier comparison ({held[0]}); nothing was changed: give "
                           "another --out, or add --force to replace it")
    return out


def write(report: dict[str, Any], out: Path) -> list[Path]:
    """compare.png (a warning instead where matplotlib is missing), compare.json and compare.md in `out`."""
    written = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        try:
            with atomic_path(out / "compare.png") as tmp, quiet_glyphs():
                figure(report).savefig(tmp, dpi=100)
            written.append(out / "compare.png")
            report["picture"] = "compare.png"
        except ConfigError as exc:
            report.setdefault("warnings", []).append(str(exc))
        write_atomic(out / "compare.json", as_json(report))
        write_atomic(out / "compare.md", markdown(report))
    except OSError as exc:
        raise CompareError(f"--out {out}: cannot write the comparison ({exc.strerror or exc}); give a writable folder")\
            from None
    return [out / "compare.md", out / "compare.json", *written]
