"""What the scaling sweep against devices shows, read off its rows: whether the estimated step
ever got slower as devices were added at the same global batch, and planning seconds per ILP
solve (planning time that grows no faster than the distinct ILPs keeps this flat)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Row = dict[str, Any]


def device_points(rows: Sequence[Row]) -> list[Row]:
    """The sweep's points against devices that planned, by device count."""
    return sorted((r for r in rows if r.get("kind") == "scaling" and r.get("axis") == "devices"
                   and not r.get("error") and r.get("est_step_time_s")),
                  key=lambda r: r["devices"])


def slower_steps(points: Sequence[Row], tolerance: float = 1e-3) -> list[tuple[Row, Row]]:
    """Each pair of neighbouring points where the estimated step got slower with more devices
    (by more than ``tolerance``, relative)."""
    return [(a, b) for a, b in zip(points, points[1:], strict=False)
            if b["est_step_time_s"] > a["est_step_time_s"] * (1 + tolerance)]


def device_scaling_lines(rows: Sequence[Row]) -> list[str]:
    """Markdown lines summing up the sweep against devices (none without such points)."""
    points = device_points(rows)
    if len(points) < 2:
        return []
    first, last = points[0], points[-1]
    slower = slower_steps(points)
    steps = (f"never got slower from {first['devices']:,} to {last['devices']:,} devices "
             f"({first['est_step_time_s']:.3g} s to {last['est_step_time_s']:.3g} s)"
             if not slower else "got slower at " + ", ".join(
                 f"{a['devices']:,} -> {b['devices']:,} devices ({a['est_step_time_s']:.3g} -> "
                 f"{b['est_step_time_s']:.3g} s)" for a, b in slower))
    per_ilp = [r["planning"]["total_s"] / r["ilp_solves"] for r in points if r.get("ilp_solves")]
    lines = [f"- Against devices, at the model's batch of {first.get('batch', 'its')} "
             f"sequences and {first['microbatches']} microbatches, the estimated step {steps}."]
    if per_ilp:
        lines.append(f"- Planning seconds per distinct ILP solved, against devices: "
                     f"{min(per_ilp):.3g}-{max(per_ilp):.3g} (from {points[0]['ilp_solves']} to "
                     f"{points[-1]['ilp_solves']} ILPs).")
    return lines
