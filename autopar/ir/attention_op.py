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
    """The mesh axis a sequence is split over, and its size, inside a ``shard_map`` body.

    ``zigzag``: the sequence is cut into ``2 size`` chunks and the device at ring position
    ``i`` holds chunks ``i`` and ``2 size - 1 - i`` (the first and second halves of its rows),
    rather than the ``i``-th contiguous slice. Under a causal mask every block after a
    device's own is then half visible (its keys' first half to all its queries, or all its
    keys to its queries' second half) and half masked, on every device alike: the kernel
    computes only the visible half."""

    axis: str
    size: int
    zigzag: bool = False


def _rotate(x: Any, ring: Ring) -> Any:
    """``x`` passed to the next device of the ring (device ``i`` gets device ``i - 1``'s)."""
    n = ring.size
    return jax.lax.ppermute(x, ring.axis, [(i, (i + 1) % n) for i in range(n)])


def zigzag_applies(causal: bool, ring_size: int, local_rows: int) -> bool:
    """Whether a ring of ``ring_size`` runs zig-zag (``Ring.zigzag``; placed so by
    ``runtime.ring_attention``) with ``local_rows`` sequence positions on each device: causal,
    and two chunks to each device."""
    return causal and ring_size > 1 and local_rows % 2 == 0


def zigzag_share(ring_size: int) -> float:
    """The share of a full ring's score blocks a zig-zag causal ring computes: each device's
    own block, and half of each of the ``ring_size - 1`` others."""
    return (ring_size + 1) / (2 * ring_size)


def _positions(rows: int, at: Any, ring: Ring | None) -> jax.Array:
    """The global positions of the ``rows`` local rows a device at ring position ``at`` holds
    (contiguous, or zig-zag: ``Ring.zigzag``)."""
    local = jnp.arange(rows)
    if ring is None or not ring.zigzag:
        return at * rows + local
    half = rows // 2
    chunk = jnp.where(local < half, at, 2 * ring.size - 1 - at)
    return chunk * half + local % half


def _block_scores(q: jax.Array, k: jax.Array, q_pos: Any, k_pos: Any, causal: bool,
                  scale: float) -> jax.Array:
    """One block's scores ``[*batch, q, k]`` in float32, masked where a key comes after its
    query (``q_pos``, ``k_pos``: their global positions; None: nothing is masked)."""
    s = jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=jnp.float32) * scale
    if not causal or q_pos is None:
        return s
    return jnp.where(k_pos[None, :] <= q_pos[:, None], s, MASKED)


def _fold(state: tuple, s: jax.Array, v: jax.Array) -> tuple:
    """The online softmax: a block of scores ``s`` and its values folded into ``(row_max,
    row_sum, out)``."""
    row_max, row_sum, out = state
    new_max = jnp.maximum(row_max, s.max(axis=-1))
    p = jnp.exp(s - new_max[..., None])
    rescale = jnp.exp(row_max - new_max)
    row_sum = row_sum * rescale + p.sum(axis=-1)
    out = out * rescale[..., None] + jnp.einsum("...qk,...kd->...qd", p, v.astype(jnp.float32))
    return new_max, row_sum, out


def halves(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """``x``'s first and second halves along ``axis`` (negative: from the end)."""
    axis %= x.ndim
    half = x.shape[axis] // 2
    return (jax.lax.slice_in_dim(x, 0, half, axis=axis),
            jax.lax.slice_in_dim(x, half, x.shape[axis], axis=axis))


def _zigzag_fold(state: tuple, q: jax.Array, k: jax.Array, v: jax.Array, earlier: Any,
                 scale: float) -> tuple:
    """A zig-zag block after the device's own (``Ring.zigzag``): where the keys came from an
    earlier ring position (``earlier``), their first half is visible to every query and their
    second half to none; else every key is visible to the queries' second half and none to
    the first. Only the visible half is computed, with no mask."""

    def keys_first_half(state: tuple) -> tuple:
        return _fold(state, _block_scores(q, halves(k, -2)[0], None, None, False, scale),
                     halves(v, -2)[0])

    def queries_second_half(state: tuple) -> tuple:
        (m1, m2), (s1, s2), (o1, o2) = (halves(x, a) for x, a in zip(state, (-1, -1, -2),
                                                                        strict=True))
        m2, s2, o2 = _fold((m2, s2, o2), _block_scores(halves(q, -2)[1], k, None, None,
                                                        False, scale), v)
        return (jnp.concatenate([m1, m2], -1), jnp.concatenate([s1, s2], -1),
                jnp.concatenate([o1, o2], -2))

    return jax.lax.cond(earlier, keys_first_half, queries_second_half, state)


def _block_grads(q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array, lse: jax.Array,
                 delta: jax.Array, q_pos: Any, k_pos: Any, causal: bool,
                 scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block's shares of dq, dk and dv (float32), its probabilities recomputed from
    ``lse``; ``d_out`` in float32, ``delta`` each query row's ``sum(d_out * out)``."""
    p = jnp.exp(_block_scores(q, k, q_pos, k_pos, causal, scale) - lse[..., None])
    dv = jnp.einsum("...qk,...qd->...kd", p, d_out)
    dp = jnp.einsum("...qd,...kd->...qk", d_out, v.astype(jnp.float32))
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("...qk,...kd->...qd", ds, k.astype(jnp.float32))
    dk = jnp.einsum("...qk,...qd->...kd", ds, q.astype(jnp.float32))
    return dq, dk, dv


def _zigzag_grads(q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array,
                  lse: jax.Array, delta: jax.Array, earlier: Any,
                  scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``_block_grads`` of a zig-zag block after the device's own, its visible half only
    (``_zigzag_fold``), as shares of the whole dq, dk and dv."""

    def keys_first_half() -> tuple:
        dq, dk, dv = _block_grads(q, halves(k, -2)[0], halves(v, -2)[0], d_out, lse, delta,
                                  None, None, False, scale)
        return (dq, jnp.concatenate([dk, jnp.zeros_like(dk)], -2),
                jnp.concatenate([dv, jnp.zeros_like(dv)], -2))

    def queries_second_half() -> tuple:
        dq, dk, dv = _block_grads(halves(q, -2)[1], k, v, halves(d_out, -2)[1],
                                  halves(lse, -1)[1], halves(delta, -1)[1], None, None,
                                  False, scale)
        return jnp.concatenate([jnp.zeros_like(dq), dq], -2), dk, dv

    return jax.lax.cond(earlier, keys_first_half, queries_second_half)


def _ring_steps(ring: Ring | None) -> tuple[Any, int]:
    """This device's ring position and the ring's size (0 and 1 on one device)."""
    return (0, 1) if ring is None else (jax.lax.axis_index(ring.axis), ring.size)


def attention_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, scale: float,
                      ring: Ring | None = None) -> tuple[jax.Array, jax.Array]:
    """``softmax(q k^T * scale [causal mask]) v`` and each query row's log-sum-exp; on a
    ``ring``, this device's queries against every device's keys and values."""
    me, n = _ring_steps(ring)
    zigzag = causal and ring is not None and ring.zigzag
    q_pos = _positions(q.shape[-2], me, ring)
    state = (jnp.full(q.shape[:-1], MASKED, jnp.float32), jnp.zeros(q.shape[:-1], jnp.float32),
             jnp.zeros((*q.shape[:-1], v.shape[-1]), jnp.float32))
    for step in range(n):
        src = (me - step) % n
        if zigzag and step > 0:
            state = _zigzag_fold(state, q, k, v, src < me, scale)
        else:
            k_pos = _positions(k.shape[-2], src, ring)
            state = _fold(state, _block_scores(q, k, q_pos, k_pos, causal, scale), v)
        if ring is not None and step < n - 1:
            k, v = _rotate((k, v), ring)
    row_max, row_sum, out = state
    return (out / row_sum[..., None]).astype(q.dtype), row_max + jnp.log(row_sum)


def attention_backward(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array,
                       lse: jax.Array, d_out: jax.Array, *, causal: bool, scale: float,
                       ring: Ring | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gradients of q, k and v, each block's probabilities recomputed from ``lse``; on a
    ``ring`` the key and value gradients travel with their blocks and are home after ``n``
    steps."""
    me, n = _ring_steps(ring)
    zigzag = causal and ring is not None and ring.zigzag
    d_out32 = d_out.astype(jnp.float32)
    # D_i = sum_d dO_id O_id: the softmax's backward needs it per query row
    delta = jnp.einsum("...qd,...qd->...q", d_out32, out.astype(jnp.float32))
    q_pos = _positions(q.shape[-2], me, ring)
    grads = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
             jnp.zeros(v.shape, jnp.float32))
    for step in range(n):
        src = (me - step) % n
        if zigzag and step > 0:
            shares = _zigzag_grads(q, k, v, d_out32, lse, delta, src < me, scale)
        else:
            shares = _block_grads(q, k, v, d_out32, lse, delta, q_pos,
                                  _positions(k.shape[-2], src, ring), causal, scale)
        dq, dk, dv = (g + x for g, x in zip(grads, shares, strict=True))
        if ring is not None:
            dk, dv = _rotate((dk, dv), ring)
            if step < n - 1:
                k, v = _rotate((k, v), ring)
        grads = (dq, dk, dv)
    dq, dk, dv = grads
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
