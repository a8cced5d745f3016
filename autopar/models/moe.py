"""GShard-style Mixture-of-Experts transformer LM in pure JAX.

Same decoder as :mod:`autopar.models.gpt` (embeddings, pre-LN causal attention blocks, tied LM
head), except that every other block (even indices 0, 2, 4, ..., as in Alpa's MoE model) replaces
its dense MLP with a top-2 gated MoE layer:

* tokens ``[B, S, M]`` are regrouped into ``[G, Sg, M]`` groups of ``Sg`` tokens
  (``Sg = gcd(B*S, expert_group_size)``, so any batch size traces);
* GShard top-2 gating with capacity ``C = ceil(capacity_factor * 2 * Sg / E)`` per expert and
  group builds one-hot ``dispatch``/``combine`` tensors ``[G, Sg, E, C]``;
* experts are one batched einsum over an expert dimension, ``wi: [E, M, F]``, ``wo: [E, F, M]``
  (relu, no biases, as in GShard);
* the auxiliary load-balancing loss ``E * sum_e(mean_gate_e * frac_top1_e)`` (1.0 when routing is
  uniform) times ``aux_loss_coef`` is added to the LM loss.

Large sizes are Alpa's MoE benchmark family (``benchmark/alpa/suite_manual_moe.py``,
``moe_specs``; global batch 1024 and expert group size 2048 from ``suite_auto_moe.py``),
seq 1024, vocab 32000, FFN = 8 x hidden in every block (``intermediate_size=hidden_size * 8`` in
``benchmark_one_case_moe.py``):

=====  ======  ======  =====  =======
size   hidden  layers  heads  experts
=====  ======  ======  =====  =======
380M   768     8       16     8
690M   768     8       16     16
1.3B   768     16      16     16
2.4B   1024    16      16     16
10B    1536    16      16     32
27B    2048    16      16     48
70B    2048    32      16     64
=====  ======  ======  =====  =======
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
    layer_norm,
    layer_norm_params,
    normal_init,
    one_hot_cross_entropy,
)


@dataclass(frozen=True)
class MoEConfig:
    """Hyper-parameters of the MoE transformer."""

    batch_size: int
    seq_len: int
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    num_experts: int
    expert_group_size: int = 2048
    mlp_ratio: int = 8
    capacity_factor: float = 1.0
    aux_loss_coef: float = 0.01
    learning_rate: float = 1e-3
    adam_eps: float = 1e-8
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_config(
            "moe",
            self,
            (
                "batch_size",
                "seq_len",
                "hidden_size",
                "num_layers",
                "num_heads",
                "vocab_size",
                "num_experts",
                "expert_group_size",
                "mlp_ratio",
            ),
        )
        gpt.check_heads("moe", self.hidden_size, self.num_heads)
        if not self.capacity_factor > 0:
            raise InvalidOptionError(
                f"invalid moe config: capacity_factor={self.capacity_factor!r} must be > 0"
            )


def _moe(hidden: int, layers: int, experts: int) -> MoEConfig:
    return MoEConfig(
        batch_size=1024,
        seq_len=1024,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=16,
        vocab_size=32000,
        num_experts=experts,
    )


SIZES: dict[str, MoEConfig] = {
    "tiny": MoEConfig(
        batch_size=8,
        seq_len=16,
        hidden_size=64,
        num_layers=2,
        num_heads=8,
        vocab_size=256,
        num_experts=8,
        expert_group_size=16,
        mlp_ratio=4,
        learning_rate=1e-2,
        adam_eps=1e-3,
    ),
    "380M": _moe(768, 8, 8),
    "690M": _moe(768, 8, 16),
    "1.3B": _moe(768, 16, 16),
    "2.4B": _moe(1024, 16, 16),
    "10B": _moe(1536, 16, 32),
    "27B": _moe(2048, 16, 48),
    "70B": _moe(2048, 32, 64),
}


def is_moe_layer(i: int) -> bool:
    """Whether block ``i`` has an MoE layer (even blocks, as in Alpa's FlaxMoELayerCollection)."""
    return i % 2 == 0


def group_size(num_tokens: int, cfg: MoEConfig) -> int:
    """Tokens per gating group: the configured size, shrunk to divide the token count."""
    return math.gcd(num_tokens, cfg.expert_group_size)


def expert_capacity(tokens_per_group: int, cfg: MoEConfig) -> int:
    """Slots per expert and group: top-2 sends ``2 * Sg`` assignments over ``E`` experts."""
    return max(1, math.ceil(cfg.capacity_factor * 2 * tokens_per_group / cfg.num_experts))


def top2_gating(logits: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard top-2 gating of router ``logits: [G, S, E]``.

    Returns ``(combine [G,S,E,C] float32, dispatch [G,S,E,C] float32, aux_loss scalar)``. A
    token's second choice queues behind every first choice of that expert in its group, and
    assignments past ``capacity`` are dropped (the token then passes through via the residual).
    Because of that queueing, a later token of a group can evict an earlier token's second
    choice when capacity is tight (GShard semantics); with ``capacity >= S`` routing is causal.
    """
    num_experts = logits.shape[-1]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    idx1 = jnp.argmax(probs, axis=-1)
    mask1 = jax.nn.one_hot(idx1, num_experts, dtype=jnp.int32)  # [G, S, E]
    idx2 = jnp.argmax(jnp.where(mask1 > 0, -jnp.inf, probs), axis=-1)
    mask2 = jax.nn.one_hot(idx2, num_experts, dtype=jnp.int32)

    # Load-balancing loss on first choices, computed before capacity drops (as in GShard).
    frac = jnp.mean(mask1.astype(jnp.float32), axis=1)  # [G, E]
    mean_prob = jnp.mean(probs, axis=1)  # [G, E]
    aux_loss = jnp.mean(jnp.sum(frac * mean_prob, axis=-1)) * num_experts

    gate1 = jnp.sum(probs * mask1, axis=-1)  # [G, S]
    gate2 = jnp.sum(probs * mask2, axis=-1)
    denom = gate1 + gate2
    gate1, gate2 = gate1 / denom, gate2 / denom  # normalise the pair before dropping

    # Position of each assignment in its expert's buffer: running count within the group.
    pos1 = jnp.cumsum(mask1, axis=1) - mask1
    mask1 = mask1 * (pos1 < capacity)
    pos2 = jnp.cumsum(mask2, axis=1) - mask2 + jnp.sum(mask1, axis=1, keepdims=True)
    mask2 = mask2 * (pos2 < capacity)

    def slots(mask: jax.Array, pos: jax.Array) -> jax.Array:  # -> [G, S, E, C] one-hot
        slot = jnp.sum(pos * mask, axis=-1)  # [G, S]
        kept = mask.astype(jnp.float32)[..., None]
        return kept * jax.nn.one_hot(slot, capacity, dtype=jnp.float32)[:, :, None, :]

    slots1, slots2 = slots(mask1, pos1), slots(mask2, pos2)
    combine = gate1[..., None, None] * slots1 + gate2[..., None, None] * slots2
    dispatch = slots1 + slots2
    return combine, dispatch, aux_loss


def moe_params(keys: Iterator[jax.Array], hidden: int, ffn: int, num_experts: int, dtype) -> dict:
    """Router ``gate: [M, E]`` and expert kernels ``wi: [E, M, F]``, ``wo: [E, F, M]`` (3 keys)."""
    kg, ki, ko = next(keys), next(keys), next(keys)
    return {
        "gate": normal_init(kg, (hidden, num_experts), gpt.INIT_STD, dtype),
        "wi": normal_init(ki, (num_experts, hidden, ffn), gpt.INIT_STD, dtype),
        "wo": normal_init(ko, (num_experts, ffn, hidden), gpt.INIT_STD, dtype),
    }


def moe_layer(x: jax.Array, p: dict, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Position-wise MoE of ``x: [B, S, M]``; returns ``(output [B, S, M], aux_loss)``."""
    b, s, m = x.shape
    sg = group_size(b * s, cfg)
    groups = x.reshape(b * s // sg, sg, m)  # [G, Sg, M]
    logits = jnp.einsum("gsm,me->gse", groups, p["gate"])
    combine, dispatch, aux = top2_gating(logits, expert_capacity(sg, cfg))
    combine, dispatch = combine.astype(x.dtype), dispatch.astype(x.dtype)
    expert_in = jnp.einsum("gsec,gsm->egcm", dispatch, groups)
    h = jax.nn.relu(jnp.einsum("egcm,emf->egcf", expert_in, p["wi"]))
    expert_out = jnp.einsum("egcf,efm->egcm", h, p["wo"])
    out = jnp.einsum("gsec,egcm->gsm", combine, expert_out)
    return out.reshape(b, s, m), aux


def init_params(rng: jax.Array, cfg: MoEConfig) -> Params:
    """Like GPT's params, but even blocks hold ``"moe"`` instead of ``"mlp"``."""
    dtype = jnp.dtype(cfg.dtype)
    h, ffn = cfg.hidden_size, cfg.mlp_ratio * cfg.hidden_size
    keys = key_stream(rng, 2 + 7 * cfg.num_layers)
    params = gpt.embedding_params(keys, cfg.vocab_size, cfg.seq_len, h, dtype)
    blocks = []
    for i in range(cfg.num_layers):
        blk = {
            "ln1": layer_norm_params(h, dtype),
            "attn": gpt.attention_params(keys, h, dtype),
            "ln2": layer_norm_params(h, dtype),
        }
        if is_moe_layer(i):
            blk["moe"] = moe_params(keys, h, ffn, cfg.num_experts, dtype)
        else:
            blk["mlp"] = gpt.mlp_params(keys, h, ffn, dtype)
        blocks.append(blk)
    params["blocks"] = blocks
    params["ln_f"] = layer_norm_params(h, dtype)
    return params


def forward(params: Params, tokens: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """``(logits [B, S, vocab], summed aux loss of all MoE layers)``."""
    x = gpt.embed(params, tokens)
    aux_total = jnp.zeros((), jnp.float32)
    for blk in params["blocks"]:  # Python loop on purpose: no scan
        x = x + gpt.causal_self_attention(layer_norm(x, blk["ln1"]), blk["attn"], cfg.num_heads)
        y = layer_norm(x, blk["ln2"])
        if "moe" in blk:
            y, aux = moe_layer(y, blk["moe"], cfg)
            aux_total = aux_total + aux
        else:
            y = gpt.mlp(y, blk["mlp"])
        x = x + y
    return gpt.lm_head(params, x), aux_total


def loss_fn(params: Params, batch: Batch, cfg: MoEConfig) -> jax.Array:
    """Mean next-token cross-entropy + ``aux_loss_coef`` x load-balancing loss."""
    logits, aux = forward(params, batch["tokens"], cfg)
    return one_hot_cross_entropy(logits, batch["labels"]) + cfg.aux_loss_coef * aux


FAMILY = ModelFamily(
    name="moe",
    init_params=init_params,
    loss_fn=loss_fn,
    batch_spec=gpt.batch_spec,
    make_batch=gpt.make_batch,
)
