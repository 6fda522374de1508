"""The sweep report's pages: report.md (the table, the gates, the profiler's advice) and report.png (throughput bars
and loss curves), drawn from the report that trainflow.report.runs builds."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainflow.report import ladder
from trainflow.util.files import atomic_path
from trainflow.util.optional import require
from trainflow.util.shown import shown

if TYPE_CHECKING:  # matplotlib loads when a picture is drawn, not when a run imports the report
    from matplotlib.figure import Figure


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def _mib(n: float | None) -> str:
    return _num(n / 2**20 if n is not None else None, ".1f")


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _monitored(row: dict[str, Any]) -> str:
    """The task's monitored validation metric and its direction, e.g. `accuracy 0.9312 (max)`."""
    val, monitor = row.get("validation"), row.get("monitor") or "loss"
    if not val or monitor not in val:
        return "-"
    return f"{monitor} {val[monitor]:.4f}" + (f" ({row['mode']})" if row.get("mode") else "")


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown page: the table, the gates, the profiler's advice, the picture."""
    lines = [f"# Report: {report['folder']}", "",
             f"Written {report['written']}. Speedups are steady-state samples/s against the baseline run "
             f"`{report['baseline']}`; loss columns are the first step's and the last logged interval's.", ""]
    counts = {s: sum(r["status"] == s for r in report["runs"]) for s in ("finished", "failed", "running",
                                                                         "interrupted")}
    lines += [f"{len(report['runs'])} run(s): " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + ".", ""]
    if report["common_overrides"]:
        lines += [f"Overrides common to all runs: `{' '.join(report['common_overrides'])}`", ""]
    if report["warnings"]:
        lines += ["## Warnings", "", *(f"- {_cell(w)}" for w in report["warnings"]), ""]
    apart = [row for row in report["runs"] if row["not_compared"]]
    if apart:
        lines += ["## Not compared with the baseline", "", "Speedups compare runs doing the same work (the same "
                  "model, data, global batch and overrides) at other speed settings only (compile, parallelism, "
                  "precision, batch layout, profiler, checkpoint, logger):", "",
                  *(f"- `{_cell(row['name'])}`: {_cell(row['not_compared'])}" for row in apart), ""]
    if report["gates"] is not None:
        lines += ["## Gates", "", "| gate | status | numbers |", "| --- | --- | --- |"]
        lines += [f"| {g['name']} | **{g['status']}** | {_cell(g['detail'])} |" for g in report["gates"]]
        skipped = sum(g["status"] == ladder.NOT_EVALUATED for g in report["gates"])
        verdict = ("a gate FAILED: the sweep exits non-zero" if not report["passed"]
                   else f"no gate failed; {skipped} not evaluated" if skipped else "all gates passed")
        lines += ["", f"Result: {verdict}.", ""]
    lines += ["## Runs", "",
              "| run | overrides | status | samples/s | speedup | MFU | peak memory | loss first -> last | "
              "val (monitored) | compile: graphs / breaks / recompiles / time | profiler | "
              "checkpoint: saves / blocked / write |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- | --- | --- | --- |"]
    for row in report["runs"]:
        c, p, k = row["compile"], row["profiler"], row["checkpoint"]
        status = "finished" if row["status"] == "finished" else f"{row['status'].upper()}: {_cell(row['error'] or '')}"
        world = f" x{row['world_size']}" if row["world_size"] and row["world_size"] > 1 else ""
        lines.append(" | ".join([
            f"| {_cell(row['name'])}" + (f" ({_cell(row['rung'])})" if row["rung"] else ""),
            f"`{_cell(' '.join(row['overrides']))}`" if row["overrides"] else "",
            status + world,
            _num(row["samples_per_sec"], ".1f"),
            _num(row["speedup"], ".2f", "x") if not row["not_compared"] else "not compared",
            _num(row["mfu"] * 100 if row["mfu"] is not None else None, ".2f", "%"),
            _gib(row["peak_memory_bytes"]),
            f"{_num(row['loss_first'], '.4f')} -> {_num(row['loss_last'], '.4f')}",
            _monitored(row),
            f"{c['graphs']} / {c['graph_breaks']} / {c['recompiles']} / {_num(c['compile_time_s'], '.1f', ' s')}"
            if c else "off",
            _cell(p["bound"]) if p else "off",
            f"{k['saves']} / {_num(k['blocked_s'], '.3f', ' s')} / {_num(k['write_s'], '.3f', ' s')}" if k else "off",
        ]) + " |")
    lines += cost_lines(report["runs"])
    advice = [(row["name"], row["profiler"]) for row in report["runs"] if row["profiler"]]
    if advice:
        lines += ["", "## What the profiler recommends", ""]
        lines += [f"- `{_cell(name)}`: **{_cell(p['bound'])}**: {_cell(p['action'])}" for name, p in advice]
    plans = [(row["name"], row["plan"]) for row in report["runs"] if row.get("plan")]
    if plans:
        lines += ["", "## parallelism=auto: per-rank memory (MiB) of each layout, the chosen one in bold", ""]
        lines += [f"- `{_cell(name)}`: " + ", ".join(
            (f"**{layout} {_mib(t.get('total'))}**" if layout == plan.get("choice") else
             f"{layout} {_mib(t.get('total'))}") for layout, t in (plan.get("table") or {}).items())
            + f"; budget {_mib(plan.get('budget_bytes'))} ({plan.get('budget_source')}); measured peak / estimate "
            + _num((plan.get("check") or {}).get("peak_over_estimate"), ".2f")
            + (f"; {plan['reason']}" if plan.get("reason") else "") for name, plan in plans]
    if report.get("picture"):
        lines += ["", "![throughput and loss curves](report.png)", ""]
    return "\n".join(shown(line) for line in lines)  # a name holding a newline stays on its line


def cost_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Energy (joules per sample and token, the boards' power) and money (the run, a million tokens) per run; where
    every run lacks one for the same reason, that reason once."""
    costs = [(row["name"], row["cost"]) for row in rows if row.get("cost")]
    if not costs:
        return []
    lines = ["", "## Energy and cost", ""]
    for part, absent_word in (("energy", "Energy"), ("money", "Cost")):
        reasons = {(c.get(part) or {}).get("absent") for _, c in costs}
        if len(reasons) == 1 and None not in reasons:
            lines.append(f"- {absent_word}: absent on every run: {_cell(reasons.pop())}.")
    measured = [(name, c) for name, c in costs
                if any("absent" not in (c.get(part) or {}) for part in ("energy", "money"))]
    if measured:
        lines += ["", "| run | power | J/sample | J/token | cost of the run | per M tokens | per M samples |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, c in measured:
            e, m = c.get("energy") or {}, c.get("money") or {}
            values = (e.get("joules_per_sample"), e.get("joules_per_token"), m.get("run"), m.get("per_million_tokens"),
                      m.get("per_million_samples"))
            cells = [_num(e.get("watts"), ".1f", " W"), *(_num(v, ".4g") for v in values)]
            lines.append(f"| {_cell(name)} | " + " | ".join(cells) + " |")
    return lines


def _cell(text: object) -> str:
    """Text from a file in a Markdown table cell: control characters escaped (shown), and `|`, which would end the
    cell."""
    return shown(text).replace("|", "\\|")


def plot_label(text: object) -> str:
    """Text from a file as a matplotlib label: control characters escaped, and `$`, which would start mathtext."""
    return shown(text).replace("$", "\\$")


@contextlib.contextmanager
def quiet_glyphs() -> Iterator[None]:
    """Drawing a name in a script the font lacks draws a box, not a warning on the console."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph .* missing from font", category=UserWarning)
        yield


def write_png(curves_of: list[tuple[str, dict[int, float]]], report: dict[str, Any], path: Path) -> None:
    """report.png: the figure below, written atomically."""
    with atomic_path(path) as tmp, quiet_glyphs():
        figure(curves_of, report).savefig(tmp, dpi=100)


def figure(curves_of: list[tuple[str, dict[int, float]]], report: dict[str, Any]) -> Figure:
    """Throughput bars (speedup on top) and every run's loss curve, drawn headless with Agg; `curves_of`: each run's
    label and losses by step, in the order of report["runs"]. A busy machine's runs are named in red."""
    require("matplotlib", "plots", "report.png")  # one line where it is missing: the Markdown and JSON need none
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: matplotlib is the plots extra
    from matplotlib.figure import Figure  # lazy: matplotlib is the plots extra

    fig = Figure(figsize=(13, 5), layout="constrained")
    FigureCanvasAgg(fig)
    bars, curves = fig.subplots(1, 2, width_ratios=[1, 1.3])
    labels = [plot_label(name) for name, _ in curves_of]
    rows = report["runs"]
    values = [row["samples_per_sec"] or 0.0 for row in rows]
    colors = [{"finished": "tab:blue", "failed": "tab:red"}.get(row["status"], "tab:gray") for row in rows]
    drawn = bars.bar(range(len(labels)), values, color=colors)
    for bar, row in zip(drawn, rows, strict=True):
        text = (row["status"] if row["status"] != "finished" else "not compared" if row["not_compared"]
                else _num(row["speedup"], ".2f", "x"))
        if row["name"] in report["busy_runs"]:
            text += "\nbusy machine!"
        bars.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                      fontsize=8, xytext=(0, 2), textcoords="offset points")
    bars.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    bars.set_ylabel("samples/s (steady state)")
    compared = any(row["speedup"] is not None and row["name"] != report["baseline"] for row in rows)
    bars.set_title(plot_label(f"throughput; speedup vs {report['baseline']}" if compared
                              else "throughput (no run does the baseline's work at other settings: no speedup)"))
    styles = ("-", "--", "-.", ":")  # curves that coincide (a resumed run) stay visible
    for i, (name, losses) in enumerate(curves_of):
        if losses:
            steps = sorted(losses)
            curves.plot(steps, [losses[s] for s in steps], styles[i % len(styles)], label=plot_label(name),
                        linewidth=1.4, marker="." if len(steps) == 1 else None)
    curves.set_xlabel("step")
    curves.set_ylabel("train loss")
    curves.set_title("loss curves")
    if any(losses for _, losses in curves_of):
        curves.legend(fontsize=8)
    folder = Path(report["folder"])  # relative where it can be: the picture is often shown away from this machine
    title = plot_label(folder.relative_to(Path.cwd()) if folder.is_relative_to(Path.cwd()) else folder)
    if report["gates"] is not None:
        counts = {s: sum(g["status"] == s for g in report["gates"]) for s in (ladder.PASS, ladder.WARN, ladder.FAIL)}
        title += "   gates: " + ", ".join(f"{n} {s}" for s, n in counts.items())
    if report["busy_runs"]:
        title += (f"\nWARNING: {len(report['busy_runs'])} run(s) measured on a busy machine "
                  f"({plot_label(', '.join(report['busy_runs']))}): do not trust their speed")
    fig.suptitle(title, fontsize=10, color="tab:red" if report["busy_runs"] else "black")
    return fig
