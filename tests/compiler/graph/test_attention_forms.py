"""Which attentions the kernel may compute (``graph.attention_forms``) and the forward with
them rewritten (``ir.attention_rewrite``): the zoo's transformers (their layouts, a
grouped-query one among them) and plain-``jnp`` attentions with each kind of scale and mask; a
mask that is not the causal one, a bias, or probabilities read elsewhere leave the site as it
is; where rewritten, the forward computes what the model's own equations do."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.compiler.graph.attention_forms import attention_rewrites
from autopar.ir.attention_rewrite import flatten_step_with_attention, rewritten_forward
from autopar.ir.flatten import flatten_step
from autopar.models import get_model

B, S, H, D = 2, 8, 2, 4


def qkv(groups: int = 1):
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (B, S, H * groups, D))
    k, v = (jax.random.normal(x, (B, S, H, D)) for x in keys[1:])
    return q, k, v


def attend(mask_of=None, scale=lambda s: s / math.sqrt(D), bias=None, probs_out=False):
    """softmax attention [B, S, H, D] with the mask ``mask_of(q_pos, k_pos)``."""
    def fn(q, k, v):
        scores = scale(jnp.einsum("bqhd,bkhd->bhqk", q, k))
        if bias is not None:
            scores = scores + bias
        if mask_of is not None:
            q_pos, k_pos = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
            scores = jnp.where(mask_of(q_pos, k_pos), scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return (out, probs) if probs_out else out
    return fn


def rewrites_and_check(fn, args):
    """The rewrites of ``fn``'s program, after checking the rewritten forward gives its
    results."""
    program = flatten_step(fn, args)
    found = attention_rewrites(program)
    if found:
        flat = jax.tree_util.tree_leaves(args)
        got = jax.jit(rewritten_forward(program, found))(flat)
        want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    return found


@pytest.mark.parametrize("mask_of", [
    lambda q, k: jnp.tril(jnp.ones((S, S), bool)),
    lambda q, k: q >= k,
    lambda q, k: k <= q,
    lambda q, k: ~(k > q),
], ids=["tril", "q>=k", "k<=q", "not k>q"])
def test_the_causal_mask_written_any_way_is_read_as_causal(mask_of):
    (site,) = rewrites_and_check(attend(mask_of), qkv())
    assert site.causal and site.scale == pytest.approx(1 / math.sqrt(D))


@pytest.mark.parametrize("mask_of", [
    lambda q, k: q > k,  # the diagonal masked too
    lambda q, k: (q >= k) & (q - k < 3),  # a window
    lambda q, k: q <= k,  # the future, not the past
], ids=["strict", "window", "anti-causal"])
def test_a_mask_that_is_not_the_causal_one_keeps_the_models_equations(mask_of):
    assert rewrites_and_check(attend(mask_of), qkv()) == []


def test_no_mask_and_a_multiplied_scale():
    (site,) = rewrites_and_check(attend(scale=lambda s: s * 0.25), qkv())
    assert not site.causal and site.scale == pytest.approx(0.25)


def test_a_bias_or_probabilities_read_elsewhere_keep_the_models_equations():
    bias = jnp.ones((S, S)) * 0.1
    assert rewrites_and_check(attend(bias=bias), qkv()) == []
    assert rewrites_and_check(attend(probs_out=True), qkv()) == []


def test_grouped_query_attention_shares_the_keys_across_the_groups():
    def gqa(q, k, v):
        qg = q.reshape(B, S, H, 2, D)
        scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k) / math.sqrt(D)
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(B, S, 2 * H, D)

    (site,) = rewrites_and_check(gqa, qkv(groups=2))
    assert site.groups == (2,)


@pytest.mark.parametrize("name", ["gpt", "moe", "llama"])
def test_the_zoos_transformers_train_alike_with_every_attention_rewritten(name):
    model = get_model(name, "tiny").with_value_and_grad(autopar.value_and_grad)
    state, batch = model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(1))
    program = flatten_step_with_attention(model.train_step, (state, batch), attention_rewrites)
    assert program is not None
    kinds = [e.name for e in program.eqns]
    layers = model.config.num_layers
    assert kinds.count("autopar_attention") == kinds.count("autopar_attention_bwd") == layers
    # the backward keeps no [queries, keys] block: the kernel recomputes it
    seq = model.config.seq_len
    blocks = [e.name for e in program.eqns for v in e.outputs
              if len(program.avals[v].shape) >= 4 and program.avals[v].shape[-2:] == (seq, seq)]
    assert blocks == [], blocks
    got = jax.jit(lambda *a: program.evaluate(a))(*jax.tree_util.tree_leaves((state, batch)))
    want = jax.tree_util.tree_leaves(jax.jit(model.train_step)(state, batch))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)


def test_a_step_without_autopar_value_and_grad_or_attention_is_not_rewritten():
    mlp = get_model("mlp", "tiny").with_value_and_grad(autopar.value_and_grad)
    assert flatten_step_with_attention(mlp.train_step, mlp.abstract_inputs(),
                                       attention_rewrites) is None
    gpt = get_model("gpt", "tiny")  # jax.value_and_grad: no loss forward to rewrite
    assert flatten_step_with_attention(gpt.train_step, gpt.abstract_inputs(),
                                       attention_rewrites) is None
