"""Ring attention: softmax attention over a sequence split across the devices of one mesh axis,
with no device ever holding the whole keys, values or score matrix.

Each device keeps its slice of the queries and passes its slice of the keys and values to the
next device of the ring, one step at a time (``jax.lax.ppermute``: XLA's collective-permute),
so after ``n`` steps every query slice has met every key slice (Liu et al., "Ring Attention
with Blockwise Transformers", 2023). A step's scores are one block, ``(S / n) x (S / n)`` per
head, folded into the running output by the online softmax (a running row maximum and row sum
rescale what was accumulated), as FlashAttention does inside one device. The backward
(``jax.custom_vjp``) is the same ring again: it recomputes each block's probabilities from the
saved log-sum-exp rather than keeping them, and the key and value gradients travel around the
ring with their blocks, back to the device that owns them after ``n`` steps. What a device
holds is O(S / n) per head, never O(S^2 / n).

The kernel is ``ir.attention_op``'s (the same code runs one block on one device); this module
maps it over a mesh. Layout here: ``[batch, sequence, heads, head_dim]``, the sequence split
over ``axis`` in order (device ``i`` of the axis holds positions ``i S/n .. (i+1) S/n - 1``);
every other mesh axis holds copies. Causal masking is by global position; a device's own block
comes first, so every query row has met an unmasked key before any fully masked block is folded
in. The kernel computes every block, masked or not: the ring's work is even, and about half of
a causal ring's blocks are wasted (skipping the fully masked ones would leave the first device
idle most of the time, unless the sequence were placed zig-zag: not done).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from autopar.errors import InvalidOptionError, MeshError
from autopar.ir.attention_op import Ring, attention_backward, attention_forward


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
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    # the kernel's layout has the sequence next to last: [batch, heads, sequence, head_dim]
    dims = (None, None, axis, None)
    forward = ring_forward(mesh, dims, Ring(axis, n), causal, scale)
    backward = ring_backward(mesh, dims, Ring(axis, n), causal, scale)

    @jax.custom_vjp
    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return forward(q, k, v)[0]

    def attend_fwd(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, tuple]:
        out, lse = forward(q, k, v)
        return out, (q, k, v, out, lse)

    def attend_bwd(saved: tuple, d_out: jax.Array) -> tuple:
        return tuple(backward(*saved, d_out))

    attend.defvjp(attend_fwd, attend_bwd)
    out = attend(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)))
    return jnp.swapaxes(out, 1, 2)


def ring_forward(mesh: Mesh, dims: tuple[Any, ...], ring: Ring, causal: bool,
                 scale: float) -> Any:
    """``(q, k, v) -> (out, lse)`` over ``mesh``, each of q, k, v, out laid out as
    ``PartitionSpec(*dims)`` (the sequence, next to last, split over ``ring.axis``; leading
    dimensions as they come), lse as the same less its last dimension."""
    spec, lse_spec = PartitionSpec(*dims), PartitionSpec(*dims[:-1])
    return jax.shard_map(partial(attention_forward, causal=causal, scale=scale, ring=ring),
                         mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, lse_spec),
                         check_vma=False)


def ring_backward(mesh: Mesh, dims: tuple[Any, ...], ring: Ring, causal: bool,
                  scale: float) -> Any:
    """``(q, k, v, out, lse, d_out) -> (dq, dk, dv)`` over ``mesh``, laid out as in
    ``ring_forward``."""
    spec, lse_spec = PartitionSpec(*dims), PartitionSpec(*dims[:-1])
    return jax.shard_map(partial(attention_backward, causal=causal, scale=scale, ring=ring),
                         mesh=mesh, in_specs=(spec,) * 4 + (lse_spec, spec),
                         out_specs=(spec,) * 3, check_vma=False)
