"""The compile report as one self-contained HTML file.

Everything the page needs is inside it: inline CSS, pictures as ``data:image/png;base64`` URIs,
no script, font or link from the network, so the file can be mailed, attached to a ticket or
opened offline. Every section has a stable ``id`` (see :func:`section_ids`) for tests and for
readers linking to a part of the report. All text from the plan is escaped.
"""

from __future__ import annotations

import base64
import html
import os
from typing import Any

from autopar.cluster import format_mesh_shape
from autopar.errors import format_bytes
from autopar.report.candidates import candidate_table, stage_ilp_statuses
from autopar.report.pictures import (
    mesh_png_bytes,
    stage_colours,
    swimlane_png_bytes,
    write_bytes_atomic,
)
from autopar.report.text import CompileReport, _mesh_text, plan_timeline
from autopar.report.units import format_count, format_seconds

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222;
       padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.code { font-family: ui-monospace, monospace; }
table.kv th { width: 12em; }
img { max-width: 100%; border: 1px solid #ddd; }
.swatch { display: inline-block; width: 0.9em; height: 0.9em; border: 1px solid #000;
          vertical-align: middle; margin-right: 0.4em; }
.muted { color: #777; }
"""
# Stage table columns; the first five are text, the rest numbers (right-aligned).
_STAGE_COLUMNS = ["#", "layers", "submesh", "logical mesh", "devices"]
_STAGE_NUMBER_COLUMNS = ["est time", "compute", "comm", "memory"]


def section_ids(report: CompileReport) -> list[str]:
    """The ids of the sections :func:`render_html` writes for ``report``, in page order."""
    plan = report.plan
    ids = ["summary"]
    if plan.planning.candidates:
        ids.append("candidates")
    ids += ["stages", "mesh"]
    if plan_timeline(plan) is not None:
        ids.append("pipeline")
    ids += ["collectives", "shardings"]
    if plan.solver:
        ids.append("solver")
    return ids + ["notes"]


def render_html(report: CompileReport) -> str:
    """The whole report as one HTML document (a ``str``; see the module docstring)."""
    renderers = {
        "summary": _summary,
        "candidates": _candidates,
        "stages": _stages,
        "mesh": _mesh,
        "pipeline": _pipeline,
        "collectives": _collectives,
        "shardings": _shardings,
        "solver": _solver,
        "notes": _notes,
    }
    title = _esc(f"autopar compile report: {report.model}")
    sections = [
        f'<section id="{sid}">\n{renderers[sid](report)}\n</section>' for sid in section_ids(report)
    ]
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{title}</title>",
            f"<style>{_CSS}</style>",
            "</head>",
            "<body>",
            f"<h1>{title}</h1>",
            *sections,
            "</body>",
            "</html>",
            "",
        ]
    )


def save_html(report: CompileReport, path: str | os.PathLike) -> None:
    """Write :func:`render_html` to ``path`` atomically (temporary file + ``os.replace``).

    Raises ``InvalidOptionError`` with one line naming the path when it cannot be written.
    """
    write_bytes_atomic(path, render_html(report).encode("utf-8"), "HTML report")


def _summary(report: CompileReport) -> str:
    plan = report.plan
    nodes, params, seconds = report.graph_nodes, report.num_params, report.compile_time_s
    rows = [
        ("model", report.model),
        ("method", plan.method),
        ("cluster", plan.cluster),
        ("mesh", _mesh_text(plan)),
        # A report of a saved plan (CompileReport.from_plan) has no graph, and may not know
        # its parameters or compile time: "-" as in the text report.
        ("graph", "-" if nodes is None else f"{nodes} ops, {report.graph_edges} edges"),
        ("parameters", "-" if params is None else format_count(params)),
        ("flops per step", format_count(report.flops_per_step)),
        ("compile time", "-" if seconds is None else f"{seconds:.2f} s"),
        ("est. step time", format_seconds(plan.est_step_time_s)),
        ("per-device memory", format_bytes(plan.peak_memory_bytes)),
    ]
    parts = plan.planning.estimate
    shown = [f"{k.removesuffix('_s').replace('_', ' ')} {format_seconds(float(v))}"
             for k, v in parts.items() if k != "total_s" and isinstance(v, int | float)]
    if shown:
        rows.append(("estimate parts", ", ".join(shown)))
    statuses = stage_ilp_statuses(plan)
    if statuses:
        rows.append(("stage-cost ILPs", ", ".join(
            f"{n} {k.replace('_', ' ')}" for k, n in statuses.items() if n)))
    if report.top_primitives:
        top = ", ".join(f"{k} {v}" for k, v in report.top_primitives.items())
        rows.append(("top primitives", top))
    body = "\n".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in rows)
    return f'<h2>Summary</h2>\n<table class="kv">\n{body}\n</table>'


def _candidates(report: CompileReport) -> str:
    """Every plan the search compared, fastest first: why the plan won."""
    head = _row(["", "candidate", "method", "est. step", "vs the plan", "note"], "th")
    rows = []
    for mark, name, method, est, ratio, note in candidate_table(report.plan):
        cells = [_esc(mark), _esc(name), _esc(method), _esc(est), _esc(ratio), _esc(note)]
        rows.append("<tr>" + "".join(
            f'<td class="num">{c}</td>' if i in (3, 4) else f"<td>{c}</td>"
            for i, c in enumerate(cells)) + "</tr>")
    return ("<h2>Candidates compared</h2>\n<p class=\"muted\">The plans the search estimated "
            "on one cost model; * marks the plan.</p>\n<table>\n" + head + "\n"
            + "\n".join(rows) + "\n</table>")


def _stages(report: CompileReport) -> str:
    plan = report.plan
    colours = stage_colours(len(plan.stages))
    head = _row(_STAGE_COLUMNS + _STAGE_NUMBER_COLUMNS, "th")
    rows = []
    for s in plan.stages:
        r, g, b = (round(255 * c) for c in colours[s.index])
        # The swatch ties the row to the stage's colour in the mesh picture.
        index = f'<span class="swatch" style="background: rgb({r}, {g}, {b})"></span>{s.index}'
        breakdown = ", ".join(f"{k} {format_bytes(v)}" for k, v in s.memory_breakdown.items())
        cells = [
            index,
            _esc(_range_text(s.layers)),
            _esc(format_mesh_shape(s.submesh_shape)),
            _esc(f"{format_mesh_shape(s.logical_mesh_shape)} ({', '.join(s.axis_names)})"),
            _esc(_range_text(s.device_ids)),
            _esc(format_seconds(s.est_time_s)),
            _esc(format_seconds(s.est_compute_time_s)),
            _esc(format_seconds(s.est_communication_time_s)),
            f'<span title="{_esc(breakdown)}">{_esc(format_bytes(s.peak_memory_bytes))}</span>',
        ]
        tds = "".join(
            f'<td class="num">{c}</td>' if i >= len(_STAGE_COLUMNS) else f"<td>{c}</td>"
            for i, c in enumerate(cells)
        )
        rows.append(f'<tr class="stage" data-stage="{s.index}">{tds}</tr>')
    return (
        f"<h2>Stages ({len(plan.stages)})</h2>\n<table>\n<thead>{head}</thead>\n"
        f"<tbody>\n" + "\n".join(rows) + "\n</tbody>\n</table>"
    )


def _mesh(report: CompileReport) -> str:
    return (
        "<h2>Device mesh</h2>\n"
        '<p class="muted">Devices the plan uses, coloured by stage; each cell names the device, '
        "its stage and its coordinate in the stage's logical mesh. Devices per host are "
        "inferred from the widest stage submesh (the plan does not store the cluster's "
        "shape).</p>\n" + _img(mesh_png_bytes(report.plan), "device mesh coloured by stage")
    )


def _pipeline(report: CompileReport) -> str:
    plan = report.plan
    timeline = plan_timeline(plan)
    assert timeline is not None, "written for a pipelined plan only (section_ids)"
    # report.to_dict()'s pipeline entry has the idle fractions computed exactly as the text
    # report does; read it rather than repeat the formulas.
    info: dict[str, Any] = report.to_dict()["pipeline"]
    measured = info.get("measured_idle_fraction")
    chunks = int(info.get("num_chunks", 1))
    rows = [
        ("schedule", info["schedule"]),
        ("microbatches", str(info["num_microbatches"])),
        ("stages", f"{len(plan.stages)}" + (f" x {chunks} chunks" if chunks > 1 else "")),
        ("estimated idle fraction", f"{info['estimated_idle_fraction']:.3f}"),
        ("theoretical (p-1)/(m+p-1)", f"{info['theoretical_idle_fraction']:.3f}"),
        ("measured idle fraction", "not measured" if measured is None else f"{measured:.3f}"),
    ]
    body = "\n".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in rows)
    title = f"{report.model}: {info['schedule']}"
    return (
        f'<h2>Pipeline</h2>\n<table class="kv">\n{body}\n</table>\n'
        "<p>Swimlane (estimated):</p>\n"
        + _img(swimlane_png_bytes(timeline, title), "pipeline swimlane")
    )


def _collective_cells(predicted: dict[str, dict[str, float]],
                      hlo: dict[str, dict[str, int]] | None) -> list[list[str]]:
    """Per kind predicted or emitted: kind, plan count and bytes, HLO count, bytes, ratio."""
    emitted = {k: v for k, v in (hlo or {}).items() if v["count"]}
    rows = []
    for kind in sorted(set(predicted) | set(emitted)):
        p = predicted.get(kind, {"count": 0, "bytes": 0})
        cells = [_esc(kind), str(int(p["count"])), _esc(format_bytes(p["bytes"]))]
        if hlo is None:
            cells += ["not compiled", "not compiled", "-"]
        else:
            h = hlo.get(kind, {"count": 0, "bytes": 0})
            ratio = f"{p['bytes'] / h['bytes']:.2f}" if h["bytes"] else "-"
            cells += [str(h["count"]), _esc(format_bytes(h["bytes"])), ratio]
        rows.append(cells)
    return rows


def _collectives(report: CompileReport) -> str:
    hlo = report.hlo_collectives
    columns = ["kind", "plan count", "plan bytes", "HLO count", "HLO bytes", "bytes ratio"]
    rows = [f'<tr class="collective">{"".join(f"<td>{c}</td>" for c in cells)}</tr>'
            for cells in _collective_cells(report.predicted_collectives(), hlo)]
    if not rows:
        rows.append('<tr><td colspan="6">none</td></tr>')
    if hlo is None and report.graph_nodes is None:
        note = "HLO not compiled: a report of a saved plan."
    elif hlo is None:
        note = "HLO not compiled: planned for a described cluster (or --no-hlo)."
    elif report.plan.is_pipelined:
        note = ("HLO counted over one step: each program the pipeline's driver ran (tasks, "
                "segments), times its calls; moves between stages are no collectives.")
    else:
        note = "XLA may combine collectives of one kind into tuple-shaped ones: compare bytes."
    body = (f"<h2>Collectives</h2>\n<table>\n<thead>{_row(columns, 'th')}</thead>\n<tbody>\n"
            + "\n".join(rows) + "\n</tbody>\n</table>\n")
    stages = [f'<tr class="stage-collective"><td>{s}</td>'
              + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"
              for s, stage_hlo in enumerate(report.hlo_stage_collectives or [])
              for cells in _collective_cells(report.predicted_collectives(s), stage_hlo)]
    if stages:
        body += ("<p>Per stage:</p>\n<table>\n"
                 f"<thead>{_row(['stage', *columns], 'th')}</thead>\n<tbody>\n"
                 + "\n".join(stages) + "\n</tbody>\n</table>\n")
    return body + f'<p class="muted">{_esc(note)}</p>'


def _shardings(report: CompileReport) -> str:
    # Every leaf, not the text report's first 40: the page has room and search (Ctrl-F).
    shardings = report.plan.shardings()
    rows = "\n".join(
        f'<tr class="sharding"><td class="code">{_esc(path)}</td>'
        f'<td class="code">{_esc(spec)}</td></tr>'
        for path, spec in shardings.items()
    )
    return (
        f"<h2>Shardings ({len(shardings)} input leaves)</h2>\n<table>\n"
        f"<thead>{_row(['input leaf', 'spec'], 'th')}</thead>\n<tbody>\n{rows}\n"
        "</tbody>\n</table>"
    )


def _solver(report: CompileReport) -> str:
    stats = report.plan.solver or {}
    rows = "\n".join(
        f"<tr><th>{_esc(str(k))}</th><td>{_esc(_stat_text(k, v))}</td></tr>"
        for k, v in stats.items()
    )
    return f'<h2>Sharding ILP</h2>\n<table class="kv">\n{rows}\n</table>'


def _notes(report: CompileReport) -> str:
    notes = list(report.notes) + list(report.plan.notes)
    if not notes:
        return '<h2>Notes</h2>\n<p class="muted">none</p>'
    items = "\n".join(f"<li>{_esc(n)}</li>" for n in notes)
    return f"<h2>Notes</h2>\n<ul>\n{items}\n</ul>"


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{_esc(alt)}" src="data:image/png;base64,{data}">'


def _row(cells: list[str], tag: str) -> str:
    return "<tr>" + "".join(f"<{tag}>{_esc(c)}</{tag}>" for c in cells) + "</tr>"


def _range_text(ids: tuple[int, ...]) -> str:
    """``0-3`` for a contiguous run, else the ids listed."""
    if len(ids) > 1 and list(ids) == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(str(i) for i in ids)


def _stat_text(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "objective" or key.endswith("_time_s"):
        return format_seconds(float(value))
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)
