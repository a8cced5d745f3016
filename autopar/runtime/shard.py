"""Run a flat program under a plan's shardings on real devices.

The program is evaluated again inside ``jax.jit`` with the plan's in/out shardings; every
intermediate tensor the plan names gets ``jax.lax.with_sharding_constraint``, and XLA's SPMD
partitioner inserts the collectives. This module is the only place that turns plan data into
``jax.sharding`` objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.errors import MeshError, PlanError
from autopar.ir.attention_op import BACKWARD_NAME, FORWARD_NAME, Ring
from autopar.ir.program import FlatEqn, FlatProgram, bind_eqn
from autopar.plan import Plan, ShardingSpec, StagePlan
from autopar.runtime.distributed import global_devices, put_all
from autopar.runtime.ring_attention import ring_backward, ring_forward

# the memory space of the leaves a plan keeps off the device between steps
HOST_MEMORY = "pinned_host"


def partition_spec(spec: ShardingSpec) -> PartitionSpec:
    """A plan spec as a ``jax.sharding.PartitionSpec``."""
    parts: list[Any] = []
    for axes in spec.dims:
        if not axes:
            parts.append(None)
        elif len(axes) == 1:
            parts.append(axes[0])
        else:
            parts.append(tuple(axes))
    return PartitionSpec(*parts)


def stage_mesh(stage: StagePlan, devices: Sequence[Any] | None = None) -> Mesh:
    """The ``jax.sharding.Mesh`` of a stage: its device ids laid out in its logical shape
    (ids index ``devices``; default: every device of the run, host-major across processes)."""
    devices = list(global_devices() if devices is None else devices)
    missing = [d for d in stage.device_ids if d >= len(devices)]
    if missing:
        raise MeshError(
            f"the plan uses device ids up to {max(stage.device_ids)} but only {len(devices)} "
            "devices are present; plan for the local devices or run on the described cluster"
        )
    grid = np.array([devices[d] for d in stage.device_ids], dtype=object)
    return Mesh(grid.reshape(stage.logical_mesh_shape), stage.axis_names)


class ShardedProgram:
    """A flat program compiled for one single-stage plan; call it with flat arguments."""

    def __init__(self, program: FlatProgram, plan: Plan, devices: Sequence[Any] | None = None,
                 donated: Sequence[bool] = ()):
        if len(plan.stages) != 1:
            raise PlanError(
                f"this executor runs single-stage plans; the plan has {len(plan.stages)} stages"
            )
        stage = plan.stages[0]
        self.program = program
        self.plan = plan
        self.mesh = stage_mesh(stage, devices)
        # the leaves the plan keeps in host memory between steps (its optimizer state): they
        # arrive and leave in pinned host memory and move to the device inside the step
        hosted = set(stage.host_paths)
        self.in_shardings = tuple(
            self._named(stage.input_shardings, path, path in hosted)
            for path in program.in_paths
        )
        self.out_shardings = tuple(
            self._named(stage.output_shardings, path, path in hosted)
            for path in program.out_paths
        )
        self._arriving = {i: self._named(stage.input_shardings, path)
                          for i, path in enumerate(program.in_paths) if path in hosted}
        # the inputs the compiled call cannot shard itself however they arrive (host memory)
        self._placed_always = frozenset(self._arriving)
        self._leaving = {i: self.out_shardings[i]
                         for i, path in enumerate(program.out_paths) if path in hosted}
        self._constraints = {
            vid: NamedSharding(self.mesh, partition_spec(spec))
            for vid, spec in stage.tensor_shardings.items()
        }
        self._operand_constraints = {
            use: NamedSharding(self.mesh, partition_spec(spec))
            for use, spec in stage.operand_shardings.items()
        }
        self._rings = ring_calls(program, stage, self.mesh)
        # donated: per flat input leaf, whether XLA may reuse its buffer for an output
        self.jitted = jax.jit(
            self._run, in_shardings=self.in_shardings, out_shardings=self.out_shardings,
            donate_argnums=tuple(i for i, give in enumerate(donated) if give),
        )
        self._compiled: Any = None

    def _named(self, specs: dict[str, ShardingSpec], path: str,
               on_host: bool = False) -> NamedSharding:
        spec = specs.get(path)
        if spec is None:
            raise PlanError(f"the plan has no sharding for '{path}'; it was made for another step")
        named = NamedSharding(self.mesh, partition_spec(spec))
        return named.with_memory_kind(HOST_MEMORY) if on_host else named

    def _constrain(self, vid: int, value: Any) -> Any:
        sharding = self._constraints.get(vid)
        return value if sharding is None else jax.lax.with_sharding_constraint(value, sharding)

    def _constrain_operand(self, eqn: int, position: int, value: Any) -> Any:
        sharding = self._operand_constraints.get((eqn, position))
        return value if sharding is None else jax.lax.with_sharding_constraint(value, sharding)

    def _run(self, *flat_args: Any) -> tuple[Any, ...]:
        args = [jax.device_put(a, self._arriving[i]) if i in self._arriving else a
                for i, a in enumerate(flat_args)]
        results = self.program.evaluate(
            args,
            on_value=self._constrain if self._constraints else None,
            on_operand=self._constrain_operand if self._operand_constraints else None,
            bind=self._bind if self._rings else None,
        )
        return tuple(jax.device_put(r, self._leaving[i]) if i in self._leaving else r
                     for i, r in enumerate(results))

    def _bind(self, eqn: FlatEqn, operands: Sequence[Any]) -> Sequence[Any]:
        ring = self._rings.get(eqn.index)
        return bind_eqn(eqn, operands) if ring is None else ring(*operands)

    def place(self, flat_args: Sequence[Any]) -> list[Any]:
        """Move arguments to the devices and layouts the plan wants (no-op where they are).
        Across processes a host value (numpy, uncommitted array) becomes a global array, each
        process placing its own shards of it (every process holds the same value)."""
        return put_all(flat_args, [s if isinstance(a, jax.Array | np.ndarray) else None
                                   for a, s in zip(flat_args, self.in_shardings, strict=True)])

    def compiled(self, flat_args: Sequence[Any]) -> Any:
        """The XLA executable for arguments shaped like ``flat_args``, compiled once: running
        the step and reading its HLO share it."""
        if self._compiled is None:
            self._compiled = self.jitted.lower(*self.abstract_args(flat_args)).compile()
        return self._compiled

    def __call__(self, flat_args: Sequence[Any]) -> list[Any]:
        args = self._call_arguments(flat_args)
        return list(self.compiled(args)(*args))

    def _call_arguments(self, flat_args: Sequence[Any]) -> list[Any]:
        """``flat_args`` as the compiled program's call takes them. In one process that call
        shards host values and uncommitted arrays itself, in C++ (MLP tiny's step on 2 CPU
        devices: 450 us a call this way, 650 us with its batch placed first in Python,
        2026-12-07). It refuses committed arrays laid out otherwise, and leaves bound for
        host memory: those are moved first."""
        if jax.process_count() != 1:
            return self.place(flat_args)
        moves = [s if (i in self._placed_always or isinstance(a, jax.Array) and a.committed)
                 else None for i, (a, s) in enumerate(zip(flat_args, self.in_shardings,
                                                         strict=True))]
        return put_all(flat_args, [s if isinstance(a, jax.Array | np.ndarray) else None
                                   for a, s in zip(flat_args, moves, strict=True)])

    def abstract_args(self, flat_args: Sequence[Any]) -> list[Any]:
        return [
            jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=s) if hasattr(a, "dtype")
            # a Python scalar (a TrainState's fresh step counter) is traced weakly typed
            else jax.ShapeDtypeStruct((), jax.numpy.asarray(a).dtype, sharding=s, weak_type=True)
            for a, s in zip(flat_args, self.in_shardings, strict=True)
        ]

    def hlo_text(self, flat_args: Sequence[Any]) -> str:
        """The compiled, optimized, SPMD-partitioned HLO text of the sharded program."""
        return self.compiled(flat_args).as_text()


def ring_calls(program: FlatProgram, stage: StagePlan, mesh: Mesh) -> dict[int, Any]:
    """The attention equations (``ir.attention_op``) whose keys the plan splits along the
    sequence, each as its ring kernel over ``mesh`` (by equation index): the plan chose
    context parallelism there (``strategies.attention``)."""
    inputs = dict(zip(program.in_ids, program.in_paths, strict=True))

    def spec(eqn: FlatEqn, position: int) -> ShardingSpec | None:
        tensor = eqn.inputs[position]
        found = stage.operand_shardings.get((eqn.index, position))
        found = found or stage.tensor_shardings.get(tensor)
        return found or stage.input_shardings.get(inputs.get(tensor, ""))

    calls: dict[int, Any] = {}
    for eqn in program.eqns:
        if eqn.name not in (FORWARD_NAME, BACKWARD_NAME):
            continue
        query, key = spec(eqn, 0), spec(eqn, 1)
        if query is None or key is None or not key.dims[-2]:
            continue
        (axis,) = key.dims[-2]
        dims = tuple(partition_spec(query))[:-1] + (None,)
        make = ring_forward if eqn.name == FORWARD_NAME else ring_backward
        calls[eqn.index] = make(mesh, dims, Ring(axis, mesh.shape[axis]),
                                eqn.params["causal"], eqn.params["scale"])
    return calls
