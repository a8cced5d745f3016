"""Stage construction: Alpa's inter-operator dynamic program, its public entry points.

The model's ``L`` layers are cut into contiguous stages, each placed on a submesh
(:mod:`autopar.compiler.inter_op.submesh`). The caller prices every (layer range, submesh)
pair with one
:class:`StageCandidate` per logical mesh shape it tried; :func:`solve_stages` picks the stages
that minimise the pipeline latency ``sum_i t_i + (m - 1) * max_i t_i`` (:func:`pipeline_time`)
on all devices of the cluster within the per-device memory budget. The search itself (the DP
and the branch and bound over stage-time caps) lives in :mod:`autopar.compiler.inter_op.stage_dp`;
:attr:`StagePartition.exact` says whether it had to thin the caps.

:func:`uniform_stages` and :func:`manual_stages` evaluate given stages on the same table, as
baselines. The options (:mod:`autopar.compiler.inter_op.stage_options`) and the submesh shapes,
candidates and cost table (:mod:`autopar.compiler.inter_op.submesh`) are re-exported here.
Pure Python +
numpy; no devices, no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.compiler.inter_op.stage_dp import pipeline_time, prepare_problems
from autopar.compiler.inter_op.stage_options import StageDPOptions
from autopar.compiler.inter_op.stage_search import search_stages
from autopar.compiler.inter_op.submesh import (
    CandidateFn,
    StageCandidate,
    StageCostTable,
    SubmeshShape,
    place_submeshes,
    submesh_shapes,
)
from autopar.errors import PlanError, choices_text

__all__ = [
    "CandidateFn",
    "StageAssignment",
    "StageCandidate",
    "StageCostTable",
    "StageDPOptions",
    "StagePartition",
    "SubmeshShape",
    "manual_stages",
    "pipeline_time",
    "place_submeshes",
    "solve_stages",
    "submesh_shapes",
    "uniform_stages",
]


@dataclass(frozen=True)
class StageAssignment:
    """One stage: layers ``[start, end)`` on ``submesh``, run as ``candidate``."""

    start: int
    end: int
    submesh: SubmeshShape
    candidate: StageCandidate

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "start": self.start,
            "end": self.end,
            "submesh": self.submesh.to_dict(),
            "candidate": self.candidate.to_dict(),
        }


@dataclass(frozen=True)
class StagePartition:
    """A chosen set of stages and its pipeline latency.

    ``total_time = sum(t_i) + (num_microbatches - 1) * max_stage_time``. ``exact`` is False when
    the search thinned the stage-time caps (``tmax_relative_gap`` > 0), so a better partition
    may exist; ``num_tmax_tried`` counts the DP runs (0 for evaluated baselines).
    """

    stages: tuple[StageAssignment, ...]
    num_microbatches: int
    total_time: float
    max_stage_time: float
    exact: bool
    num_tmax_tried: int
    tmax_relative_gap: float = 0.0

    @property
    def submeshes(self) -> tuple[SubmeshShape, ...]:
        """The stages' submesh shapes, in stage order."""
        return tuple(stage.submesh for stage in self.stages)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "stages": [stage.to_dict() for stage in self.stages],
            "num_microbatches": self.num_microbatches,
            "total_time": self.total_time,
            "max_stage_time": self.max_stage_time,
            "exact": self.exact,
            "num_tmax_tried": self.num_tmax_tried,
            "tmax_relative_gap": self.tmax_relative_gap,
        }


def solve_stages(
    table: StageCostTable, num_hosts: int, devices_per_host: int, options: StageDPOptions
) -> StagePartition:
    """The stages minimising ``sum(t_i) + (m - 1) * max(t_i)`` on all devices of the cluster.

    Each stage's memory counts the microbatches the schedule really holds on it
    (``options.in_flight(stage, num_stages)``); for schedules where that depends on the stage
    count the search runs per count (:mod:`autopar.compiler.inter_op.stage_dp`).

    Raises PlanError (one line, with the numbers) when ``num_stages`` exceeds the layers or
    devices, or when no assignment fits (naming the least per-device memory one would need).
    """
    problems = prepare_problems(table, num_hosts, devices_per_host, options)
    found = search_stages(problems, num_hosts, devices_per_host, options)
    best, problem = found.best, found.problem
    stages = tuple(
        StageAssignment(
            start=k,
            end=e,
            submesh=table.submeshes[problem.table_index[j]],
            candidate=table.candidates(k, e, problem.table_index[j])[c],
        )
        for (k, e, j, _), c in zip(best.stages, best.candidates, strict=True)
    )
    return StagePartition(
        stages=stages,
        num_microbatches=options.num_microbatches,
        total_time=best.total,
        max_stage_time=best.max_time,
        exact=bool(found.gap == 0.0),
        tmax_relative_gap=found.gap,
        num_tmax_tried=found.num_tried,
    )


# ----------------------------------------------------------------------------- baselines


def _evaluate(
    table: StageCostTable,
    layer_ranges: Sequence[tuple[int, int]],
    shapes: Sequence[SubmeshShape],
    num_hosts: int,
    per_host: int,
    options: StageDPOptions,
    what: str,
) -> StagePartition:
    """The given stages, each run as its fastest candidate that fits the memory budget."""
    indices = [table.submesh_index(shape) for shape in shapes]
    place_submeshes(shapes, num_hosts, per_host)
    count, m = len(layer_ranges), options.num_microbatches
    stages = []
    for position, ((start, end), shape, index) in enumerate(
        zip(layer_ranges, shapes, indices, strict=True)
    ):
        in_flight = options.in_flight(position, count)
        versions = options.weight_versions(position, count)
        found = table.candidates(start, end, index)
        fitting = [c for c in found if options.fits(c.memory(in_flight, versions))]
        if not fitting:
            label = f"{what}: stage {position} (layers [{start}, {end}) on {shape})"
            if not found:
                raise PlanError(f"{label} has no candidate in the cost table")
            least = min(c.memory(in_flight, versions) for c in found)
            raise PlanError(
                f"{label} needs at least {least:.0f} bytes per device with {in_flight:g} "
                f"microbatches in flight ({options.schedule}); the budget is "
                f"{options.memory_budget_bytes:.0f}"
            )
        fastest = min(fitting, key=lambda c: (c.sum_part(m) + (m - 1) * c.max_part(m)))
        stages.append(StageAssignment(start, end, shape, fastest))
    times = [stage.candidate.max_part(m) for stage in stages]
    sums = [stage.candidate.sum_part(m) for stage in stages]
    return StagePartition(
        stages=tuple(stages),
        num_microbatches=m,
        total_time=pipeline_time(times, m, sums),
        max_stage_time=max(times),
        exact=True,
        num_tmax_tried=0,
    )


def uniform_stages(
    table: StageCostTable,
    num_stages: int,
    num_hosts: int,
    devices_per_host: int,
    options: StageDPOptions,
) -> StagePartition:
    """The baseline: ``num_stages`` stages of equal layer counts on equal submeshes.

    Only ``options``' microbatches, schedule and memory budget are used. PlanError (naming the
    numbers and the stage counts that do divide) when the layers or devices do not split.
    """
    layers, devices = table.num_layers, num_hosts * devices_per_host

    def shape_for(count: int) -> SubmeshShape | None:
        if layers % count or devices % count:
            return None
        width = devices // count
        shape = (
            SubmeshShape(1, width)
            if width <= devices_per_host
            else SubmeshShape(width // devices_per_host, devices_per_host)
        )
        ok = shape.num_devices == width and shape in table.submeshes
        return shape if ok and shape.fits(num_hosts, devices_per_host) else None

    valid = [c for c in range(1, min(layers, devices) + 1) if shape_for(c) is not None]
    shape = shape_for(num_stages) if 1 <= num_stages <= min(layers, devices) else None
    if shape is None:
        raise PlanError(
            f"uniform stages: {num_stages} stages do not split {layers} layers and {devices} "
            f"devices ({num_hosts} hosts x {devices_per_host}) evenly onto submeshes of the "
            f"table; choices: {choices_text(valid)}"
        )
    per = layers // num_stages
    ranges = [(i * per, (i + 1) * per) for i in range(num_stages)]
    return _evaluate(
        table, ranges, [shape] * num_stages, num_hosts, devices_per_host, options, "uniform stages"
    )


def manual_stages(
    table: StageCostTable,
    layer_ranges: Sequence[tuple[int, int]],
    submesh_shapes: Sequence[SubmeshShape],
    num_hosts: int,
    devices_per_host: int,
    options: StageDPOptions,
) -> StagePartition:
    """The user's stages, validated and evaluated on ``table`` like :func:`solve_stages`'s.

    The ranges must cover layers ``0..L-1`` contiguously, one submesh per range, and the
    submeshes must use exactly the cluster's devices; PlanError (one line) otherwise.
    """
    layers, devices = table.num_layers, num_hosts * devices_per_host
    ranges = [(int(start), int(end)) for start, end in layer_ranges]
    if len(ranges) != len(submesh_shapes) or not ranges:
        raise PlanError(
            f"manual stages: {len(ranges)} layer ranges but {len(submesh_shapes)} submeshes; "
            "give one submesh per range and at least one range"
        )
    expected_start = 0
    for start, end in ranges:
        if start != expected_start or end <= start:
            raise PlanError(
                f"manual stages: layer ranges {ranges} must be non-empty [start, end) pairs "
                f"covering 0..{layers - 1} in order; range [{start}, {end}) should start at "
                f"{expected_start}"
            )
        expected_start = end
    if expected_start != layers:
        raise PlanError(
            f"manual stages: layer ranges {ranges} end at layer {expected_start} but the model "
            f"has {layers} layers"
        )
    used = sum(shape.num_devices for shape in submesh_shapes)
    if used != devices:
        raise PlanError(
            f"manual stages: submeshes use {used} devices but the cluster has {devices} "
            f"({num_hosts} hosts x {devices_per_host})"
        )
    return _evaluate(
        table, ranges, submesh_shapes, num_hosts, devices_per_host, options, "manual stages"
    )
