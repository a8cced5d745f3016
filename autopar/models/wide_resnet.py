"""Wide-ResNet (bottleneck ResNet with a width factor) in pure JAX, NHWC.

The architecture follows Alpa's ``alpa/model/wide_resnet.py`` (itself Flax's ImageNet ResNet)
so parameter counts match Alpa's size names: a 7x7/2 stem conv + batch norm + relu + 3x3/2 max
pool, then stages of bottleneck blocks whose stage ``i`` uses ``f = num_channels * 2**i``::

    1x1 conv -> f, BN, relu -> 3x3 conv (stride) -> f * width_factor, BN, relu
    -> 1x1 conv -> 4f, BN (scale initialised to 0) ; + residual (1x1 conv + BN when the shape
    changes) ; relu

then global average pooling, a dense head and softmax cross-entropy. Convs have no bias. Batch
norm runs in training mode (statistics of the current batch); ``train_step`` carries running
statistics in ``state["batch_stats"]`` and updates them with momentum 0.9.

Large sizes are Alpa's Wide-ResNet family (``benchmark/alpa/suite_wresnet.py``,
``wresnet_specs``; global batch from ``perf_test_auto_suite``), 224x224 images, 1024 classes:

=====  ======  ========  =====  =====
size   layers  channels  width  batch
=====  ======  ========  =====  =====
250M   50      160       2      1536
500M   50      224       2      1536
1B     50      320       2      1536
2B     50      448       2      1536
4B     50      640       2      1536
6.8B   50      320       16     1536
13B    101     320       16     1520
=====  ======  ========  =====  =====
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from autopar.models.base import (
    Batch,
    ModelFamily,
    Params,
    check_config,
    choose,
    key_stream,
    normal_init,
    one_hot_cross_entropy,
)

# Blocks per stage for each supported depth (3 convs per bottleneck block + stem + head).
STAGES: dict[int, tuple[int, ...]] = {
    14: (1, 1, 1, 1),
    26: (2, 2, 2, 2),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
}
_DIMS = ("NHWC", "HWIO", "NHWC")


@dataclass(frozen=True)
class WResNetConfig:
    """Hyper-parameters of the Wide-ResNet."""

    batch_size: int
    image_size: int
    num_layers: int
    num_channels: int
    width_factor: int
    num_classes: int = 1024
    bn_momentum: float = 0.9
    bn_epsilon: float = 1e-5
    learning_rate: float = 1e-3
    adam_eps: float = 1e-8
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_config(
            "wresnet",
            self,
            ("batch_size", "image_size", "num_channels", "width_factor", "num_classes"),
        )
        choose("wresnet", "num_layers", self.num_layers, STAGES)


def _wrn(layers: int, channels: int, width: int, batch: int = 1536) -> WResNetConfig:
    return WResNetConfig(
        batch_size=batch,
        image_size=224,
        num_layers=layers,
        num_channels=channels,
        width_factor=width,
    )


SIZES: dict[str, WResNetConfig] = {
    "tiny": WResNetConfig(
        batch_size=8,
        image_size=32,
        num_layers=14,
        num_channels=8,
        width_factor=2,
        num_classes=16,
        learning_rate=1e-2,
        adam_eps=1e-3,
    ),
    "250M": _wrn(50, 160, 2),
    "500M": _wrn(50, 224, 2),
    "1B": _wrn(50, 320, 2),
    "2B": _wrn(50, 448, 2),
    "4B": _wrn(50, 640, 2),
    "6.8B": _wrn(50, 320, 16),
    "13B": _wrn(101, 320, 16, batch=1520),  # Alpa ran 13B at 1520 (= 38 micro-batches of 40)
}


def block_layout(cfg: WResNetConfig) -> list[tuple[int, int, int, bool]]:
    """Static layout of every block: ``(in_channels, filters, stride, has_projection)``."""
    layout, cin = [], cfg.num_channels
    for i, n in enumerate(STAGES[cfg.num_layers]):
        f = cfg.num_channels * 2**i
        for j in range(n):
            stride = 2 if i > 0 and j == 0 else 1
            layout.append((cin, f, stride, cin != 4 * f or stride != 1))
            cin = 4 * f
    return layout


def _conv_init(key, kh: int, kw: int, cin: int, cout: int, dtype) -> jax.Array:
    return normal_init(key, (kh, kw, cin, cout), math.sqrt(2.0 / (kh * kw * cin)), dtype)


def _bn_init(c: int, dtype, zero_scale: bool = False) -> dict:
    scale = jnp.zeros((c,), dtype) if zero_scale else jnp.ones((c,), dtype)
    return {"scale": scale, "bias": jnp.zeros((c,), dtype)}


def init_params(rng: jax.Array, cfg: WResNetConfig) -> Params:
    """``{"stem": {conv, bn}, "blocks": [...], "head": {kernel, bias}}``."""
    dtype = jnp.dtype(cfg.dtype)
    c, w = cfg.num_channels, cfg.width_factor
    layout = block_layout(cfg)
    keys = key_stream(rng, 2 + 4 * len(layout))
    k_stem, k_head = next(keys), next(keys)
    blocks = []
    for cin, f, _, proj in layout:
        k1, k2, k3 = next(keys), next(keys), next(keys)
        blk = {
            "conv1": _conv_init(k1, 1, 1, cin, f, dtype),
            "bn1": _bn_init(f, dtype),
            "conv2": _conv_init(k2, 3, 3, f, f * w, dtype),
            "bn2": _bn_init(f * w, dtype),
            # Zero-init last BN scale: each block starts as the identity (Flax/Goyal et al.).
            "conv3": _conv_init(k3, 1, 1, f * w, 4 * f, dtype),
            "bn3": _bn_init(4 * f, dtype, zero_scale=True),
        }
        if proj:
            blk["proj_conv"] = _conv_init(next(keys), 1, 1, cin, 4 * f, dtype)
            blk["proj_bn"] = _bn_init(4 * f, dtype)
        blocks.append(blk)
    cout = layout[-1][1] * 4
    return {
        "stem": {"conv": _conv_init(k_stem, 7, 7, 3, c, dtype), "bn": _bn_init(c, dtype)},
        "blocks": blocks,
        "head": {
            "kernel": normal_init(k_head, (cout, cfg.num_classes), math.sqrt(1.0 / cout), dtype),
            "bias": jnp.zeros((cfg.num_classes,), dtype),
        },
    }


def init_batch_stats(cfg: WResNetConfig) -> dict:
    """``{"batch_stats": ...}``: running mean 0 / var 1 for every BN, mirroring the params."""
    dtype = jnp.dtype(cfg.dtype)

    def stats(c: int) -> dict:
        return {"mean": jnp.zeros((c,), dtype), "var": jnp.ones((c,), dtype)}

    blocks = []
    for _, f, _, proj in block_layout(cfg):
        blk = {"bn1": stats(f), "bn2": stats(f * cfg.width_factor), "bn3": stats(4 * f)}
        if proj:
            blk["proj_bn"] = stats(4 * f)
        blocks.append(blk)
    return {"batch_stats": {"stem": {"bn": stats(cfg.num_channels)}, "blocks": blocks}}


def _conv(x: jax.Array, w: jax.Array, stride: int = 1, padding="SAME") -> jax.Array:
    return lax.conv_general_dilated(x, w, (stride, stride), padding, dimension_numbers=_DIMS)


def _batch_norm(x, p, stats, cfg: WResNetConfig, train: bool):
    """Returns ``(y, new_stats)``; ``new_stats`` is None when ``stats`` is None."""
    if train:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=(0, 1, 2))
        var = jnp.mean(jnp.square(xf), axis=(0, 1, 2)) - jnp.square(mean)
    else:
        mean, var = stats["mean"].astype(jnp.float32), stats["var"].astype(jnp.float32)
    y = (x.astype(jnp.float32) - mean) * lax.rsqrt(var + cfg.bn_epsilon)
    y = (y * p["scale"] + p["bias"]).astype(x.dtype)
    if stats is None or not train:
        return y, stats
    m = cfg.bn_momentum
    # Running statistics are state, not a function of the parameters' gradient path.
    new = {
        k: (m * stats[k] + (1 - m) * lax.stop_gradient(v)).astype(stats[k].dtype)
        for k, v in (("mean", mean), ("var", var))
    }
    return y, new


def forward(
    params: Params,
    batch_stats: dict | None,
    images: jax.Array,
    cfg: WResNetConfig,
    train: bool = True,
) -> tuple[jax.Array, dict | None]:
    """``(logits [B, num_classes], new batch_stats)`` of ``images: [B, H, W, 3]``.

    ``batch_stats`` may be None in training mode (the loss does not need it; nothing is updated).
    """
    x = images.astype(jnp.dtype(cfg.dtype))
    x = _conv(x, params["stem"]["conv"], 2, ((3, 3), (3, 3)))
    x, stem_bn = _batch_norm(
        x, params["stem"]["bn"], None if batch_stats is None else batch_stats["stem"]["bn"],
        cfg, train
    )
    x = jax.nn.relu(x)
    x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    new_blocks = []
    for i, ((_, _, stride, proj), p) in enumerate(
        zip(block_layout(cfg), params["blocks"], strict=True)
    ):
        st = {} if batch_stats is None else batch_stats["blocks"][i]
        new_st: dict[str, Any] = {}

        def bn(y, name, p=p, st=st, new_st=new_st):
            y, new_st[name] = _batch_norm(y, p[name], st.get(name), cfg, train)
            return y

        y = jax.nn.relu(bn(_conv(x, p["conv1"]), "bn1"))
        y = jax.nn.relu(bn(_conv(y, p["conv2"], stride), "bn2"))
        y = bn(_conv(y, p["conv3"]), "bn3")
        residual = bn(_conv(x, p["proj_conv"], stride), "proj_bn") if proj else x
        x = jax.nn.relu(residual + y)
        new_blocks.append(new_st)
    x = jnp.mean(x, axis=(1, 2))
    logits = x @ params["head"]["kernel"] + params["head"]["bias"]
    new_stats = None if batch_stats is None else {"stem": {"bn": stem_bn}, "blocks": new_blocks}
    return logits, new_stats


def loss_fn(params: Params, batch: Batch, cfg: WResNetConfig) -> jax.Array:
    """Mean softmax cross-entropy, batch norm in training mode (running stats not needed)."""
    logits, _ = forward(params, None, batch["images"], cfg)
    return one_hot_cross_entropy(logits, batch["labels"])


def loss_with_stats(
    params: Params, extra: dict, batch: Batch, cfg: WResNetConfig
) -> tuple[jax.Array, dict]:
    """``(loss, {"batch_stats": updated running statistics})`` for the train step."""
    logits, stats = forward(params, extra["batch_stats"], batch["images"], cfg)
    return one_hot_cross_entropy(logits, batch["labels"]), {"batch_stats": stats}


def batch_spec(cfg: WResNetConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """``{"images": f[B, H, W, 3], "labels": int32[B]}``."""
    s = cfg.image_size
    return {
        "images": jax.ShapeDtypeStruct((cfg.batch_size, s, s, 3), jnp.dtype(cfg.dtype)),
        "labels": jax.ShapeDtypeStruct((cfg.batch_size,), jnp.int32),
    }


def make_batch(rng: jax.Array, cfg: WResNetConfig) -> Batch:
    """Gaussian images and uniform labels in ``[0, num_classes)``."""
    ki, kl = jax.random.split(rng)
    s = cfg.image_size
    shape = (cfg.batch_size, s, s, 3)
    # Drawn flat: XLA:CPU compiles rank-4 random draws slowly.
    images = jax.random.normal(ki, (math.prod(shape),), jnp.dtype(cfg.dtype)).reshape(shape)
    return {
        "images": images,
        "labels": jax.random.randint(kl, (cfg.batch_size,), 0, cfg.num_classes, jnp.int32),
    }


FAMILY = ModelFamily(
    name="wresnet",
    init_params=init_params,
    loss_fn=loss_fn,
    batch_spec=batch_spec,
    make_batch=make_batch,
    init_extra=init_batch_stats,
    loss_with_extra=loss_with_stats,
)
