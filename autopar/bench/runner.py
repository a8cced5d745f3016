"""Running one benchmark case or scaling point: plan, compare, and (locally) run and time.

A case's row (a plain dict, one JSON line) holds the full search's planning times by phase,
its estimated step time and TFLOPS per device, the plan's summary and predicted
communication, the baselines planned in the same process (so ratios compare like with like)
and, for local cases, the measured step times, the collectives counted in the compiled HLO and
the cost model's error under the default and the calibrated cluster descriptions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from autopar.bench import baselines as bl
from autopar.bench.planning import (
    Searched,
    alpa_gpt_flops,
    full_search,
    partition_summary,
    plan_summary,
    planning_times,
    predicted_communication,
    same_plan,
    tflops_per_device,
)
from autopar.bench.suites import (
    MEGATRON_FAMILIES,
    NO_MEMORY_LIMIT,
    Baseline,
    BenchCase,
    ScalingAxis,
    ScalingPoint,
)
from autopar.cluster import ClusterSpec, load_cluster
from autopar.errors import AutoparError
from autopar.models import ZooModel, get_model
from autopar.plan import Plan

Phase = Callable[[str], AbstractContextManager[None]]  # Progress.phase


@dataclass(frozen=True)
class RunOptions:
    """How to run a suite: the local devices to use, and an optional calibrated description of
    them (``autopar profile``'s cluster JSON) to estimate local cases under as well."""

    devices: int = 8
    calibrated: ClusterSpec | None = None
    ilp_time_limit_s: float = 30.0


@dataclass
class _Local:
    """What a local case needs to run plans: the devices, the real inputs, the step (marked
    with ``autopar.value_and_grad``, as the plans were traced) and the plain JAX step."""

    devices: list[Any]
    inputs: Any  # autopar.bench.measure.LocalInputs
    step_fn: Callable
    plain_step_fn: Callable
    case: BenchCase

    def run(self, plan: Plan) -> Any:
        from autopar.bench.measure import measure_plan

        return measure_plan(self.step_fn, plan, self.inputs, self.devices,
                            self.case.warmup_steps, self.case.timed_steps)


def case_cluster(case: BenchCase, options: RunOptions) -> ClusterSpec:
    """The described cluster (with ``case.hosts``), or the local devices as one host."""
    if case.local:
        from autopar.api import local_cluster
        from autopar.bench.measure import local_devices

        return local_cluster(local_devices(case.devices or options.devices))
    cluster = load_cluster(case.cluster)
    return cluster.with_hosts(case.hosts) if case.hosts else cluster


def calibrated_cluster(options: RunOptions, devices: int) -> ClusterSpec | None:
    """The calibrated description sized to the local devices (one host of ``devices``)."""
    cal = options.calibrated
    if cal is None or cal.num_devices == devices:
        return cal
    return cal.with_devices(1, devices)


def run_case(case: BenchCase, options: RunOptions, phase: Phase) -> dict[str, Any]:
    """Plan ``case`` with the full search and its baselines (and run them, locally)."""
    import autopar
    from autopar.compiler.graph.trace import trace_step

    wall = time.perf_counter()
    model = get_model(case.model, case.size, **case.config_overrides())
    marked = model.with_value_and_grad(autopar.value_and_grad)
    cluster = case_cluster(case, options)
    row: dict[str, Any] = {
        "kind": "case", "case": case.name, "model": case.model, "size": case.size,
        "overrides": case.config_overrides(), "where": "local" if case.local else "described",
        "cluster": cluster.name, "devices": cluster.num_devices, "hosts": cluster.num_hosts,
        "devices_per_host": cluster.devices_per_host, "params": model.num_params(),
        "microbatches": case.microbatches, "notes": [],
    }
    with phase(f"{case.name}: full search"):
        searched = full_search(model, cluster, microbatches=case.microbatches,
                               pipeline_layers=case.pipeline_layers,
                               memory_budget_bytes=None if case.local else NO_MEMORY_LIMIT)
    with phase(f"{case.name}: tracing the whole step"):
        start = time.perf_counter()
        traced = trace_step(marked.train_step, marked.abstract_inputs())
        row["whole_step_trace_s"] = time.perf_counter() - start
    plan = searched.plan
    flops = traced.graph.total_flops
    est = plan.est_step_time_s
    row.update({
        "flops_per_step": flops, "planning": planning_times(searched.trace_s, plan),
        "ilp_solves": plan.planning.stage_search["ilp_solves"], "est_step_time_s": est,
        "est_tflops_per_device": tflops_per_device(flops, est, cluster.num_devices),
        "plan": plan_summary(plan), "predicted_communication": predicted_communication(plan),
        "measured": None, "cost_model": None,
    })
    row["notes"] += list(plan.notes)
    local = _local_run(case, model, options, phase) if case.local else None
    if local is not None:
        with phase(f"{case.name}: running autopar's plan"):
            timing = local.run(plan)
        row["measured"] = timing.to_dict() | {"tflops_per_device": tflops_per_device(
            flops, timing.median_s, cluster.num_devices)}

        def replan(other: ClusterSpec) -> Plan:
            return full_search(model, other, microbatches=case.microbatches,
                               pipeline_layers=case.pipeline_layers).plan

        row["cost_model"] = _cost_model(est, timing.median_s, options, cluster, phase, replan,
                                        plan)
    row["baselines"] = _baselines(case, model, cluster, traced, searched, options, local, row,
                                  phase)
    row["what_if"] = _what_if(case, model, est, cluster.num_devices, row)
    row["wall_s"] = time.perf_counter() - wall
    return row


def _local_run(case: BenchCase, model: ZooModel, options: RunOptions, phase: Phase) -> _Local:
    import autopar
    from autopar.bench.measure import local_devices, make_inputs

    with phase(f"{case.name}: making inputs"):
        inputs = make_inputs(model)
    marked = model.with_value_and_grad(autopar.value_and_grad)
    return _Local(local_devices(case.devices or options.devices), inputs, marked.train_step,
                  model.train_step, case)


def _cost_model(est_s: float, measured_s: float, options: RunOptions, cluster: ClusterSpec,
                phase: Phase, replan: Callable[[ClusterSpec], Plan], plan: Plan
                ) -> dict[str, Any]:
    """Measured over estimated step time under the default description and, with
    ``--calibrated``, under the calibrated one (re-planned: the plan may change, ``same_plan``
    says whether it did; only then is its ratio about the same program)."""
    out: dict[str, Any] = {"est_default_s": est_s, "measured_s": measured_s,
                           "measured_over_default": measured_s / est_s if est_s else None,
                           "est_calibrated_s": None, "measured_over_calibrated": None,
                           "same_plan": None}
    cal = calibrated_cluster(options, cluster.num_devices)
    if cal is not None:
        with phase("re-planning under the calibrated description"):
            other = replan(cal)
        est_cal = other.est_step_time_s
        out.update({"est_calibrated_s": est_cal,
                    "measured_over_calibrated": measured_s / est_cal if est_cal else None,
                    "same_plan": same_plan(plan, other)})
    return out


def _baselines(case: BenchCase, model: ZooModel, cluster: ClusterSpec, traced: Any,
               searched: Searched, options: RunOptions, local: _Local | None, row: dict,
               phase: Phase) -> list[dict[str, Any]]:
    est = searched.plan.est_step_time_s
    measured = (row["measured"] or {}).get("step_time_s")
    limit = options.ilp_time_limit_s
    planners: dict[Baseline, Callable[[ClusterSpec], Plan]] = {
        Baseline.SINGLE_DEVICE: lambda c: bl.plan_single_device(traced, c),
        Baseline.DATA_PARALLEL: lambda c: bl.plan_data_parallel(traced, c),
        Baseline.INTRA_OP: lambda c: bl.plan_intra_op(traced, c, limit),
        Baseline.MEGATRON: lambda c: bl.plan_megatron(traced, c, limit),
    }
    splits: dict[str, bl.PipelineSplits] = {}  # one search for both hand splits
    out = []
    for baseline in case.baselines:
        entry: dict[str, Any] = {"name": baseline.value, "est_step_time_s": None,
                                 "est_ratio": None, "measured_step_time_s": None,
                                 "measured_ratio": None, "note": "", "error": None}
        try:
            with phase(f"{case.name}: baseline {baseline.value}"):
                if baseline in (Baseline.EQUAL_LAYER, Baseline.EQUAL_OPERATOR):
                    _pipeline_baseline(baseline, searched, cluster, splits, entry)
                elif baseline is Baseline.MEGATRON and case.model not in MEGATRON_FAMILIES:
                    entry["note"] = f"Megatron's specs name GPT blocks; not for {case.model}"
                else:
                    _plan_baseline(baseline, planners[baseline], cluster, local, options,
                                   phase, entry)
        except AutoparError as err:
            entry["error"] = " ".join(str(err).split())
        if entry["est_step_time_s"] is not None and entry.get("est_ratio") is None and est:
            entry["est_ratio"] = entry["est_step_time_s"] / est
        if entry["measured_step_time_s"] is not None and measured:
            entry["measured_ratio"] = entry["measured_step_time_s"] / measured
        out.append(entry)
    return out


def _plan_baseline(baseline: Baseline, planner: Callable[[ClusterSpec], Plan],
                   cluster: ClusterSpec, local: _Local | None, options: RunOptions,
                   phase: Phase, entry: dict) -> None:
    plan = planner(cluster)
    entry.update({"est_step_time_s": plan.est_step_time_s, "plan": plan_summary(plan),
                  "planning_s": plan.planning.planning_time_s,
                  "predicted_communication": predicted_communication(plan)})
    if local is None:
        if baseline is Baseline.SINGLE_DEVICE:
            entry["note"] = "estimated: the step's compute on one device"
        return
    if baseline is Baseline.SINGLE_DEVICE:
        from autopar.bench.measure import measure_single_device

        timing = measure_single_device(local.plain_step_fn, local.inputs, local.devices[0],
                                       local.case.warmup_steps, local.case.timed_steps)
    else:
        timing = local.run(plan)
    entry["measured"] = timing.to_dict()
    entry["measured_step_time_s"] = timing.median_s
    entry["hlo_collectives"] = timing.hlo_collectives
    entry["cost_model"] = _cost_model(plan.est_step_time_s, timing.median_s, options,
                                      cluster, phase, planner, plan)


def _pipeline_baseline(baseline: Baseline, searched: Searched, cluster: ClusterSpec,
                       memo: dict[str, bl.PipelineSplits], entry: dict) -> None:
    """Equal-layer or equal-operator stages, estimated by the stage DP's own formula
    (sum + (M - 1) x max of the stage times) and compared with the DP's stages under it.
    ``memo`` keeps the splits for the other kind."""
    if "splits" not in memo:
        memo["splits"] = bl.pipeline_splits(searched.pp, searched.method, cluster,
                                            searched.cache, len(searched.plan.stages))
    splits = memo["splits"]
    part, dp = splits.partitions[baseline.value], splits.partitions["dp"]
    entry.update({"est_step_time_s": part.total_time, "est_ratio": part.total_time / dp.total_time,
                  "plan": partition_summary(part), "note": splits.note})


def _what_if(case: BenchCase, model: ZooModel, est_s: float, devices: int,
             row: dict) -> dict[str, Any] | None:
    """autopar's estimate beside the published figure (what-if cases only). For GPT both are
    also put on one count, Alpa's formula without the recomputed forward: autopar's estimate
    has no rematerialisation (memory is not enforced), while the published run recomputed the
    forward and counted it, so its figure is scaled by 72 / 96 of the layers' flops."""
    pub = case.published
    if pub is None:
        return None
    gpt = case.model == "gpt"
    plain = alpa_gpt_flops(model.config, checkpoint_activations=False) if gpt else None
    est_alpa = tflops_per_device(plain, est_s, devices) if plain else None
    published_plain = None
    if gpt and pub.tflops_per_device is not None:
        share = plain / alpa_gpt_flops(model.config, checkpoint_activations=True)
        published_plain = pub.tflops_per_device * (share if pub.counts_recompute else 1.0)
    return {
        "est_tflops_per_device": row["est_tflops_per_device"],
        "est_tflops_per_device_alpa_formula": est_alpa,
        "published_tflops_per_device": pub.tflops_per_device,
        "published_tflops_per_device_without_recompute": published_plain,
        "est_over_published": (est_alpa / published_plain
                               if est_alpa and published_plain else None),
        "published_source": pub.source,
        "published_setting": pub.setting,
        "comparable": case.comparable,
    }


def run_scaling_point(point: ScalingPoint, phase: Phase) -> dict[str, Any]:
    """Plan one scaling point with the full search; its planning times by phase."""
    overrides = dict(point.overrides) | {"num_layers": point.num_layers}
    model = get_model(point.model, point.size, **overrides)
    cluster = load_cluster(point.cluster)
    cluster = cluster.with_devices(point.hosts, point.devices_per_host or cluster.devices_per_host)
    wall = time.perf_counter()
    with phase(f"scaling: {point.name}"):
        searched = full_search(model, cluster, microbatches=point.microbatches,
                               pipeline_layers=point.pipeline_layers,
                               memory_budget_bytes=NO_MEMORY_LIMIT)
    plan = searched.plan
    x = point.num_layers if point.axis is ScalingAxis.LAYERS else cluster.num_devices
    return {
        "kind": "scaling", "axis": point.axis.value, "x": x, "case": point.name,
        "model": point.model, "size": point.size, "num_layers": point.num_layers,
        "cluster": cluster.name, "hosts": cluster.num_hosts, "devices": cluster.num_devices,
        "microbatches": point.microbatches, "planning": planning_times(searched.trace_s, plan),
        "ilp_solves": plan.planning.stage_search["ilp_solves"],
        "est_step_time_s": plan.est_step_time_s, "plan": plan_summary(plan),
        "wall_s": time.perf_counter() - wall,
    }
