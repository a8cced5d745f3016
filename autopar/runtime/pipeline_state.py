"""What a pipelined step's driver holds: each stage's devices, the values of one step, which
results every device gets, and the microbatches' mean (``runtime.pipeline`` and
``runtime.async_pipeline`` drive steps with them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.program import carried_inputs
from autopar.runtime.program_calls import ProgramCall

__all__ = ["StageDevices", "StepState", "is_averaged", "microbatch_mean", "shared_outputs"]


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
    # per (value, stage, loss input or None): the value placed on that stage
    placed: dict[tuple[int, int, int | None], Any] = field(default_factory=dict)
    acts: dict[tuple[int, int], Any] = field(default_factory=dict)
    cots: dict[tuple[int, int], Any] = field(default_factory=dict)
    # per (piece, microbatch): its forward's residuals (``runtime.vjp_residuals``)
    residuals: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    # per piece: its parameters' copies, made once per step (``runtime.param_copies``)
    copies: dict[int, list[Any]] = field(default_factory=dict)
    saved_cots: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    # per piece: its parameters' gradients summed over the microbatches run so far
    accum: dict[int, list[Any]] = field(default_factory=dict)
    # when given, every program the step runs is logged here (``runtime.pipeline_hlo``)
    calls: list[ProgramCall] | None = None


def shared_outputs(pp: PipelineProgram) -> frozenset[int]:
    """The step's results a pipelined step returns on every device: the loss function's loss
    and aux (means over the microbatches: metrics, not per-example values) as the step returns
    them, and every scalar it returns (a metric computed after the loss, say). Not: its other
    results, the new state, which stays where the stages hold it; nor an aux result the step
    returns as the new value of a state input (``ir.program.carried_inputs``: Wide-ResNet's
    batch statistics), which the next step reads as it is. Replicating those cost Wide-ResNet
    an all-gather per statistic split by channel, every step, which neither its plan nor
    ShardParallel pays."""
    outer = pp.outer
    batch = {pp.operand_of[f] for f in pp.split_inputs}
    state = [(path, arg, outer.avals[v].shape) for path, arg, v in
             zip(outer.in_paths, outer.leaf_arg_indices(), outer.in_ids, strict=True)
             if v not in batch]
    carried = carried_inputs(state, [(path, getattr(outer.avals[v], "shape", ()))
                                     for path, v in zip(outer.out_paths, outer.out_ids,
                                                        strict=True)])
    fed_back = {outer.out_ids[j] for j in carried}
    loss, *aux = pp.vg.outputs[: 1 + pp.loss.num_aux]
    kept = {loss} | (set(aux) - fed_back)
    return frozenset(v for v in outer.out_ids
                     if v in kept or not getattr(outer.avals[v], "shape", ()))


def is_averaged(value: Any) -> bool:
    """Whether a loss-function result is averaged over the microbatches: an inexact one is.
    An integer or boolean result (a dropout seed's counter, which every microbatch advances
    alike from the same state) is the last microbatch's: a mean of integers is not one (in
    float32 it changed a uint32 seed by 16)."""
    return bool(jnp.issubdtype(value.dtype, jnp.inexact))


@jax.jit
def microbatch_mean(parts: list[Any]) -> Any:
    """The microbatches' mean of one result, summed in microbatch order (the fused step's
    loop sums in the same order), in the result's dtype; ``is_averaged``: which are."""
    if not is_averaged(parts[0]):
        return parts[-1]
    return (sum(parts[1:], parts[0]) / len(parts)).astype(parts[0].dtype)


def stage_meshes(stages: Sequence[StageDevices], devices: Sequence[Any]
                  ) -> tuple[list[Mesh], NamedSharding]:
    """Each stage's mesh over ``devices`` (indexed by the plan's device ids), and where the
    step's small outputs go: every device of the plan, in plan order (one stage: its own mesh,
    so that the outputs fed back into the next step, the new state's scalars among them, lie
    on the one mesh its one program runs on)."""
    by_id = dict(enumerate(devices))
    meshes = [Mesh(np.array([by_id[i] for i in s.device_ids]).reshape(s.mesh_shape),
                   s.axis_names) for s in stages]
    if len(stages) == 1:
        return meshes, NamedSharding(meshes[0], PartitionSpec())
    every = sorted({d for s in stages for d in s.device_ids})
    return meshes, NamedSharding(Mesh(np.array([by_id[i] for i in every]), ("all",)),
                                 PartitionSpec())
