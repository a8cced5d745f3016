"""Softmax attention found in a traced step by its shape, not by a model's name.

An attention is ``probs = softmax(mask(scale(q . k)))`` over the key axis, then
``out = probs . v``. In the flat program that is a ``dot_general`` contracting the head
dimension (the scores, ``[..., queries, keys]``), a short chain of element-wise steps (the
scale; a ``select_n`` against a constant where a mask applies; dtype conversions; a
transpose), the softmax (``reduce_max``, ``sub``, ``exp``, ``reduce_sum``, ``div``: what
``jax.nn.softmax`` emits), and a second ``dot_general`` contracting the probabilities' key
axis with the values. :func:`find_attention` matches that backwards from the second matmul,
so the backward's matmuls (which read the probabilities but contract their query axis, or read
the softmax's gradient) are not taken for attentions. What it finds is what context
parallelism (``runtime.ring_attention``) would replace.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.compiler.graph.opgraph import OpGraph, OpNode

# Steps allowed between the scores matmul and the softmax's input (and around the
# probabilities): they keep the scores' elements as they are, up to scale, mask or layout.
_BETWEEN = frozenset({"mul", "div", "add", "sub", "select_n", "convert_element_type",
                      "transpose", "reshape", "stop_gradient"})
# How far back a chain is followed: a model's scale, mask and casts take a few steps.
_MAX_CHAIN = 8


@dataclass(frozen=True)
class AttentionSite:
    """One softmax attention: ``scores`` and ``output`` are the ids of its two matmul nodes;
    ``query``, ``key``, ``value`` and ``result`` tensor ids; ``causal`` where a ``select_n``
    masks the scores with a predicate made from ``iota`` (positions compared); the lengths of
    the query and key axes; ``nodes``: every node of it, the two matmuls included."""

    scores: int
    output: int
    query: int
    key: int
    value: int
    result: int
    causal: bool
    query_length: int
    key_length: int
    nodes: tuple[int, ...]
    # the nodes between the scores matmul and the softmax's input, from the softmax's side
    # (scale, mask, casts), and which operand of the output matmul the probabilities are
    chain: tuple[int, ...] = ()
    probabilities_side: int = 0


def find_attention(graph: OpGraph) -> list[AttentionSite]:
    """Every softmax attention in ``graph``, in program order."""
    found = []
    for node in graph.nodes:
        if node.primitive == "dot_general":
            site = _match(graph, node)
            if site is not None:
                found.append(site)
    return found


def _node(graph: OpGraph, tensor: int) -> OpNode | None:
    at = graph.producer.get(tensor)
    return None if at is None else graph.nodes[at]


def _back(graph: OpGraph, tensor: int, passing: frozenset[str],
          path: list[int]) -> tuple[int, OpNode | None]:
    """Follow ``tensor`` back through nodes in ``passing`` (each time along the operand of the
    most elements, the data rather than a scale or a mask constant) to the first node that is
    not; the nodes passed are added to ``path``."""
    for _ in range(_MAX_CHAIN):
        node = _node(graph, tensor)
        if node is None or node.primitive not in passing:
            return tensor, node
        path.append(node.id)
        data = [t for t in node.inputs if graph.tensors[t].dtype != "bool"]
        tensor = max(data, key=lambda t: (graph.tensors[t].size, not _is_filler(graph, t)))
    return tensor, None


def _is_filler(graph: OpGraph, tensor: int) -> bool:
    """Whether ``tensor`` is a scalar broadcast (a mask's fill value, a scale), not data."""
    node = _node(graph, tensor)
    return node is not None and node.primitive == "broadcast_in_dim" and all(
        graph.tensors[t].size == 1 for t in node.inputs)


def _made_from_iota(graph: OpGraph, tensor: int) -> bool:
    seen: set[int] = set()
    todo = [tensor]
    while todo and len(seen) < 4 * _MAX_CHAIN:
        node = _node(graph, todo.pop())
        if node is None or node.id in seen:
            continue
        if node.primitive == "iota":
            return True
        seen.add(node.id)
        todo.extend(node.inputs)
    return False


def _match(graph: OpGraph, out: OpNode) -> AttentionSite | None:
    contract, _ = out.params.get("dimension_numbers", (((), ()), ((), ())))
    for side, probs in enumerate(out.inputs):
        path = [out.id]
        t, norm = _back(graph, probs, frozenset({"convert_element_type"}), path)
        if norm is None or norm.primitive != "div" or tuple(contract[side]) != (
                graph.tensors[t].ndim - 1,):
            continue  # the probabilities' last (key) axis is what a forward ·v contracts
        path.append(norm.id)
        exp = _node(graph, norm.inputs[0])
        if exp is None or exp.primitive != "exp":
            continue
        path.append(exp.id)
        shifted = _node(graph, exp.inputs[0])
        if shifted is None or shifted.primitive != "sub":
            continue
        path.append(shifted.id)
        logits = shifted.inputs[0]
        if not any(graph.nodes[c].primitive in ("reduce_max", "max")
                   for c in graph.consumers.get(logits, ())):
            continue
        chain: list[int] = []
        _, scores = _back(graph, logits, _BETWEEN, chain)
        if scores is None or scores.primitive != "dot_general" or len(scores.inputs) != 2:
            continue
        masks = [graph.nodes[n] for n in chain if graph.nodes[n].primitive == "select_n"]
        shape = graph.tensors[logits].shape
        return AttentionSite(
            scores=scores.id, output=out.id, query=scores.inputs[0], key=scores.inputs[1],
            value=out.inputs[1 - side], result=out.outputs[0],
            causal=any(_made_from_iota(graph, m.inputs[0]) for m in masks),
            query_length=shape[-2], key_length=shape[-1],
            nodes=tuple(sorted({scores.id, *chain, *_softmax_nodes(graph, logits, out.id),
                                *path})),
            chain=tuple(chain), probabilities_side=side)
    return None


def _softmax_nodes(graph: OpGraph, logits: int, before: int) -> set[int]:
    """The softmax's own nodes below ``logits``: its row maximum and row sum with their
    broadcasts and reshapes, up to the normalising ``div``; all before node ``before`` (the
    matmul with the values: later readers of the same values are the backward's)."""
    nodes: set[int] = set()
    todo = [logits]
    keep = {"reduce_max", "max", "sub", "exp", "reduce_sum", "div", "broadcast_in_dim",
            "reshape", "stop_gradient"}
    while todo:
        for c in graph.consumers.get(todo.pop(), ()):
            node = graph.nodes[c]
            if node.primitive in keep and c < before and c not in nodes:
                nodes.add(c)
                if node.primitive != "div":
                    todo.extend(node.outputs)
    return nodes

