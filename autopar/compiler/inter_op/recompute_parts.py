"""What selective recomputation keeps and recomputes of a piece, read off its forward
equations once per structure (``LayerCostCache``), for the stage search's selectively
recomputed candidates (``remat``): the bytes of its matmuls' outputs (kept, as JAX's
``dots_with_no_batch_dims_saveable`` keeps them) and the share of its forward's flops the rest
is (the attention core and the element-wise chains, recomputed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autopar.compiler.graph.op_costs import primitive_flops
from autopar.ir.pieces import Piece
from autopar.ir.pipeline_program import PipelineProgram


@dataclass(frozen=True)
class RecomputeParts:
    """One piece's figures, unsplit: ``matmul_output_bytes`` its forward's matmul outputs
    (what selective recomputation keeps, ``keeps_output``), ``recomputed_share`` the share of
    its forward's flops selective recomputation recomputes."""

    matmul_output_bytes: float
    recomputed_share: float


def keeps_output(eqn: Any) -> bool:
    """Whether selective recomputation keeps ``eqn``'s output: a matmul with no batch
    dimensions (JAX's ``dots_with_no_batch_dims_saveable``), a layer's linear maps; the
    attention core's batched matmuls and everything element-wise are recomputed."""
    return eqn.name == "dot_general" and not any(eqn.params["dimension_numbers"][1])


def recompute_parts(pp: PipelineProgram, piece: Piece) -> RecomputeParts:
    """``piece``'s :class:`RecomputeParts`."""
    fwd = pp.forward
    kept = total = recomputed = 0.0
    for i in piece.eqns:
        eqn = fwd.eqns[i]
        flops = primitive_flops(eqn.name, eqn.params,
                                [tuple(fwd.avals[v].shape) for v in eqn.inputs],
                                [tuple(fwd.avals[v].shape) for v in eqn.outputs])
        total += flops
        if keeps_output(eqn):
            kept += sum(_nbytes(fwd.avals[v]) for v in eqn.outputs)
        else:
            recomputed += flops
    return RecomputeParts(kept, recomputed / total if total else 0.0)


def _nbytes(aval: Any) -> float:
    return float(math.prod(int(d) for d in aval.shape) * aval.dtype.itemsize)
