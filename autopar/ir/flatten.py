"""Tracing a train step into a ``FlatProgram`` (``program``): ``jax.make_jaxpr`` on abstract
shapes, then one deterministic walk that inlines nested calls and numbers every value.

The compiler and the runtime both flatten a step with this walk, so a tensor id in a ``Plan``
names the same value to both.

Inlined: ``jit``/``pjit``, ``closed_call``/``core_call``, ``custom_jvp_call``,
``custom_vjp_call`` and ``checkpoint``/``remat``. Kept whole: ``while``, ``cond`` and every
other primitive (their bodies are not numbered), and ``scan`` unless the program is flattened
with ``expand_scans``.

With ``expand_scans`` every ``scan`` is numbered as a *region* (an enter per operand, its
body once, an exit per result: the form ``program``'s docstring describes); one-stage
planning traces that way.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from autopar.errors import TraceError
from autopar.ir.layered_grad import plain_expansion
from autopar.ir.program import FlatProgram, TensorKind
from autopar.ir.walk import LossExpansion, Numberer


def argument_names(fn: Callable, nargs: int) -> list[str]:
    """Names of the first ``nargs`` positional parameters of ``fn`` (``argN`` where unknown)."""
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:nargs]]
    return names + [f"arg{i}" for i in range(len(names), nargs)]


def leaf_path(prefix: str, keypath: Sequence[Any]) -> str:
    """``state/params/w`` for the leaf at ``keypath`` under the argument ``prefix``."""
    rest = jax.tree_util.keystr(tuple(keypath), simple=True, separator="/")
    return f"{prefix}/{rest}" if rest else prefix


def is_array_like(leaf: Any) -> bool:
    """Arrays, tracers, ShapeDtypeStructs and Python or NumPy scalars."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return True
    return isinstance(leaf, (bool, int, float, complex, np.number))


def _abstract_leaf(leaf: Any) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    if isinstance(leaf, (bool, int, float, complex, np.number)):
        return leaf
    raise TraceError(
        f"argument leaf of type {type(leaf).__name__} is not an array; "
        "train-step arguments must be pytrees of arrays or jax.ShapeDtypeStruct"
    )


@dataclass(frozen=True)
class StepJaxpr:
    """``fn(*args)`` traced once by ``jax.make_jaxpr``, before any walk: the closed jaxpr, its
    input leaves' paths and per-argument ranges, and the trees. Every flattening of one step
    at one set of shapes (plain, with its markers kept, rematerialised) walks this same
    jaxpr, so the user's step (and its optimizer update) is traced once, not per form."""

    closed: Any
    in_paths: tuple[str, ...]
    ranges: tuple[tuple[int, int], ...]
    in_tree: Any
    out_tree: Any


def trace_jaxpr(fn: Callable, args: Sequence[Any]) -> StepJaxpr:
    """Trace ``fn(*args)`` (arrays or ``jax.ShapeDtypeStruct``) with ``jax.make_jaxpr``;
    raises ``TraceError`` with one line for any failure inside the user's code."""
    names = argument_names(fn, len(args))
    in_paths: list[str] = []
    ranges: list[tuple[int, int]] = []
    leaves: list[Any] = []
    for name, arg in zip(names, args, strict=True):
        start = len(leaves)
        for keypath, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            in_paths.append(leaf_path(name, keypath))
            leaves.append(_abstract_leaf(leaf))
        ranges.append((start, len(leaves)))
    in_tree = jax.tree_util.tree_structure(tuple(args))
    out_tree_box: list[Any] = []

    def flat_fn(*flat_leaves: Any) -> list[Any]:
        out = fn(*jax.tree_util.tree_unflatten(in_tree, flat_leaves))
        for keypath, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
            if not is_array_like(leaf):  # None is an empty subtree, as in jax.jit
                shown = repr(leaf) if isinstance(leaf, str) and len(leaf) <= 40 else ""
                raise TraceError(
                    f"the step's output '{leaf_path('out', keypath)}' is a "
                    f"{type(leaf).__name__}{f' ({shown})' if shown else ''}; a train step must "
                    "return a pytree of arrays"
                )
        flat_out, out_tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(out_tree)
        return flat_out

    try:
        closed = jax.make_jaxpr(flat_fn)(*leaves)
    except TraceError:
        raise
    except Exception as exc:  # any failure inside user code is reported as one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        name = getattr(fn, "__name__", "train step")
        raise TraceError(
            f"could not trace {name}: {type(exc).__name__}: {first}"
        ) from exc
    return StepJaxpr(closed, tuple(in_paths), tuple(ranges), in_tree, out_tree_box[-1])


def flatten_step(fn: Callable, args: Sequence[Any], keep_markers: bool = False,
                 expand_loss: LossExpansion | None = None,
                 expand_scans: bool = False, *, jaxpr: StepJaxpr | None = None) -> FlatProgram:
    """Trace ``fn(*args)`` (arrays or ``jax.ShapeDtypeStruct``) into a ``FlatProgram``.

    Nothing is computed and no device memory is touched: abstract shapes are enough.
    ``keep_markers``: see ``walk.Numberer`` (the pipeline pass sets it). ``expand_loss``: what an
    ``autopar.value_and_grad`` equation is inlined as (default: its plain value and gradient;
    ``remat_loss.flatten_step_rematerialised`` passes the rematerialised form).
    ``expand_scans``: number scan bodies as regions (see the module docstring). ``jaxpr``:
    the step already traced at these arguments' shapes (``trace_jaxpr``), walked again.
    """
    traced = jaxpr if jaxpr is not None else trace_jaxpr(fn, args)
    closed = traced.closed
    numberer = Numberer(keep_markers, expand_loss or plain_expansion, expand_scans)
    in_ids = [
        numberer.new_id(var.aval, TensorKind.INPUT) for var in closed.jaxpr.invars
    ]
    out_ids = numberer.walk(closed.jaxpr, closed.consts, in_ids)
    out_paths = [
        leaf_path("out", keypath)
        for keypath, _ in jax.tree_util.tree_flatten_with_path(
            jax.tree_util.tree_unflatten(traced.out_tree, list(range(len(out_ids))))
        )[0]
    ]
    return numberer.program(in_ids, out_ids, list(traced.in_paths), out_paths,
                            traced.in_tree, traced.out_tree, list(traced.ranges))
