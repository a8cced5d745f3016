"""The bench's one-stage pipeline baseline (local cases): the pipeline with one stage over
every device, timed in the case's rounds beside the same pipeline at one microbatch, its
stage run by ShardParallel (``planning.OneStagePipelinePlans``) and the same microbatches
accumulated by a hand-written step under ``jax.jit`` from that ShardParallel plan's input
layouts (``hand_accumulation``), and the entry that sets the four side by side."""

from __future__ import annotations

from typing import Any

from autopar.bench.hand_accumulation import HandStep, jit_accumulation
from autopar.bench.planning import (
    OneStagePipelinePlans,
    plan_one_stage_pipeline,
    plan_summary,
    predicted_communication,
)
from autopar.bench.suites import Baseline, BenchCase
from autopar.cluster import ClusterSpec
from autopar.errors import AutoparError
from autopar.models import ZooModel
from autopar.plan import Plan

__all__ = ["fill_entry", "hand_steps", "plan_for_case", "timed_plans"]

# the names the one-stage pipeline, it at one microbatch and its stage run by ShardParallel
# are timed under
_ONE_STAGE = Baseline.ONE_STAGE_PIPELINE.value
_ONE_MICROBATCH = f"{_ONE_STAGE}: one microbatch"
_SAME_STAGE = f"{_ONE_STAGE}: its stage by ShardParallel"
_HAND_ACCUMULATION = f"{_ONE_STAGE}: its microbatches accumulated by hand under jax.jit"


def plan_for_case(case: BenchCase, model: ZooModel, cluster: ClusterSpec
                    ) -> OneStagePipelinePlans | str:
    """The one-stage pipeline, it at one microbatch and its stage as a ShardParallel plan, or
    why not (the error)."""
    try:
        return plan_one_stage_pipeline(model, cluster, microbatches=case.microbatches,
                                       pipeline_layers=case.pipeline_layers)
    except AutoparError as err:
        return " ".join(str(err).split())


def timed_plans(one_stage: OneStagePipelinePlans) -> dict[str, Plan]:
    """The three plans under the names they are timed under, in the case's same rounds."""
    return {_ONE_STAGE: one_stage.pipelined, _ONE_MICROBATCH: one_stage.one_microbatch,
            _SAME_STAGE: one_stage.same_stage}


def hand_steps(one_stage: OneStagePipelinePlans, model: ZooModel, inputs: Any,
               devices: list[Any]) -> dict[str, HandStep]:
    """The pipeline's microbatches accumulated by a hand-written step (``lax.scan``) under
    ``jax.jit`` with the input layouts of its stage run by ShardParallel, under the name it
    is timed under."""
    return {_HAND_ACCUMULATION: jit_accumulation(
        model, one_stage.pipelined.num_microbatches, one_stage.same_stage, inputs, devices)}


def fill_entry(one_stage: OneStagePipelinePlans | str | None,
                        timings: dict[str, Any], entry: dict) -> None:
    """The one-stage pipeline's entry: its estimate and measurement, and beside them (measured
    in the same rounds) the same stage run by ShardParallel and the pipeline at one
    microbatch, with the ratios that split the pipeline's cost over ShardParallel into the
    microbatches' own (pipeline / one microbatch) and the runtime's (one microbatch /
    ShardParallel); and the same microbatches accumulated by hand under ``jax.jit``: pipeline
    / it is what the runtime costs beyond the work the plan asks for."""
    if one_stage is None:
        entry["note"] = "local cases only: timed beside its stage run by ShardParallel"
        return
    if isinstance(one_stage, str):
        entry["error"] = one_stage
        return
    plan = one_stage.pipelined
    timing, same_timing = timings[_ONE_STAGE], timings[_SAME_STAGE]
    single = timings[_ONE_MICROBATCH].median_s
    hand = timings[_HAND_ACCUMULATION]
    entry.update({"est_step_time_s": plan.est_step_time_s, "plan": plan_summary(plan),
                  "predicted_communication": predicted_communication(plan),
                  "measured": timing.to_dict(), "measured_step_time_s": timing.median_s,
                  "hlo_collectives": timing.hlo_collectives,
                  "same_stage_shard_s": same_timing.median_s,
                  "over_same_stage_shard": timing.median_s / same_timing.median_s,
                  "one_microbatch_s": single,
                  "one_microbatch_over_same_stage_shard": single / same_timing.median_s,
                  "over_one_microbatch": timing.median_s / single,
                  "hand_accumulation_s": hand.median_s,
                  "hand_accumulation_collectives": hand.hlo_collectives,
                  "over_hand_accumulation": timing.median_s / hand.median_s,
                  "cost_model": {"est_default_s": plan.est_step_time_s,
                                 "measured_s": timing.median_s,
                                 "measured_over_default": timing.median_s
                                 / plan.est_step_time_s if plan.est_step_time_s else None,
                                 "est_calibrated_s": None, "measured_calibrated_s": None,
                                 "measured_over_calibrated": None, "same_plan": None}})
    mesh = "x".join(str(d) for d in plan.stages[0].logical_mesh_shape)
    single_mesh = "x".join(str(d) for d in one_stage.one_microbatch.stages[0].logical_mesh_shape)
    entry["note"] = (f"{plan.num_microbatches} microbatches; ShardParallel on the same "
                     f"{mesh} mesh: {same_timing.median_s:.3g} s (pipeline / it: "
                     f"{entry['over_same_stage_shard']:.2f}); the pipeline at one microbatch "
                     f"({single_mesh}): {single:.3g} s (it / ShardParallel: "
                     f"{entry['one_microbatch_over_same_stage_shard']:.2f}, pipeline / it: "
                     f"{entry['over_one_microbatch']:.2f}); its microbatches accumulated by "
                     f"hand (lax.scan) under jax.jit: {hand.median_s:.3g} s (pipeline / it: "
                     f"{entry['over_hand_accumulation']:.2f})")
