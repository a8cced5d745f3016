"""Softmax attention as two primitives of autopar's own, and the blockwise kernel behind them.

A traced step's attention is a dozen equations (the scores matmul, scale, mask, softmax, the
matmul with the values); its backward keeps the probabilities, ``[..., queries, keys]``, for
the gradient. Where the planner replaces such a site (``ir.attention_rewrite``), the step
holds instead ``autopar_attention`` (``q, k, v -> out, lse``) and, in its backward,
``autopar_attention_bwd`` (``q, k, v, out, lse, d_out -> dq, dk, dv``): the residuals are
O(sequence), never O(sequence^2), and the intra-operator ILP sees one node per direction with
strategies of its own (``compiler.intra_op.strategies.attention``), among them context
parallelism: the sequence split over a mesh axis, run as ring attention
(``runtime.ring_attention``).

Layout: ``q [*batch, Sq, D]``, ``k [*batch, Sk, D]``, ``v [*batch, Sk, Dv]``, ``out [*batch,
Sq, Dv]``, ``lse [*batch, Sq]`` (float32, each query row's log-sum-exp of its scores): any
number of leading dimensions (batch, heads), every one treated alike. The kernel folds key
blocks into the output with the online softmax (a running row maximum and row sum rescale
what was accumulated, as FlashAttention does); on one device there is one block, on a ring of
``n`` devices each device meets ``n`` blocks, one per step, passed along the ring with
``ppermute``. The backward recomputes each block's probabilities from ``lse``. Causal masking
is by global position (the query and key sequences of one length, split alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

# A finite stand-in for minus infinity: exp(MASKED - m) is 0 for any real row maximum m, and
# no 0 * inf or inf - inf turns a sum into NaN.
MASKED = -1e30


@dataclass(frozen=True)
class Ring:
    """The mesh axis a sequence is split over, and its size, inside a ``shard_map`` body."""

    axis: str
    size: int


def _rotate(x: Any, ring: Ring) -> Any:
    """``x`` passed to the next device of the ring (device ``i`` gets device ``i - 1``'s)."""
    n = ring.size
    return jax.lax.ppermute(x, ring.axis, [(i, (i + 1) % n) for i in range(n)])


def _block_scores(q: jax.Array, k: jax.Array, src: Any, me: Any, causal: bool,
                  scale: float) -> jax.Array:
    """One block's scores ``[*batch, q, k]`` in float32, masked where a key comes after its
    query (``src``: the ring position the key block started at; ``me``: this device's)."""
    s = jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=jnp.float32) * scale
    if not causal:
        return s
    q_pos = me * q.shape[-2] + jnp.arange(q.shape[-2])[:, None]
    k_pos = src * k.shape[-2] + jnp.arange(k.shape[-2])[None, :]
    return jnp.where(k_pos <= q_pos, s, MASKED)


def _ring_steps(ring: Ring | None) -> tuple[Any, int]:
    """This device's ring position and the ring's size (0 and 1 on one device)."""
    return (0, 1) if ring is None else (jax.lax.axis_index(ring.axis), ring.size)


def attention_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, scale: float,
                      ring: Ring | None = None) -> tuple[jax.Array, jax.Array]:
    """``softmax(q k^T * scale [causal mask]) v`` and each query row's log-sum-exp; on a
    ``ring``, this device's queries against every device's keys and values."""
    me, n = _ring_steps(ring)
    row_max = jnp.full(q.shape[:-1], MASKED, jnp.float32)
    row_sum = jnp.zeros(q.shape[:-1], jnp.float32)
    out = jnp.zeros((*q.shape[:-1], v.shape[-1]), jnp.float32)
    for step in range(n):
        s = _block_scores(q, k, (me - step) % n, me, causal, scale)
        new_max = jnp.maximum(row_max, s.max(axis=-1))
        p = jnp.exp(s - new_max[..., None])
        rescale = jnp.exp(row_max - new_max)
        row_sum = row_sum * rescale + p.sum(axis=-1)
        out = out * rescale[..., None] + jnp.einsum("...qk,...kd->...qd", p,
                                                    v.astype(jnp.float32))
        row_max = new_max
        if ring is not None and step < n - 1:
            k, v = _rotate((k, v), ring)
    return (out / row_sum[..., None]).astype(q.dtype), row_max + jnp.log(row_sum)


def attention_backward(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array,
                       lse: jax.Array, d_out: jax.Array, *, causal: bool, scale: float,
                       ring: Ring | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gradients of q, k and v, each block's probabilities recomputed from ``lse``; on a
    ``ring`` the key and value gradients travel with their blocks and are home after ``n``
    steps."""
    me, n = _ring_steps(ring)
    d_out32, q32 = d_out.astype(jnp.float32), q.astype(jnp.float32)
    # D_i = sum_d dO_id O_id: the softmax's backward needs it per query row
    delta = jnp.einsum("...qd,...qd->...q", d_out32, out.astype(jnp.float32))
    dq = jnp.zeros(q.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    for step in range(n):
        p = jnp.exp(_block_scores(q, k, (me - step) % n, me, causal, scale) - lse[..., None])
        dv = dv + jnp.einsum("...qk,...qd->...kd", p, d_out32)
        dp = jnp.einsum("...qd,...kd->...qk", d_out32, v.astype(jnp.float32))
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + jnp.einsum("...qk,...kd->...qd", ds, k.astype(jnp.float32))
        dk = dk + jnp.einsum("...qk,...qd->...kd", ds, q32)
        if ring is not None:
            dk, dv = _rotate((dk, dv), ring)
            if step < n - 1:
                k, v = _rotate((k, v), ring)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _forward_avals(q: Any, k: Any, v: Any, *, causal: bool, scale: float) -> list[Any]:
    return [jax.core.ShapedArray((*q.shape[:-1], v.shape[-1]), q.dtype),
            jax.core.ShapedArray(q.shape[:-1], jnp.float32)]


def _backward_avals(q: Any, k: Any, v: Any, out: Any, lse: Any, d_out: Any, *, causal: bool,
                    scale: float) -> list[Any]:
    return [jax.core.ShapedArray(x.shape, x.dtype) for x in (q, k, v)]


def _forward_impl(q: Any, k: Any, v: Any, *, causal: bool, scale: float) -> list[Any]:
    return list(attention_forward(q, k, v, causal=causal, scale=scale))


def _backward_impl(q: Any, k: Any, v: Any, out: Any, lse: Any, d_out: Any, *, causal: bool,
                   scale: float) -> list[Any]:
    return list(attention_backward(q, k, v, out, lse, d_out, causal=causal, scale=scale))


def _primitive(name: str, impl: Any, avals: Any) -> Primitive:
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(impl)
    prim.def_abstract_eval(avals)
    # on one device, or with the sequence whole on each: the kernel's one block, as plain ops
    # XLA's partitioner splits along any leading dimension
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
    return prim


FORWARD_NAME = "autopar_attention"
BACKWARD_NAME = "autopar_attention_bwd"
ATTENTION_FORWARD = _primitive(FORWARD_NAME, _forward_impl, _forward_avals)
ATTENTION_BACKWARD = _primitive(BACKWARD_NAME, _backward_impl, _backward_avals)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, scale: float) -> jax.Array:
    """Softmax attention (layout in the module docstring) as the two primitives: what a
    rewritten site computes."""
    return ATTENTION_FORWARD.bind(q, k, v, causal=causal, scale=scale)[0]


def _attention_fwd(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool,
                   scale: float) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    out, lse = ATTENTION_FORWARD.bind(q, k, v, causal=causal, scale=scale)
    return out, (q, k, v, out, lse)


def _attention_bwd(causal: bool, scale: float, saved: tuple[jax.Array, ...],
                   d_out: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(ATTENTION_BACKWARD.bind(*saved, d_out, causal=causal, scale=scale))


attention.defvjp(_attention_fwd, _attention_bwd)
