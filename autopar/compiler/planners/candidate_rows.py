"""The full search's record of its candidates: one row per candidate plan (its estimate,
memory and whether it fits), the row of one that failed, and the note comparing the user's own
layout with the chosen plan."""

from __future__ import annotations

from typing import Any

from autopar.compiler.planners.annotations import UserLayout
from autopar.errors import format_bytes
from autopar.plan import Plan


def fits_budget(plan: Plan, budget: float) -> bool:
    """Whether ``plan``'s peak memory is within ``budget`` bytes per device."""
    return plan.peak_memory_bytes <= budget


def candidate_row(name: str, plan: Plan, budget: float) -> dict[str, Any]:
    """The row of a candidate that has ``plan``."""
    row: dict[str, Any] = {
        "name": name, "method": plan.method.value, "est_step_time_s": plan.est_step_time_s,
        "peak_memory_bytes": plan.peak_memory_bytes,
        "fits": fits_budget(plan, budget), "num_stages": len(plan.stages),
        "estimate": dict(plan.planning.estimate),
        "note": "rematerialised" if plan.remat_positions is not None else "",
        "chosen_plan": plan,
    }
    if plan.solver is not None:  # a one-stage ILP's end: optimal, time_limit, ...
        row["ilp_status"] = plan.solver.get("status")
    if not row["fits"]:
        row["note"] = (row["note"] + "; " if row["note"] else "") + (
            f"needs {plan.peak_memory_bytes / 2**30:.2f} GiB per device, over the budget")
    return row


def annotations_note(layout: UserLayout, rows: list[dict[str, Any]], plan: Plan) -> str:
    """``your annotations: est. X; autopar's plan: est. Y`` (or why they were not planned)."""
    mine = f"autopar's plan: est. {plan.est_step_time_s:.4g} s/step"
    row = next((r for r in rows if r["name"] == layout.label), None)
    where = (f"your annotations (the inputs committed to your "
             f"{' x '.join(layout.axis_names)} mesh, {layout.label.split()[-1]})")
    if row is None:
        return f"{where}: not a candidate here, the mesh does not cover the cluster; {mine}"
    if row.get("est_step_time_s") is None:
        return f"{where}: not planned ({row.get('note', '')}); {mine}"
    fits = "" if row["fits"] else ", over the memory budget"
    return f"{where}: est. {row['est_step_time_s']:.4g} s/step{fits}; {mine}"


def failed_row(name: str, method: str, err: Exception) -> dict[str, Any]:
    """The row of a candidate that could not be planned, saying why; ``needs_bytes``: the
    least per-device memory it needed, where the error knows it (a memory budget no plan of it
    fits)."""
    row: dict[str, Any] = {"name": name, "method": method, "est_step_time_s": None,
                           "fits": False, "note": " ".join(str(err).split())}
    needs = getattr(err, "min_peak_bytes", None) or getattr(err, "peak_bytes", None)
    if needs:
        row["needs_bytes"] = float(needs)
    return row


def no_candidate_text(rows: list[dict[str, Any]], budget: float) -> str:
    """Why the full search has no plan: the least memory a candidate needed, where memory is
    why (the candidate named), then every candidate's reason."""
    reasons = "; ".join(f"{r['name']}: {r['note']}" for r in rows)
    needing = [r for r in rows if r.get("needs_bytes")]
    if not needing:
        return f"the full search planned no candidate: {reasons}"
    least = min(needing, key=lambda r: r["needs_bytes"])
    return (f"no candidate of the full search fits in {format_bytes(budget)} per device: "
            f"the least memory any needs is {format_bytes(least['needs_bytes'])} "
            f"({least['name']}); raise memory_budget_bytes, or use more devices. "
            f"Each candidate: {reasons}")
