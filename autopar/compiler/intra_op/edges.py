"""Edges of the intra-operator ILP: resharding cost between the variables at both ends of
every data use, and between a new-state output and the input leaf it replaces.

Each use of a tensor gets a matrix [producer choice][consumer choice] of resharding seconds.
Uses between two variables add up into one edge; a use inside one variable (producer and
consumer merged by following or tying) can only take the diagonal, which goes into that
variable's own costs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from autopar.compiler.cost.resharding import ReshardCost, ReshardSteps, reshard_cost
from autopar.compiler.graph.opgraph import OpGraph, OpNode, TensorInfo
from autopar.compiler.intra_op.problem import ProblemEdge
from autopar.compiler.intra_op.strategies.base import Strategy
from autopar.compiler.intra_op.strategies.reduce import SPLIT_REDUCTIONS
from autopar.compiler.intra_op.variables import (
    COLLECTIVE_TIE_BREAK_S,
    DecisionVariables,
    Variable,
)
from autopar.plan import ShardingSpec

# how many use notes an edge keeps for --dump-ilp readers
_NOTES_PER_EDGE = 4


def state_ties(graph: OpGraph, tensor_home: dict[int, tuple[int, int]]) -> list[tuple[int, int]]:
    """(output tensor, input tensor) pairs of new-state leaves and the leaves they replace:
    outputs whose path after the result index equals an input's path after the argument
    name (``out/0/params/w`` replaces ``state/params/w``) with the same shape and dtype.

    Only outputs with a home in ``tensor_home`` (produced by an op or an input) count."""
    by_suffix: dict[str, int] = {}
    for io in graph.inputs:
        suffix = io.path.split("/", 1)[1] if "/" in io.path else ""
        if io.arg_index == 0:
            by_suffix[suffix] = io.tensor
    ties = []
    for io in graph.outputs:
        parts = io.path.split("/", 2)
        if len(parts) < 3 or parts[1] != "0":
            continue
        in_t = by_suffix.get(parts[2])
        if in_t is None or io.tensor not in tensor_home:
            continue
        a, b = graph.tensors[io.tensor], graph.tensors[in_t]
        if (a.shape, a.dtype) == (b.shape, b.dtype):
            ties.append((io.tensor, in_t))
    return ties


def summed_dims(node: OpNode) -> frozenset[int]:
    """The operand dimensions a reduction that may split them sums over (none for other
    ops): a slice of its operand along one is priced (``reshard_cost``)."""
    if node.primitive not in SPLIT_REDUCTIONS:
        return frozenset()
    return frozenset(int(a) for a in node.params["axes"])


def input_needs(strategies: Sequence[Strategy], k: int) -> list[ShardingSpec | None]:
    """The spec each of ``strategies`` reads its operand ``k`` in (None: any)."""
    return [s.input_specs[k] for s in strategies]


def _output_specs(strategies: list[Strategy]) -> list[ShardingSpec]:
    return [s.output_specs[0] for s in strategies]


class ReshardingEdges:
    """Resharding costs on ``table``'s variables, cached by what they depend on.

    ``cost`` is also how the read-back of a solution prices the reshards it keeps."""

    def __init__(self, table: DecisionVariables):
        self.table = table
        # shared by builds on the same mesh (``MeshCaches``): costs depend on specs, type and
        # mesh only, matrices on the strategy lists at both ends, which the builds share
        self._cost_cache: dict[tuple, ReshardCost] = table.caches.reshard_costs
        self._steps_cache: dict[tuple, ReshardSteps] = table.caches.reshard_steps
        self._matrix_cache: dict[tuple, np.ndarray] = table.caches.matrices

    def cost(self, src: ShardingSpec, dst: ShardingSpec, info: TensorInfo,
             price_slice: frozenset[int] = frozenset()) -> ReshardCost:
        """Resharding ``info``-typed data from ``src`` to ``dst`` on the table's mesh (a
        slice priced where it splits a dimension of ``price_slice``: one a reduction reading
        it sums over, ``reshard_cost``).

        Cached by what the cost depends on: the specs, the tensor's rank and its bytes (not
        its shape or dtype: tensors of one size and rank reshard alike, about half the
        lookups of a model's build)."""
        key = (src, dst, info.nbytes, info.ndim, price_slice)
        found = self._cost_cache.get(key)
        if found is None:
            found = reshard_cost(src, dst, info, self.table.mesh, price_slice,
                                 self._steps_cache)
            self._cost_cache[key] = found
        return found

    def use_matrix(
        self, tensor: int, needs: Callable[[], Sequence[ShardingSpec | None]], key: tuple,
        price_slice: frozenset[int] = frozenset(),
    ) -> np.ndarray:
        """Resharding seconds [producer choice][consumer choice] for one use of ``tensor``;
        ``needs()[j]`` is the spec the use needs under the consumer's choice j
        (``price_slice``: the dimensions the consumer sums over, where it is a reduction,
        ``cost``).

        Cached by the producer's and consumer's strategy lists: the same op of every tied
        layer reuses one matrix."""
        home, out = self.table.tensor_home[tensor]
        src_list = self.table.variable_of(home).members[home]
        info = self.table.graph.tensors[tensor]
        full_key = (id(src_list), out, key, info.shape, info.dtype, price_slice)
        found = self._matrix_cache.get(full_key)
        if found is None:
            wanted = needs()
            # many strategies share a spec: price each distinct (producer, consumer) pair once
            src_index: dict[ShardingSpec, int] = {}
            rows = [src_index.setdefault(s.output_specs[out], len(src_index)) for s in src_list]
            need_index: dict[ShardingSpec, int] = {}
            cols = [-1 if n is None else need_index.setdefault(n, len(need_index))
                    for n in wanted]
            found = self._priced(tuple(src_index), tuple(need_index), info,
                                 price_slice)[np.ix_(rows, cols)]
            self._matrix_cache[full_key] = found
        return found

    def _priced(self, srcs: tuple[ShardingSpec, ...], needs: tuple[ShardingSpec, ...],
                info: TensorInfo, price_slice: frozenset[int] = frozenset()) -> np.ndarray:
        """Seconds [src][need] (and a last column of zeros: no need) between distinct specs,
        cached by the specs themselves: ops with different strategy lists often produce and
        need the same few specs of a tensor type."""
        key = ("priced", srcs, needs, info.nbytes, info.ndim, price_slice)
        small = self._matrix_cache.get(key)
        if small is None:
            small = np.zeros((len(srcs), len(needs) + 1))
            for a, spec in enumerate(srcs):
                for b, need in enumerate(needs):
                    move = self.cost(spec, need, info, price_slice)
                    count = sum(c.count for c in move.collectives)
                    small[a, b] = move.time_s + COLLECTIVE_TIE_BREAK_S * count
            self._matrix_cache[key] = small
        return small

    def edges(self, ties: Sequence[tuple[int, int]]) -> list[ProblemEdge]:
        """Every nonzero edge: operand uses, then the state ``ties`` (see ``state_ties``).

        Adds the diagonal of uses within one variable to that variable's costs, in place."""
        table = self.table
        matrices: dict[tuple[int, int], np.ndarray] = {}
        notes: dict[tuple[int, int], list[str]] = {}

        def add_use(tensor: int, dst_var: Variable,
                    needs: Callable[[], Sequence[ShardingSpec | None]], key: tuple, note: str,
                    repeat: int = 1, price_slice: frozenset[int] = frozenset()) -> None:
            src_var = table.home_variable(tensor)
            matrix = self.use_matrix(tensor, needs, key, price_slice)
            if repeat > 1:  # a use inside a scan body reshards on every iteration
                matrix = matrix * repeat
            if src_var.index == dst_var.index:
                # one decision at both ends: only the diagonal can happen
                src_var.costs = list(np.asarray(src_var.costs) + np.diagonal(matrix))
                return
            pair = (src_var.index, dst_var.index)
            if pair in matrices:
                matrices[pair] = matrices[pair] + matrix
            else:
                matrices[pair] = matrix
            notes.setdefault(pair, []).append(note)

        for node in table.graph.nodes:
            var = table.variable_of(node.id)
            strategies = var.members[node.id]
            for k, t in enumerate(node.inputs):
                if t not in table.tensor_home:
                    continue  # literal or constant: every device holds it whole
                add_use(t, var, partial(input_needs, strategies, k), ("use", id(strategies), k),
                        f"t{t}->n{node.id}.{k}", node.repeat, summed_dims(node))
        for out_t, in_t in ties:
            in_member = table.tensor_home[in_t][0]
            in_var = table.variable_of(in_member)
            in_list = in_var.members[in_member]
            add_use(out_t, in_var, partial(_output_specs, in_list), ("tie", id(in_list)),
                    f"tie t{out_t}=t{in_t}")
        return [
            ProblemEdge(
                src, dst, matrix, note="; ".join(notes[(src, dst)][:_NOTES_PER_EDGE])
            )
            for (src, dst), matrix in matrices.items()
            if matrix.any()
        ]
