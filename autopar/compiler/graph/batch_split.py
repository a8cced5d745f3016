"""Follow a batch split through the graph and find the communication it implies.

Data parallelism splits each batch leaf along its first dimension over all devices and keeps
the state whole. Pushing that split forward op by op tells which tensors stay split, and where
a split dimension is summed away — the gradient contractions and the loss mean — leaving a
partial sum on every device that must be all-reduced. Ops that cannot keep a split gather
their split operands first (an all-gather). This is the communication XLA's partitioner inserts
for the same input shardings; the report sets the two side by side.

Scan regions (``ir.program``) are followed through: an operand enters the body split as it is
(``xs`` one dimension lower), a body result leaves the loop likewise, and a collective inside
the body is implied once per iteration. A carry keeps one layout around its loop (see
``_Propagator.run``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.compiler.graph.batch_split_rules import ImpliedCollective, Split, SplitRules
from autopar.compiler.graph.op_costs import ELEMENTWISE
from autopar.compiler.graph.opgraph import OpGraph
from autopar.errors import BatchSizeError
from autopar.plan import CollectiveKind

# Ops that keep their operand's layout element for element (one operand, same shape out).
SHAPE_PRESERVING = frozenset(
    """
    convert_element_type copy copy_p stop_gradient reduce_precision bitcast_convert_type
    optimization_barrier custom_jvp_call sharding_constraint name
    """.split()
) | ELEMENTWISE


@dataclass
class BatchSplitResult:
    split_dim: dict[int, int | None]  # tensor id -> split dimension (None: whole)
    collectives: list[ImpliedCollective]


class _Propagator(SplitRules):
    """Pushes a split through the whole graph with the rules of ``batch_split_rules``."""

    def run(self, split_inputs: dict[int, int]) -> BatchSplitResult:
        """Propagate, then settle every scan carry's layout around its loop: a carry whose
        body result comes out split other than it went in enters split like the result when
        it went in whole (each device slices its part), and whole otherwise; the propagation
        runs again until every carry keeps its layout (a carry changes at most twice: whole ->
        split -> whole, so this ends). A carry left whole whose result is still split is
        gathered at the end of every iteration."""
        while True:
            self.run_once(split_inputs)
            changed = False
            for loop in self.graph.loops:
                for enter, exit_ in loop.carry_pairs():
                    going = self.split.get(self.graph.nodes[enter].outputs[0])
                    back = self.split.get(self.graph.nodes[exit_].inputs[0])
                    if back is None or back == going:
                        continue
                    if enter in self.carry_layout and self.carry_layout[enter] is None:
                        continue  # settled whole
                    slice_in = going is None and enter not in self.carry_layout
                    self.carry_layout[enter] = back if slice_in else None
                    changed = True
            if not changed:
                break
        for loop in self.graph.loops:
            for enter, exit_ in loop.carry_pairs():
                node = self.graph.nodes[exit_]
                going = self.split.get(self.graph.nodes[enter].outputs[0])
                back = self.split.get(node.inputs[0])
                if back is not None and back != going:
                    self.emit(node, CollectiveKind.ALL_GATHER, node.inputs[0])
                    self.split[node.outputs[0]] = None
        return BatchSplitResult(split_dim=dict(self.split), collectives=self.collectives)

    def run_once(self, split_inputs: dict[int, int]) -> None:
        self.split = {}
        self.collectives = []
        for io in self.graph.inputs:
            self.split[io.tensor] = split_inputs.get(io.tensor)
        rules = self.rules()
        for node in self.graph.nodes:
            if node.id in self.carry_layout:
                result: list[Split] = self.scan_enter(node)
            elif not any(self.split.get(t) is not None for t in node.inputs):
                result = [None] * len(node.outputs)
            elif node.primitive in rules:
                result = rules[node.primitive](node)
            elif node.primitive in SHAPE_PRESERVING:
                result = self.elementwise(node)
            else:
                result = self.gather_inputs(node)
            for t, d in zip(node.outputs, result, strict=True):
                self.split[t] = d


def propagate_batch_split(
    graph: OpGraph, split_inputs: dict[int, int], num_shards: int, *, keep_batch: bool = False
) -> BatchSplitResult:
    """Push ``split_inputs`` (input tensor id -> split dimension) through ``graph``;
    ``keep_batch``: see ``SplitRules.gather_inputs`` (``batch_split_rules``)."""
    return _Propagator(graph, num_shards, keep_batch).run(split_inputs)


def group_collectives(found: list[ImpliedCollective]) -> dict[CollectiveKind, tuple[int, int]]:
    """kind -> (count, total bytes)."""
    out: dict[CollectiveKind, tuple[int, int]] = {}
    for c in found:
        count, nbytes = out.get(c.kind, (0, 0))
        out[c.kind] = (count + 1, nbytes + c.nbytes)
    return out


def batch_split_inputs(graph: OpGraph, batch_argnums: tuple[int, ...], num_shards: int,
                       mesh_text: str) -> dict[int, int]:
    """The batch leaves (non-scalar leaves of the ``batch_argnums`` arguments) to split on
    their first dimension ``num_shards`` ways, by tensor id; raises ``BatchSizeError`` naming
    the first whose leading dimension does not divide (``mesh_text``: the mesh, for it)."""
    split: dict[int, int] = {}
    for io in graph.inputs:
        info = graph.tensors[io.tensor]
        if io.arg_index not in batch_argnums or info.ndim == 0:
            continue
        if info.shape[0] % num_shards != 0:
            raise BatchSizeError(
                f"batch leaf '{io.path}' has leading dimension {info.shape[0]}, not divisible "
                f"by the data-parallel degree {num_shards} (mesh {mesh_text}); use a batch "
                f"size that is a multiple of {num_shards}"
            )
        split[io.tensor] = 0
    return split
