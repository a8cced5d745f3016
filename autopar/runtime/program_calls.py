"""The driver's log of the programs a pipelined step runs (``PipelineRunner(..., calls=...)``),
read by ``runtime.pipeline_hlo`` to count their collectives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np


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
