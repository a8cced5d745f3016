"""``autopar show PLAN.json``: the report of a saved plan, without tracing anything.

Reads either a plan file (``Plan.save``: a plan dict with ``format_version``) or a report
document (``autopar compile --json``: the report's keys with the plan under ``plan``). A plan
file has no graph, so the report shows ``-`` for the graph (and for the parameter count and
compile time when the plan did not record them); a report document restores what it holds.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from autopar.cli.output import emit_report
from autopar.errors import InvalidOptionError, PlanError
from autopar.plan import Plan
from autopar.report.text import CompileReport

logger = logging.getLogger(__name__)


def run_show(args: argparse.Namespace) -> int:
    report = load_report(args.plan_path)
    emit_report(report, args)
    return 0


def load_report(path_text: str) -> CompileReport:
    """The report of a plan file or of a ``--json`` report document (one-line errors)."""
    path = Path(path_text)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidOptionError(f"cannot read plan file '{path}': {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise InvalidOptionError(f"'{path}' is not a plan: not a text file ({exc.reason})") \
            from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidOptionError(f"'{path}' is not a plan: not JSON ({exc})") from exc
    if isinstance(data, dict) and isinstance(data.get("plan"), dict):
        plan = _plan(data["plan"], path)
        logger.info("%s: an 'autopar compile --json' report, plan format version %s", path,
                    plan.format_version)
        return _report_of_document(data, plan, path)
    if isinstance(data, dict) and "format_version" in data:
        plan = _plan(data, path)
        logger.info("%s: a saved plan, format version %s", path, plan.format_version)
        return CompileReport.from_plan(plan, model=str(path))
    raise InvalidOptionError(
        f"'{path}' is not a plan: expected a file from Plan.save (a plan with "
        "'format_version') or from 'autopar compile --json' (a report with 'plan'); got "
        + (f"a JSON object with keys {', '.join(sorted(data)[:8]) or 'none'}"
           if isinstance(data, dict) else f"a JSON {type(data).__name__}")
    )


def _plan(data: dict[str, Any], path: Path) -> Plan:
    try:
        return Plan.from_dict(data)
    except PlanError as exc:
        raise PlanError(f"'{path}': {exc}") from exc
    except (TypeError, ValueError, AttributeError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise PlanError(f"'{path}' is not a valid plan: {type(exc).__name__}: {first}") from exc


def _report_of_document(doc: dict[str, Any], plan: Plan, path: Path) -> CompileReport:
    """A report from its ``to_dict`` document: what the document holds, the plan's otherwise."""
    report = CompileReport.from_plan(plan, model=str(doc.get("model") or path))
    graph = doc.get("graph")
    if not isinstance(graph, dict):
        graph = {}
    report.graph_nodes = _int(graph.get("nodes"))
    report.graph_edges = _int(graph.get("edges"))
    top = graph.get("top_primitives")
    if isinstance(top, dict):
        report.top_primitives = {str(k): v for k, v in top.items() if _int(v) is not None}
    report.num_params = _int(doc.get("num_params"))
    flops = doc.get("flops_per_step")
    if isinstance(flops, (int, float)) and not isinstance(flops, bool):
        report.flops_per_step = float(flops)
    compile_time = doc.get("compile_time_s")
    if isinstance(compile_time, (int, float)) and not isinstance(compile_time, bool):
        report.compile_time_s = float(compile_time)
    collectives = doc.get("collectives")
    hlo = collectives.get("hlo") if isinstance(collectives, dict) else None
    if isinstance(hlo, dict) and all(
        isinstance(v, dict) and _int(v.get("count")) is not None
        and isinstance(v.get("bytes"), (int, float)) for v in hlo.values()
    ):
        report.hlo_collectives = hlo
    stages = collectives.get("stages") if isinstance(collectives, dict) else None
    if isinstance(stages, list) and all(isinstance(s, dict) and isinstance(s.get("hlo"), dict)
                                        for s in stages):
        report.hlo_stage_collectives = [s["hlo"] for s in stages]
    notes = doc.get("notes")
    if isinstance(notes, list):  # the document's notes are the report's, then the plan's
        report.notes = [str(n) for n in notes[: max(0, len(notes) - len(plan.notes))]]
    return report


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
