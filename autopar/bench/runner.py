"""Running one benchmark case: plan, compare, and (locally) run and time.

A case's row (a plain dict, one JSON line) holds the full search's planning times by phase,
its estimated step time and TFLOPS per device, the plan's summary and predicted
communication, the baselines planned in the same process (so ratios compare like with like)
and, for local cases, the measured step times, the collectives counted in the compiled HLO and
the cost model's error under the default and the calibrated cluster descriptions. A scaling
point (planning only) is ``scaling_point``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from autopar.bench import baselines as bl
from autopar.bench.hand_baselines import hand_plan_rows
from autopar.bench.one_stage import fill_entry, hand_steps, plan_for_case, timed_plans
from autopar.bench.planning import (
    OneStagePipelinePlans,
    Searched,
    alpa_gpt_flops,
    candidate_rows,
    full_search,
    ilp_solves,
    plan_summary,
    planning_times,
    predicted_communication,
    same_plan,
    tflops_per_device,
)
from autopar.bench.suites import MEGATRON_FAMILIES, NO_MEMORY_LIMIT, Baseline, BenchCase
from autopar.cluster import ClusterSpec, load_cluster
from autopar.errors import AutoparError
from autopar.models import ZooModel, get_model
from autopar.plan import MethodName, Plan

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

    def run_together(self, plans: dict[str, Plan], hand_steps: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
        """Every plan (and every step compiled by hand, ``hand_steps``) timed in interleaved
        rounds (``measure.measure_plans``): the machine's load drifts alike over all of them,
        so their ratios are steadier."""
        from autopar.bench.measure import measure_plans

        return measure_plans(self.step_fn, plans, self.inputs, self.devices,
                             self.case.warmup_steps, self.case.timed_steps,
                             hand_steps=hand_steps)


def single_local_device(local: _Local) -> ClusterSpec:
    """The default description of the first of a local case's devices, alone."""
    from autopar.runtime.local_cluster import local_cluster

    return local_cluster(local.devices[:1])


def case_cluster(case: BenchCase, options: RunOptions) -> ClusterSpec:
    """The described cluster (with ``case.hosts``), or the local devices as one host."""
    if case.cluster is None:  # a local case
        from autopar.bench.measure import local_devices
        from autopar.runtime.local_cluster import local_cluster

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
    wall = time.perf_counter()
    model = get_model(case.model, case.size, **case.config_overrides())
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
    local = _local_run(case, model, options, phase) if case.local else None
    # the search's own choice, by estimate (locally the clock may keep another candidate)
    row["search_est_step_time_s"] = searched.plan.est_step_time_s
    if local is not None:
        from autopar.bench.measure import measured_default

        # what autopar.parallelize keeps on these devices: its best candidates timed here
        with phase(f"{case.name}: timing the full search's best candidates"):
            searched.plan = measured_default(searched, local.inputs, local.devices)
    traced = searched.traced
    plan = searched.plan
    flops = traced.graph.total_flops
    est = plan.est_step_time_s
    row.update({
        "flops_per_step": flops, "planning": planning_times(searched.trace_s, plan),
        "ilp_solves": ilp_solves(plan), "est_step_time_s": est,
        "est_tflops_per_device": tflops_per_device(flops, est, cluster.num_devices),
        "plan": plan_summary(plan), "predicted_communication": predicted_communication(plan),
        "estimate": dict(plan.planning.estimate), "candidates": candidate_summaries(plan),
        "measured": None, "cost_model": None, "simple_vs_default": None,
    })
    row["notes"] += list(plan.notes)
    timings: dict[str, Any] = {}
    one_stage: OneStagePipelinePlans | str | None = None
    if local is not None:
        plans = _measured_plans(case, searched)
        hand = {}
        if Baseline.ONE_STAGE_PIPELINE in case.baselines:
            with phase(f"{case.name}: planning the one-stage pipeline and its stage"):
                one_stage = plan_for_case(case, model, cluster)
            if isinstance(one_stage, OneStagePipelinePlans):
                plans.update(timed_plans(one_stage))
                hand = hand_steps(one_stage, model, local.inputs, local.devices)
        with phase(f"{case.name}: running autopar's plan and the one-stage baselines"):
            timings = local.run_together(plans, hand)
        timing = timings.pop("autopar")
        row["measured"] = timing.to_dict() | {"tflops_per_device": tflops_per_device(
            flops, timing.median_s, cluster.num_devices)}

        def replan(other: ClusterSpec) -> Plan:
            return full_search(model, other, microbatches=case.microbatches,
                               pipeline_layers=case.pipeline_layers).plan

        row["cost_model"] = _cost_model(est, timing.median_s, options, cluster, phase, replan,
                                        plan, local)
    row["baselines"] = _baselines(case, cluster, traced, searched, options, local, row,
                                  phase, timings, one_stage)
    if case.hand_plans:
        with phase(f"{case.name}: hand plans (pinned, and jax.jit from their inputs)"):
            row["hand_plans"] = hand_plan_rows(traced, cluster, est,
                                               (row["measured"] or {}).get("step_time_s"),
                                               local, options.ilp_time_limit_s)
    row["simple_vs_default"] = _simple_vs_default(row)
    row["what_if"] = _what_if(case, model, est, cluster.num_devices, row)
    row["wall_s"] = time.perf_counter() - wall
    return row


# The one-stage methods a user would try by hand: "best simple" is the faster of them measured.
SIMPLE_BASELINES = (Baseline.DATA_PARALLEL, Baseline.INTRA_OP)
_CANDIDATE_OF = {Baseline.DATA_PARALLEL: MethodName.DATA, Baseline.INTRA_OP: MethodName.SHARD}


def _measured_plans(case: BenchCase, searched: Searched) -> dict[str, Plan]:
    """autopar's plan and the one-stage baselines the full search planned itself (the very
    plans it compared), to be timed together."""
    plans = {"autopar": searched.plan}
    for baseline in case.baselines:
        name = _CANDIDATE_OF.get(baseline)
        if name is not None and name in searched.candidates:
            plans[baseline.value] = searched.candidates[name]
    return plans


def _simple_vs_default(row: dict[str, Any]) -> dict[str, Any] | None:
    """Measured: the faster of the simple one-stage plans (data parallel, intra-op only) over
    autopar's default plan (>= 1: the default is at least as fast)."""
    measured = (row.get("measured") or {}).get("step_time_s")
    if not measured:
        return None
    simple = {b["name"]: b["measured_step_time_s"] for b in row["baselines"]
              if b["name"] in {s.value for s in SIMPLE_BASELINES}
              and b.get("measured_step_time_s")}
    if not simple:
        return None
    best = min(simple, key=simple.__getitem__)
    return {"best_simple": best, "best_simple_s": simple[best], "default_s": measured,
            "ratio": simple[best] / measured}


def candidate_summaries(plan: Plan) -> list[dict[str, Any]]:
    """The full search's candidates as a row keeps them: name, method, estimate, whether it
    fits and whether it was chosen, and its note."""
    return [{k: c.get(k) for k in ("name", "method", "est_step_time_s", "fits", "chosen",
                                   "note")} for c in candidate_rows(plan)]


def _local_run(case: BenchCase, model: ZooModel, options: RunOptions, phase: Phase) -> _Local:
    import autopar
    from autopar.bench.measure import local_devices, make_inputs

    with phase(f"{case.name}: making inputs"):
        inputs = make_inputs(model)
    marked = model.with_value_and_grad(autopar.value_and_grad)
    return _Local(local_devices(case.devices or options.devices), inputs, marked.train_step,
                  model.train_step, case)


def _cost_model(est_s: float, measured_s: float, options: RunOptions, cluster: ClusterSpec,
                phase: Phase, replan: Callable[[ClusterSpec], Plan], plan: Plan,
                local: _Local | None = None) -> dict[str, Any]:
    """Measured over estimated step time under the default description and, with
    ``--calibrated``, under the calibrated one. The calibrated description plans anew, and
    its plan may differ (``same_plan``): then that plan is run and timed too
    (``measured_calibrated_s``), so that each ratio sets an estimate beside the clock of the
    program it estimates."""
    out: dict[str, Any] = {"est_default_s": est_s, "measured_s": measured_s,
                           "measured_over_default": measured_s / est_s if est_s else None,
                           "est_calibrated_s": None, "measured_calibrated_s": None,
                           "measured_over_calibrated": None, "same_plan": None}
    cal = calibrated_cluster(options, cluster.num_devices)
    if cal is not None:
        with phase("re-planning under the calibrated description"):
            other = replan(cal)
        same = same_plan(plan, other)
        measured_cal: float | None = measured_s
        if not same:
            measured_cal = None
            if local is not None:
                with phase("running the plan the calibrated description chose"):
                    measured_cal = local.run(other).median_s
        est_cal = other.est_step_time_s
        out.update({"est_calibrated_s": est_cal, "measured_calibrated_s": measured_cal,
                    "measured_over_calibrated":
                        measured_cal / est_cal if est_cal and measured_cal else None,
                    "same_plan": same})
    return out


def _baselines(case: BenchCase, cluster: ClusterSpec, traced: Any, searched: Searched,
               options: RunOptions, local: _Local | None, row: dict, phase: Phase,
               timings: dict[str, Any],
               one_stage: OneStagePipelinePlans | str | None = None
               ) -> list[dict[str, Any]]:
    est = searched.plan.est_step_time_s
    measured = (row["measured"] or {}).get("step_time_s")
    limit = options.ilp_time_limit_s
    candidates = searched.candidates
    # one local device alone does not share the host (runtime.local_cluster): the default
    # description of that device, not one of the case's devices
    alone = single_local_device(local) if local is not None else None
    planners: dict[Baseline, Callable[[ClusterSpec], Plan]] = {
        Baseline.SINGLE_DEVICE: lambda c: bl.plan_single_device(
            traced, alone if alone is not None and c is cluster else c),
        Baseline.DATA_PARALLEL: lambda c: bl.plan_data_parallel(traced, c),
        Baseline.INTRA_OP: lambda c: bl.plan_intra_op(traced, c, limit),
        Baseline.MEGATRON: lambda c: bl.plan_megatron(traced, c, limit),
    }
    out = []
    for baseline in case.baselines:
        entry: dict[str, Any] = {"name": baseline.value, "est_step_time_s": None,
                                 "est_ratio": None, "measured_step_time_s": None,
                                 "measured_ratio": None, "note": "", "error": None}
        try:
            with phase(f"{case.name}: baseline {baseline.value}"):
                if baseline is Baseline.ONE_STAGE_PIPELINE:
                    fill_entry(one_stage, timings, entry)
                elif baseline in (Baseline.EQUAL_LAYER, Baseline.EQUAL_OPERATOR):
                    _pipeline_baseline(baseline, searched.plan, entry)
                elif baseline is Baseline.MEGATRON and case.model not in MEGATRON_FAMILIES:
                    entry["note"] = f"Megatron's specs name GPT blocks; not for {case.model}"
                else:
                    planned = candidates.get(_CANDIDATE_OF.get(baseline, ""))
                    _plan_baseline(baseline, planners[baseline], cluster, local, options,
                                   phase, entry, planned, timings.get(baseline.value))
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
                   phase: Phase, entry: dict, planned: Plan | None = None,
                   timing: Any = None) -> None:
    """``planned``: the full search's own plan of this method, when it made one (the same
    plan it compared, so the ratio compares like with like); else planned here.
    ``timing``: its measurement from the interleaved rounds, when it was timed there."""
    plan = planned if planned is not None else planner(cluster)
    entry.update({"est_step_time_s": plan.est_step_time_s, "plan": plan_summary(plan),
                  "planning_s": plan.planning.planning_time_s,
                  "predicted_communication": predicted_communication(plan)})
    if planned is not None:
        entry["note"] = "the full search's own candidate"
    if local is None:
        if baseline is Baseline.SINGLE_DEVICE:
            entry["note"] = "estimated: the step's compute on one device"
        return
    if baseline is Baseline.SINGLE_DEVICE:
        from autopar.bench.measure import measure_single_device

        timing = measure_single_device(local.plain_step_fn, local.inputs, local.devices[0],
                                       local.case.warmup_steps, local.case.timed_steps)
    elif timing is None:
        timing = local.run(plan)
    entry["measured"] = timing.to_dict()
    entry["measured_step_time_s"] = timing.median_s
    entry["hlo_collectives"] = timing.hlo_collectives
    entry["cost_model"] = _cost_model(plan.est_step_time_s, timing.median_s, options,
                                      cluster, phase, planner, plan, local)


def _pipeline_baseline(baseline: Baseline, plan: Plan, entry: dict) -> None:
    """Equal-layer or equal-operator stages: the full search evaluated them itself, as
    candidates beside the stage DP's (as many stages as the DP chose, or the nearest count
    that splits evenly; two when it chose one), with the same whole-step estimate."""
    name = f"pipeshard: {baseline.value}"
    row = next((c for c in plan.planning.candidates if c.get("name") == name), None)
    if row is None:
        reasons = [c.get("note") for c in plan.planning.candidates
                   if c.get("method") == MethodName.PIPESHARD and c.get("est_step_time_s") is None]
        entry["note"] = ("not planned: " + "; ".join(r for r in reasons if r)
                         if any(reasons) else "no stage count near the DP's splits the "
                         "layers and devices evenly, or the step is not pipelined")
        return
    stages = row.get("stages") or []
    entry.update({"est_step_time_s": row["est_step_time_s"], "note": row.get("note", ""),
                  "plan": {"num_stages": len(stages), "stages_text": ", ".join(stages)}})


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
    if plain is not None and pub.tflops_per_device is not None:  # (plain: a GPT's)
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
