"""Whether a loss function treats the examples of its batch apart: what cutting the batch into
microbatches needs.

A pipeline runs the loss forward once per microbatch and takes the mean of the microbatches'
losses (and aux outputs, and gradients). That equals the whole batch's loss exactly when the
loss is a mean over examples of what each example computes alone. A batch statistic (batch
norm's mean and variance), a branch on a sum over the batch, or a loss that is a nonlinear
function of a batch mean computes something else on a microbatch, and the step would silently
train another model.

The batch split is followed through the forward (``batch_split``: the batch leaves split on
their first dimension). Where it is summed away (a reduction or contraction over the batch: an
all-reduce under data parallelism) the result is a sum over examples. Such a sum may reach the
outputs only linearly: scaled or divided by values that do not depend on the batch, added to
other such sums, reshaped, summed further. Anything else (meeting a per-example value again,
a nonlinear op, a product of two sums) couples the examples; so does an op that can only run
on the whole batch (a sort, a cumulative sum or a reversal along it).
"""

from __future__ import annotations

from collections.abc import Collection

from autopar.compiler.graph.batch_split import propagate_batch_split
from autopar.compiler.graph.opgraph import OpGraph, OpNode
from autopar.plan import CollectiveKind

# Ops that are linear in their one operand (or sums of their operands).
_LINEAR_UNARY = frozenset({"neg", "convert_element_type", "reshape", "squeeze", "reduce_sum",
                           "copy", "copy_p", "expand_dims", "reduce_precision",
                           "stop_gradient", "broadcast_in_dim"})
_SUMS = frozenset({"add", "sub", "add_any"})
_PRODUCTS = frozenset({"mul", "dot_general"})
# Ops that run along one axis of their operand: along the batch they mix its examples. (Other
# ops the batch split gathers before, a gather or a concatenation it cannot follow, are its
# conservative fallback for pricing data parallelism, not a coupling.)
_ALONG_AN_AXIS = frozenset({"sort", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
                            "rev"})


def _along_batch(node: OpNode, split: dict[int, int | None]) -> bool:
    """Whether ``node`` runs along the dimension its first operand's batch is split on."""
    d = split.get(node.inputs[0]) if node.inputs else None
    axes = node.params.get("dimension", node.params.get("axis", node.params.get("dimensions")))
    if d is None or axes is None:
        return False
    return d in (tuple(axes) if isinstance(axes, (tuple, list)) else (axes,))


def coupled_examples(graph: OpGraph, split_inputs: Collection[int]) -> str | None:
    """Where ``graph`` (a loss forward) mixes the examples of the batch, in a few words, or
    None when each example is computed alone and the outputs are means or sums over them.
    ``split_inputs``: its inputs that carry the batch on their first dimension."""
    # one shard: every split is kept, whatever the sizes
    # an op the split cannot follow is taken to keep its examples apart, so that what comes
    # after it is still followed (a sum over the batch there is still found)
    result = propagate_batch_split(graph, {t: 0 for t in split_inputs}, 1, keep_batch=True)
    summed: dict[int, CollectiveKind] = {}
    for found in result.collectives:
        summed.setdefault(found.node, found.kind)
    split = result.split_dim
    over_batch: set[int] = set()  # values that are sums over the batch, or linear in them
    for node in graph.nodes:
        kind = summed.get(node.id)
        if node.primitive in _ALONG_AN_AXIS and _along_batch(node, split):
            return f"{node.primitive} runs along the batch"
        if kind is CollectiveKind.ALL_REDUCE:
            if any(t in over_batch for t in node.inputs):
                return f"{node.primitive} sums over the batch a value made from a batch sum"
            over_batch.update(node.outputs)
            continue
        tainted = [t in over_batch for t in node.inputs]
        if not any(tainted):
            continue
        per_example = any(split.get(t) is not None for t in node.inputs)
        name = node.primitive
        linear = (
            name in _LINEAR_UNARY
            or (name in _SUMS and not per_example)
            or (name in _PRODUCTS and sum(tainted) == 1 and not per_example)
            or (name == "div" and tainted == [True, False] and not per_example)
            # a choice on a batch-free predicate (Keras's divide_no_nan: where(n == 0, 0, s / n))
            or (name == "select_n" and not tainted[0] and not per_example)
        )
        if not linear:
            if per_example:
                return f"a sum over the batch meets a per-example value at {name}"
            return f"a sum over the batch goes through {name}"
        over_batch.update(node.outputs)
    return None
