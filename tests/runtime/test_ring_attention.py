"""Ring attention (``runtime.ring_attention``) against plain softmax attention under
``jax.jit``: the same output and gradients within fp32 round-off, causal or not, zig-zag or
contiguous, on rings of 2, 4 and 8; in the compiled program the keys and values travel by
collective-permute, never gathered whole, no device holds a score matrix of the whole sequence,
and a causal ring computes half blocks after each device's own."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.errors import InvalidOptionError, MeshError
from autopar.runtime.hlo import count_collectives
from autopar.runtime.ring_attention import ring_attention

BATCH, SEQ, HEADS, HEAD_DIM = 2, 96, 2, 8  # 96 / 4 devices: blocks of 24 positions


def attention(q, k, v, causal):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((q.shape[1],) * 2, bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


@pytest.fixture(scope="module")
def case():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "seq"))
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, weights = (jax.random.normal(key, (BATCH, SEQ, HEADS, HEAD_DIM)) for key in keys)
    return mesh, (q, k, v), weights


def weighted_sum(attend, weights):
    return lambda q, k, v: (attend(q, k, v) * weights).sum()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_output_and_gradients_equal_plain_attention(case, causal):
    mesh, qkv, weights = case
    ring = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh, "seq", causal=causal))
    plain = jax.jit(lambda q, k, v: attention(q, k, v, causal))
    np.testing.assert_allclose(ring(*qkv), plain(*qkv), rtol=1e-5, atol=1e-5)
    ring_grads = jax.jit(jax.grad(weighted_sum(ring, weights), argnums=(0, 1, 2)))(*qkv)
    plain_grads = jax.jit(jax.grad(weighted_sum(plain, weights), argnums=(0, 1, 2)))(*qkv)
    for ours, theirs in zip(ring_grads, plain_grads, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_keys_and_values_travel_the_ring_and_are_never_gathered(case):
    mesh, qkv, weights = case
    split = NamedSharding(mesh, PartitionSpec(None, "seq", None, None))
    step = jax.grad(weighted_sum(lambda q, k, v: ring_attention(q, k, v, mesh, "seq"),
                                 weights), argnums=(0, 1, 2))
    hlo = jax.jit(step, in_shardings=(split,) * 3).lower(*qkv).compile().as_text()
    counted = count_collectives(hlo)
    assert counted.count("collective-permute") > 0
    assert counted.count("all-gather") == 0 and counted.count("all-to-all") == 0
    # a block of scores is 24 x 24 per head; nothing of the whole sequence's 96 x 96
    assert re.search(rf"\b{SEQ},{SEQ}\b", hlo) is None
    assert re.search(rf"\b{SEQ // 4},{SEQ // 4}\]", hlo) is not None
    # causal, zig-zag: after its own block each device computes half a block, its keys' first
    # half against every query (24 x 12) or every key against its queries' second half
    # (12 x 24), never the masked half
    for half in (rf"\b{SEQ // 4},{SEQ // 8}\]", rf"\b{SEQ // 8},{SEQ // 4}\]"):
        assert re.search(half, hlo) is not None, half


@pytest.mark.parametrize("ring, seq", [(2, 96), (8, 96), (4, 92)],
                         ids=["2-zigzag", "8-zigzag", "4-odd-slices"])
def test_causal_rings_of_every_size_equal_plain_attention(ring, seq):
    """Zig-zag on rings of 2 and 8 (slices of 48 and 12 positions); slices of an odd length
    (92 / 4 = 23) stay contiguous, every block computed."""
    mesh = Mesh(np.array(jax.devices()[:ring]), ("seq",))
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    q, k, v, weights = (jax.random.normal(key, (BATCH, seq, HEADS, HEAD_DIM)) for key in keys)
    ring_fn = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh, "seq"))
    plain = jax.jit(lambda q, k, v: attention(q, k, v, True))
    np.testing.assert_allclose(ring_fn(q, k, v), plain(q, k, v), rtol=1e-5, atol=1e-5)
    ours = jax.jit(jax.grad(weighted_sum(ring_fn, weights), argnums=(0, 1, 2)))(q, k, v)
    theirs = jax.jit(jax.grad(weighted_sum(plain, weights), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_one_line_errors(case):
    mesh, (q, k, v), _ = case
    with pytest.raises(InvalidOptionError, match="one shape"):
        ring_attention(q, k[:, :48], v, mesh, "seq")
    with pytest.raises(MeshError, match="does not split evenly over the 4 devices"):
        ring_attention(q[:, :90], k[:, :90], v[:, :90], mesh, "seq")
