"""The compile report: a plain dict (for ``--json``) and its readable text rendering."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autopar.cluster import format_mesh_shape
from autopar.compiler.graph.opgraph import OpGraph
from autopar.errors import format_bytes
from autopar.ir.schedule_timeline import Timeline, render_text, stage_timeline
from autopar.ir.schedules import is_async
from autopar.plan import Plan
from autopar.report.async_text import async_facts, async_lines, async_timeline
from autopar.report.candidates import (
    candidate_lines,
    ilp_status_lines,
    measured_step_time_s,
    measured_text,
    stage_ilp_statuses,
)
from autopar.report.units import format_count, format_seconds


@dataclass
class CompileReport:
    """What ``autopar compile`` found: the step's size, the plan and its estimates.

    A report of a saved plan (``from_plan``: ``autopar show``) has no graph: ``graph_nodes``,
    ``graph_edges`` and, when unknown, ``num_params`` and ``compile_time_s`` are None (``-`` in
    the text, None in ``to_dict``).
    """

    model: str
    plan: Plan
    graph_nodes: int | None
    graph_edges: int | None
    num_params: int | None
    flops_per_step: float
    compile_time_s: float | None
    top_primitives: dict[str, int] = field(default_factory=dict)
    hlo_collectives: dict[str, dict[str, int]] | None = None  # kind -> {count, bytes}
    # a pipelined step's, per stage (``runtime.pipeline_hlo``); None: not counted per stage
    hlo_stage_collectives: list[dict[str, dict[str, int]]] | None = None
    notes: list[str] = field(default_factory=list)
    # per device, from the compiled program's memory analysis (None: not compiled)
    xla_memory_bytes: int | None = None
    # a run statistic of the step (``ParallelizedStep.timed_call``), not part of the plan
    measured_idle_fraction: float | None = None

    @classmethod
    def build(
        cls,
        model: str,
        plan: Plan,
        graph: OpGraph,
        num_params: int | None,
        compile_time_s: float,
        hlo_collectives: dict[str, dict[str, int]] | None = None,
    ) -> CompileReport:
        top = dict(list(graph.primitive_counts().items())[:8])
        return cls(
            model=model,
            plan=plan,
            graph_nodes=graph.num_nodes,
            graph_edges=graph.num_edges,
            num_params=num_params,
            flops_per_step=graph.total_flops,
            compile_time_s=compile_time_s,
            top_primitives=top,
            hlo_collectives=hlo_collectives,
        )

    @classmethod
    def from_plan(cls, plan: Plan, model: str, num_params: int | None = None) -> CompileReport:
        """The report of a saved plan, without the step's graph: flops are the plan's, the
        compile time is the planning time the plan recorded (None when it has none)."""
        recorded = plan.planning.planning_time_s
        return cls(
            model=model,
            plan=plan,
            graph_nodes=None,
            graph_edges=None,
            num_params=num_params,
            flops_per_step=plan.total_flops,
            compile_time_s=None if recorded is None else float(recorded),
        )

    def predicted_collectives(self, stage: int | None = None) -> dict[str, dict[str, float]]:
        """Per kind, what the plan predicts for one step (``stage``: that stage's only)."""
        out: dict[str, dict[str, float]] = {}
        for st in self.plan.stages:
            if stage is not None and st.index != stage:
                continue
            for c in st.collectives:
                entry = out.setdefault(c.kind.value, {"count": 0, "bytes": 0.0, "time_s": 0.0})
                entry["count"] += c.count
                entry["bytes"] += c.nbytes
                entry["time_s"] += c.time_s
        return out

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document: the report's keys, with the whole plan under ``plan``."""
        plan = self.plan
        return {
            "model": self.model,
            "method": plan.method,
            "cluster": plan.cluster,
            "mesh_shape": list(plan.mesh_shape),
            "compile_time_s": self.compile_time_s,
            "est_step_time_s": plan.est_step_time_s,
            "measured_step_time_s": measured_step_time_s(plan),
            "peak_memory_bytes": plan.peak_memory_bytes,
            "xla_memory_bytes": self.xla_memory_bytes,
            "num_params": self.num_params,
            "flops_per_step": self.flops_per_step,
            "graph": {
                "nodes": self.graph_nodes,
                "edges": self.graph_edges,
                "top_primitives": self.top_primitives,
            },
            "stages": [
                {
                    "layers": list(s.layers),
                    "submesh_shape": list(s.submesh_shape),
                    "logical_mesh_shape": list(s.logical_mesh_shape),
                    "est_time_s": s.est_time_s,
                    "peak_memory_bytes": s.peak_memory_bytes,
                    "memory_breakdown": dict(s.memory_breakdown),
                }
                for s in plan.stages
            ],
            "pipeline": _pipeline_dict(plan, self.measured_idle_fraction),
            "shardings": plan.shardings(),
            "collectives": {
                "predicted": self.predicted_collectives(),
                "hlo": self.hlo_collectives,
                "stages": None if self.hlo_stage_collectives is None else [
                    {"stage": s, "predicted": self.predicted_collectives(s), "hlo": hlo}
                    for s, hlo in enumerate(self.hlo_stage_collectives)
                ],
            },
            "estimate": dict(plan.planning.estimate),
            "candidates": [dict(c) for c in plan.planning.candidates],
            "stage_cost_ilps": stage_ilp_statuses(plan),
            "notes": list(self.notes) + list(plan.notes),
            "plan": plan.to_dict(),
        }

    def to_text(self, max_shardings: int = 40) -> str:
        plan = self.plan
        lines = [
            f"autopar compile report: {self.model}",
            f"  method            {plan.method}",
            f"  cluster           {plan.cluster}",
            f"  mesh              {_mesh_text(plan)}",
            "  graph             "
            + ("-" if self.graph_nodes is None
               else f"{self.graph_nodes} ops, {self.graph_edges} edges"),
            "  parameters        "
            + ("-" if self.num_params is None else format_count(self.num_params)),
            f"  flops per step    {format_count(self.flops_per_step)}",
            "  compile time      "
            + ("-" if self.compile_time_s is None else f"{self.compile_time_s:.2f} s"),
            f"  est. step time    {format_seconds(plan.est_step_time_s)}"
            + measured_text(plan),
            f"  per-device memory {format_bytes(plan.peak_memory_bytes)}"
            + ("" if self.xla_memory_bytes is None
               else f" (XLA's memory analysis: {format_bytes(self.xla_memory_bytes)})"),
            *_estimate_lines(plan),
            *_breakdown_lines(plan),
            *candidate_lines(plan),
            "",
            "stages",
            f"  {'#':>2}  {'layers':<10} {'submesh':<8} {'logical':<8} {'est time':>10} "
            f"{'compute':>10} {'comm':>10} {'memory':>10}",
        ]
        for s in plan.stages:
            layers = f"{s.layers[0]}-{s.layers[-1]}" if len(s.layers) > 1 else str(s.layers[0])
            lines.append(
                f"  {s.index:>2}  {layers:<10} {format_mesh_shape(s.submesh_shape):<8} "
                f"{format_mesh_shape(s.logical_mesh_shape):<8} "
                f"{format_seconds(s.est_time_s):>10} "
                f"{format_seconds(s.est_compute_time_s):>10} "
                f"{format_seconds(s.est_communication_time_s):>10} "
                f"{format_bytes(s.peak_memory_bytes):>10}"
            )
        timeline, layout = plan_timeline(plan), plan.pipeline
        if timeline is not None and layout is not None:  # (a timeline: a pipelined plan)
            lines += [
                "",
                f"pipeline: {layout.schedule}, {plan.num_microbatches} microbatches, "
                f"{len(plan.stages)} stages"
                + (f" x {layout.num_chunks} chunks" if layout.num_chunks > 1 else ""),
                f"  idle fraction: estimated {timeline.idle_fraction:.3f}, theoretical "
                f"(p-1)/(m+p-1) = {_theoretical(len(plan.stages), plan.num_microbatches):.3f}"
                + (f", measured {self.measured_idle_fraction:.3f}"
                   if self.measured_idle_fraction is not None else ""),
                *ilp_status_lines(plan),
                *async_lines(plan, format_seconds),
                "  swimlane (estimated; one column per forward slot):",
            ]
            lines += ["    " + row for row in render_text(timeline).splitlines()]
        lines += ["", "collectives (predicted by the plan | counted in compiled HLO)"]
        predicted = self.predicted_collectives()
        rows = collective_rows(predicted, self.hlo_collectives)
        lines += [f"  {row}" for row in rows] or ["  none"]
        for stage, hlo in enumerate(self.hlo_stage_collectives or []):
            lines += [f"  stage {stage}: {row}"
                      for row in collective_rows(self.predicted_collectives(stage), hlo)]
        emitted = {k: v for k, v in (self.hlo_collectives or {}).items() if v["count"]}
        if self.hlo_collectives is not None and plan.is_pipelined:
            lines.append("  (HLO counted over one step: each program the driver ran, times "
                         "its calls)")
        if self.hlo_collectives is None and plan.is_pipelined:
            lines.append("  (HLO not counted: a saved plan's report, planned for a described "
                         "cluster, or --no-hlo)")
        elif self.hlo_collectives is None and self.graph_nodes is None:
            lines.append("  (HLO not counted: a report of a saved plan)")
        elif self.hlo_collectives is None:
            lines.append("  (HLO not compiled: planned for a described cluster, or --no-hlo)")
        elif any(emitted.get(k, {"count": 0})["count"] < predicted[k]["count"] for k in predicted):
            lines.append(
                "  (XLA combines collectives of one kind into tuple-shaped ones: compare bytes)"
            )
        if self.hlo_collectives is not None and REDUCE_SCATTER in predicted \
                and REDUCE_SCATTER not in emitted:
            lines.append("  (no reduce-scatter in the HLO: XLA's CPU backend emits one as an "
                         "all-reduce and a slice; compare all-reduce + reduce-scatter bytes)")
        if plan.solver:
            lines += ["", "sharding ILP"] + _solver_lines(plan.solver)
        shardings = plan.shardings()
        lines += ["", f"shardings ({len(shardings)} input leaves)"]
        width = max((len(p) for p in shardings), default=0)
        for i, (path, spec) in enumerate(shardings.items()):
            if i == max_shardings:
                lines.append(f"  ... {len(shardings) - max_shardings} more (see --json)")
                break
            lines.append(f"  {path:<{width}}  {spec}")
        for note in list(self.notes) + list(plan.notes):
            lines.append(f"note: {note}")
        return "\n".join(lines)


REDUCE_SCATTER = "reduce-scatter"


def collective_rows(predicted: dict[str, dict[str, float]],
                    hlo: dict[str, dict[str, int]] | None) -> list[str]:
    """One text row per collective kind predicted or emitted: the plan's count and bytes, and
    beside them (``hlo`` given) the HLO's and the ratio of the bytes."""
    emitted = {k: v for k, v in (hlo or {}).items() if v["count"]}
    rows = []
    for kind in sorted(set(predicted) | set(emitted)):
        p = predicted.get(kind, {"count": 0, "bytes": 0})
        row = f"{kind:<18} plan {int(p['count']):>4} x, {format_bytes(p['bytes']):>10}"
        if hlo is not None:
            h = hlo.get(kind, {"count": 0, "bytes": 0})
            ratio = f"{p['bytes'] / h['bytes']:.2f}" if h["bytes"] else "-"
            row += (f" | hlo {h['count']:>4} x, {format_bytes(h['bytes']):>10}"
                    f" | bytes ratio {ratio}")
        rows.append(row)
    return rows


_ESTIMATE_PARTS = (("compute_s", "compute"), ("communication_s", "communication"),
                   ("runtime_s", "runtime call"), ("schedule_s", "schedule"),
                   ("tails_s", "tails"), ("before_s", "before the loss"),
                   ("host_s", "driver on the host"),
                   ("accumulate_s", "of the schedule: gradient accumulation"))


def _estimate_lines(plan: Plan) -> list[str]:
    """The estimate's parts (what the step time is made of), when the plan records them."""
    parts = plan.planning.estimate
    shown = [f"{label} {format_seconds(float(parts[key]))}" for key, label in _ESTIMATE_PARTS
             if isinstance(parts.get(key), int | float)]
    return ["                    " + ", ".join(shown)] if shown else []


def _breakdown_lines(plan: Plan) -> list[str]:
    """The one-stage plan's memory parts (a pipeline's stages have their own, in the table)."""
    if len(plan.stages) != 1 or not plan.stages[0].memory_breakdown:
        return []
    parts = plan.stages[0].memory_breakdown
    return ["                    " + ", ".join(
        f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in parts.items())]


def plan_timeline(plan: Plan) -> Timeline | None:
    """The estimated schedule of a pipelined plan (None for other plans)."""
    layout = plan.pipeline
    if layout is None:
        return None
    if is_async(layout.schedule):  # its steady state: no flush between steps
        return async_timeline(plan)
    return stage_timeline(layout.schedule, [s.est_time_s for s in plan.stages],
                          plan.num_microbatches, layout.num_chunks)


def _pipeline_dict(plan: Plan,
                   measured_idle_fraction: float | None) -> dict[str, Any] | None:
    timeline = plan_timeline(plan)
    if timeline is None or plan.pipeline is None:  # (a timeline: a pipelined plan)
        return None
    return plan.pipeline.to_dict() | {
        "asynchronous": async_facts(plan),
        "num_microbatches": plan.num_microbatches,
        "estimated_idle_fraction": timeline.idle_fraction,
        "theoretical_idle_fraction": _theoretical(len(plan.stages), plan.num_microbatches),
        "measured_idle_fraction": measured_idle_fraction,
    }


def _mesh_text(plan: Plan) -> str:
    if plan.is_pipelined:
        devices = sum(len(s.device_ids) for s in plan.stages)
        return f"{len(plan.stages)} stage(s) on {devices} devices"
    return format_mesh_shape(plan.mesh_shape)


def _theoretical(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


def _solver_lines(stats: dict[str, Any]) -> list[str]:
    gap = stats.get("gap")
    rows = [
        ("solver", f"{stats.get('solver')} ({stats.get('status')}"
                   f"{', proven optimal' if stats.get('proven_optimal') else ''})"),
        ("objective", format_seconds(float(stats.get("objective", 0.0)))),
        ("gap", "-" if gap is None else f"{gap:.2e}"),
        ("decisions", f"{stats.get('decision_variables', '-')} (from "
                      f"{stats.get('variables_before_merging', '-')} ops and inputs)"),
        ("ILP size", f"{stats.get('num_variables', 0)} variables, "
                     f"{stats.get('num_constraints', 0)} constraints"),
        ("time", f"build {float(stats.get('build_time_s', 0.0)):.2f} s, "
                 f"solve {float(stats.get('solve_time_s', 0.0)):.2f} s"),
    ]
    return [f"  {k:<10} {v}" for k, v in rows]
