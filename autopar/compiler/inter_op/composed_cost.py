"""A layer's cost as the sum of its repeated blocks' costs: what ``LayerCostCache`` gives a
layer that the forward's repeated structure cuts into blocks, each solved once per mesh."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from autopar.compiler.inter_op.piece_cost import PieceCost, nbytes, stopped_early
from autopar.compiler.intra_op.problem import IlpStatus
from autopar.ir.pieces import Piece
from autopar.ir.pipeline_pieces import PieceRoles
from autopar.ir.pipeline_program import PipelineProgram
from autopar.plan import ShardingSpec


def compose_costs(pp: PipelineProgram, piece: Piece, units: Sequence[Piece],
                  costs: Sequence[PieceCost], roles: Callable[[Piece], PieceRoles], *,
                  specs: bool = True) -> PieceCost:
    """One cost for ``piece`` from its ``units``' ``costs`` (``roles``: a piece's input and
    output roles): times and bytes added, plans merged (an inner boundary keeps its
    producer's layout: its consumer's is a resharding inside the layer), the worst ILP ending
    kept; ``boundary_bytes`` the piece's own inputs, split as its blocks split their batch;
    recomputed, every block's inputs are kept (the runtime checkpoints each block) and the
    largest block's activations rebuilt at once. ``specs=False``: times and bytes only (no
    specs, no collectives)."""
    fwd = pp.forward
    inside = {v for i in piece.eqns for v in fwd.eqns[i].outputs} if specs else set()

    def input_bytes(p: Piece) -> float:
        r = roles(p)
        return sum(nbytes(fwd.avals[v]) for v in (*r.acts, *r.micro))

    splits = [input_bytes(u) / c.boundary_bytes
              for u, c in zip(units, costs, strict=True) if c.boundary_bytes > 0]
    stopped = [c for c in costs if stopped_early(c)]
    gaps = [c.ilp_gap for c in costs if c.ilp_gap is not None]
    values: dict[int, ShardingSpec] = {}
    cotangents: dict[int, ShardingSpec] = {}
    contractions: dict[tuple[int, int, str], ShardingSpec] = {}
    for c in costs if specs else ():
        values.update(c.value_specs)
        cotangents.update(c.cotangent_specs)
        contractions.update(c.contraction_specs)
    return PieceCost(
        time_s=sum(c.time_s for c in costs),
        compute_s=sum(c.compute_s for c in costs),
        fixed_bytes=sum(c.fixed_bytes for c in costs),
        activation_bytes=sum(c.activation_bytes for c in costs),
        boundary_bytes=input_bytes(piece) / max(splits) if splits else 0.0,
        input_specs={v: s for c in costs if specs for v, s in c.input_specs.items()
                     if v not in inside},
        ilp_status=(stopped[0] if stopped else max(
            costs, key=lambda c: c.ilp_status != IlpStatus.TRIVIAL)).ilp_status,
        sync_s=sum(c.sync_s for c in costs),
        update_s=sum(c.update_s for c in costs),
        param_bytes=sum(c.param_bytes for c in costs),
        whole_param_bytes=sum(c.whole_param_bytes for c in costs),
        ilp_gap=max(gaps) if gaps else None,
        collectives=tuple(x for c in costs if specs for x in c.collectives),
        sync_collectives=tuple(x for c in costs if specs for x in c.sync_collectives),
        value_specs=values,
        cotangent_specs=cotangents,
        contraction_specs=contractions,
        launch_s=sum(c.launch_s for c in costs),
        update_launch_s=sum(c.update_launch_s for c in costs),
        matmul_output_bytes=sum(c.matmul_output_bytes for c in costs),
        selective_recompute_s=sum(c.selective_recompute_s for c in costs),
        checkpoint_bytes=sum(c.checkpoint_bytes for c in costs),
        recompute_bytes=max((c.recompute_bytes for c in costs), default=0.0),
    )
