"""Planning a zoo model with the full search, timed by phase, and the plan as plain rows.

Shared by the harness's cases and scaling points and by ``benchmarks/plan_pipeline.py``. The
full search is ``AutoParallel`` through the compiler's own entry (``dispatch.trace`` then
``dispatch.plan``, as ``autopar.parallelize`` plans without ``method=``), called directly so
that tracing is timed apart from planning and every candidate's plan (data parallelism, the
ILP, ZeRO, the pipelines) comes back for the baselines to run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from autopar.cluster import ClusterSpec, format_mesh_shape
from autopar.compiler.graph.trace import TracedStep
from autopar.compiler.inter_op.stages import StagePartition
from autopar.ir.pipeline_program import PipelineProgram
from autopar.method_options import LayerMode, StageMode
from autopar.models import ZooModel
from autopar.plan import MethodName, Plan


@dataclass
class Searched:
    """The full search's result for one model and cluster: the plan, every candidate's plan
    by name (``data``, ``shard``, ``zero2``, ``zero3``, ``pipeshard``) and the trace time."""

    plan: Plan
    candidates: dict[str, Plan]
    trace_s: float
    traced: TracedStep
    pp: PipelineProgram | None = None
    # each candidate's plan with the program its ids name (``PlannedProgram``), by name
    programs: dict[str, Any] = field(default_factory=dict)


def full_search(model: ZooModel, cluster: ClusterSpec, *, microbatches: int,
                pipeline_layers: int | str = LayerMode.AUTO,
                memory_budget_bytes: float | None = None) -> Searched:
    """Trace ``model``'s train step (differentiated with ``autopar.value_and_grad``) at
    abstract shapes and plan it with ``AutoParallel`` on ``cluster``, every candidate planned
    (``prune=False``): the pipelined ones are the benchmark's hand-split baselines too."""
    import autopar
    from autopar.compiler.planners import dispatch

    marked = model.with_value_and_grad(autopar.value_and_grad)
    # per_microbatch_statistics: what Alpa and GPipe run (Wide-ResNet's batch norm takes each
    # microbatch's statistics), which the benchmark compares with; autopar's own default
    # leaves such pipelines out, as they compute another loss than the step's
    method = autopar.AutoParallel(num_microbatches=microbatches, layers=pipeline_layers,
                                  memory_budget_bytes=memory_budget_bytes, prune=False,
                                  per_microbatch_statistics=True)
    args = marked.abstract_inputs()  # the user's arguments: made before planning starts
    start = time.perf_counter()
    step = dispatch.trace(marked.train_step, args, method, (1,))
    trace_s = time.perf_counter() - start
    planned = dispatch.plan(step, cluster)
    # (the plan's batch argument is the step's (1,): traced so above)
    return Searched(planned.plan, {n: c.plan for n, c in planned.candidates.items()},
                    trace_s, step.traced, step.pipeline, dict(planned.candidates))


def planning_times(trace_s: float, plan: Plan) -> dict[str, float]:
    """Seconds by phase: ``trace_s`` (the whole step and the pipeline cut); ``ilp_s`` (every
    intra-operator ILP: the one-stage ILP's, the layers' costs and the chosen stages' own
    solves), ``dp_s`` (the stage search without the ILPs it asked for), ``other_s`` (layer
    clustering, the propagation planners) and ``total_s`` (trace included)."""
    timings = plan.planning.phases
    planned = float(plan.planning.planning_time_s or timings.get("total_s", 0.0))
    if "stage_costs_s" not in timings:
        ilp = timings.get("shard_s", planned if plan.method is MethodName.SHARD else 0.0)
        return {"trace_s": trace_s, "ilp_s": ilp, "dp_s": 0.0, "other_s": planned - ilp,
                "total_s": trace_s + planned}
    ilp = timings["stage_costs_s"] + timings["stage_plans_s"] + timings.get("shard_s", 0.0)
    return {
        "trace_s": trace_s,
        "ilp_s": ilp,
        "stage_cost_ilp_s": timings["stage_costs_s"],
        "stage_plan_ilp_s": timings["stage_plans_s"],
        "dp_s": timings["stage_dp_s"],
        "other_s": max(planned - ilp - timings["stage_dp_s"], 0.0),
        "total_s": trace_s + planned,
    }


def candidate_rows(plan: Plan) -> list[dict[str, Any]]:
    """The candidates the full search compared (``PlanningRecord.candidates``), fastest
    first."""
    return sorted(plan.planning.candidates,
                  key=lambda c: (c.get("est_step_time_s") is None,
                                 c.get("est_step_time_s") or 0.0))


def ilp_solves(plan: Plan) -> int:
    """The stage-cost ILPs the pipelined search solved (0 when it did not run)."""
    search = plan.planning.stage_search or {}
    if "ilp_solves" in search:
        return int(search["ilp_solves"])
    return max((int(c.get("ilp_solves") or 0) for c in plan.planning.candidates), default=0)


def plan_summary(plan: Plan) -> dict[str, Any]:
    """Stages (layer range, submesh, logical mesh, estimated seconds per microbatch or per
    step), method, microbatches and schedule."""
    pipeline = plan.pipeline
    return {
        "method": plan.method.value,
        "num_stages": len(plan.stages),
        "num_microbatches": plan.num_microbatches,
        "schedule": None if pipeline is None else str(pipeline.schedule),
        "pipeline_layers": None if pipeline is None else len(pipeline.layer_positions) + 1,
        "replicas": 1 if pipeline is None else pipeline.replicas,
        "est_idle_fraction": plan.planning.estimated_idle_fraction,
        "stages": [
            {"layers": [s.layers[0], s.layers[-1]] if s.layers else [],
             "submesh": list(s.submesh_shape),
             "logical_mesh": format_mesh_shape(s.logical_mesh_shape),
             "devices": len(s.device_ids),
             "est_time_s": s.est_time_s,
             "est_communication_time_s": s.est_communication_time_s}
            for s in plan.stages
        ],
    }


def partition_summary(partition: StagePartition) -> dict[str, Any]:
    """A stage partition (the DP's or a hand split) in ``plan_summary``'s stage layout."""
    return {
        "method": MethodName.PIPESHARD,
        "num_stages": len(partition.stages),
        "num_microbatches": partition.num_microbatches,
        "stages": [
            {"layers": [st.start, st.end - 1],
             "submesh": [st.submesh.num_hosts, st.submesh.devices_per_host],
             "logical_mesh": format_mesh_shape(st.candidate.logical_mesh_shape),
             "devices": st.submesh.num_devices,
             "est_time_s": st.candidate.time}
            for st in partition.stages
        ],
    }


def predicted_communication(plan: Plan) -> dict[str, Any]:
    """The plan's modelled communication: seconds per step summed over stages (a stage's per
    microbatch time times the microbatches), its share of the stages' summed time, and the
    predicted collectives by kind where the planner records them (data and shard plans; a
    pipelined plan keeps only the time)."""
    m = plan.num_microbatches if plan.is_pipelined else 1
    comm = sum(s.est_communication_time_s for s in plan.stages) * m
    total = sum(s.est_time_s for s in plan.stages) * m
    kinds: dict[str, dict[str, float]] = {}
    for stage in plan.stages:
        if len(stage.device_ids) < 2:
            continue  # the plan lists the gradient's reduction; on one device it is no-op
        for c in stage.collectives:
            entry = kinds.setdefault(c.kind.value, {"count": 0, "bytes": 0.0, "time_s": 0.0})
            entry["count"] += c.count
            entry["bytes"] += c.nbytes
            entry["time_s"] += c.time_s
    return {"time_s": comm, "fraction": comm / total if total > 0 else 0.0,
            "collectives": kinds or None}


def same_plan(a: Plan, b: Plan) -> bool:
    """Whether two plans choose the same stages, meshes and input shardings."""
    def shape(p: Plan) -> list[tuple]:
        return [(s.layers, s.submesh_shape, s.logical_mesh_shape) for s in p.stages]

    return shape(a) == shape(b) and a.shardings() == b.shardings()


def tflops_per_device(flops: float, step_s: float | None, devices: int) -> float | None:
    """``flops`` per step over ``step_s`` seconds on ``devices`` devices, in TFLOPS each."""
    if not step_s or step_s <= 0:
        return None
    return flops / step_s / devices / 1e12


def alpa_gpt_flops(config: Any, checkpoint_activations: bool = True) -> float:
    """Flops of one GPT train step as Alpa counts them (``compute_gpt_tflops`` in Alpa's
    benchmark utilities): 72 B S H^2 L (1 + S / 6H) + 6 B S H V, with 24 B S H^2 L (1 + S / 6H)
    more for the forward recomputed under rematerialisation."""
    b, s, h = config.batch_size, config.seq_len, config.hidden_size
    factor = 96 if checkpoint_activations else 72
    return (factor * b * s * h * h * config.num_layers * (1 + s / (6 * h))
            + 6 * b * s * h * config.vocab_size)


@dataclass(frozen=True)
class OneStagePipelinePlans:
    """A one-stage pipeline and what its measured time is set beside: ``pipelined``
    (``PipeshardParallel``, one stage over every device, the case's microbatches),
    ``one_microbatch`` (the same with one microbatch: the pipeline runtime with no split) and
    ``same_stage`` (the pipelined stage's logical mesh run by ``ShardParallel``). Pipelined /
    one microbatch is the microbatches' own cost; one microbatch / same stage the runtime's."""

    pipelined: Plan
    one_microbatch: Plan
    same_stage: Plan


def plan_one_stage_pipeline(model: ZooModel, cluster: ClusterSpec, *, microbatches: int,
                            pipeline_layers: int | str = LayerMode.AUTO) -> OneStagePipelinePlans:
    """``PipeshardParallel`` with one stage over every device of ``cluster``, at
    ``microbatches`` and at one, and the same stage (its logical mesh) run by
    ``ShardParallel`` (see ``OneStagePipelinePlans``)."""
    import autopar
    from autopar.compiler.planners import dispatch

    marked = model.with_value_and_grad(autopar.value_and_grad)

    def pipeline(m: int) -> Plan:
        method = autopar.PipeshardParallel(num_microbatches=m, num_stages=1,
                                           stages=StageMode.UNIFORM, layers=pipeline_layers,
                                           per_microbatch_statistics=True)
        step = dispatch.trace(marked.train_step, marked.abstract_inputs(), method, (1,))
        return dispatch.plan(step, cluster).plan

    pipelined = pipeline(microbatches)
    mesh = tuple(pipelined.stages[0].logical_mesh_shape)
    shard = autopar.ShardParallel(mesh_shape=mesh)
    step = dispatch.trace(marked.train_step, marked.abstract_inputs(), shard, (1,))
    same = dispatch.plan(step, cluster).plan
    return OneStagePipelinePlans(pipelined, pipeline(1), same)
