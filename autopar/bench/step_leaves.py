"""The input leaves of a train step ``(state, batch)``, as the hand plans' rules read them: each
leaf's pytree path (the one the tracer gives it), shape, whether it is fed anew each step, and
its element size."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Leaf", "graph_leaves", "tree_leaves"]


@dataclass(frozen=True)
class Leaf:
    """One input leaf of a train step: its path (``state/params/w``), shape, and whether it is
    a batch leaf (fed anew each step) rather than state."""

    path: str
    shape: tuple[int, ...]
    is_batch: bool = False
    itemsize: int = 4  # bytes per element

    @property
    def ndim(self) -> int:
        return len(self.shape)


def graph_leaves(graph: Any, batch_argnums: Sequence[int] = (1,)) -> list[Leaf]:
    """The input leaves of a traced step's graph (``TracedStep.graph``)."""
    return [Leaf(io.path, tuple(graph.tensors[io.tensor].shape), io.arg_index in batch_argnums,
                 graph.tensors[io.tensor].itemsize)
            for io in graph.inputs]


def tree_leaves(args: Sequence[Any], names: Sequence[str] = ("state", "batch"),
                batch_argnums: Sequence[int] = (1,)) -> list[Leaf]:
    """The leaves of a step's arguments, with the paths the tracer gives them."""
    import jax

    from autopar.ir.flatten import leaf_path

    found = []
    for i, (name, arg) in enumerate(zip(names, args, strict=True)):
        for keypath, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            found.append(Leaf(leaf_path(name, keypath), tuple(leaf.shape), i in batch_argnums,
                              jax.numpy.dtype(leaf.dtype).itemsize))
    return found
