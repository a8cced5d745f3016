"""What the report says about the full search's record: the candidates it compared (each
with its estimate, its ratio to the chosen plan and, where they were timed, its measured
step), the chosen plan's measured step, and how the stage-cost ILPs of the pipelined search
ended. The text report (``text``) and the HTML page (``html``) both read these.
"""

from __future__ import annotations

from autopar.plan import Plan
from autopar.report.units import format_seconds


def measured_step_time_s(plan: Plan) -> float | None:
    """The plan's step as timed on the devices it was planned for, when the full search timed
    its candidates there (``AutoParallel.measure_candidates``); else None."""
    for c in plan.planning.candidates:
        if c.get("chosen") and c.get("measured_step_time_s") is not None:
            return float(c["measured_step_time_s"])
    return None


def measured_text(plan: Plan) -> str:
    """What the text report adds after the estimated step: `` (measured ... on these
    devices)`` when the full search timed the plan here, else ``""``."""
    measured = measured_step_time_s(plan)
    return "" if measured is None else f" (measured {format_seconds(measured)} on these devices)"


def candidate_table(plan: Plan) -> list[tuple[str, str, str, str, str, str]]:
    """The candidates the search compared as rows (mark, name, method, est. step, ratio to
    the chosen plan, note), fastest first; [] when the plan records none."""
    rows = []
    chosen = plan.est_step_time_s
    ranked = sorted(plan.planning.candidates,
                    key=lambda c: (c.get("est_step_time_s") is None,
                                   c.get("est_step_time_s") or 0.0))
    for c in ranked:
        est = c.get("est_step_time_s")
        note = str(c.get("note") or "")
        if c.get("fits") is False and est is not None and "budget" not in note:
            note = (note + "; " if note else "") + "does not fit the memory budget"
        measured = c.get("measured_step_time_s")
        if measured is not None:
            note = (f"measured {format_seconds(float(measured))} here"
                    + ("; " + note if note else ""))
        rows.append(("*" if c.get("chosen") else "", str(c.get("name", "?")),
                     str(c.get("method", "?")),
                     "-" if est is None else format_seconds(float(est)),
                     "-" if est is None or not chosen else f"{float(est) / chosen:.2f}x",
                     note))
    return rows


def candidate_lines(plan: Plan) -> list[str]:
    """The text report's candidates section: one line per candidate (``candidate_table``) and,
    for a one-stage plan, how the pipelined candidates' stage-cost ILPs ended; [] when the
    plan records no candidates."""
    rows = candidate_table(plan)
    if not rows:
        return []
    width = max(len(r[1]) for r in rows)
    lines = ["", f"candidates compared ({len(rows)}; * the plan; est. step and its ratio to "
                 "the plan's)"]
    for mark, name, method, est, ratio, note in rows:
        lines.append(f"  {mark:1} {name:<{width}} {method:<10} {est:>11} {ratio:>7}"
                     + (f"  {note}" if note else ""))
    if not plan.is_pipelined:  # a pipelined plan says it with its schedule
        lines += [line.replace("stage-cost ILPs", "the pipelined candidates' stage-cost ILPs")
                  for line in ilp_status_lines(plan)]
    return lines


def stage_ilp_statuses(plan: Plan) -> dict[str, int] | None:
    """How the stage-cost ILPs of the pipelined search ended, by status (None when the plan
    did not search stages): ``proven``, ``within_gap``, ``time_limit``, ``no_solution``,
    ``solver_error``."""
    search = plan.planning.stage_search or {}
    found = search.get("ilp_statuses")
    if found is None:
        for c in plan.planning.candidates:
            if c.get("ilp_statuses") is not None:
                return dict(c["ilp_statuses"])
        return None
    return dict(found)


def ilp_status_lines(plan: Plan) -> list[str]:
    """One text line: how many stage-cost ILPs were solved and how they ended; [] when the
    plan did not search stages."""
    statuses = stage_ilp_statuses(plan)
    if not statuses:
        return []
    total = sum(statuses.values())
    parts = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in statuses.items() if n)
    return [f"  stage-cost ILPs: {total} solved ({parts})"]
