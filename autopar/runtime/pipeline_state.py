"""What a pipelined step's driver holds: each stage's devices, the values of one step, which
results every device gets, and the microbatches' mean (``runtime.pipeline`` and
``runtime.async_pipeline`` drive steps with them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax

from autopar.ir.pipeline_program import PipelineProgram
from autopar.runtime.program_calls import ProgramCall

__all__ = ["StageDevices", "StepState", "microbatch_mean", "shared_outputs"]


@dataclass(frozen=True)
class StageDevices:
    """One stage's devices as a logical mesh (row-major ``device_ids``)."""

    device_ids: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]


@dataclass
class StepState:
    """Values of one step: the step's own, per-microbatch activations and cotangents."""

    env: dict[int, Any]
    placed: dict[tuple[int, int], Any] = field(default_factory=dict)
    acts: dict[tuple[int, int], Any] = field(default_factory=dict)
    cots: dict[tuple[int, int], Any] = field(default_factory=dict)
    vjps: dict[tuple[int, int], Any] = field(default_factory=dict)
    saved_cots: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    accum: dict[int, list[Any] | None] = field(default_factory=dict)
    loss_parts: dict[int, list[Any]] = field(default_factory=dict)
    # when given, every program the step runs is logged here (``runtime.pipeline_hlo``)
    calls: list[ProgramCall] | None = None


def shared_outputs(pp: PipelineProgram) -> frozenset[int]:
    """The step's results a pipelined step returns on every device: the loss function's loss
    and aux (means over the microbatches: metrics, not per-example values) as the step returns
    them, and every scalar it returns (a metric computed after the loss, say). Not: its other
    results, the new state, which stays where the stages hold it; nor an aux result the step
    returns as part of that state (one whose path below the step's result, shape and dtype
    are those of an input below its argument: Wide-ResNet's batch statistics), which the
    next step reads as it is. Replicating those cost Wide-ResNet an all-gather per statistic
    split by channel, every step, which neither its plan nor ShardParallel pays."""
    outer = pp.outer
    loss, *aux = pp.vg.outputs[: 1 + pp.loss.num_aux]
    state = {_below(path, 1, outer.avals[v]) for path, v in zip(outer.in_paths, outer.in_ids,
                                                                 strict=True)} - {None}
    fed_back = {v for path, v in zip(outer.out_paths, outer.out_ids, strict=True)
                if _below(path, 2, outer.avals[v]) in state}
    kept = {loss} | (set(aux) - fed_back)
    return frozenset(v for v in outer.out_ids
                     if v in kept or not getattr(outer.avals[v], "shape", ()))


def _below(path: str, depth: int, aval: Any) -> tuple[str, Any, Any] | None:
    """A leaf's path without its first ``depth`` parts (``state/`` for an input,
    ``out/0/`` for a result), with its shape and dtype; None for a leaf that is the whole
    argument or result (nothing below to match)."""
    parts = path.split("/")
    if len(parts) <= depth:
        return None
    return "/".join(parts[depth:]), tuple(getattr(aval, "shape", ())), getattr(aval, "dtype", None)


@jax.jit
def microbatch_mean(parts: list[Any]) -> Any:
    """The microbatches' mean of one result, summed in microbatch order (the fused step's
    loop sums in the same order)."""
    return sum(parts[1:], parts[0]) / len(parts)
