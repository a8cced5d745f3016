"""Ring attention: softmax attention over a sequence split across the devices of one mesh
axis, with no device ever holding the whole keys, values or score matrix.

Each device keeps its slice of the queries and passes its slice of the keys and values to
the next device of the ring, one step at a time (``jax.lax.ppermute``: XLA's
collective-permute), so after ``n`` steps every query slice has met every key slice (Liu et
al., "Ring Attention with Blockwise Transformers", 2023). A step's scores are one block,
``(S / n) x (S / n)`` per head, folded into the running output by the online softmax (a
running row maximum and row sum rescale what was accumulated), as FlashAttention does inside
one device. The backward (``jax.custom_vjp``) is the same ring again: it recomputes each
block's probabilities from the saved log-sum-exp rather than keeping them, and the key and
value gradients travel around the ring with their blocks, back to the device that owns them
after ``n`` steps. What a device holds is O(S / n) per head, never O(S^2 / n).

Layout: ``[batch, sequence, heads, head_dim]``, the sequence split over ``axis`` in order
(device ``i`` of the axis holds positions ``i S/n .. (i+1) S/n - 1``); every other mesh axis
holds copies. Causal masking is by global position; a device's own block comes first, so
every query row has met an unmasked key before any fully masked block is folded in. (The
causal ring is unbalanced in work: the last device's queries meet every key that matters,
the first device's only its own. A zig-zag placement of the sequence would even that out.)
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from autopar.errors import InvalidOptionError, MeshError

# A finite stand-in for minus infinity: exp(MASKED - m) is 0 for any real row maximum m, and
# no 0 * inf or inf - inf turns a sum into NaN.
MASKED = -1e30


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, mesh: Mesh, axis: str, *,
                   causal: bool = True, scale: float | None = None) -> jax.Array:
    """``softmax(q k^T * scale [+ causal mask]) v`` per batch row and head, for ``q``, ``k``,
    ``v`` of shape ``[batch, sequence, heads, head_dim]`` with the sequence split over the
    mesh axis ``axis``: each device computes its queries' output from the key and value
    slices passed around the ring. ``scale`` defaults to ``head_dim ** -0.5``. Differentiable
    (its own backward ring). ``InvalidOptionError`` for q, k, v of other shapes, ``MeshError``
    for a sequence the axis does not split evenly (one line each)."""
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise InvalidOptionError(f"ring_attention takes q, k, v of one shape [batch, sequence, "
                                 f"heads, head_dim]; got {q.shape}, {k.shape}, {v.shape}")
    n = mesh.shape[axis]
    if q.shape[1] % n:
        raise MeshError(f"the sequence ({q.shape[1]}) does not split evenly over the {n} "
                         f"devices of mesh axis {axis!r}")
    spec = PartitionSpec(None, axis, None, None)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    local = partial(_attend, axis=axis, n=n, causal=causal, scale=scale)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                         check_vma=False)(q, k, v)


def _rotate(x: Any, axis: str, n: int) -> Any:
    """``x`` passed to the next device of the ring (device ``i`` gets device ``i - 1``'s)."""
    return jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])


def _scores(q: jax.Array, k: jax.Array, src: jax.Array, me: jax.Array, *, causal: bool,
            scale: float) -> jax.Array:
    """One block's scores, ``[batch, heads, q, k]``, masked where a key comes after its query
    (``src``: the device the key block started on; ``me``: this device)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if not causal:
        return s
    size = q.shape[1]
    q_pos = me * size + jnp.arange(size)[:, None]
    k_pos = src * size + jnp.arange(size)[None, :]
    return jnp.where(k_pos <= q_pos, s, MASKED)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _attend(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, n: int, causal: bool,
            scale: float) -> jax.Array:
    return _forward(q, k, v, axis, n, causal, scale)[0]


def _forward(q, k, v, axis, n, causal, scale):
    """The output and each query row's log-sum-exp of its scores (for the backward)."""
    me = jax.lax.axis_index(axis)
    b, size, h, _ = q.shape
    row_max = jnp.full((b, h, size), MASKED, jnp.float32)
    row_sum = jnp.zeros((b, h, size), jnp.float32)
    out = jnp.zeros((b, h, size, v.shape[-1]), jnp.float32)
    for step in range(n):
        src = (me - step) % n
        s = _scores(q, k, src, me, causal=causal, scale=scale)
        new_max = jnp.maximum(row_max, s.max(axis=-1))
        p = jnp.exp(s - new_max[..., None])
        rescale = jnp.exp(row_max - new_max)
        row_sum = row_sum * rescale + p.sum(axis=-1)
        out = out * rescale[..., None] + jnp.einsum("bhqk,bkhd->bhqd", p, v.astype(jnp.float32))
        row_max = new_max
        if step < n - 1:
            k, v = _rotate((k, v), axis, n)
    out = out / row_sum[..., None]
    lse = row_max + jnp.log(row_sum)
    return jnp.transpose(out, (0, 2, 1, 3)).astype(q.dtype), lse


def _attend_fwd(q, k, v, axis, n, causal, scale):
    out, lse = _forward(q, k, v, axis, n, causal, scale)
    return out, (q, k, v, out, lse)


def _attend_bwd(axis, n, causal, scale, saved, d_out):
    q, k, v, out, lse = saved
    me = jax.lax.axis_index(axis)
    d_out32 = d_out.astype(jnp.float32)
    # D_i = sum_d dO_id O_id: the softmax's backward needs it per query row
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out32, out.astype(jnp.float32))
    dq = jnp.zeros(q.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    q32 = q.astype(jnp.float32)
    for step in range(n):
        src = (me - step) % n
        s = _scores(q, k, src, me, causal=causal, scale=scale)
        p = jnp.exp(s - lse[..., None])
        dv = dv + jnp.einsum("bhqk,bqhd->bkhd", p, d_out32)
        dp = jnp.einsum("bqhd,bkhd->bhqk", d_out32, v.astype(jnp.float32))
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + jnp.einsum("bhqk,bkhd->bqhd", ds, k.astype(jnp.float32))
        dk = dk + jnp.einsum("bhqk,bqhd->bkhd", ds, q32)
        # the key and value gradients go on with their blocks: after n steps, home
        dk, dv = _rotate((dk, dv), axis, n)
        if step < n - 1:
            k, v = _rotate((k, v), axis, n)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attend.defvjp(_attend_fwd, _attend_bwd)
