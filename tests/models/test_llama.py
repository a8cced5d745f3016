"""The Llama 3 family: published parameter counts, grouped-query attention, RoPE, causality,
training, and ShardParallel on 8 devices giving the serial step's numbers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

from autopar.errors import InvalidOptionError
from autopar.models import get_model, llama, model_sizes

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

STEPS = 3  # serial steps on one batch


@pytest.fixture(scope="module")
def serial():
    """Tiny llama: initial state, one batch, and the jitted serial steps' states and losses."""
    model = get_model("llama", "tiny")
    state = state0 = model.init_state(jax.random.key(0))
    batch = model.make_batch(jax.random.key(10))
    step = jax.jit(model.train_step)
    states, losses = [], []
    for _ in range(STEPS):  # the same batch every step: its loss must go down
        state, loss = step(state, batch)
        states.append(state)
        losses.append(float(loss))
    return model, state0, batch, states, losses


# -- sizes ----------------------------------------------------------------------------------------
def _count(c) -> int:
    """By hand: untied embedding and head, per block q/o (H x H), k/v (H x kv*hd), 3 SwiGLU
    matrices and 2 RMSNorm scales, plus the final RMSNorm."""
    h, kv = c.hidden_size, c.num_kv_heads * c.head_dim
    per_block = 2 * h * h + 2 * h * kv + 3 * h * c.ffn_size + 2 * h
    return 2 * c.vocab_size * h + c.num_layers * per_block + h


@pytest.mark.parametrize("size,published", [("8B", 8.03e9), ("70B", 70.6e9), ("405B", 405.9e9)])
def test_param_counts_match_llama3(size, published):
    model = get_model("llama", size)  # counted from abstract shapes: nothing is allocated
    count = model.num_params()
    assert abs(count - published) / published < 0.01, (size, count)
    assert count == _count(model.config)
    c = model.config
    assert (c.seq_len, c.vocab_size, c.num_kv_heads, c.batch_size) == (8192, 128256, 8, 1024)
    assert c.rope_theta == 500000.0


def _primitives(jaxpr, found: set[str]) -> set[str]:
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for sub in jaxprs_in_params(eqn.params):
            _primitives(sub, found)
    return found


def test_405b_traces_abstractly_without_stack():
    # full width at 2 layers: the huge shapes traced, nothing allocated
    model = get_model("llama", "405B", num_layers=2)
    closed = jax.make_jaxpr(model.train_step)(*model.abstract_inputs())
    assert closed.out_avals[-1].shape == ()
    assert len(closed.out_avals) - 1 == len(jax.tree.leaves(model.abstract_state()))
    # RoPE and GQA need no stack/unstack (the embedding lookup is the only gather)
    assert not _primitives(closed.jaxpr, set()) & {"stack", "unstack"}


def test_sizes_and_bad_configs():
    assert model_sizes("llama") == ("tiny", "8B", "70B", "405B")
    for overrides, needle in (
        ({"num_kv_heads": 3}, "num_kv_heads=3"),
        ({"num_heads": 7}, "num_heads=7"),
        ({"num_heads": 64}, "head_dim=1"),
        ({"rope_theta": 0.0}, "rope_theta=0.0"),
        ({"ffn_size": 0}, "ffn_size=0"),
    ):
        with pytest.raises(InvalidOptionError, match=needle):
            get_model("llama", **overrides)


# -- building blocks ------------------------------------------------------------------------------
def _naive_gqa(q, k, v):
    """Multi-head causal attention after copying each kv head to its query heads."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s, hd = q.shape[1], q.shape[3]
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(hd)
    causal = np.tril(np.ones((s, s), dtype=bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    return jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(scores, axis=-1), v)


def test_grouped_query_attention_equals_repeated_kv_heads():
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq, (2, 8, 8, 16))
    k = jax.random.normal(kk, (2, 8, 2, 16))
    v = jax.random.normal(kv, (2, 8, 2, 16))
    got, want = jax.jit(lambda *a: (llama.grouped_query_attention(*a), _naive_gqa(*a)))(q, k, v)
    assert got.shape == (2, 8, 8, 16)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_rope_rotates_pairs():
    s, d = 16, 8
    x = jax.random.normal(jax.random.key(2), (2, s, 3, d))
    cos, sin = llama.rope_tables(s, d, 500000.0)
    rope = jax.jit(llama.apply_rope)
    y = np.asarray(rope(x, cos, sin))
    x = np.asarray(x)
    half = d // 2
    # each pair (i, i + d/2) keeps its length; position 0 is not rotated at all
    np.testing.assert_allclose(np.hypot(y[..., :half], y[..., half:]),
                               np.hypot(x[..., :half], x[..., half:]), rtol=1e-5)
    np.testing.assert_array_equal(y[:, 0], x[:, 0])
    assert np.abs(y[:, 1:] - x[:, 1:]).max() > 1e-2
    # the score of a rotated query and key depends on their offset only
    q = np.broadcast_to(x[:1, :1, :1], (2, s, 3, d))  # one vector at every position
    rq = np.asarray(rope(jnp.asarray(q), cos, sin))[0, :, 0]
    assert np.dot(rq[3], rq[1]) == pytest.approx(np.dot(rq[7], rq[5]), rel=1e-4)


def test_no_stack_or_gather_in_attention():
    # what a sharding pass sees: RoPE and GQA are slices, a concatenate, reshapes and einsums
    q, kv = jnp.zeros((2, 8, 8, 16)), jnp.zeros((2, 8, 2, 16))

    def attn(q, k, v):
        cos, sin = llama.rope_tables(8, 16, 500000.0)
        return llama.grouped_query_attention(
            llama.apply_rope(q, cos, sin), llama.apply_rope(k, cos, sin), v)

    prims = {e.primitive.name for e in jax.make_jaxpr(attn)(q, kv, kv).jaxpr.eqns}
    assert not prims & {"stack", "gather", "unstack"}, prims


# -- the model ------------------------------------------------------------------------------------
def test_causal(serial):
    model, state0, batch, _, _ = serial
    fwd = jax.jit(lambda p, t: llama.forward(p, t, model.config))
    tokens = batch["tokens"]
    t = tokens.shape[1] // 2
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % model.config.vocab_size)
    a, b = np.asarray(fwd(state0["params"], tokens)), np.asarray(fwd(state0["params"], changed))
    np.testing.assert_allclose(a[:, :t], b[:, :t], rtol=1e-5, atol=1e-5)
    assert np.abs(a[:, t:] - b[:, t:]).max() > 1e-4


def test_tiny_train_step_lowers_loss(serial):
    _, state0, _, states, losses = serial
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(256), rel=0.05)  # uniform at init
    assert losses[-1] < losses[0] - 0.1, losses
    moved = [bool(np.any(np.asarray(a) != np.asarray(b))) for a, b in zip(
        jax.tree.leaves(state0["params"]), jax.tree.leaves(states[0]["params"]), strict=True)]
    assert all(moved)


# ShardParallel against the serial step, on every mesh, is in
# tests/compiler/planners/test_shard_numerics.py (it runs every zoo family, llama included).
