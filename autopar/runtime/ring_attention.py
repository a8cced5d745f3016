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
in.

A causal ring runs zig-zag where each device's slice has an even length: its slice's halves
are exchanged so that the device at ring position ``i`` holds chunks ``i`` and ``2n - 1 - i``
of the ``2n`` the sequence is cut into (two collective-permutes per tensor, into the kernel and
back out of it), and every block after a device's own is then half visible and half masked on
every device alike: the kernel computes the visible half only (``ir.attention_op.Ring``), so a
causal ring does about ``(n + 1) / 2n`` of the work of a full one, evenly. Contiguous slices
would leave the first device's later blocks all masked and the last's all visible: skipping
the masked ones there would leave the ring waiting on its last device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from autopar.errors import InvalidOptionError, MeshError
from autopar.ir.attention_op import (
    Ring,
    attention_backward,
    attention_forward,
    halves,
    zigzag_applies,
)


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
    body = _ring_body(attention_forward, ring, causal, scale, (-2, -2, -2), (-2, -1))
    return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, lse_spec),
                         check_vma=False)


def ring_backward(mesh: Mesh, dims: tuple[Any, ...], ring: Ring, causal: bool,
                  scale: float) -> Any:
    """``(q, k, v, out, lse, d_out) -> (dq, dk, dv)`` over ``mesh``, laid out as in
    ``ring_forward``."""
    spec, lse_spec = PartitionSpec(*dims), PartitionSpec(*dims[:-1])
    body = _ring_body(attention_backward, ring, causal, scale, (-2, -2, -2, -2, -1, -2),
                      (-2, -2, -2))
    return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4 + (lse_spec, spec),
                         out_specs=(spec,) * 3, check_vma=False)


def _ring_body(kernel: Callable[..., Any], ring: Ring, causal: bool, scale: float,
               in_axes: Sequence[int], out_axes: Sequence[int]) -> Callable[..., Any]:
    """``kernel`` on one device's slices, zig-zag where it applies: the operands' sequence
    dimensions (``in_axes``) exchanged into zig-zag order first, the results'
    (``out_axes``) back after."""

    def body(*args: jax.Array) -> Any:
        rows = args[0].shape[-2]
        if not zigzag_applies(causal, ring.size, rows) or args[1].shape[-2] != rows:
            return kernel(*args, causal=causal, scale=scale, ring=ring)
        zigzag = replace(ring, zigzag=True)
        moved = [_to_zigzag(x, ring, a) for x, a in zip(args, in_axes, strict=True)]
        outs = kernel(*moved, causal=causal, scale=scale, ring=zigzag)
        return tuple(_from_zigzag(x, ring, a) for x, a in zip(outs, out_axes, strict=True))

    return body


def _zigzag_owner(chunk: int, n: int) -> int:
    """The ring position holding ``chunk`` (of ``2n``) in zig-zag order."""
    return chunk if chunk < n else 2 * n - 1 - chunk


def _to_zigzag(x: jax.Array, ring: Ring, axis: int) -> jax.Array:
    """Contiguous slices (position ``i`` holds chunks ``2i``, ``2i + 1``) to zig-zag ones
    (chunks ``i``, ``2n - 1 - i``): every even chunk goes to its owner by one
    collective-permute, every odd one by another; an even position's first chunk is the even
    one that arrives, an odd position's the odd one."""
    n = ring.size
    first, second = halves(x, axis)
    evens = jax.lax.ppermute(first, ring.axis, [(i, _zigzag_owner(2 * i, n)) for i in range(n)])
    odds = jax.lax.ppermute(second, ring.axis,
                            [(i, _zigzag_owner(2 * i + 1, n)) for i in range(n)])
    even = jax.lax.axis_index(ring.axis) % 2 == 0
    return jnp.concatenate([jnp.where(even, evens, odds), jnp.where(even, odds, evens)],
                           axis % x.ndim)


def _from_zigzag(x: jax.Array, ring: Ring, axis: int) -> jax.Array:
    """``_to_zigzag`` undone: each position's even chunk back to its contiguous owner as its
    first half, its odd chunk as its second."""
    n = ring.size
    low, high = halves(x, axis)
    even = jax.lax.axis_index(ring.axis) % 2 == 0
    evens, odds = jnp.where(even, low, high), jnp.where(even, high, low)

    def even_chunk(i: int) -> int:
        return i if i % 2 == 0 else 2 * n - 1 - i

    first = jax.lax.ppermute(evens, ring.axis, [(i, even_chunk(i) // 2) for i in range(n)])
    second = jax.lax.ppermute(odds, ring.axis,
                              [(i, (2 * n - 1 - even_chunk(i)) // 2) for i in range(n)])
    return jnp.concatenate([first, second], axis % x.ndim)
