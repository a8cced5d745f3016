"""The benchmark's PNG plots, each on its own Agg ``Figure`` (pyplot's global state untouched).

Every function takes the suite's rows (the JSON lines) and returns a Figure, or None when the
rows hold nothing to plot; ``write_plots`` saves those that exist.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopar.report.pictures import figure_png_bytes, write_bytes_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Row = dict[str, Any]
_PHASES = (("total_s", "total", "k"), ("trace_s", "trace", "tab:blue"),
           ("ilp_s", "ILP", "tab:orange"), ("dp_s", "stage DP", "tab:green"))


def _scaling_figure(rows: Sequence[Row], axis: str, xlabel: str, log_x: bool) -> Figure | None:
    from matplotlib.figure import Figure

    points = sorted((r for r in rows if r.get("kind") == "scaling" and r["axis"] == axis
                     and not r.get("error")), key=lambda r: r["x"])
    if not points:
        return None
    figure = Figure(figsize=(7, 4.2), dpi=100)
    ax = figure.add_subplot()
    xs = [r["x"] for r in points]
    for key, label, colour in _PHASES:
        ys = [max(r["planning"][key], 1e-4) for r in points]
        ax.plot(xs, ys, marker="o", label=label, color=colour)
    ax.set_yscale("log")
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("planning time (s)")
    twin = ax.twinx()
    twin.plot(xs, [r["ilp_solves"] for r in points], linestyle="--", marker="x",
              color="tab:gray", label="ILP solves")
    twin.set_ylabel("ILP solves (distinct layer x mesh)")
    twin.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    first = points[0]
    ax.set_title(f"{first['model']} {first['size']}: planning time vs {axis}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    figure.tight_layout()
    return figure


def planning_vs_layers(rows: Sequence[Row]) -> Figure | None:
    """Planning time by phase (and ILP solves) against the model's layer count."""
    return _scaling_figure(rows, "layers", "transformer layers", log_x=False)


def planning_vs_devices(rows: Sequence[Row]) -> Figure | None:
    """Planning time by phase (and ILP solves) against the described cluster's devices."""
    return _scaling_figure(rows, "devices", "devices (described)", log_x=True)


_MARKERS = "osD^vPX*<>"


def _measured_points(rows: Sequence[Row]
                     ) -> list[tuple[str, str, float, float, float | None, float | None]]:
    """(case, plan, estimated s, measured s, calibrated estimate s, the calibrated plan's
    measured s) of every timed plan."""
    found = []
    for r in rows:
        if r.get("kind") != "case" or r.get("cost_model") is None:
            continue
        items = [("autopar", r["cost_model"])]
        items += [(b["name"], b["cost_model"]) for b in r.get("baselines", [])
                  if b.get("cost_model")]
        for name, cm in items:
            found.append((r["case"], name, cm["est_default_s"], cm["measured_s"],
                          cm.get("est_calibrated_s"),
                          cm.get("measured_calibrated_s", cm["measured_s"])))
    return found


def estimated_vs_measured(rows: Sequence[Row]) -> Figure | None:
    """Measured against estimated step time of every plan run locally, log-log, with the
    diagonal: colour by plan, marker by case; calibrated estimates hollow."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    points = _measured_points(rows)
    if not points:
        return None
    cases = list(dict.fromkeys(p[0] for p in points))
    plans = list(dict.fromkeys(p[1] for p in points))
    figure = Figure(figsize=(8, 5), dpi=100)
    ax = figure.add_subplot()
    for case, plan, est, measured, calibrated, measured_calibrated in points:
        colour = f"C{plans.index(plan) % 10}"
        marker = _MARKERS[cases.index(case) % len(_MARKERS)]
        ax.scatter([est], [measured], color=colour, marker=marker)
        if calibrated and measured_calibrated:
            ax.scatter([calibrated], [measured_calibrated], marker=marker, facecolors="none",
                       edgecolors=colour)
    every = [v for p in points for v in (p[2], p[3], p[4], p[5]) if v]
    lo, hi = min(every) / 2, max(every) * 2
    ax.plot([lo, hi], [lo, hi], color="gray", linestyle=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("estimated step time (s)")
    ax.set_ylabel("measured step time (s, median)")
    ax.set_title("cost model vs measurement, local devices (dotted: measured = estimated; "
                 "hollow: calibrated)", fontsize=9)
    handles = [Line2D([], [], color=f"C{i % 10}", marker="o", linestyle="", label=plan)
               for i, plan in enumerate(plans)]
    handles += [Line2D([], [], color="gray", marker=_MARKERS[i % len(_MARKERS)], linestyle="",
                       label=case) for i, case in enumerate(cases)]
    ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    ax.grid(True, which="major", alpha=0.3)
    figure.tight_layout()
    return figure


def baseline_ratios(rows: Sequence[Row]) -> Figure | None:
    """Per case, each baseline's step time over autopar's: estimated (solid) and measured
    (hatched); above 1 means autopar's plan is faster."""
    from matplotlib.figure import Figure

    cases = [r for r in rows if r.get("kind") == "case" and r.get("baselines")]
    names = list(dict.fromkeys(b["name"] for r in cases for b in r["baselines"]
                               if b.get("est_ratio") or b.get("measured_ratio")))
    if not names:
        return None
    figure = Figure(figsize=(max(6.0, 1.6 * len(cases) + 2), 4.5), dpi=100)
    ax = figure.add_subplot()
    width = 0.8 / (2 * len(names))
    colours = [f"C{i}" for i in range(len(names))]
    for i, row in enumerate(cases):
        found = {b["name"]: b for b in row["baselines"]}
        for j, name in enumerate(names):
            b = found.get(name) or {}
            for k, key in enumerate(("est_ratio", "measured_ratio")):
                value = b.get(key)
                if value:
                    ax.bar(i - 0.4 + width * (2 * j + k + 0.5), value, width,
                           color=colours[j], hatch="//" if k else None,
                           edgecolor="black" if k else colours[j], linewidth=0.5)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([r["case"] for r in cases], rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("baseline step time / autopar's")
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=n) for c, n in zip(colours, names, strict=True)]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="measured"))
    ax.legend(handles=handles, fontsize=7)
    ax.set_title("baselines vs autopar (solid: estimated, hatched: measured)", fontsize=10)
    figure.tight_layout()
    return figure


PLOTS = (("planning-vs-layers", planning_vs_layers),
         ("planning-vs-devices", planning_vs_devices),
         ("estimated-vs-measured", estimated_vs_measured),
         ("baselines", baseline_ratios))


def write_plots(rows: Sequence[Row], out_dir: str | os.PathLike, prefix: str) -> list[Path]:
    """Save every plot the rows support as ``{prefix}-{name}.png`` in ``out_dir``."""
    written = []
    for name, draw in PLOTS:
        figure = draw(rows)
        if figure is None:
            continue
        path = Path(out_dir) / f"{prefix}-{name}.png"
        write_bytes_atomic(path, figure_png_bytes(figure), "plot")
        written.append(path)
    return written
