"""Where a pipelined step's values live: each stage's mesh, the layout its plan gives a value
there, and the step's values put (or, traced as one program, held) in that layout. The base
of ``runtime.pipeline.PipelineRunner``, which drives the schedule over these placements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from autopar.ir.pipeline_program import PipelineProgram
from autopar.runtime.distributed import put
from autopar.runtime.fused_step import FusedStep
from autopar.runtime.pipeline_state import StageDevices, StepState, shared_outputs, stage_meshes
from autopar.runtime.shard import partition_spec


class StagePlacement:
    """A pipelined step's stages as meshes, and its values placed on them."""

    def __init__(self, pp: PipelineProgram, stages: Sequence[StageDevices],
                 devices: Sequence[Any], specs: Sequence[dict[int, Any]] | None = None):
        self.pp = pp
        self.meshes, self.everywhere = stage_meshes(stages, devices)
        # per stage: forward value id -> ShardingSpec the stage's plan gives it
        self.specs = [dict(d) for d in specs] if specs is not None else [{} for _ in stages]
        # step values the stage plans lay out by a forward value's spec: each loss input
        # (a parameter) as the pieces read it, each parameter's gradient as its parameter
        # (the optimizer update then runs on the plan's shards, not on replicated copies)
        self.spec_source = {oid: fid for fid, oid in pp.operand_of.items()}
        self.spec_source.update({gid: fid for fid, gid in pp.grad_outputs().items()})
        self.shared_outputs = shared_outputs(pp)
        # the whole step traced as one program (``runtime.fused_step``), when the runner
        # built on this placement fuses it
        self.fused: FusedStep | None = None

    def sharding(
        self, stage: int, aval: Any, vid: int | None = None, batched: bool = False
    ) -> NamedSharding:
        """The stage plan's spec for forward value ``vid`` when it has one; otherwise batched
        values are split along their first dimension over the stage's devices when it divides,
        and everything else is replicated on the stage."""
        mesh = self.meshes[stage]
        spec = self.specs[stage].get(vid) if vid is not None else None
        if spec is not None:
            return NamedSharding(mesh, partition_spec(spec))
        shape = getattr(aval, "shape", ())
        if batched and shape and shape[0] % mesh.size == 0 and mesh.size > 1:
            return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
        return NamedSharding(mesh, PartitionSpec())

    def place(self, value: Any, stage: int, vid: int | None = None,
              batched: bool = False) -> Any:
        """``value`` on ``stage`` in the layout its plan gives forward value ``vid`` (see
        ``sharding``): put there, or, traced into one program, held to it."""
        sharding = self.sharding(stage, value, vid, batched)
        if isinstance(value, jax.core.Tracer):
            # the driver traced as one program (``runtime.fused_step``): a placement on the
            # stage is a layout the program holds the value to
            return jax.lax.with_sharding_constraint(value, sharding)
        # distributed.put is jax.device_put in one process; across processes (every process
        # runs this driver over every task, JAX skips the computations of devices it does not
        # hold) it also moves values between stages on different processes
        return put(value, sharding)

    def output(self, st: StepState, vid: int) -> Any:
        """The step's result ``vid``: a small one (``shared_outputs``) on every device of the
        plan, so that every process of a run can read it (``float(loss)``); the rest (the new
        state) where its segment made it, as global arrays (``distributed.to_host`` reads
        them anywhere)."""
        value = st.env[vid] if vid in st.env else self.pp.outer.values[vid]
        if (vid in self.shared_outputs and isinstance(value, jax.Array)
                and value.sharding != self.everywhere):
            return put(value, self.everywhere)
        return value

    def _fetch(self, st: StepState, vid: int, stage: int, fid: int | None = None) -> Any:
        """Step value ``vid`` on ``stage`` (as loss input ``fid`` when given, else as the
        forward value whose layout it shares, ``spec_source``). A value with no layout of
        its own on the stage's devices stays where it was made (an optimizer state as the
        update made it), not replicated; a captured constant is read from the trace."""
        key = (vid, stage, fid)
        if key not in st.placed:
            value = st.env[vid] if vid in st.env else self.pp.outer.values[vid]
            source = fid if fid is not None else self.spec_source.get(vid)
            if source is None and self._on_stage(value, stage):
                st.placed[key] = value
            else:
                st.placed[key] = self.place(value, stage, source)
        return st.placed[key]

    def _on_stage(self, value: Any, stage: int) -> bool:
        if isinstance(value, jax.core.Tracer):  # one program: every value is on its mesh
            return self.fused is not None
        sharding = getattr(value, "sharding", None)
        return (isinstance(value, jax.Array) and value.committed and sharding is not None
                and sharding.device_set == set(self.meshes[stage].devices.flat))
