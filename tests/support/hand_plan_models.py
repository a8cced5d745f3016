"""Small train steps covering Alpa's shard-parallel test models, for the hand-plan oracle.

Each builder returns a :class:`Case`: a plain JAX + optax Adam step ``(state, batch) -> (state,
loss)``, its concrete state and batch. Parameter names follow the zoo's conventions
(``layers/<i>/kernel``, ``blocks/<i>/attn/q/kernel``, ``moe/wi``, ...) so the hand plans'
path rules (:mod:`autopar.bench.hand_plans`) apply to them as to the zoo's models:

* ``dense_chain``: an L-layer dense ReLU MLP with biases (Alpa's ``test_mlp``), in the two
  regimes batch >> hidden (data parallelism wins) and hidden >> batch (Megatron wins);
* ``bert_layers``: post-LN BERT layers (separate q/k/v/out kernels reshaped to heads, softmax
  attention without a mask, GELU MLP) on continuous inputs (Alpa's ``test_bert_layer``);
* ``moe_layer``: one GShard top-2 MoE layer with a router (Alpa's ``test_moe_layer``);
* ``conv_bn_stack``: convolutions with batch norm and a dense head (Alpa's ``test_conv``);
* ``tied_embedding``: an embedding lookup whose table is also the output projection.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax

from autopar.models import moe
from autopar.models.base import layer_norm, layer_norm_params, one_hot_cross_entropy


@dataclass(frozen=True)
class Case:
    name: str
    step: Callable
    state: Any
    batch: Any


def adam_step(loss_fn: Callable, learning_rate: float = 1e-2) -> tuple[Callable, Callable]:
    """``(train_step, init)`` of one Adam update of ``loss_fn(params, batch)``; eps 1e-3 as in
    the zoo's tiny models (see ``ZooModel.optimizer``)."""
    opt = optax.adam(learning_rate, eps=1e-3)

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state}, loss

    def init(params):
        return {"params": params, "opt_state": opt.init(params)}

    return train_step, init


def _dense(key, din: int, dout: int) -> dict:
    return {"kernel": jax.random.normal(key, (din, dout)) / math.sqrt(din),
            "bias": jnp.zeros((dout,))}


def dense_chain(name: str, batch: int, width: int, depth: int, seed: int = 0) -> Case:
    """``depth`` dense ReLU layers of ``width`` features (no ReLU after the last), MSE loss."""

    def loss_fn(params, b):
        h = b["x"]
        for i, layer in enumerate(params["layers"]):
            h = h @ layer["kernel"] + layer["bias"]
            if i != depth - 1:
                h = jax.nn.relu(h)
        return jnp.mean((h - b["y"]) ** 2)

    k = jax.random.split(jax.random.key(seed), depth + 2)
    params = {"layers": [_dense(k[i], width, width) for i in range(depth)]}
    data = {"x": jax.random.normal(k[depth], (batch, width)),
            "y": jax.random.normal(k[depth + 1], (batch, width))}
    step, init = adam_step(loss_fn)
    return Case(name, step, init(params), data)


def bert_layers(name: str = "bert", batch: int = 4, seq: int = 8, hidden: int = 64,
                heads: int = 4, depth: int = 2, seed: int = 1) -> Case:
    """``depth`` post-LN BERT layers; MSE of the last layer's output against a target."""
    hd = hidden // heads

    def attention(x, p):
        b, s, _ = x.shape

        def split_heads(t):
            return t.reshape(b, s, heads, hd)

        q = split_heads(x @ p["q"]["kernel"] + p["q"]["bias"])
        k = split_heads(x @ p["k"]["kernel"] + p["k"]["bias"])
        v = split_heads(x @ p["v"]["kernel"] + p["v"]["bias"])
        probs = jax.nn.softmax(jnp.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(hd), axis=-1)
        ctx = jnp.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, s, hidden)
        return ctx @ p["out"]["kernel"] + p["out"]["bias"]

    def loss_fn(params, b):
        x = b["x"]
        for blk in params["blocks"]:
            x = layer_norm(x + attention(x, blk["attn"]), blk["ln1"])
            mlp = blk["mlp"]
            h = jax.nn.gelu(x @ mlp["fc_in"]["kernel"] + mlp["fc_in"]["bias"])
            x = layer_norm(x + h @ mlp["fc_out"]["kernel"] + mlp["fc_out"]["bias"], blk["ln2"])
        return jnp.mean((x - b["y"]) ** 2)

    keys = iter(jax.random.split(jax.random.key(seed), 6 * depth + 2))
    blocks = []
    for _ in range(depth):
        blocks.append({
            "attn": {n: _dense(next(keys), hidden, hidden) for n in ("q", "k", "v", "out")},
            "ln1": layer_norm_params(hidden, jnp.float32),
            "mlp": {"fc_in": _dense(next(keys), hidden, 4 * hidden),
                    "fc_out": _dense(next(keys), 4 * hidden, hidden)},
            "ln2": layer_norm_params(hidden, jnp.float32),
        })
    data = {"x": jax.random.normal(next(keys), (batch, seq, hidden)),
            "y": jax.random.normal(next(keys), (batch, seq, hidden))}
    step, init = adam_step(loss_fn)
    return Case(name, step, init({"blocks": blocks}), data)


def moe_layer(name: str = "moe-layer", groups: int = 8, group_size: int = 16,
              hidden: int = 32, experts: int = 8, seed: int = 2) -> Case:
    """One GShard top-2 MoE layer on ``[groups, group_size, hidden]`` tokens; MSE + aux loss."""
    ffn = 2 * hidden

    def loss_fn(params, b):
        x, p = b["x"], params["moe"]
        logits = jnp.einsum("gsm,me->gse", x, p["gate"])
        combine, dispatch, aux = moe.top2_gating(logits, capacity=group_size // 2)
        expert_in = jnp.einsum("gsec,gsm->egcm", dispatch, x)
        h = jax.nn.relu(jnp.einsum("egcm,emf->egcf", expert_in, p["wi"]))
        expert_out = jnp.einsum("egcf,efm->egcm", h, p["wo"])
        y = jnp.einsum("gsec,egcm->gsm", combine, expert_out)
        return jnp.mean((y - b["y"]) ** 2) + 0.01 * aux

    k = jax.random.split(jax.random.key(seed), 5)
    params = {"moe": {"gate": jax.random.normal(k[0], (hidden, experts)) * 0.1,
                      "wi": jax.random.normal(k[1], (experts, hidden, ffn)) * 0.05,
                      "wo": jax.random.normal(k[2], (experts, ffn, hidden)) * 0.05}}
    data = {"x": jax.random.normal(k[3], (groups, group_size, hidden)),
            "y": jax.random.normal(k[4], (groups, group_size, hidden))}
    step, init = adam_step(loss_fn)
    return Case(name, step, init(params), data)


def conv_bn_stack(name: str = "conv-bn", batch: int = 8, size: int = 8, channels: int = 8,
                  depth: int = 2, head: int = 256, classes: int = 16, seed: int = 3) -> Case:
    """``depth`` 3x3 convolutions with training-mode batch norm and ReLU, global average
    pooling, then a two-layer dense head; cross-entropy over ``classes``."""

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def batch_norm(x, p):
        mean = jnp.mean(x, axis=(0, 1, 2))
        var = jnp.mean(jnp.square(x - mean), axis=(0, 1, 2))
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]

    def loss_fn(params, b):
        h = b["images"]
        for layer in params["convs"]:
            h = jax.nn.relu(batch_norm(conv(h, layer["kernel"]), layer["bn"]))
        h = jnp.mean(h, axis=(1, 2))
        dense = params["head"]["layers"]
        h = jax.nn.relu(h @ dense[0]["kernel"] + dense[0]["bias"])
        logits = h @ dense[1]["kernel"] + dense[1]["bias"]
        return one_hot_cross_entropy(logits, b["labels"])

    k = jax.random.split(jax.random.key(seed), depth + 4)
    convs = []
    cin = 4
    for i in range(depth):
        convs.append({"kernel": jax.random.normal(k[i], (3, 3, cin, channels))
                      / math.sqrt(9 * cin),
                      "bn": layer_norm_params(channels, jnp.float32)})
        cin = channels
    params = {"convs": convs,
              "head": {"layers": [_dense(k[depth], channels, head),
                                  _dense(k[depth + 1], head, classes)]}}
    data = {"images": jax.random.normal(k[depth + 2], (batch, size, size, 4)),
            "labels": jax.random.randint(k[depth + 3], (batch,), 0, classes)}
    step, init = adam_step(loss_fn)
    return Case(name, step, init(params), data)


def tied_embedding(name: str = "tied-embedding", batch: int = 8, seq: int = 8,
                   vocab: int = 128, hidden: int = 32, seed: int = 4) -> Case:
    """Embedding lookup, one dense GELU layer, logits against the same table (``h @ wte.T``),
    next-token cross-entropy."""

    def loss_fn(params, b):
        x = jnp.take(params["wte"], b["tokens"], axis=0)
        h = jax.nn.gelu(x @ params["dense"]["kernel"] + params["dense"]["bias"])
        return one_hot_cross_entropy(h @ params["wte"].T, b["labels"])

    k = jax.random.split(jax.random.key(seed), 3)
    params = {"wte": jax.random.normal(k[0], (vocab, hidden)) * 0.1,
              "dense": _dense(k[1], hidden, hidden)}
    tokens = jax.random.randint(k[2], (batch, seq + 1), 0, vocab)
    data = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    step, init = adam_step(loss_fn)
    return Case(name, step, init(params), data)
