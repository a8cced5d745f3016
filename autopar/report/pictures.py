"""PNG pictures of a plan: the device mesh coloured by stage, and the pipeline swimlane.

matplotlib is imported inside the functions, so importing autopar never pays for it, and every
figure is drawn on its own Agg canvas, leaving pyplot's global state alone (the CLI and the
HTML report may draw from any thread or process without a display).
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autopar.cluster import format_mesh_shape
from autopar.errors import InvalidOptionError
from autopar.ir.schedule_timeline import Timeline
from autopar.plan import Plan

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.figure import Figure

# Colour of devices no stage uses (gaps in the id range between stages).
UNUSED_COLOUR = "#E0E0E0"
# Past this many cells the device labels no longer fit inside the cells.
_MAX_LABELLED_CELLS = 256


@dataclass(frozen=True)
class MeshLayout:
    """Where each used device sits in the mesh picture.

    The plan does not store the cluster's full shape, so the picture is a grid of the hosts the
    stages use (rows) by devices per host (columns): device ``d`` sits at row ``d // per_host``,
    column ``d % per_host``.
    """

    per_host: int
    rows: int
    stage_of_device: dict[int, int]

    def cell(self, device: int) -> tuple[int, int]:
        """(row, column) of ``device``."""
        return divmod(device, self.per_host)


def mesh_layout(plan: Plan) -> MeshLayout:
    """The grid of :func:`mesh_figure`: devices per host from the widest stage submesh."""
    per_host = max((s.submesh_shape[1] for s in plan.stages), default=1) or 1
    stage_of_device = {d: s.index for s in plan.stages for d in s.device_ids}
    last = max(stage_of_device, default=0)
    return MeshLayout(per_host=per_host, rows=last // per_host + 1, stage_of_device=stage_of_device)


def stage_colours(num_stages: int) -> list[tuple[float, float, float]]:
    """One distinct RGB colour per stage (tab10, tab20, then evenly spaced hues)."""
    from matplotlib import colormaps
    from matplotlib.colors import hsv_to_rgb

    if num_stages <= 10:
        return [_rgb(colormaps["tab10"](i)) for i in range(num_stages)]
    if num_stages <= 20:
        return [_rgb(colormaps["tab20"](i)) for i in range(num_stages)]
    return [_rgb(hsv_to_rgb((i / num_stages, 0.65, 0.85))) for i in range(num_stages)]


def _rgb(colour: Sequence[float] | np.ndarray) -> tuple[float, float, float]:
    """A colour's red, green and blue (an RGBA colour's alpha left out)."""
    red, green, blue = colour[:3]
    return red, green, blue


def mesh_figure(plan: Plan) -> Figure:
    """The devices the plan uses as hosts x devices per host, each cell coloured by stage.

    Each cell is labelled with its device id, stage and coordinate in the stage's logical mesh
    (``device_ids`` are row-major over it); the legend gives each stage's logical
    mesh. A non-pipelined plan is one stage covering every device.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    layout = mesh_layout(plan)
    colours = stage_colours(len(plan.stages))
    cols, rows = layout.per_host, layout.rows
    # About 0.8 inch per cell, shrunk so a 1000-device cluster still makes a sane picture; the
    # legend gets a strip of its own below the grid so it never covers the axis labels.
    cell = min(0.8, 14.0 / cols, 10.0 / rows)
    legend_h = 0.25 * len(plan.stages) + 0.2
    width = max(6.5, cols * cell + 1.8)
    height = rows * cell + 1.2 + legend_h
    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)

    labelled = cols * rows <= _MAX_LABELLED_CELLS
    coordinate = {
        d: ",".join(str(int(i)) for i in _unravel(pos, s.logical_mesh_shape))
        for s in plan.stages
        for pos, d in enumerate(s.device_ids)
    }
    for device in range(rows * cols):
        row, col = layout.cell(device)
        stage = layout.stage_of_device.get(device)
        colour = UNUSED_COLOUR if stage is None else colours[stage]
        axes.add_patch(
            Rectangle((col, row), 1, 1, facecolor=colour, edgecolor="black", linewidth=1.0)
        )
        if labelled:
            text = f"d{device}\n" + (
                "unused" if stage is None else f"S{stage} ({coordinate[device]})"
            )
            axes.text(
                col + 0.5,
                row + 0.5,
                text,
                ha="center",
                va="center",
                fontsize=8,
                color=_label_colour(colour),
            )

    axes.set_xlim(0, cols)
    axes.set_ylim(rows, 0)  # device 0 top left, ids read left to right, top to bottom
    axes.set_aspect("equal")
    # Rows are labelled by their device range, not "host r": the plan does not record the
    # cluster's shape, so a row is a host only when the widest stage spans a whole host.
    axes.set_xticks([c + 0.5 for c in range(cols)] if cols <= 32 else [])
    axes.set_xticklabels([str(c) for c in range(cols)] if cols <= 32 else [])
    axes.set_yticks([r + 0.5 for r in range(rows)] if rows <= 32 else [])
    axes.set_yticklabels(
        [f"d{r * cols}-{r * cols + cols - 1}" for r in range(rows)] if rows <= 32 else []
    )
    axes.set_xlabel("device within host (d % devices per host)", fontsize=9)
    axes.tick_params(length=0, labelsize=8)
    handles = [
        Patch(
            facecolor=colours[s.index],
            edgecolor="black",
            label=f"stage {s.index}: logical mesh {format_mesh_shape(s.logical_mesh_shape)} "
            f"({', '.join(s.axis_names)}) on submesh "
            f"{format_mesh_shape(s.submesh_shape)}, {len(s.device_ids)} devices",
        )
        for s in plan.stages
    ]
    figure.legend(handles=handles, loc="lower center", ncol=1, fontsize=8, frameon=False)
    axes.set_title(
        f"{plan.method} plan: {len(layout.stage_of_device)} devices, "
        f"{cols} per host (widest stage submesh)",
        fontsize=10,
    )
    figure.tight_layout(rect=(0.0, legend_h / height, 1.0, 1.0))
    return figure


def mesh_png_bytes(plan: Plan) -> bytes:
    """:func:`mesh_figure` as PNG bytes."""
    return figure_png_bytes(mesh_figure(plan))


def save_mesh_png(plan: Plan, path: str | os.PathLike) -> None:
    """Write :func:`mesh_figure` as a PNG file (atomically; ``InvalidOptionError`` if it fails)."""
    write_bytes_atomic(path, mesh_png_bytes(plan), "mesh picture")


def swimlane_png_bytes(timeline: Timeline, title: str | None = None) -> bytes:
    """``autopar.report.swimlane``'s picture of ``timeline`` as PNG bytes."""
    from autopar.report.swimlane import swimlane_figure

    return figure_png_bytes(swimlane_figure(timeline, title))


def figure_png_bytes(figure: Figure) -> bytes:
    """Render an Agg figure to PNG bytes.

    The "Software" text chunk is left out: it names matplotlib's web site, and the HTML report
    promises no URL anywhere (and equal plans then give equal bytes).
    """
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()


def write_bytes_atomic(path: str | os.PathLike, data: bytes, what: str) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory.

    A reader never sees half a file. Any ``OSError`` becomes an ``InvalidOptionError`` with one
    line naming ``what`` and the path, which the CLI prints as is.
    """
    target = Path(path)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        # mkstemp creates the file 0600; a report is meant to be shared like any written file.
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise InvalidOptionError(f"cannot write {what} '{target}': {reason}") from exc
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass  # the write already failed; that error is the one to report


def _unravel(position: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major coordinate of ``position`` in a mesh of ``shape``."""
    out = []
    for size in reversed(shape):
        position, index = divmod(position, size)
        out.append(index)
    return tuple(reversed(out))


def _label_colour(colour: str | tuple[float, float, float]) -> str:
    """Black text on light cells, white on dark ones (relative luminance)."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(colour)
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.5 else "white"
