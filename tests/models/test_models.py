"""Tests of the model zoo: tiny models train, abstract inputs match, big sizes count right."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopar.errors import InvalidOptionError
from autopar.models import MODEL_NAMES, ZooModel, get_model, gpt, model_sizes, moe, wide_resnet

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

NUM_STEPS = 3


@pytest.fixture(scope="module")
def runs():
    """Per model: (model, initial state, batch, states after each step, losses); compiled once."""
    cache = {}

    def get(name: str):
        if name not in cache:
            model = get_model(name)

            # One compile for both (each random draw costs XLA:CPU compile time).
            def setup(key):
                return model.init_state(key), model.make_batch(jax.random.fold_in(key, 1))

            state0, batch = jax.jit(setup)(jax.random.PRNGKey(0))
            step = jax.jit(model.train_step)
            states, losses, state = [], [], state0
            for _ in range(NUM_STEPS):  # same batch every step: loss must go down
                state, loss = step(state, batch)
                states.append(state)
                losses.append(float(loss))
            cache[name] = (model, state0, batch, states, losses)
        return cache[name]

    return get


def _changed(a, b) -> list[bool]:
    return [
        bool(np.any(np.asarray(x) != np.asarray(y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    ]


def _shapes(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_tiny_train_step(runs, name):
    model, state0, _, states, losses = runs(name)
    assert isinstance(model, ZooModel) and model.size == "tiny"
    assert all(math.isfinite(x) for x in losses), losses
    # Same pytree structure, shapes and dtypes in and out, so the step can be iterated.
    for state in states:
        assert jax.tree.structure(state) == jax.tree.structure(state0)
        assert _shapes(state) == _shapes(state0)
    first = _changed(state0["params"], states[0]["params"])
    if name == "wresnet":
        # The last BN of each block starts with scale 0, which blocks the first step's gradient
        # to the convs before it; they move from the second step on.
        assert any(first)
    else:
        assert all(first)
    assert all(_changed(state0["params"], states[-1]["params"]))
    assert losses[-1] < losses[0], losses


def test_wresnet_updates_running_stats(runs):
    _, state0, _, states, _ = runs("wresnet")
    assert all(_changed(state0["batch_stats"], states[0]["batch_stats"]))


def test_wresnet_loss_fn_matches_train_step(runs):
    # loss_fn(params, batch) is the loss train_step differentiates (for wresnet: batch norm in
    # training mode, independent of running stats).
    model, state0, batch, _, losses = runs("wresnet")
    loss = jax.jit(model.loss_fn)(state0["params"], batch)
    assert float(loss) == pytest.approx(losses[0], rel=1e-5)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_abstract_inputs_match_concrete(runs, name):
    model, state0, batch, _, _ = runs(name)
    abstract_state, abstract_batch = model.abstract_inputs()
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract_state))
    assert jax.tree.structure(abstract_state) == jax.tree.structure(state0)
    assert _shapes(abstract_state) == _shapes(state0)
    assert _shapes(abstract_batch) == _shapes(batch)
    assert _shapes(model.abstract_state()) == _shapes(abstract_state)
    assert _shapes(model.abstract_batch()) == _shapes(abstract_batch)


def test_tiny_dims_divisible_by_8():
    fields = ("batch_size", "hidden_size", "num_heads", "num_experts", "num_channels", "seq_len")
    for name in MODEL_NAMES:
        cfg = get_model(name).config
        for f in fields:
            if hasattr(cfg, f):
                assert getattr(cfg, f) % 8 == 0, (name, f)


@pytest.mark.parametrize("name", ["gpt", "moe"])
def test_causal_mask(runs, name):
    model, state0, batch, _, _ = runs(name)
    config = model.config
    if name == "moe":
        # GShard queues second choices behind *all* first choices of the group, so a later
        # token can evict an earlier one when capacity is tight; with room for every token the
        # MoE model is exactly causal.
        config = get_model("moe", capacity_factor=float(config.num_experts)).config
        assert moe.expert_capacity(config.expert_group_size, config) >= config.expert_group_size

    @jax.jit
    def fwd(params, tokens):
        if name == "gpt":
            return gpt.forward(params, tokens, config)
        return moe.forward(params, tokens, config)[0]  # (logits, aux_loss)

    tokens = batch["tokens"]
    t = tokens.shape[1] // 2
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % config.vocab_size)
    a, b = np.asarray(fwd(state0["params"], tokens)), np.asarray(fwd(state0["params"], changed))
    np.testing.assert_allclose(a[:, :t], b[:, :t], rtol=1e-5, atol=1e-5)
    assert np.abs(a[:, t:] - b[:, t:]).max() > 1e-4


def test_top2_gating_routes_within_capacity():
    logits = jax.random.normal(jax.random.PRNGKey(0), (4, 32, 8))
    tight, roomy = jax.jit(lambda x: (moe.top2_gating(x, 2), moe.top2_gating(x, 64)))(logits)
    for combine, dispatch, aux in (tight, roomy):
        capacity = combine.shape[-1]
        assert dispatch.shape == (4, 32, 8, capacity)
        d = np.asarray(dispatch)
        assert set(np.unique(d)) <= {0.0, 1.0}
        assert d.sum(axis=1).max() <= 1  # a buffer slot holds at most one token
        assert (d.sum(axis=(2, 3)) <= 2).all()  # a token goes to at most two experts
        assert math.isfinite(float(aux)) and float(aux) > 0
    # capacity 64 (the last loop) leaves room for everyone: each token's two gates sum to one.
    np.testing.assert_allclose(np.asarray(combine).sum(axis=(2, 3)), 1.0, rtol=1e-5)
    assert (d.sum(axis=(2, 3)) == 2).all()


# -- parameter counts of the big sizes (abstract shapes only: nothing is allocated) -------------
def _nominal(size: str) -> float:
    return float(size[:-1]) * {"M": 1e6, "B": 1e9}[size[-1]]


def _gpt_count(c) -> int:
    h = c.hidden_size  # per block: q,k,v,out (4H^2+3H: no key bias), MLP (8H^2+5H), 2 LNs (4H)
    return c.num_layers * (12 * h * h + 12 * h) + (c.vocab_size + c.seq_len) * h + 2 * h


def _moe_count_alpa(c) -> float:
    """Alpa's own formula (compute_moe_parameter_count, mlp_factor 8, tied embedding).

    It counts biases on expert layers (ours have none, as in Alpa's actual model) and no
    position embedding, so we only expect agreement to ~1%.
    """
    h, f = c.hidden_size, c.mlp_ratio
    attn = h * (3 * h + 1) + h * (h + 1) + 4 * h
    ffn = h * (f * h + 1) + h * f * (h + 1)
    half = c.num_layers / 2
    return half * (attn + ffn) + half * (attn + c.num_experts * ffn) + c.vocab_size * (h + 1)


def _wresnet_count(c) -> int:
    """By hand from the hyper-parameters, following Alpa's bottleneck (width on the 3x3 only)."""
    ch, w = c.num_channels, c.width_factor
    n, cin = 7 * 7 * 3 * ch + 2 * ch, ch
    for i, blocks in enumerate(wide_resnet.STAGES[c.num_layers]):
        f = ch * 2**i
        for j in range(blocks):
            n += cin * f + 9 * f * f * w + f * w * 4 * f + 2 * (f + f * w + 4 * f)
            if cin != 4 * f or (i > 0 and j == 0):  # projection shortcut
                n += cin * 4 * f + 2 * 4 * f
            cin = 4 * f
    return n + cin * c.num_classes + c.num_classes


@pytest.mark.parametrize(
    "name,size", [(n, s) for n in ("gpt", "moe", "wresnet") for s in model_sizes(n) if s != "tiny"]
)
def test_param_counts_match_size_names(name, size):
    model = get_model(name, size)
    count = model.num_params()
    assert abs(count - _nominal(size)) / _nominal(size) < 0.15, (size, count)
    if name == "gpt":
        assert count == _gpt_count(model.config)
    elif name == "moe":
        assert count == pytest.approx(_moe_count_alpa(model.config), rel=0.01)
    else:
        assert count == _wresnet_count(model.config)


def test_alpa_default_batch_sizes():
    assert get_model("gpt", "39B").config.batch_size == 1024
    assert get_model("moe", "70B").config.batch_size == 1024
    assert get_model("wresnet", "4B").config.batch_size == 1536
    assert get_model("gpt", "39B", batch_size=64).abstract_batch()["tokens"].shape == (64, 1024)


def test_big_models_trace_abstractly():
    # Full width at 2 layers keeps the test fast while exercising the huge shapes abstractly.
    for name, size in (("gpt", "39B"), ("moe", "70B"), ("wresnet", "6.8B")):
        overrides = {"num_layers": 14} if name == "wresnet" else {"num_layers": 2}
        model = get_model(name, size, **overrides)
        jaxpr = jax.make_jaxpr(model.train_step)(*model.abstract_inputs())
        out_state, loss = jaxpr.out_avals[:-1], jaxpr.out_avals[-1]
        assert loss.shape == () and len(out_state) == len(jax.tree.leaves(model.abstract_state()))


# -- options and errors ---------------------------------------------------------------------------
def test_sizes_and_overrides():
    assert MODEL_NAMES == ("mlp", "gpt", "moe", "wresnet", "llama")
    for name in MODEL_NAMES:
        assert model_sizes(name)[0] == "tiny"
    assert set(model_sizes("gpt")) >= {"350M", "1.3B", "2.6B", "6.7B", "15B", "39B"}
    assert set(model_sizes("moe")) >= {"380M", "690M", "1.3B", "2.4B", "10B", "27B", "70B"}
    assert set(model_sizes("wresnet")) >= {"250M", "1B", "2B", "4B", "6.8B", "13B"}
    deep = get_model("gpt", num_layers=48, seq_len=32)
    assert deep.num_layers == 48 and len(deep.abstract_state()["params"]["blocks"]) == 48
    assert deep.abstract_batch()["labels"].shape == (8, 32)
    assert get_model("mlp", loss="xent").abstract_batch()["y"].dtype == jnp.int32


@pytest.mark.parametrize(
    "call,needles",
    [
        (lambda: get_model("gtp"), ["'gtp'", "mlp, gpt, moe, wresnet"]),
        (lambda: model_sizes("resnet"), ["'resnet'", "mlp, gpt, moe, wresnet"]),
        (lambda: get_model("gpt", "7B"), ["'7B'", "tiny, 350M, 1.3B"]),
        (lambda: get_model("moe", "tiny", hiden_size=8), ["'hiden_size'", "hidden_size"]),
        (lambda: get_model("gpt", num_heads=7), ["num_heads=7"]),
        (lambda: get_model("wresnet", num_layers=48), ["num_layers=48", "50, 101"]),
        (lambda: get_model("mlp", activation="tanh"), ["'tanh'", "relu, gelu"]),
        (lambda: get_model("mlp", batch_size=0), ["batch_size=0"]),
    ],
)
def test_bad_options_raise_one_line(call, needles):
    with pytest.raises(InvalidOptionError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message
    assert isinstance(info.value, ValueError)
