"""Markers a train step leaves for the pipeline pass: where the loss function is, and where the
user wants layer boundaries.

``autopar.value_and_grad`` / ``autopar.grad`` behave exactly like the JAX functions, but they
bind one ``autopar_value_and_grad`` equation that carries the loss function's forward jaxpr.
Under plain ``jax.jit`` it lowers to ``jax.value_and_grad`` of that jaxpr (the same numbers);
the pipeline pass instead cuts the forward into stage functions and derives each stage's
backward with ``jax.vjp``. ``mark_pipeline_boundary`` is an identity with an equation of its own
that the pass reads as a layer cut. Both are ordinary JAX primitives (abstract evaluation,
lowering, differentiation and batching rules), nothing of JAX or Flax is patched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from autopar.errors import InvalidOptionError

VALUE_AND_GRAD = "autopar_value_and_grad"
PIPELINE_BOUNDARY = "autopar_pipeline_boundary"


# --------------------------------------------------------------- pipeline boundary ---------

pipeline_boundary_p = jcore.Primitive(PIPELINE_BOUNDARY)
pipeline_boundary_p.multiple_results = True
pipeline_boundary_p.def_impl(lambda *xs: list(xs))
pipeline_boundary_p.def_abstract_eval(lambda *avals: list(avals))
mlir.register_lowering(pipeline_boundary_p, lambda ctx, *xs: list(xs))


def _boundary_jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list, list]:
    # the tangents pass straight through: the backward needs no marker of its own
    return pipeline_boundary_p.bind(*primals), list(tangents)


ad.primitive_jvps[pipeline_boundary_p] = _boundary_jvp
batching.primitive_batchers[pipeline_boundary_p] = lambda args, dims: (
    pipeline_boundary_p.bind(*args),
    dims,
)


def mark_pipeline_boundary(*values: Any) -> Any:
    """Mark a layer boundary for the pipeline pass: everything computed before this call in the
    loss function belongs to earlier layers. Returns its arguments unchanged (one value or a
    tuple, each may be a pytree); has no effect on the numbers."""
    leaves, tree = jax.tree_util.tree_flatten(values)
    out = pipeline_boundary_p.bind(*leaves) if leaves else []
    result = jax.tree_util.tree_unflatten(tree, out)
    return result[0] if len(values) == 1 else result


# --------------------------------------------------------------- value_and_grad ------------


@dataclass(frozen=True, eq=False)
class LossFunction:
    """The loss function's forward as a jaxpr over (closed-over values, argument leaves).

    ``diff_leaves``: positions (among the argument leaves) of the leaves differentiated;
    outputs of ``jaxpr`` are the loss and then the aux leaves. Compared by identity: it is a
    primitive parameter and must be hashable."""

    jaxpr: Any  # jax.extend.core.Jaxpr, its constvars the closed-over values
    num_consts: int
    num_args: int
    diff_leaves: tuple[int, ...]
    num_aux: int

    def forward(self, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        """[loss, *aux] for these values."""
        return jax.core.eval_jaxpr(self.jaxpr, list(consts), *args)

    def value_and_grad(self, *operands: Any) -> list[Any]:
        """[loss, *aux, *grads of diff_leaves] for operands = consts + argument leaves."""
        consts, args = operands[: self.num_consts], list(operands[self.num_consts :])

        def loss(diff_values: list[Any]) -> tuple[Any, list[Any]]:
            full = list(args)
            for i, v in zip(self.diff_leaves, diff_values, strict=True):
                full[i] = v
            out = self.forward(consts, full)
            return out[0], out[1:]

        (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(
            [args[i] for i in self.diff_leaves]
        )
        return [value, *aux, *grads]


def _vg_abstract_eval(*avals: Any, loss: LossFunction) -> list[Any]:
    outs = [v.aval for v in loss.jaxpr.outvars]
    grads = [avals[loss.num_consts + i] for i in loss.diff_leaves]
    return [*outs, *grads]


value_and_grad_p = jcore.Primitive(VALUE_AND_GRAD)
value_and_grad_p.multiple_results = True
value_and_grad_p.def_impl(lambda *ops, loss: loss.value_and_grad(*ops))
value_and_grad_p.def_abstract_eval(_vg_abstract_eval)
mlir.register_lowering(
    value_and_grad_p,
    mlir.lower_fun(lambda *ops, loss: loss.value_and_grad(*ops), multiple_results=True),
)


class LossCaptured(Exception):  # noqa: N818 - a signal, not an error
    """What ``traced_loss`` stops a step's trace with: its loss function as
    ``autopar.value_and_grad`` traced it, and its closed-over values (each concrete where it
    was, None where it was a traced value of the step)."""

    def __init__(self, loss: LossFunction, consts: Sequence[Any]):
        super().__init__("the loss function was traced")
        self.loss = loss
        self.consts = tuple(consts)


# set while ``traced_loss`` traces a step: the first autopar.value_and_grad raises
# ``LossCaptured`` instead of binding (a context variable, so threads and nested traces keep
# their own)
_CAPTURING: ContextVar[bool] = ContextVar("autopar_capturing_loss", default=False)


def traced_loss(fn: Callable, args: Sequence[Any]) -> LossCaptured | None:
    """``fn(*args)``'s loss function (``LossCaptured``), the step traced only as far as its
    first ``autopar.value_and_grad`` call: what follows it (the optimizer's update, a third
    of a large step's trace) is not traced. None when the trace ends or fails before: the
    caller traces the whole step, which reports what went wrong."""
    token = _CAPTURING.set(True)
    try:
        jax.make_jaxpr(fn)(*args)
    except LossCaptured as found:
        return found
    except Exception:  # noqa: BLE001 - the whole step's trace reports it
        return None
    finally:
        _CAPTURING.reset(token)
    return None


def _normalise_argnums(argnums: int | Sequence[int], nargs: int) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or any(not isinstance(i, int) or not -nargs <= i < nargs for i in nums):
        raise InvalidOptionError(
            f"argnums={argnums!r} must name positional arguments of the loss function "
            f"(it was called with {nargs})"
        )
    return tuple(i % nargs for i in nums)


def value_and_grad(
    fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable:
    """Drop-in for ``jax.value_and_grad`` that marks the loss function for the pipeline pass.

    Same arguments and results as JAX's; the loss must be a scalar. Under PipeshardParallel the
    loss is taken as a mean over the batch: the batch is cut into microbatches, and the loss,
    the aux outputs and the gradients are the means of the microbatches' (which equals the
    full-batch value for a mean loss)."""

    def wrapped(*args: Any) -> Any:
        nums = _normalise_argnums(argnums, len(args))
        leaves, in_tree = jax.tree_util.tree_flatten(args)
        starts, ends, count = [], [], 0
        for a in args:
            starts.append(count)
            count += len(jax.tree_util.tree_leaves(a))
            ends.append(count)
        diff = tuple(j for i in nums for j in range(starts[i], ends[i]))
        out_tree_box: list[Any] = []

        def flat_fun(*flat: Any) -> list[Any]:
            out = fun(*jax.tree_util.tree_unflatten(in_tree, flat))
            value, aux = out if has_aux else (out, None)
            aux_leaves, aux_tree = jax.tree_util.tree_flatten(aux)
            out_tree_box.append(aux_tree)
            return [value, *aux_leaves]

        capturing = _CAPTURING.get()
        token = _CAPTURING.set(False)  # a loss function inside it is part of it
        try:
            closed = jax.make_jaxpr(flat_fun)(*leaves)
        finally:
            _CAPTURING.reset(token)
        value_aval = closed.out_avals[0]
        if value_aval.shape != () or not jnp.issubdtype(value_aval.dtype, jnp.floating):
            raise InvalidOptionError(
                "autopar.value_and_grad needs a loss function returning a float scalar, got "
                f"{value_aval.str_short()}"
            )
        loss = LossFunction(
            jaxpr=closed.jaxpr,
            num_consts=len(closed.consts),
            num_args=len(leaves),
            diff_leaves=diff,
            num_aux=len(closed.out_avals) - 1,
        )
        if capturing:
            raise LossCaptured(loss, [None if isinstance(c, jax.core.Tracer) else c
                                      for c in closed.consts])
        outs = value_and_grad_p.bind(*closed.consts, *leaves, loss=loss)
        value = outs[0]
        aux = jax.tree_util.tree_unflatten(out_tree_box[-1], outs[1 : 1 + loss.num_aux])
        grad_leaves = iter(outs[1 + loss.num_aux :])
        grads = []
        for i in nums:
            arg_leaves, tree = jax.tree_util.tree_flatten(args[i])
            picked = [next(grad_leaves) for _ in arg_leaves]
            grads.append(jax.tree_util.tree_unflatten(tree, picked))
        grad = grads[0] if isinstance(argnums, int) else tuple(grads)
        return ((value, aux), grad) if has_aux else (value, grad)

    return wrapped


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """Drop-in for ``jax.grad`` that marks the loss function (see :func:`value_and_grad`)."""
    vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    def wrapped(*args: Any) -> Any:
        out, g = vg(*args)
        return (g, out[1]) if has_aux else g

    return wrapped


def expand_value_and_grad(loss: LossFunction) -> Callable[..., list[Any]]:
    """The function an ``autopar_value_and_grad`` equation stands for (to inline it)."""
    return partial(_expanded, loss)


def _expanded(loss: LossFunction, *operands: Any) -> list[Any]:
    return loss.value_and_grad(*operands)
