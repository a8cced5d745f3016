"""Llama-3-style decoder-only language model in pure JAX.

Token embedding (``embed: [V, H]``), ``num_layers`` pre-norm blocks and an untied LM head
(``lm_head: [H, V]``). Each block is

* RMSNorm, then grouped-query causal attention: ``num_heads`` query heads share
  ``num_kv_heads`` key/value heads (query head ``n`` reads kv head ``n // (num_heads /
  num_kv_heads)``), ``head_dim = hidden / num_heads``, no biases, and rotary position embedding
  (RoPE, base ``rope_theta``) applied to queries and keys; then the residual;
* RMSNorm, then a SwiGLU MLP ``w_down(silu(x @ w_gate) * (x @ w_up))`` of width ``ffn_size``;
  then the residual;

followed by a final RMSNorm. The loss is the mean cross-entropy of ``logits[b, t]`` against
``labels[b, t]`` (the next token), trained with ZooModel's Adam step.

RoPE is written in the "rotate half" form: a head vector ``x = [x1, x2]`` (two halves of
``head_dim / 2``) becomes ``x * cos + [-x2, x1] * sin``, which rotates each pair
``(x1[i], x2[i])`` by ``position * rope_theta ** (-2 i / head_dim)``. It uses slices, one
``concatenate`` and elementwise ops only, and grouped-query attention is a reshape of the
queries to ``[B, S, kv_heads, group, head_dim]`` and an einsum against the shared kv heads (no
repeat, no gather): plain ops that a sharding pass handles like any other.

Blocks are a Python for-loop, so the traced step shows every layer's ops; with
``scan_layers=True`` (``--model llama-scan`` on the command line) the blocks' parameters are
stacked along a leading layer axis and the blocks run under ``jax.lax.scan``, as in
:mod:`autopar.models.gpt`.

Large sizes are the Llama 3 models' published shapes ("The Llama 3 Herd of Models", Dubey et
al. 2024, Table 3: layers, model dimension, FFN dimension, attention and key/value heads, peak
learning rate, RoPE base 500,000), with the released tokenizer's vocabulary of 128,256 tokens
(Table 3 rounds it to 128K) and the final pre-training sequence length of 8,192. The global
batch is 1024 sequences of 8,192 tokens, the 8M-token batch of Section 3.4.1 (pre-training
starts at 4M tokens of sequences of 4,096 and doubles both):

=====  ======  ======  =====  ========  ======  =======
size   hidden  layers  heads  kv heads  ffn     peak lr
=====  ======  ======  =====  ========  ======  =======
8B     4096    32      32     8         14336   3e-4
70B    8192    80      64     8         28672   1.5e-4
405B   16384   126     128    8         53248   8e-5
=====  ======  ======  =====  ========  ======  =======
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from autopar.errors import InvalidOptionError
from autopar.models import gpt
from autopar.models.base import (
    Batch,
    ModelFamily,
    Params,
    check_config,
    key_stream,
    normal_init,
    one_hot_cross_entropy,
)

INIT_STD = 0.02


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of the Llama decoder."""

    batch_size: int
    seq_len: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    vocab_size: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    learning_rate: float = 3e-4
    adam_eps: float = 1e-8
    dtype: str = "float32"
    scan_layers: bool = False  # stacked block parameters, blocks under jax.lax.scan

    def __post_init__(self) -> None:
        if not isinstance(self.scan_layers, bool):
            raise InvalidOptionError(
                f"invalid llama config: scan_layers={self.scan_layers!r} must be True or False")
        check_config(
            "llama",
            self,
            (
                "batch_size",
                "seq_len",
                "hidden_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "ffn_size",
                "vocab_size",
            ),
        )
        for name in ("rope_theta", "norm_eps", "adam_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise InvalidOptionError(f"invalid llama config: {name}={value!r} must be > 0")
        gpt.check_heads("llama", self.hidden_size, self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise InvalidOptionError(
                f"invalid llama config: num_heads={self.num_heads} is not divisible by "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise InvalidOptionError(
                f"invalid llama config: head_dim={self.hidden_size // self.num_heads} "
                "(hidden_size / num_heads) must be even for rotary embeddings"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _llama3(hidden: int, layers: int, heads: int, ffn: int, lr: float) -> LlamaConfig:
    return LlamaConfig(
        batch_size=1024,
        seq_len=8192,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        ffn_size=ffn,
        vocab_size=128256,
        learning_rate=lr,
    )


SIZES: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        batch_size=8,
        seq_len=16,
        hidden_size=64,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        ffn_size=128,
        vocab_size=256,
        learning_rate=1e-2,
        adam_eps=1e-3,
    ),
    "8B": _llama3(4096, 32, 32, 14336, 3e-4),
    "70B": _llama3(8192, 80, 64, 28672, 1.5e-4),
    "405B": _llama3(16384, 126, 128, 53248, 8e-5),
}


# -- building blocks --------------------------------------------------------------------------
def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-5) -> jax.Array:
    """RMSNorm over the last axis with a learned ``scale`` (statistics in float32)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """``cos`` and ``sin`` of the rotation angles, each float32 ``[seq_len, head_dim]``.

    Column ``i`` and ``i + head_dim/2`` share the angle ``t * theta ** (-2 i / head_dim)`` at
    position ``t``. Built from jnp ops on static shapes (iota, exp, cos, sin), so a traced step
    holds a few small ops rather than a ``[seq, head_dim]`` constant.
    """
    half = head_dim // 2
    inv_freq = jnp.exp(jnp.arange(half, dtype=jnp.float32) * (-2.0 * math.log(theta) / head_dim))
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x: [B, S, ..., head_dim]`` by the tables of :func:`rope_tables` (``[S, D]``).

    Rotate-half form: ``x * cos + concat(-x2, x1) * sin`` with ``x1, x2`` the two halves of the
    last axis; computed in float32 and returned in ``x``'s dtype.
    """
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    # the tables' [S, D] lines up with x's sequence axis (1) and last axis
    shape = (1, cos.shape[0]) + (1,) * (x.ndim - 3) + (cos.shape[1],)
    y = xf * cos.reshape(shape) + rotated * sin.reshape(shape)
    return y.astype(x.dtype)


def attention_params(keys: Iterator[jax.Array], cfg: LlamaConfig, dtype) -> dict:
    """Bias-free ``wq: [H, heads*hd]``, ``wk``/``wv: [H, kv_heads*hd]``, ``wo: [heads*hd, H]``
    (4 keys)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    kq, kk, kv, ko = (next(keys) for _ in range(4))
    return {
        "wq": normal_init(kq, (h, cfg.num_heads * hd), INIT_STD, dtype),
        "wk": normal_init(kk, (h, cfg.num_kv_heads * hd), INIT_STD, dtype),
        "wv": normal_init(kv, (h, cfg.num_kv_heads * hd), INIT_STD, dtype),
        "wo": normal_init(ko, (cfg.num_heads * hd, h), INIT_STD, dtype),
    }


def grouped_query_attention(
    q: jax.Array, k: jax.Array, v: jax.Array
) -> jax.Array:
    """Causal attention of ``q: [B, S, heads, hd]`` over ``k, v: [B, S, kv_heads, hd]``.

    Query head ``n`` attends with kv head ``n // group`` (``group = heads / kv_heads``): the
    queries are viewed as ``[B, S, kv_heads, group, hd]`` and contracted against the shared kv
    heads, so no kv head is copied. Returns ``[B, S, heads, hd]``.
    """
    b, s, nh, hd = q.shape
    nkv = k.shape[2]
    g = nh // nkv
    qg = q.reshape(b, s, nkv, g, hd)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k).astype(jnp.float32) / math.sqrt(hd)
    mask = jnp.tril(jnp.ones((s, s), dtype=jnp.bool_))
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    ctx = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v)
    return ctx.reshape(b, s, nh, hd)


def attention(x: jax.Array, p: dict, cfg: LlamaConfig, rope: tuple[jax.Array, jax.Array]):
    """Grouped-query causal self-attention of ``x: [B, S, H]`` with RoPE on q and k."""
    b, s, _ = x.shape
    hd = cfg.head_dim
    cos, sin = rope
    q = apply_rope((x @ p["wq"]).reshape(b, s, cfg.num_heads, hd), cos, sin)
    k = apply_rope((x @ p["wk"]).reshape(b, s, cfg.num_kv_heads, hd), cos, sin)
    v = (x @ p["wv"]).reshape(b, s, cfg.num_kv_heads, hd)
    ctx = grouped_query_attention(q, k, v)
    return ctx.reshape(b, s, cfg.num_heads * hd) @ p["wo"]


def mlp_params(keys: Iterator[jax.Array], hidden: int, ffn: int, dtype) -> dict:
    """SwiGLU weights ``w_gate``, ``w_up: [H, F]`` and ``w_down: [F, H]`` (3 keys)."""
    kg, ku, kd = next(keys), next(keys), next(keys)
    return {
        "w_gate": normal_init(kg, (hidden, ffn), INIT_STD, dtype),
        "w_up": normal_init(ku, (hidden, ffn), INIT_STD, dtype),
        "w_down": normal_init(kd, (ffn, hidden), INIT_STD, dtype),
    }


def swiglu_mlp(x: jax.Array, p: dict) -> jax.Array:
    """``(silu(x @ w_gate) * (x @ w_up)) @ w_down``."""
    return (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]


# -- the Llama family -----------------------------------------------------------------------------
def init_params(rng: jax.Array, cfg: LlamaConfig) -> Params:
    """Llama parameters: ``embed``, ``blocks`` (a list, one dict per layer; with
    ``scan_layers`` one dict of arrays stacked along a leading layer axis), ``norm_f`` and the
    untied ``lm_head``."""
    dtype = jnp.dtype(cfg.dtype)
    h = cfg.hidden_size
    keys = key_stream(rng, 2 + 7 * cfg.num_layers)
    params: dict = {"embed": normal_init(next(keys), (cfg.vocab_size, h), INIT_STD, dtype)}
    blocks = []
    for _ in range(cfg.num_layers):
        blocks.append(
            {
                "attn_norm": jnp.ones((h,), dtype),
                "attn": attention_params(keys, cfg, dtype),
                "mlp_norm": jnp.ones((h,), dtype),
                "mlp": mlp_params(keys, h, cfg.ffn_size, dtype),
            }
        )
    params["blocks"] = gpt.stack_layers(blocks) if cfg.scan_layers else blocks
    params["norm_f"] = jnp.ones((h,), dtype)
    params["lm_head"] = normal_init(next(keys), (h, cfg.vocab_size), INIT_STD, dtype)
    return params


def block(
    x: jax.Array, blk: Params, cfg: LlamaConfig, rope: tuple[jax.Array, jax.Array]
) -> jax.Array:
    """One pre-RMSNorm block: attention, then the SwiGLU MLP, each with a residual."""
    x = x + attention(rms_norm(x, blk["attn_norm"], cfg.norm_eps), blk["attn"], cfg, rope)
    return x + swiglu_mlp(rms_norm(x, blk["mlp_norm"], cfg.norm_eps), blk["mlp"])


def forward(params: Params, tokens: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """Logits ``[B, S, vocab]`` of ``tokens: int32[B, S]`` (position t sees tokens <= t)."""
    x = jnp.take(params["embed"], tokens, axis=0)
    rope = rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta)
    if cfg.scan_layers:
        x, _ = jax.lax.scan(
            lambda h, blk: (block(h, blk, cfg, rope), None), x, params["blocks"])
    else:
        for blk in params["blocks"]:  # a Python loop: the trace shows every layer's ops
            x = block(x, blk, cfg, rope)
    return rms_norm(x, params["norm_f"], cfg.norm_eps) @ params["lm_head"]


def loss_fn(params: Params, batch: Batch, cfg: LlamaConfig) -> jax.Array:
    """Mean next-token cross-entropy (``labels`` are already the shifted tokens)."""
    return one_hot_cross_entropy(forward(params, batch["tokens"], cfg), batch["labels"])


FAMILY = ModelFamily(
    name="llama",
    init_params=init_params,
    loss_fn=loss_fn,
    batch_spec=gpt.batch_spec,
    make_batch=gpt.make_batch,
)
