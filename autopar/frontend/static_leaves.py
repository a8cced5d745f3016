"""Non-array pytree leaves of a train step's arguments and outputs are static.

Equinox models (``eqx.Module``) and similar libraries keep non-array objects among a pytree's
leaves: activation functions, ints, bools, strings. ``eqx.filter_jit`` traces the array leaves
and treats every other leaf as static; autopar does the same, generically on pytrees (it never
imports Equinox):

* an *array leaf* is anything with a ``shape`` and a ``dtype``: ``jax.Array`` (and tracers),
  ``np.ndarray``, NumPy scalars, ``jax.ShapeDtypeStruct``; these are traced (dynamic);
* every other leaf is *static*, Python scalars included (as in ``eqx.filter_jit``, unlike
  ``jax.jit``): its value is closed over when tracing and is part of the input signature, so a
  different value re-traces and re-plans; static leaves must be hashable.

The traced program sees each argument with ``None`` in place of its static leaves (``None`` is
an empty subtree, so the array leaves keep their paths, e.g. ``model/layers/0/weight``, and the
plan still names them); the step is called with the static leaves put back. The step's outputs
are split the same way: the program returns their array leaves, and the static ones recorded at
trace time are put back around the results of each call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from autopar.errors import InvalidOptionError, TraceError


def is_array_leaf(leaf: Any) -> bool:
    """Whether a pytree leaf is traced: arrays, tracers, NumPy scalars, ShapeDtypeStructs."""
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


@dataclass(frozen=True)
class LeafSplit:
    """A pytree split into its array leaves and its static (non-array) leaves."""

    treedef: Any  # jax.tree_util.PyTreeDef of the whole tree
    static: tuple[tuple[int, Any], ...]  # (position among all leaves, value), in order

    @property
    def has_static(self) -> bool:
        return bool(self.static)

    def merge(self, arrays: Sequence[Any]) -> Any:
        """The whole tree from its array leaves (in leaf order) and the static leaves."""
        if not self.static:
            return jax.tree_util.tree_unflatten(self.treedef, list(arrays))
        leaves: list[Any] = []
        pending = iter(arrays)
        fixed = dict(self.static)
        for i in range(self.treedef.num_leaves):
            leaves.append(fixed[i] if i in fixed else next(pending))
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def arrays_only(self, tree_leaves: Sequence[Any], what: str) -> Any:
        """The tree with ``None`` in place of each static leaf; ``what`` names it in errors."""
        if not self.static:
            return jax.tree_util.tree_unflatten(self.treedef, list(tree_leaves))
        fixed = {i for i, _ in self.static}
        holes = [None if i in fixed else leaf for i, leaf in enumerate(tree_leaves)]
        try:
            return jax.tree_util.tree_unflatten(self.treedef, holes)
        except Exception as exc:  # a pytree type that cannot hold None where a leaf was
            raise TraceError(
                f"{what} has non-array leaves (static) but its pytree type cannot be rebuilt "
                f"with None in their place ({type(exc).__name__}); keep non-array values out of "
                "it or mark them static in the pytree's definition"
            ) from exc


def split_leaves(tree: Any) -> tuple[LeafSplit, list[Any]]:
    """Split ``tree`` into its :class:`LeafSplit` and its array leaves (in leaf order)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    static = tuple((i, leaf) for i, leaf in enumerate(leaves) if not is_array_leaf(leaf))
    return LeafSplit(treedef, static), [leaf for leaf in leaves if is_array_leaf(leaf)]


def array_leaves(tree: Any) -> list[Any]:
    """The array leaves of ``tree``, in the order the traced program takes them."""
    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if is_array_leaf(leaf)]


def signature_part(name: str, arg: Any, arrays: list[Any] | None = None) -> tuple:
    """The part of the input signature one argument contributes: its tree structure, the shape
    and dtype of each array leaf, the type and value of each static leaf (the type keeps ``1``
    and ``1.0`` and ``True`` apart, which compare equal). Every step call computes it, so it
    reads leaves without their paths (a path is looked up only for the error); ``arrays``, when
    given, gets the array leaves appended (the program's flat inputs: one pass over the leaves
    serves both)."""
    parts: list[Any] = []
    leaves, treedef = jax.tree_util.tree_flatten(arg)
    for leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):  # is_array_leaf, inlined
            parts.append((tuple(leaf.shape), leaf.dtype))
            if arrays is not None:
                arrays.append(leaf)
            continue
        try:
            hash(leaf)
        except TypeError:
            from autopar.ir.flatten import leaf_path

            keypath = next(path for path, found in jax.tree_util.tree_flatten_with_path(arg)[0]
                           if found is leaf)
            raise InvalidOptionError(
                f"argument leaf '{leaf_path(name, keypath)}' is a {type(leaf).__name__}, not an "
                "array, so it is static and must be hashable (as with eqx.filter_jit); make it "
                "an array or a hashable value"
            ) from None
        parts.append(("static", type(leaf), leaf))
    return (treedef, tuple(parts))


@dataclass
class StaticOutputs:
    """The static leaves of the step's outputs, recorded by each trace (the same each time)."""

    split: LeafSplit | None = field(default=None)

    def record(self, out: Any) -> Any:
        """Record ``out``'s static leaves; return ``out`` with ``None`` in their place."""
        self.split, _ = split_leaves(out)
        return self.split.arrays_only(jax.tree_util.tree_leaves(out), "the step's output")

    def restore(self, arrays: Sequence[Any], out_tree: Any) -> Any:
        """The step's outputs from the program's flat results (``out_tree``: the program's
        output structure, used when nothing was recorded)."""
        if self.split is None or not self.split.has_static:
            return jax.tree_util.tree_unflatten(out_tree, list(arrays))
        return self.split.merge(arrays)
