"""What a pipelined step costs as a whole: the schedule's device time, the per-step tails, and
the driver's own work on the host.

The stage search compares stage partitions by Alpa's formula (``stage_dp``); this module is
the estimate every pipelined candidate is finally judged by, the same one the one-stage
plans are compared with (``planners/auto``: the full search keeps the least of them):

    step = before + max over stages (end of the stage's last task + its tail) + host

- the schedule simulated with each stage's forward and backward times per microbatch
  (``ir.schedule_timeline``: a forward is a third of a stage's time, a backward two thirds);
- each stage's *tail* once per step after its last backward: the gradients' reduction over
  its devices, the step's optimizer update of its parameters and, when the pipeline is
  replicated over groups of hosts, the replicas' all-reduce of those gradients;
- *before*: the step's equations before the loss function (batch preprocessing);
- *host*: the driver's work, one host thread issuing every task, transfer and small
  operation of the step one after the other (``runtime/pipeline.py``), counted from the
  pieces and the schedule (:func:`driver_counts`) and priced with the cluster's
  ``RuntimeCosts``. A one-stage plan, and a one-stage pipeline (``runtime.fused_step``), pays
  one call of one program instead.

Pure: no devices, no JAX arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.cluster import ClusterSpec, RuntimeCosts
from autopar.compiler.cost.collectives import allreduce_time
from autopar.compiler.cost.estimate import CallArrays, one_call_time_s
from autopar.ir.pieces import Piece
from autopar.ir.pipeline_pieces import least_cut_transfers, piece_roles
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.pipeline_segments import Segment, plan_segments
from autopar.ir.schedule_orders import make_schedule
from autopar.ir.schedule_timeline import stage_timeline, steady_state
from autopar.ir.schedules import ScheduleName, is_async

__all__ = [
    "DriverCounts",
    "PipelineEstimate",
    "driver_counts",
    "least_driver_counts",
    "runs_as_one_program",
    "estimate_pipeline",
    "replica_allreduce_time",
]


@dataclass(frozen=True)
class DriverCounts:
    """What the pipeline driver issues per step: ``tasks`` (jitted stage programs: forward,
    backward and weight-gradient tasks, segments, the losses' means, the microbatches' cut),
    ``small_ops`` (eager operations: cotangent and gradient sums) and
    ``transfers`` (``jax.device_put`` calls placing values on a stage); ``calls``: calls of
    one program holding the whole step (a one-stage pipeline's, ``runtime.fused_step``)."""

    tasks: int
    small_ops: int
    transfers: int
    calls: int = 0

    def seconds(self, runtime: RuntimeCosts, one_call_s: float | None = None) -> float:
        """Host seconds per step; ``one_call_s``: each call of the whole step's program, its
        arrays' buffers and its batch's arrival included (``one_program_call_s``; default:
        the bare call)."""
        call_s = runtime.call_s if one_call_s is None else one_call_s
        return (self.calls * call_s + (self.tasks + self.small_ops) * runtime.task_s
                + self.transfers * runtime.transfer_s)

    def to_dict(self) -> dict[str, int]:
        return {"tasks": self.tasks, "small_ops": self.small_ops, "transfers": self.transfers,
                "calls": self.calls}


def runs_as_one_program(schedule: str, num_stages: int) -> bool:
    """Whether the runtime runs the pipelined step as one program (``runtime.fused_step``):
    one stage under a synchronous schedule, where nothing waits on another stage."""
    return num_stages == 1 and not is_async(schedule)


def driver_counts(pp: PipelineProgram, pieces: Sequence[Piece], stage_of_piece: Sequence[int],
                  schedule: str, num_microbatches: int, num_chunks: int = 1,
                  segments: Sequence[Segment] | None = None) -> DriverCounts:
    """The driver's operations per step for ``pieces`` owned by ``stage_of_piece`` (as
    ``runtime.pipeline.PipelineRunner`` runs them: one task per schedule entry, each input of
    a forward placed on its stage per microbatch unless it is a step input, fetched once per
    stage; each output cotangent placed for the backward, each input gradient sent back).
    A synchronous one-stage pipeline is one call of one program (``runtime.fused_step``, the
    runtime's default for one stage): the accumulation, the microbatches' cut and the
    segments are inside it."""
    m = num_microbatches
    stages = max(stage_of_piece) + 1
    if runs_as_one_program(schedule, stages):
        return DriverCounts(0, 0, 0, calls=1)
    sched = make_schedule(schedule, stages, m, num_chunks)
    tasks = sum(len(stage_tasks) for stage_tasks in sched.tasks)
    loss_inputs = set(pp.operand_of)
    small = transfers = 0
    fetched: set[tuple[int, int]] = set()
    for piece in pieces:
        stage = stage_of_piece[piece.index]
        roles = piece_roles(pp, piece)
        per_microbatch = 0
        for v in (*roles.diff, *roles.nondiff):
            if v in loss_inputs and v not in pp.split_inputs:
                fetched.add((pp.operand_of[v], stage))
            else:
                per_microbatch += 1
        per_microbatch += len(roles.float_outputs)  # cotangents placed for the backward
        per_microbatch += len(roles.acts)  # input gradients sent to their producer
        transfers += m * per_microbatch
        # no accumulators' zeros: the first backward's gradients are the accumulators
    transfers += len(fetched)
    tasks += len(pp.split_inputs)  # one program cuts each split input into its microbatches
    # the loss's cotangent seed is made and placed once, then reused
    outputs = len(pp.loss_outputs)
    tasks += outputs  # the mean over microbatches of each loss output
    transfers += outputs * m
    consumers: dict[int, int] = {}
    for piece in pieces:
        for v in piece.inputs:
            consumers[v] = consumers.get(v, 0) + 1
    for fid in pp.diff_inputs:
        transfers += max(consumers.get(fid, 0), 1)  # each gradient to its home stage
        small += max(consumers.get(fid, 0) - 1, 0)  # summed over the pieces reading it
    if segments is None:  # (given: ``plan_segments`` of these pieces and stages)
        segments, _ = plan_segments(pp, list(pieces), list(stage_of_piece))
    if is_async(schedule):  # each stage's update per version instead of the segments after
        segments = [seg for seg in segments if seg.phase == "before"]
        tasks += stages * (m if schedule == ScheduleName.PIPEDREAM else 1)
    tasks += len(segments)
    transfers += sum(len(seg.inputs) for seg in segments)
    return DriverCounts(tasks, small, transfers)


def least_driver_counts(pp: PipelineProgram, num_microbatches: int,
                        asynchronous: bool = False) -> DriverCounts:
    """What ``driver_counts`` counts for every pipeline of two or more stages of ``pp``,
    wherever its stages are cut: a forward and a backward task per stage and microbatch, the
    microbatches' cut and the losses' means; per microbatch, the slice of every batch leaf
    the forward reads placed on a stage that reads it, each loss output placed and what the
    first cut sends (``least_cut_transfers``, the least over every cut point); every other
    loss input the forward reads fetched once; every gradient sent home; and the step's
    equations outside the loss run as segments (``_least_segments``). ``asynchronous``: an
    asynchronous schedule may be the one, which runs the update in its stages' tasks. A floor
    under the driver's time (``seconds``): the pipelines' least host time."""
    m = num_microbatches
    fwd = pp.forward
    loss_inputs = set(fwd.in_ids)
    read = {v for eqn in fwd.eqns for v in eqn.inputs if v in loss_inputs}
    split = read & pp.split_inputs
    outputs = len(pp.loss_outputs)
    segment_tasks, segment_inputs = _least_segments(pp, asynchronous)
    tasks = 2 * 2 * m + len(pp.split_inputs) + outputs + segment_tasks
    fetched = {pp.operand_of[v] for v in read - split}
    per_microbatch = len(split) + outputs + least_cut_transfers(pp)
    transfers = m * per_microbatch + len(fetched) + len(pp.diff_inputs) + segment_inputs
    return DriverCounts(tasks, 0, transfers)


def _least_segments(pp: PipelineProgram, asynchronous: bool) -> tuple[int, int]:
    """The fewest segment tasks and segment inputs placed (``plan_segments``) of any
    partition: a segment per phase that has equations at least, and every value a segment
    reads that no segment makes (the step's inputs, the gradients) placed once at least. An
    asynchronous schedule keeps only the segments before the pipeline and runs a task per
    stage (two at least) for its updates instead."""
    skipped = pp.driver_eqns
    after = pp.after_gradients
    eqns = [e for e in pp.outer.eqns if e.index not in skipped]
    made = {v for e in eqns for v in e.outputs} | pp.outer_constants

    def least(phases: tuple[bool, ...]) -> tuple[int, int]:
        kept = [e for e in eqns if (e.index in after) in phases]
        present = {e.index in after for e in kept}
        return len(present), len({v for e in kept for v in e.inputs} - made)

    tasks, inputs = least((False, True))
    if asynchronous:
        before_tasks, before_inputs = least((False,))
        tasks, inputs = min(tasks, before_tasks + 2), min(inputs, before_inputs)
    return tasks, inputs


def replica_allreduce_time(whole_param_bytes: float, stage_devices: int, replicas: int,
                           cluster: ClusterSpec) -> float:
    """Seconds that ``replicas`` copies of a stage, each on its own group of hosts, add to the
    stage's own gradient reduction to all-reduce its ``whole_param_bytes`` of gradients
    between them, done hierarchically as NCCL and Megatron-LM's data-parallel groups do:
    inside the stage the gradients are reduce-scattered over its ``stage_devices`` devices
    (rather than all-reduced: the same bytes, already priced in the stage's tail), each device
    all-reduces its ``1 / stage_devices`` slice with the same device of every other replica
    over the links between hosts, and the stage all-gathers the result (the other half of its
    own all-reduce's bytes). Priced as one flat all-reduce of each device's whole gradients
    per replica group, it would count the bytes crossing the hosts' links twice and make a
    cluster of more hosts look slower at the same batch."""
    if replicas <= 1 or whole_param_bytes <= 0:
        return 0.0
    link = cluster.inter_host
    return allreduce_time(whole_param_bytes / max(stage_devices, 1), replicas, link.alpha,
                          link.beta)


@dataclass(frozen=True)
class PipelineEstimate:
    """A pipelined step's estimate and its parts (seconds per step)."""

    total_s: float
    makespan_s: float  # the schedule's tasks, simulated
    tail_s: float  # what the stages' tails add after the schedule's end
    before_s: float  # the step's equations before the loss function
    host_s: float  # the driver's work (see DriverCounts)
    idle_fraction: float
    theoretical_idle_fraction: float
    counts: DriverCounts | None = None
    # of the schedule's time, per step and summed over the stages: the gradients' additions
    # into their accumulators (what a one-stage step does not do)
    accumulate_s: float = 0.0

    @property
    def device_s(self) -> float:
        return self.before_s + self.makespan_s + self.tail_s

    def to_dict(self) -> dict[str, Any]:
        """The parts, for the plan's planning record."""
        out: dict[str, Any] = {
            "total_s": self.total_s, "schedule_s": self.makespan_s, "tails_s": self.tail_s,
            "before_s": self.before_s, "host_s": self.host_s,
        }
        out["accumulate_s"] = self.accumulate_s
        if self.counts is not None:
            out["driver"] = self.counts.to_dict()
        return out


def estimate_pipeline(schedule: str, num_microbatches: int, stage_times: Sequence[float],
                      stage_tails: Sequence[float], *, num_chunks: int = 1,
                      before_s: float = 0.0, host_s: float = 0.0,
                      counts: DriverCounts | None = None,
                      accumulate_s: float = 0.0) -> PipelineEstimate:
    """The step's estimate for stages taking ``stage_times[s]`` per microbatch (forward and
    backward) and ``stage_tails[s]`` once after their last task (see the module docstring).

    Asynchronous schedules: one call's share of their steady state (calls back to back, no
    drain), each stage's tail (its update) after every backward that writes a version."""
    if is_async(schedule):
        steady = steady_state(schedule, list(stage_times), num_microbatches, list(stage_tails))
        total = before_s + steady.call_s + host_s
        return PipelineEstimate(total, steady.call_s, 0.0, before_s, host_s,
                                steady.idle_fraction, 0.0, counts, accumulate_s)
    timeline = stage_timeline(schedule, list(stage_times), num_microbatches, num_chunks)
    ends = [0.0] * len(stage_times)
    for task, (_, end) in timeline.spans.items():
        ends[task.stage] = max(ends[task.stage], end)
    makespan = timeline.makespan
    finish = max((end + tail for end, tail in zip(ends, stage_tails, strict=True)),
                 default=makespan)
    tail = max(finish - makespan, 0.0)
    total = before_s + makespan + tail + host_s
    return PipelineEstimate(total, makespan, tail, before_s, host_s, timeline.idle_fraction,
                            timeline.theoretical_idle_fraction, counts, accumulate_s)


def one_program_call_s(pp: PipelineProgram, cluster: ClusterSpec) -> float:
    """The call of a step over every device of ``cluster`` run as one program: the call, its
    arrays' buffers and its batch fed (``cost.estimate.one_call_time_s``)."""
    call = CallArrays(len(pp.outer.in_paths) + len(pp.outer.out_paths), len(pp.split_inputs))
    return one_call_time_s(cluster.runtime, call,
                           min(cluster.num_devices, cluster.devices_per_host))


def tasks_per_microbatch(schedule: str) -> int:
    """Tasks a piece runs per microbatch: forward and backward, and the weight gradient
    apart under zero-bubble schedules."""
    return 3 if schedule == ScheduleName.ZB_H1 else 2


def stage_host_seconds(runtime: RuntimeCosts, schedule: str, num_microbatches: int,
                       only_stage: bool, puts_per_microbatch: Any, params: Any,
                       fixed: Any, one_call_s: float | None = None) -> Any:
    """The driver's seconds per step for a stage (``only_stage``: it holds every device),
    from what its layers send per microbatch and hold (numbers, or arrays of them over
    layer ranges: the same operations either way). ``one_call_s``: the step's call when it
    runs as one program, its arrays' buffers and its batch's arrival included
    (``one_program_call_s``; default: the bare call)."""
    if only_stage and runs_as_one_program(schedule, 1):
        # the only stage: the runtime runs the step as one program (runtime.fused_step)
        return runtime.call_s if one_call_s is None else one_call_s
    per_task = tasks_per_microbatch(schedule)
    return (num_microbatches * (per_task * runtime.task_s
                                + puts_per_microbatch * runtime.transfer_s)
            # each gradient sent to its home stage (the first backward's gradients are the
            # accumulators: no zeros made and placed)
            + params * runtime.transfer_s
            + fixed * runtime.transfer_s)
