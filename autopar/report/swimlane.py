"""Swimlane pictures (PNG) of simulated pipeline schedules.

matplotlib is imported inside the functions, so importing autopar never pays for it, and the
figure is drawn on its own Agg canvas, leaving pyplot's global state alone. ``swimlane_figure``
builds the picture; ``save_swimlane_png`` writes it to a file and ``autopar.report.pictures``
renders
it to bytes for the HTML report.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from autopar.ir.schedule_timeline import Timeline
from autopar.ir.schedules import TaskKind

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Colour per task kind; chunks of interleaved schedules are told apart by shade.
_KIND_COLOURS = {TaskKind.F: "#4C72B0", TaskKind.B: "#DD8452", TaskKind.W: "#55A868"}
_KIND_NAMES = {
    TaskKind.F: "F (forward)",
    TaskKind.B: "B (backward)",
    TaskKind.W: "W (weight gradient)",
}
# Above this many tasks per lane the labels no longer fit inside the bars.
_MAX_LABELLED_TASKS_PER_LANE = 48


def save_swimlane_png(timeline: Timeline, path: str | Path, title: str | None = None) -> None:
    """Draw ``timeline`` (see :func:`swimlane_figure`) and write it as a PNG file."""
    swimlane_figure(timeline, title).savefig(Path(path), format="png")


def swimlane_figure(timeline: Timeline, title: str | None = None) -> Figure:
    """Draw ``timeline`` as one lane per stage (stage 0 on top) on a fresh Agg figure.

    F, B and W tasks get distinct colours, idle time stays white, and the title carries the
    simulated idle fraction (``title`` is prepended when given).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import to_rgb
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    schedule = timeline.schedule
    p, v = schedule.num_stages, schedule.num_chunks
    makespan = timeline.makespan or 1.0
    # Width by the makespan in forward slots (the median forward task), not in cost units:
    # plan timelines are in seconds, where a width in units would squash the picture. Under
    # the unit costs (a forward is 1/v) this is the makespan x v of the papers' figures.
    forwards = sorted(e - s for t, (s, e) in timeline.spans.items() if t.kind is TaskKind.F)
    slot = forwards[len(forwards) // 2] if forwards else 0.0
    slots = makespan / slot if slot > 0 else makespan * v
    # The legend gets a strip of its own below the axes, so it never covers the x label.
    legend_h = 0.35
    height = 1.0 + 0.6 * p + legend_h
    figure = Figure(figsize=(min(24.0, 4.0 + 0.35 * slots), height), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)

    per_lane = max(len(stage_tasks) for stage_tasks in schedule.tasks)
    show_labels = per_lane <= _MAX_LABELLED_TASKS_PER_LANE
    for task, (start, end) in timeline.spans.items():
        base = to_rgb(_KIND_COLOURS[task.kind])
        # Later chunks drawn lighter: mix towards white by chunk / v.
        mix = 0.55 * task.chunk / v
        colour = tuple(c + (1.0 - c) * mix for c in base)
        lane = p - 1 - task.stage
        axes.broken_barh(
            [(start, end - start)],
            (lane - 0.4, 0.8),
            facecolors=colour,
            edgecolors="black",
            linewidth=0.5,
        )
        if show_labels and end > start:
            axes.text(
                (start + end) / 2,
                lane,
                task.label,
                ha="center",
                va="center",
                fontsize=7,
                color="white" if mix < 0.3 else "black",
            )

    axes.set_xlim(0, makespan)
    axes.set_ylim(-0.6, p - 0.4)
    axes.set_yticks(range(p))
    axes.set_yticklabels([f"stage {p - 1 - lane}" for lane in range(p)])
    shade_note = "; lighter shade = later chunk" if v > 1 else ""
    axes.set_xlabel(f"time (task cost units){shade_note}")
    kinds = [k for k in TaskKind if any(t.kind is k for t in timeline.spans)]
    figure.legend(
        handles=[
            Patch(facecolor=_KIND_COLOURS[k], edgecolor="black", label=_KIND_NAMES[k])
            for k in kinds
        ]
        + [Patch(facecolor="white", edgecolor="black", label="idle (bubble)")],
        loc="lower center",
        ncol=len(kinds) + 1,
        fontsize=8,
        frameon=False,
    )
    summary = (
        f"{schedule.name}: p={p}, m={schedule.num_microbatches}"
        + (f", v={v}" if v > 1 else "")
        + f" | idle fraction {timeline.idle_fraction:.1%}"
    )
    axes.set_title(f"{title} | {summary}" if title else summary, fontsize=10)
    figure.tight_layout(rect=(0.0, legend_h / height, 1.0, 1.0))
    return figure
