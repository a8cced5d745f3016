"""Checkpoints that move between plans: the abstract target that restores a saved state into a
parallelized step's layout.

A step's state is a pytree of ``jax.Array`` s, so any checkpointer of JAX arrays saves it; Orbax
(``orbax-checkpoint``) is the one docs/quickstart.md shows. Restoring needs a target: each
leaf's shape, dtype and the sharding to read it into. :func:`restore_target` gives the one the
step that will run on it wants (its plan's layout, on its devices), whatever plan, mesh or
device count saved it::

    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    target = autopar.restore_target(step, abstract_state, batch)
    state = ckpt.restore(path, target)
    state, loss = step(state, batch)

A step accepts a state laid out by any other plan as it is (it moves it to its own layout);
the target only makes the restored state land where no move is needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax

from autopar.errors import InvalidOptionError
from autopar.frontend.static_leaves import is_array_leaf

if TYPE_CHECKING:
    from autopar.api import ParallelizedStep

__all__ = ["restore_target"]


def restore_target(step: ParallelizedStep, *args: Any, argnum: int = 0) -> Any:
    """Argument ``argnum`` of a call ``step(*args)`` (default: the first, the state) with each
    array leaf as a ``jax.ShapeDtypeStruct`` carrying the sharding ``step``'s plan for these
    arguments gives it (:meth:`ParallelizedStep.input_shardings`); non-array (static) leaves
    stay as they are. ``args``: the step's arguments as arrays or ``jax.ShapeDtypeStruct``
    (``jax.eval_shape(init)`` for the state; a sharding they carry is not the target's).
    Planning the step for them is its first call's planning, done now (the call reuses it).

    Pass the result as Orbax's restore target (``StandardCheckpointer().restore(path,
    target)``): the state comes back on ``step``'s devices, in its layout."""
    if not isinstance(argnum, int) or not 0 <= argnum < len(args):
        raise InvalidOptionError(f"argnum={argnum!r} must name one of the {len(args)} "
                                 "argument(s) given")
    if argnum in step.static_argnums:
        raise InvalidOptionError(f"argument {argnum} is static (static_argnums): it has no "
                                 "arrays to restore")
    shardings = step.input_shardings(*args)
    # the flat inputs are the array leaves of the non-static arguments, in order
    start = sum(_array_count(args[i]) for i in range(argnum) if i not in step.static_argnums)
    placed = iter(shardings[start:])

    def abstract(leaf: Any) -> Any:
        if not is_array_leaf(leaf):
            return leaf
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=next(placed),
                                    weak_type=getattr(leaf, "weak_type", False))

    return jax.tree_util.tree_map(abstract, args[argnum])


def _array_count(tree: Any) -> int:
    return sum(1 for leaf in jax.tree_util.tree_leaves(tree) if is_array_leaf(leaf))
