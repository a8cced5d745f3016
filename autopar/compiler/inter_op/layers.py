"""Operator clustering: cut a forward OpGraph into layers for pipeline stages (Alpa §5.2).

The forward computation of a loss function arrives as an OpGraph whose nodes are in program
(topological) order. A *layer* is a contiguous run of nodes in that order, and a cut between two
layers costs the bytes of every activation live across it: produced at or before the cut,
consumed after it. Tensors no node produces (graph inputs, constants, literals) are not
activations -- every stage can hold its own copy -- so they never count. A graph output that no
later node reads does not cross a cut either (the stage that makes it returns it).

``cluster_layers`` follows Alpa's layer-construction DP: every layer's flops stay within
``(1 +/- tolerance) x`` the average, the largest cut is minimised, ties are broken by the sum of
all cuts, then by flops imbalance (sum of squared layer flops). ``layers_from_boundaries`` turns
explicit cut positions (from ``mark_pipeline_boundary()``) into the same result type.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.compiler.graph.opgraph import OpGraph
from autopar.compiler.inter_op.layer_cuts import flops_band, min_max_cut, min_sum_cut
from autopar.errors import PlanError
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.repeats import find_repeats
from autopar.method_options import LayerMode

DEFAULT_BALANCE_TOLERANCE = 0.25


@dataclass(frozen=True)
class LayerClustering:
    """Layers of a forward graph and what each cut between them costs.

    ``layers[k]`` are the node ids of layer ``k`` in program order; ``positions[k]`` is the index
    (in ``graph.nodes``) of the first node of layer ``k + 1``; ``cut_bytes[k]`` is the bytes of the
    activations live across that cut. ``tolerance_used`` is the flops tolerance the clustering
    satisfied (larger than ``balance_tolerance`` when the requested one was infeasible and had to
    be relaxed); both are ``None`` for layers given by explicit boundaries.
    """

    layers: tuple[tuple[int, ...], ...]
    flops: tuple[float, ...]
    cut_bytes: tuple[int, ...]
    positions: tuple[int, ...]
    balance_tolerance: float | None = None
    tolerance_used: float | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def max_cut_bytes(self) -> int:
        return max(self.cut_bytes, default=0)

    @property
    def imbalance(self) -> float:
        """Largest layer's flops over the average (1.0 is perfectly balanced)."""
        total = sum(self.flops)
        return max(self.flops) * len(self.flops) / total if total > 0 else 1.0

    @property
    def relaxed(self) -> bool:
        """Whether the requested tolerance was infeasible and a looser one was used."""
        return (
            self.tolerance_used is not None
            and self.balance_tolerance is not None
            and self.tolerance_used > self.balance_tolerance
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data."""
        return {
            "num_layers": self.num_layers,
            "layers": [list(layer) for layer in self.layers],
            "flops": list(self.flops),
            "cut_bytes": list(self.cut_bytes),
            "positions": list(self.positions),
            "balance_tolerance": self.balance_tolerance,
            "tolerance_used": self.tolerance_used,
            "imbalance": self.imbalance,
        }


def cut_bytes_by_position(graph: OpGraph) -> np.ndarray:
    """``out[p]`` = bytes live across the cut before node position ``p`` (``0 <= p <= N``).

    One sweep: a tensor produced at position ``a`` and last read at ``b > a`` crosses the cuts
    ``a + 1 .. b``, so it adds its bytes to a difference array at ``a + 1`` and removes them at
    ``b + 1``. ``out[0]`` and ``out[N]`` are 0 (nothing is live before the first node or after
    the last reader).
    """
    n = len(graph.nodes)
    produced_at: dict[int, int] = {}
    last_read: dict[int, int] = {}
    for pos, node in enumerate(graph.nodes):
        for t in node.inputs:
            last_read[t] = pos
        for t in node.outputs:
            produced_at[t] = pos
    diff = np.zeros(n + 2, dtype=np.int64)
    for t, start in produced_at.items():
        end = last_read.get(t, -1)
        if end > start:
            nbytes = graph.tensors[t].nbytes
            diff[start + 1] += nbytes
            diff[end + 1] -= nbytes
    return np.cumsum(diff)[: n + 1]


def layers_from_boundaries(graph: OpGraph, boundary_positions: tuple[int, ...]) -> LayerClustering:
    """Layers cut before each of ``boundary_positions`` (indices into ``graph.nodes``).

    Positions must be strictly increasing within ``1 .. N - 1`` so that no layer is empty;
    raises PlanError otherwise.
    """
    n = len(graph.nodes)
    positions = tuple(int(p) for p in boundary_positions)
    if n == 0:
        raise PlanError("cannot cut an empty graph (0 nodes) into layers")
    bad = [p for p in positions if not 1 <= p <= n - 1]
    if bad:
        raise PlanError(
            f"pipeline boundary position {bad[0]} is outside the graph's cut positions "
            f"1..{n - 1} (graph has {n} nodes)"
        )
    if any(b <= a for a, b in itertools.pairwise(positions)):
        raise PlanError(
            f"pipeline boundary positions {list(positions)} must be strictly increasing "
            f"(each layer needs at least one node)"
        )
    return _clustering(graph, positions, cut_bytes_by_position(graph), None, None)


def cluster_layers(
    graph: OpGraph, num_layers: int, *, balance_tolerance: float = DEFAULT_BALANCE_TOLERANCE
) -> LayerClustering:
    """Cut ``graph`` (nodes in program order) into ``num_layers`` contiguous layers.

    Every layer's flops lie within ``(1 +/- tolerance) x`` the average; among such cuttings the
    largest cut's bytes is minimised, then the sum of cut bytes, then the sum of squared layer
    flops (flops imbalance). Zero-flop nodes never make a layer on their own: each layer holds
    at least one flop-bearing node, and the zero-flop nodes between two flop-bearing ones join
    whichever side gives the cheaper cut. If no cutting satisfies the tolerance it is doubled
    until one does, and ``tolerance_used`` records the value used.

    Raises PlanError if ``num_layers < 1``, exceeds the number of flop-bearing nodes, or
    ``balance_tolerance`` is negative.
    """
    n = len(graph.nodes)
    if num_layers < 1:
        raise PlanError(f"num_layers must be at least 1, got {num_layers}")
    if balance_tolerance < 0:
        raise PlanError(f"balance_tolerance must be >= 0, got {balance_tolerance}")
    if n == 0:
        raise PlanError("cannot cut an empty graph (0 nodes) into layers")
    node_flops = np.array([max(float(node.flops), 0.0) for node in graph.nodes])
    flop_positions = np.flatnonzero(node_flops > 0)
    num_heavy = len(flop_positions)
    position_bytes = cut_bytes_by_position(graph)
    if num_layers == 1:
        return _clustering(graph, (), position_bytes, balance_tolerance, balance_tolerance)
    if num_layers > num_heavy:
        raise PlanError(
            f"cannot cut {num_layers} layers from a graph with {num_heavy} flop-bearing nodes "
            f"(of {n} nodes); ask for at most {num_heavy} layers"
        )

    # Reduction 1 (exact): a layer's flops only change when a cut moves past a flop-bearing
    # node, so between two consecutive flop-bearing nodes every cut position gives the same layer
    # flops and only its own bytes differ (a cut's bytes do not depend on the other cuts). Keep
    # one candidate per gap, the cheapest position (earliest on ties, so zero-flop producers
    # join the layer that reads them). Candidate m (1..H-1) cuts before flop-bearing node m.
    gap_starts = flop_positions[:-1] + 1
    gap_bytes = position_bytes[: flop_positions[-1] + 1]
    best_bytes = np.minimum.reduceat(gap_bytes, gap_starts)
    segment = np.repeat(np.arange(num_heavy - 1), np.diff(flop_positions))
    hits = np.where(
        gap_bytes[gap_starts[0] :] == best_bytes[segment],
        np.arange(gap_starts[0], len(gap_bytes)),
        len(gap_bytes),
    )
    best_position = np.minimum.reduceat(hits, gap_starts - gap_starts[0])

    prefix = np.concatenate(([0.0], np.cumsum(node_flops[flop_positions])))
    # Boundary index j in 0..H: 0 is the start, H the end, 1..H-1 the gap candidates.
    boundary_bytes = np.concatenate(([0], best_bytes, [0])).astype(np.float64)

    # Relax the tolerance only as far as needed: pass 1 is cheap and returns inf when no
    # cutting fits the flops band. From tolerance 1 on there is no lower bound, and at
    # num_layers - 1 the upper bound is the total, so the loop always ends.
    tolerance = balance_tolerance
    while True:
        band = flops_band(prefix[-1], num_layers, tolerance)
        max_cut = min_max_cut(prefix, boundary_bytes, num_layers, band)
        if np.isfinite(max_cut):
            break
        tolerance = 2.0 * tolerance if tolerance > 0 else DEFAULT_BALANCE_TOLERANCE
    chosen = min_sum_cut(prefix, boundary_bytes, num_layers, band, max_cut)
    positions = tuple(int(best_position[j - 1]) for j in chosen)
    return _clustering(graph, positions, position_bytes, balance_tolerance, tolerance)


def _clustering(
    graph: OpGraph,
    positions: tuple[int, ...],
    position_bytes: np.ndarray,
    balance_tolerance: float | None,
    tolerance_used: float | None,
) -> LayerClustering:
    """Assemble the result for cuts before each of ``positions`` (strictly increasing)."""
    edges = (0, *positions, len(graph.nodes))
    nodes = graph.nodes
    layers = tuple(tuple(node.id for node in nodes[a:b]) for a, b in itertools.pairwise(edges))
    flops = tuple(
        float(sum(node.flops for node in nodes[a:b])) for a, b in itertools.pairwise(edges)
    )
    return LayerClustering(
        layers=layers,
        flops=flops,
        cut_bytes=tuple(int(position_bytes[p]) for p in positions),
        positions=positions,
        balance_tolerance=balance_tolerance,
        tolerance_used=tolerance_used,
    )


# By default about one layer per two devices, at most this many: enough cuts for the stage DP
# to balance on, few enough distinct layers that costing them stays quick.
DEFAULT_MAX_LAYERS = 16


def layer_positions(pp: PipelineProgram, graph: OpGraph, layers: int | str,
                    num_devices: int) -> list[int]:
    """Cut positions (forward equation indices of ``pp.forward``, whose graph is ``graph``)
    between layers, as ``PipeshardParallel(layers=...)`` asks: ``"marked"`` (the user's
    ``autopar.mark_pipeline_boundary`` calls), ``"auto"`` (the marks when there are any, else
    clustering into about one layer per two devices) or a number of layers to cluster into."""
    marked = sorted(set(p for p in pp.boundary_positions() if 0 < p < len(graph.nodes)))
    if layers == LayerMode.MARKED or (layers == LayerMode.AUTO and marked):
        if not marked:
            raise PlanError("layers='marked' but the loss function has no "
                            "autopar.mark_pipeline_boundary() calls")
        return marked
    heavy = sum(1 for n in graph.nodes if n.flops > 0)
    # at least two, except on one device: its only stage would be costed as the sum of its
    # layers' plans, which is no better than the whole forward as one piece (Alpa's GPT 350M
    # on one V100: two layers estimated 0.3% slower than one)
    count = layers if isinstance(layers, int) else min(
        DEFAULT_MAX_LAYERS, max(min(2, num_devices), num_devices // 2), heavy)
    return list(cluster_layers(graph, count).positions)


def remat_layer_positions(pp: PipelineProgram, graph: OpGraph) -> list[int]:
    """Where to cut the loss forward into layers for one-stage rematerialisation: the user's
    ``mark_pipeline_boundary`` calls, else up to ``DEFAULT_MAX_LAYERS`` clustered layers."""
    if pp.boundary_positions():
        return layer_positions(pp, graph, LayerMode.MARKED, num_devices=1)
    heavy = sum(1 for n in graph.nodes if n.flops > 0)
    positions = layer_positions(pp, graph, max(1, min(DEFAULT_MAX_LAYERS, heavy)),
                                num_devices=1)
    # checkpointed per repeated block (a transformer's), as pipeline stages are
    # (``PipelineLayout.checkpoint_positions``): a layer of several blocks would rebuild
    # them all at once in its backward
    grid = None if pp.layer_scans else find_repeats(pp.forward, positions)
    if grid is None:
        return positions
    return sorted(set(positions) | set(grid.cuts_within(0, len(pp.forward.eqns))))
