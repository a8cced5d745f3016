"""How each op carries a batch split: per primitive, the split dimension of its results from
its operands' and the collectives the split forces at it (an all-reduce where a split
dimension is summed away, an all-gather where an op cannot keep a split). ``batch_split``
pushes a split through the whole graph with these rules and settles scan carries.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from autopar.compiler.graph.opgraph import OpGraph, OpNode
from autopar.ir.program import SCAN_ENTER, SCAN_EXIT
from autopar.plan import CollectiveKind


@dataclass(frozen=True)
class ImpliedCollective:
    """A collective the split forces at one node: its kind and full tensor size in bytes."""

    node: int
    kind: CollectiveKind
    nbytes: int


Split = int | None  # the split dimension of a tensor (None: whole)


class SplitRules:
    """The split state of one propagation (each tensor's split dimension, the collectives
    found so far) and the rule of every primitive that can keep a split."""

    def __init__(self, graph: OpGraph, num_shards: int, keep_batch: bool = False) -> None:
        self.graph = graph
        self.n = num_shards
        self.keep_batch = keep_batch
        self.split: dict[int, Split] = {}
        self.collectives: list[ImpliedCollective] = []
        # scan carries' settled layouts around their loops, by enter node (see
        # ``batch_split``'s ``run``)
        self.carry_layout: dict[int, Split] = {}

    def shape(self, t: int) -> tuple[int, ...]:
        return self.graph.tensors[t].shape

    def can_split(self, t: int, dim: int) -> bool:
        shape = self.shape(t)
        return 0 <= dim < len(shape) and shape[dim] % self.n == 0 and shape[dim] >= self.n

    def emit(self, node: OpNode, kind: CollectiveKind, tensor: int) -> None:
        # inside a scan body, once per iteration
        self.collectives.extend(
            [ImpliedCollective(node.id, kind, self.graph.tensors[tensor].nbytes)] * node.repeat)

    def gather_inputs(self, node: OpNode) -> list[Split]:
        """The fallback: every split operand is all-gathered, every result is whole. With
        ``keep_batch`` (following examples, not pricing: ``batch_coupling``) nothing is
        gathered, and a result whose first dimension is the operands' split first dimension
        stays split on it, as if the op treated examples apart."""
        if self.keep_batch:
            dims = {self.split.get(t) for t in node.inputs} - {None}
            sizes = {self.shape(t)[0] for t in node.inputs if self.split.get(t) == 0}
            return [0 if dims == {0} and self.shape(o)[:1] == tuple(sizes) else None
                    for o in node.outputs]
        for t in dict.fromkeys(node.inputs):
            if self.split.get(t) is not None:
                self.emit(node, CollectiveKind.ALL_GATHER, t)
        return [None] * len(node.outputs)

    def set_output(self, node: OpNode, dim: Split) -> list[Split]:
        out = node.outputs[0]
        if dim is not None and not self.can_split(out, dim):
            dim = None
        return [dim] + [None] * (len(node.outputs) - 1)

    # -- rules ---------------------------------------------------------------------------------

    def elementwise(self, node: OpNode) -> list[Split]:
        # Operands have the output's rank (size-1 dimensions broadcast) or are scalars. A split
        # survives when every split operand is split on the same full-size dimension; whole
        # operands are sliced locally for free.
        out_shape = self.shape(node.outputs[0])
        dims = set()
        for t in node.inputs:
            d = self.split.get(t)
            if d is None:
                continue
            shape = self.shape(t)
            if len(shape) != len(out_shape) or shape[d] != out_shape[d]:
                return self.gather_inputs(node)
            dims.add(d)
        if len(dims) > 1:
            return self.gather_inputs(node)
        return self.set_output(node, dims.pop() if dims else None)

    def broadcast_in_dim(self, node: OpNode) -> list[Split]:
        d = self.split.get(node.inputs[0])
        if d is None:
            return self.set_output(node, None)
        in_shape, out_shape = self.shape(node.inputs[0]), self.shape(node.outputs[0])
        out_dim = node.params["broadcast_dimensions"][d]
        if in_shape[d] != out_shape[out_dim]:
            return self.gather_inputs(node)
        return self.set_output(node, out_dim)

    def reshape(self, node: OpNode) -> list[Split]:
        d = self.split.get(node.inputs[0])
        if d is None:
            return self.set_output(node, None)
        in_shape, out_shape = self.shape(node.inputs[0]), self.shape(node.outputs[0])
        prefix = math.prod(in_shape[:d])
        # The split survives when dimension d starts an output dimension (a merge with minor
        # dimensions, or the major piece of a split) and both sizes divide by the shard count.
        for j in range(len(out_shape)):
            if math.prod(out_shape[:j]) != prefix:
                continue
            a, b = in_shape[d], out_shape[j]
            if a % self.n == 0 and b % self.n == 0 and (a % b == 0 or b % a == 0):
                return self.set_output(node, j)
        return self.gather_inputs(node)

    def transpose(self, node: OpNode) -> list[Split]:
        d = self.split.get(node.inputs[0])
        perm = list(node.params["permutation"])
        return self.set_output(node, None if d is None else perm.index(d))

    def reduce(self, node: OpNode) -> list[Split]:
        d = self.split.get(node.inputs[0])
        axes = tuple(node.params.get("axes", ()))
        if d is None:
            return self.set_output(node, None)
        if d in axes:
            if node.primitive in ("argmax", "argmin"):
                return self.gather_inputs(node)
            self.emit(node, CollectiveKind.ALL_REDUCE, node.outputs[0])
            return self.set_output(node, None)
        return self.set_output(node, d - sum(1 for a in axes if a < d))

    def dot_general(self, node: OpNode) -> list[Split]:
        lhs, rhs = node.inputs[:2]
        (lc, rc), (lb, rb) = node.params["dimension_numbers"]
        dl, dr = self.split.get(lhs), self.split.get(rhs)
        lhs_free = [i for i in range(len(self.shape(lhs))) if i not in lc and i not in lb]
        rhs_free = [i for i in range(len(self.shape(rhs))) if i not in rc and i not in rb]
        if dl is not None and dl in lc:
            partner = rc[list(lc).index(dl)]
            if dr is not None and dr != partner:
                return self.gather_inputs(node)
            # Both sides hold matching slices of the contraction: each device has a partial sum.
            self.emit(node, CollectiveKind.ALL_REDUCE, node.outputs[0])
            return self.set_output(node, None)
        if dr is not None and dr in rc:
            if dl is not None:
                return self.gather_inputs(node)
            self.emit(node, CollectiveKind.ALL_REDUCE, node.outputs[0])
            return self.set_output(node, None)
        if dl is not None and dr is not None:
            if dl in lb and dr in rb and list(lb).index(dl) == list(rb).index(dr):
                return self.set_output(node, list(lb).index(dl))
            return self.gather_inputs(node)
        if dl is not None:
            pos = list(lb).index(dl) if dl in lb else len(lb) + lhs_free.index(dl)
            return self.set_output(node, pos)
        if dr is not None:
            if dr in rb:
                return self.set_output(node, list(rb).index(dr))
            return self.set_output(node, len(lb) + len(lhs_free) + rhs_free.index(dr))
        return self.set_output(node, None)

    def conv(self, node: OpNode) -> list[Split]:
        lhs, rhs = node.inputs[:2]
        dn = node.params["dimension_numbers"]
        dl, dr = self.split.get(lhs), self.split.get(rhs)
        if dr is None and dl == dn.lhs_spec[0] and node.params.get("batch_group_count", 1) == 1:
            return self.set_output(node, dn.out_spec[0])
        if (
            dl == dn.lhs_spec[1]
            and dr == dn.rhs_spec[1]
            and node.params.get("feature_group_count", 1) == 1
        ):
            # Input features contracted on both sides (a weight gradient): partial sums.
            self.emit(node, CollectiveKind.ALL_REDUCE, node.outputs[0])
            return self.set_output(node, None)
        if dl is None and dr is None:
            return self.set_output(node, None)
        return self.gather_inputs(node)

    def gather(self, node: OpNode) -> list[Split]:
        operand, indices = node.inputs[:2]
        dn = node.params["dimension_numbers"]
        d = self.split.get(indices)
        operand_d = self.split.get(operand)
        if operand_d is not None:
            # a batched gather (``take_along_axis``: operand and indices share a batch
            # dimension) reads each example's rows from that example's part: it stays split
            batching = tuple(getattr(dn, "operand_batching_dims", ()))
            index_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
            if operand_d not in batching or d != index_batching[batching.index(operand_d)]:
                return self.gather_inputs(node)
        if d is None:
            return self.set_output(node, None)
        index_vector_dim = len(self.shape(indices)) - 1
        if d == index_vector_dim:
            return self.gather_inputs(node)
        batch_out_dims = [
            i for i in range(len(self.shape(node.outputs[0]))) if i not in dn.offset_dims
        ]
        batch_in_dims = [i for i in range(len(self.shape(indices))) if i != index_vector_dim]
        return self.set_output(node, batch_out_dims[batch_in_dims.index(d)])

    def scatter(self, node: OpNode) -> list[Split]:
        operand, indices, updates = node.inputs[:3]
        if self.split.get(operand) is not None:
            return self.gather_inputs(node)
        if self.split.get(indices) is not None or self.split.get(updates) is not None:
            if node.primitive == "scatter-add" or node.primitive == "scatter_add":
                # Each device scatters its part of the batch: the results add up.
                self.emit(node, CollectiveKind.ALL_REDUCE, node.outputs[0])
                return self.set_output(node, None)
            return self.gather_inputs(node)
        return self.set_output(node, None)

    def same_dim_if_untouched(self, node: OpNode) -> list[Split]:
        """Slicing-like ops: the split survives if the split dimension keeps its size."""
        src = node.inputs[0]
        d = self.split.get(src)
        others_split = any(self.split.get(t) is not None for t in node.inputs[1:])
        if d is None and not others_split:
            return self.set_output(node, None)
        out = node.outputs[0]
        if (
            d is not None
            and not others_split
            and len(self.shape(out)) == len(self.shape(src))
            and self.shape(out)[d] == self.shape(src)[d]
            and node.params.get("dimension", node.params.get("axis", -1)) != d
        ):
            return self.set_output(node, d)
        return self.gather_inputs(node)

    def windowed(self, node: OpNode) -> list[Split]:
        """Pooling and its gradient: the split survives where the window is 1 wide, stride 1."""
        d = self.split.get(node.inputs[0])
        others_split = any(self.split.get(t) is not None for t in node.inputs[1:])
        window = node.params.get("window_dimensions")
        strides = node.params.get("window_strides")
        if d is None and not others_split:
            return self.set_output(node, None)
        if d is not None and window is not None and strides is not None and window[d] == 1 \
                and strides[d] == 1:  # (a windowed op has both; its params are untyped)
            # Every split operand must agree on the dimension (select_and_scatter_add's source).
            if all(self.split.get(t) in (None, d) for t in node.inputs[1:]):
                return self.set_output(node, d)
        return self.gather_inputs(node)

    def squeeze(self, node: OpNode) -> list[Split]:
        d = self.split.get(node.inputs[0])
        if d is None:
            return self.set_output(node, None)
        dims = tuple(node.params["dimensions"])
        return self.set_output(node, d - sum(1 for a in dims if a < d))

    def concatenate(self, node: OpNode) -> list[Split]:
        dims = {self.split.get(t) for t in node.inputs}
        if dims == {None}:
            return self.set_output(node, None)
        if len(dims) == 1 and dims != {node.params["dimension"]}:
            return self.set_output(node, dims.pop())
        return self.gather_inputs(node)

    def scan_enter(self, node: OpNode) -> list[Split]:
        """A scan operand into the body: consts and carries as they are; ``xs`` lose their
        leading length axis (a split of that axis cannot enter: every iteration needs its whole
        slice). A carry's layout may be settled by the propagation (``carry_layout``, set by
        ``batch_split``'s ``run``)."""
        d = self.split.get(node.inputs[0])
        if node.id in self.carry_layout:
            settled = self.carry_layout[node.id]
            if d is not None and d != settled:
                return self.gather_inputs(node)
            return self.set_output(node, settled)  # whole -> split: each device slices
        if d is None:
            return self.set_output(node, None)
        if node.params["role"] == "xs":
            return self.gather_inputs(node) if d == 0 else self.set_output(node, d - 1)
        return self.set_output(node, d)

    def scan_exit(self, node: OpNode) -> list[Split]:
        """A body result out of the loop: the final carry as it is (its enter's layout: see
        ``batch_split``'s ``run``), the stacked ``ys`` behind a whole length axis."""
        d = self.split.get(node.inputs[0])
        if d is None:
            return self.set_output(node, None)
        return self.set_output(node, d + 1 if node.params["role"] == "ys" else d)

    def rules(self) -> dict[str, Callable[[OpNode], list[Split]]]:
        rules: dict[str, Callable[[OpNode], list[Split]]] = {
            SCAN_ENTER.name: self.scan_enter,
            SCAN_EXIT.name: self.scan_exit,
            "broadcast_in_dim": self.broadcast_in_dim,
            "reshape": self.reshape,
            "transpose": self.transpose,
            "dot_general": self.dot_general,
            "conv_general_dilated": self.conv,
            "gather": self.gather,
            "scatter-add": self.scatter,
            "scatter_add": self.scatter,
            "scatter": self.scatter,
            "squeeze": self.squeeze,
            "concatenate": self.concatenate,
        }
        for name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
                     "reduce_and", "reduce_or"):
            rules[name] = self.reduce
        for name in ("reduce_window_max", "reduce_window_min", "reduce_window_sum",
                     "reduce_window", "select_and_scatter_add", "select_and_gather_add"):
            rules[name] = self.windowed
        for name in ("slice", "pad", "dynamic_slice", "dynamic_update_slice", "cumsum",
                     "cumprod", "cummax", "cummin", "cumlogsumexp", "rev", "sort"):
            rules[name] = self.same_dim_if_untouched
        return rules
