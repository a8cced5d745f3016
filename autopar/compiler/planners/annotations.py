"""The user's own layout, read from the step's inputs: leaves committed to a ``NamedSharding``
over a mesh the user built (as LLM codebases do at init). The full search plans that layout
as one more candidate (ShardParallel on a logical mesh of the user's mesh's shape, those
inputs pinned, the ILP choosing the rest) and reports it beside its own plan.

Only the inputs say what the user meant here: ``with_sharding_constraint`` calls in the
model are numbered as copies (``ir.flatten``) and pin nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

from autopar.cluster import format_mesh_shape
from autopar.plan import ShardingSpec

# the logical mesh's axis names, in the order of the user's mesh axes
LOGICAL_AXES = ("x", "y")


@dataclass(frozen=True)
class UserLayout:
    """The user's mesh shape and axis names, and each committed input leaf's spec on the
    logical mesh of that shape (by leaf path, ``state/params/w``)."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    pins: tuple[tuple[str, ShardingSpec], ...]

    @property
    def label(self) -> str:
        return f"annotations {format_mesh_shape(self.mesh_shape)}"


def user_layout(args: Sequence[Any], in_paths: Sequence[str]) -> UserLayout | None:
    """The layout of the input leaves committed to one multi-device ``NamedSharding`` mesh
    of one or two axes (``in_paths``: the leaves' paths, in ``tree_leaves`` order); None when
    no leaf is, or they are on meshes of other ranks."""
    leaves = jax.tree_util.tree_leaves(tuple(args))
    mesh = None
    pins: list[tuple[str, ShardingSpec]] = []
    for path, leaf in zip(in_paths, leaves, strict=True):
        sharding = getattr(leaf, "sharding", None)
        leaf_mesh = getattr(sharding, "mesh", None)
        if sharding is None or leaf_mesh is None or getattr(leaf_mesh, "size", 1) < 2 \
                or not hasattr(leaf, "ndim"):
            continue
        if not getattr(leaf, "committed", True):
            continue
        mesh = mesh or leaf_mesh
        if leaf_mesh.shape_tuple != mesh.shape_tuple or len(mesh.axis_names) > 2:
            continue
        pins.append((path, _spec(sharding.spec, leaf.ndim, mesh.axis_names)))
    if mesh is None or not pins or len(mesh.axis_names) > 2:
        return None
    shape = tuple(int(size) for _, size in mesh.shape_tuple)
    return UserLayout(shape, tuple(mesh.axis_names), tuple(pins))


def _spec(partition: Any, ndim: int, axis_names: Sequence[str]) -> ShardingSpec:
    rename = dict(zip(axis_names, LOGICAL_AXES, strict=False))
    dims: list[tuple[str, ...]] = []
    for d in range(ndim):
        entry = partition[d] if d < len(partition) else None
        if entry is None:
            dims.append(())
        else:
            names = (entry,) if isinstance(entry, str) else tuple(entry)
            dims.append(tuple(rename[a] for a in names))
    return ShardingSpec(tuple(dims))
