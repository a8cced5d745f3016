"""GPT-style decoder-only language model in pure JAX.

Token embedding + learned position embedding, ``num_layers`` pre-LayerNorm blocks (causal
multi-head attention with separate q/k/v/out kernels, then a GELU MLP of ``mlp_ratio * hidden``),
a final LayerNorm and an LM head tied to the token embedding (``logits = x @ wte.T``). The loss is
the mean cross-entropy of ``logits[b, t]`` against ``labels[b, t]`` (the next token).

Blocks are a Python for-loop, so the traced step shows every layer's ops. With
``scan_layers=True`` (``get_model("gpt", size, scan_layers=True)``; ``--model gpt-scan`` on the
command line) the blocks' parameters are stacked along a leading layer axis (``blocks`` is one
dict of ``[num_layers, ...]`` arrays) and the blocks run under ``jax.lax.scan``, as large JAX
models are usually written; the initial values are the unrolled model's, stacked, so both
variants compute the same numbers.

Large sizes are Alpa's GPT benchmark family (``benchmark/alpa/suite_manual_gpt.py``,
``gpt_specs``; global batch 1024 from ``suite_auto_gpt.py``), seq 1024, vocab 51200:

=====  ======  ======  =====
size   hidden  layers  heads
=====  ======  ======  =====
350M   1024    24      16
1.3B   2048    24      32
2.6B   2560    32      32
6.7B   4096    32      32
15B    5120    48      40
39B    8192    48      64
=====  ======  ======  =====
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from autopar.errors import InvalidOptionError
from autopar.models.base import (
    Batch,
    ModelFamily,
    Params,
    check_config,
    key_stream,
    layer_norm,
    layer_norm_params,
    normal_init,
    one_hot_cross_entropy,
)

INIT_STD = 0.02  # GPT-2 style initializer range


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of the GPT decoder."""

    batch_size: int
    seq_len: int
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    mlp_ratio: int = 4
    learning_rate: float = 1e-3
    adam_eps: float = 1e-8
    dtype: str = "float32"
    scan_layers: bool = False  # stacked block parameters, blocks under jax.lax.scan

    def __post_init__(self) -> None:
        if not isinstance(self.scan_layers, bool):
            raise InvalidOptionError(
                f"invalid gpt config: scan_layers={self.scan_layers!r} must be True or False")
        check_config(
            "gpt",
            self,
            (
                "batch_size",
                "seq_len",
                "hidden_size",
                "num_layers",
                "num_heads",
                "vocab_size",
                "mlp_ratio",
            ),
        )
        check_heads("gpt", self.hidden_size, self.num_heads)


def check_heads(family: str, hidden_size: int, num_heads: int) -> None:
    """Raise InvalidOptionError unless the heads split the hidden size evenly."""
    if hidden_size % num_heads:
        raise InvalidOptionError(
            f"invalid {family} config: hidden_size={hidden_size} is not divisible by "
            f"num_heads={num_heads}"
        )


def _gpt(batch_size: int, hidden: int, layers: int, heads: int) -> GPTConfig:
    return GPTConfig(
        batch_size=batch_size,
        seq_len=1024,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        vocab_size=51200,
    )


SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(
        batch_size=8,
        seq_len=16,
        hidden_size=64,
        num_layers=2,
        num_heads=8,
        vocab_size=256,
        learning_rate=1e-2,
        adam_eps=1e-3,
    ),
    "350M": _gpt(1024, 1024, 24, 16),
    "1.3B": _gpt(1024, 2048, 24, 32),
    "2.6B": _gpt(1024, 2560, 32, 32),
    "6.7B": _gpt(1024, 4096, 32, 32),
    "15B": _gpt(1024, 5120, 48, 40),
    "39B": _gpt(1024, 8192, 48, 64),
}


# -- building blocks shared with the MoE family ------------------------------------------------
def dense_params(key: jax.Array, din: int, dout: int, dtype, std: float = INIT_STD) -> dict:
    """``{"kernel": [din, dout], "bias": [dout]}``."""
    return {"kernel": normal_init(key, (din, dout), std, dtype), "bias": jnp.zeros((dout,), dtype)}


def dense(x: jax.Array, p: dict) -> jax.Array:
    """``x @ kernel + bias`` (``x @ kernel`` for a projection without bias)."""
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def attention_params(keys: Iterator[jax.Array], hidden: int, dtype) -> dict:
    """Separate q, k, v and output projections, each ``[hidden, hidden]`` (4 keys).

    The key projection has no bias: a key bias adds the same ``q . b`` to every score of a
    query, which softmax ignores, so its gradient is exactly zero and only rounding noise reaches
    it -- noise that Adam's normalisation would blow up into full-size updates.
    """
    kq, kk, kv, ko = (next(keys) for _ in range(4))
    return {
        "q": dense_params(kq, hidden, hidden, dtype),
        "k": {"kernel": normal_init(kk, (hidden, hidden), INIT_STD, dtype)},
        "v": dense_params(kv, hidden, hidden, dtype),
        "out": dense_params(ko, hidden, hidden, dtype),
    }


def causal_self_attention(x: jax.Array, p: dict, num_heads: int) -> jax.Array:
    """Causal multi-head self-attention of ``x: [B, S, H]``."""
    b, s, h = x.shape
    hd = h // num_heads

    def heads(t: jax.Array) -> jax.Array:  # [B, S, H] -> [B, S, heads, head_dim]
        return t.reshape(b, s, num_heads, hd)

    q, k, v = heads(dense(x, p["q"])), heads(dense(x, p["k"])), heads(dense(x, p["v"]))
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k).astype(jnp.float32) / math.sqrt(hd)
    # Built from jnp ops on static shapes: an [S, S] constant, never a huge concrete array.
    mask = jnp.tril(jnp.ones((s, s), dtype=jnp.bool_))
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    ctx = jnp.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, s, h)
    return dense(ctx, p["out"])


def mlp_params(keys: Iterator[jax.Array], hidden: int, ffn: int, dtype) -> dict:
    """Two dense layers ``hidden -> ffn -> hidden`` (2 keys)."""
    k1, k2 = next(keys), next(keys)
    return {
        "fc_in": dense_params(k1, hidden, ffn, dtype),
        "fc_out": dense_params(k2, ffn, hidden, dtype),
    }


def mlp(x: jax.Array, p: dict) -> jax.Array:
    """Position-wise GELU MLP."""
    return dense(jax.nn.gelu(dense(x, p["fc_in"])), p["fc_out"])


def embedding_params(
    keys: Iterator[jax.Array], vocab: int, seq_len: int, hidden: int, dtype
) -> dict:
    """Token (``wte: [V, H]``) and position (``wpe: [S, H]``) embeddings (2 keys)."""
    kt, kp = next(keys), next(keys)
    return {
        "wte": normal_init(kt, (vocab, hidden), INIT_STD, dtype),
        "wpe": normal_init(kp, (seq_len, hidden), INIT_STD, dtype),
    }


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """Token + position embedding of ``tokens: int32[B, S]`` -> ``[B, S, H]``."""
    s = tokens.shape[1]
    return jnp.take(params["wte"], tokens, axis=0) + params["wpe"][:s]


def lm_head(params: Params, x: jax.Array) -> jax.Array:
    """Final LayerNorm then logits tied to the token embedding: ``x @ wte.T``."""
    return layer_norm(x, params["ln_f"]) @ params["wte"].T


# -- the GPT family -------------------------------------------------------------------------------
def init_params(rng: jax.Array, cfg: GPTConfig) -> Params:
    """GPT parameters: ``wte``, ``wpe``, ``blocks`` (a list, one dict per layer; with
    ``scan_layers`` one dict of arrays stacked along a leading layer axis) and ``ln_f``."""
    dtype = jnp.dtype(cfg.dtype)
    h = cfg.hidden_size
    keys = key_stream(rng, 2 + 6 * cfg.num_layers)
    params = embedding_params(keys, cfg.vocab_size, cfg.seq_len, h, dtype)
    blocks = []
    for _ in range(cfg.num_layers):
        blocks.append(
            {
                "ln1": layer_norm_params(h, dtype),
                "attn": attention_params(keys, h, dtype),
                "ln2": layer_norm_params(h, dtype),
                "mlp": mlp_params(keys, h, cfg.mlp_ratio * h, dtype),
            }
        )
    params["blocks"] = stack_layers(blocks) if cfg.scan_layers else blocks
    params["ln_f"] = layer_norm_params(h, dtype)
    return params


def stack_layers(blocks: list[Params]) -> Params:
    """Per-layer parameter dicts as one dict of arrays with a leading layer axis."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *blocks)


def block(x: jax.Array, blk: Params, cfg: GPTConfig) -> jax.Array:
    """One pre-LayerNorm transformer block."""
    x = x + causal_self_attention(layer_norm(x, blk["ln1"]), blk["attn"], cfg.num_heads)
    return x + mlp(layer_norm(x, blk["ln2"]), blk["mlp"])


def forward(params: Params, tokens: jax.Array, cfg: GPTConfig) -> jax.Array:
    """Logits ``[B, S, vocab]`` of ``tokens: int32[B, S]`` (position t sees tokens <= t)."""
    x = embed(params, tokens)
    if cfg.scan_layers:
        x, _ = jax.lax.scan(lambda h, blk: (block(h, blk, cfg), None), x, params["blocks"])
    else:
        for blk in params["blocks"]:  # a Python loop: the trace shows every layer's ops
            x = block(x, blk, cfg)
    return lm_head(params, x)


def loss_fn(params: Params, batch: Batch, cfg: GPTConfig) -> jax.Array:
    """Mean next-token cross-entropy (``labels`` are already the shifted tokens)."""
    return one_hot_cross_entropy(forward(params, batch["tokens"], cfg), batch["labels"])


def batch_spec(cfg) -> dict[str, jax.ShapeDtypeStruct]:
    """``{"tokens": int32[B, S], "labels": int32[B, S]}`` (also used by the MoE family)."""
    shape = (cfg.batch_size, cfg.seq_len)
    return {
        "tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
        "labels": jax.ShapeDtypeStruct(shape, jnp.int32),
    }


def make_batch(rng: jax.Array, cfg) -> Batch:
    """Random token sequences; ``labels[:, t] = tokens[:, t + 1]`` (one longer stream, shifted)."""
    seq = jax.random.randint(rng, (cfg.batch_size, cfg.seq_len + 1), 0, cfg.vocab_size, jnp.int32)
    return {"tokens": seq[:, :-1], "labels": seq[:, 1:]}


FAMILY = ModelFamily(
    name="gpt",
    init_params=init_params,
    loss_fn=loss_fn,
    batch_spec=batch_spec,
    make_batch=make_batch,
)
