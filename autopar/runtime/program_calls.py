"""The driver's logs of a pipelined step: the programs it runs (``PipelineRunner(...,
calls=...)``, read by ``runtime.pipeline_hlo`` to count their collectives) and when each task
ran (``TaskRecord``, when timing is on)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np


@dataclass
class TaskRecord:
    """When a task ran (seconds since the step started); filled when timing is on. ``kind``
    is the schedule's (F, B, W) or ``step`` for a step run as one program
    (``runtime.fused_step``: every microbatch's tasks, ``microbatch`` -1)."""

    kind: str
    microbatch: int
    stage: int
    chunk: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class ProgramCall:
    """One call of a jitted program by the driver: ``label`` says which (``F2``: the forward
    of piece 2, ``segment3``, ...), ``stage`` where it runs (None: where the caller's input
    lies), ``args`` its arguments as abstract values (``abstract_args``)."""

    label: str
    stage: int | None
    fn: Any
    args: tuple[Any, ...]


def abstract_args(args: Any) -> Any:
    """``args`` with every array as its shape, dtype and (when committed) sharding: enough to
    compile the program again, without keeping its buffers alive (or reading donated ones)."""
    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            sharding = x.sharding if x.committed else None
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        if isinstance(x, np.ndarray):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x

    return jax.tree.map(leaf, args)


def measured_idle_fraction(records: Sequence[TaskRecord], num_stages: int) -> float:
    """1 - busy time / (stages x span) over recorded tasks (each stage runs one at a time)."""
    if not records:
        return 0.0
    span = max(r.end_s for r in records) - min(r.start_s for r in records)
    busy = sum(r.end_s - r.start_s for r in records)
    return max(0.0, 1.0 - busy / (num_stages * span)) if span > 0 else 0.0
