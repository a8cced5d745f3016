"""The hand-plan oracle in the benchmark: every expert layout of ``hand_plans`` that applies to a
case's model, beside autopar's plan.

For each hand plan the row holds two figures that answer different questions:

* **estimated**: autopar's cost model on the ILP plan with the hand plan's inputs pinned (the
  ILP only places the intermediates). The full search's candidates include the free ILP, whose
  objective is at most any pinned one's, so "est. / autopar's" below 1 means the search space
  misses the expert's layout.
* **measured** (local cases): ``jax.jit(step, in_shardings=hand)``, which is what XLA's own
  sharding propagation makes of the expert's inputs, timed and its compiled collectives
  counted: the plan a user gets without autopar.

The mesh of a 1-D hand plan is ``(hosts, devices per host)`` (the hand plans split over every
device either way); a 2-D one (``data-megatron``) on one host takes ``(2, n / 2)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from autopar.bench.hand_oracle import (
    collective_traffic,
    jit_collectives,
    plan_pinned,
    state_in_layout,
)
from autopar.bench.hand_plans import HAND_PLANS, HandPlan, graph_leaves
from autopar.cluster import ClusterSpec
from autopar.compiler.cost.estimate import call_arrays, one_call_time_s
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import TracedStep
from autopar.errors import AutoparError
from autopar.plan import Plan

TWO_D_PLANS = frozenset({"data-megatron"})


def hand_mesh(plan: HandPlan, cluster: ClusterSpec) -> tuple[int, int] | None:
    """The mesh ``plan`` runs on over every device of ``cluster`` (None: none fits)."""
    if cluster.num_hosts > 1:
        return (cluster.num_hosts, cluster.devices_per_host)
    n = cluster.num_devices
    if plan.name in TWO_D_PLANS:
        return (2, n // 2) if n >= 4 and n % 2 == 0 else None
    return (1, n)


def applicable_hand_plans(traced: TracedStep, cluster: ClusterSpec
                          ) -> list[tuple[HandPlan, tuple[int, int], dict]]:
    """Every hand plan that applies to the step on ``cluster``: (plan, mesh, input specs)."""
    leaves = graph_leaves(traced.graph)
    found = []
    for plan in HAND_PLANS:
        mesh = hand_mesh(plan, cluster)
        if mesh is None:
            continue
        axes = dict(zip(("x", "y"), mesh, strict=True))
        specs = plan.specs(leaves, axes)
        if specs is not None:
            found.append((plan, mesh, specs))
    return found


def plan_hand(traced: TracedStep, cluster: ClusterSpec, mesh_shape: tuple[int, int],
              specs: dict, time_limit_s: float) -> Plan:
    """autopar's plan with the hand plan's inputs pinned, estimated as every one-stage plan is
    (its stage plus one call of the runtime)."""
    mesh = LogicalMesh.from_cluster(cluster, mesh_shape)
    plan = plan_pinned(traced, mesh, specs, cluster_name=cluster.name,
                       devices_per_host=cluster.devices_per_host, time_limit_s=time_limit_s)
    runtime = one_call_time_s(cluster.runtime, call_arrays(traced.graph, (1,)),
                              min(mesh.num_devices, cluster.devices_per_host))
    return replace(plan, est_step_time_s=plan.stages[0].est_time_s + runtime)


def measure_hand(step_fn: Any, inputs: Any, specs: dict, devices: Sequence[Any],
                 mesh_shape: tuple[int, int], warmup: int, repeats: int) -> dict[str, Any]:
    """``jax.jit(step, in_shardings=hand)`` on ``devices``: its median step time and the
    collectives XLA emitted (count by kind, and the bytes the busiest device sends)."""
    from autopar.bench.measure import TrainingLoop, time_calls

    args = (inputs.state, inputs.batch)
    summary, jitted = jit_collectives(step_fn, args, specs, devices[:math.prod(mesh_shape)],
                                      mesh_shape, ("x", "y"))
    # called as autopar's plans are (measure.TrainingLoop): the state in the hand plan's layout
    # from the previous step, the batch from the host
    state = state_in_layout(jitted, args)
    first, times = time_calls(TrainingLoop(jitted, state, inputs.batch), warmup, repeats)
    times.sort()
    return {"step_time_s": times[len(times) // 2], "first_call_s": first,
            "hlo_collectives": summary.by_kind(),
            "hlo_bytes_per_device": collective_traffic(summary)}


def hand_plan_rows(traced: TracedStep, cluster: ClusterSpec, est_s: float,
                   measured_s: float | None, local: Any, time_limit_s: float
                   ) -> list[dict[str, Any]]:
    """One row per applicable hand plan: estimated (pinned ILP) and, with ``local`` (the
    runner's local run), measured as XLA compiles it. Ratios are over autopar's plan."""
    rows = []
    for hand, mesh_shape, specs in applicable_hand_plans(traced, cluster):
        row: dict[str, Any] = {"name": hand.name, "summary": hand.summary,
                               "mesh": list(mesh_shape), "est_step_time_s": None,
                               "est_ratio": None, "measured_step_time_s": None,
                               "measured_ratio": None, "hlo_collectives": None, "error": None}
        try:
            plan = plan_hand(traced, cluster, mesh_shape, specs, time_limit_s)
            row["est_step_time_s"] = plan.est_step_time_s
            row["est_ratio"] = plan.est_step_time_s / est_s if est_s else None
            if local is not None:
                got = measure_hand(local.plain_step_fn, local.inputs, specs, local.devices,
                                   mesh_shape, local.case.warmup_steps,
                                   local.case.timed_steps)
                row.update(measured_step_time_s=got["step_time_s"],
                           hlo_collectives=got["hlo_collectives"],
                           hlo_bytes_per_device=got["hlo_bytes_per_device"])
                if measured_s:
                    row["measured_ratio"] = got["step_time_s"] / measured_s
        except AutoparError as err:
            row["error"] = " ".join(str(err).split())
        rows.append(row)
    return rows


def hand_plans_table(cases: Sequence[dict[str, Any]], fmt: Any) -> list[str]:
    """The markdown table of every case's hand-plan rows (``fmt``: the number formatter)."""
    lines = ["| case | hand plan | mesh | est. step, inputs pinned (s) | est. / autopar's | "
             "measured, jax.jit (s) | measured / autopar's | XLA's collectives |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    found = False
    for r in cases:
        for h in r.get("hand_plans") or []:
            found = True
            kinds = h.get("hlo_collectives") or {}
            text = ", ".join(f"{k} {v['count']}" for k, v in sorted(kinds.items())
                             if v["count"]) or (
                "none" if h.get("measured_step_time_s") is not None else "—")
            if h.get("error"):
                text = f"error: {h['error']}"
            mesh = "x".join(str(d) for d in h["mesh"])
            lines.append(f"| {r['case']} | {h['name']} | {mesh} | {fmt(h['est_step_time_s'])} | "
                         f"{fmt(h['est_ratio'])} | {fmt(h['measured_step_time_s'])} | "
                         f"{fmt(h['measured_ratio'])} | {text} |")
    return lines if found else ["No case ran the hand plans."]
