"""An L-layer MLP: ``num_layers`` dense layers with relu/gelu between them.

Layer 0 maps ``input_dim -> hidden_size``, the middle layers ``hidden_size -> hidden_size`` and
the last ``hidden_size -> output_dim``; every layer has a bias. Loss is MSE against float targets
(``loss="mse"``) or softmax cross-entropy against integer labels (``loss="xent"``).

Named sizes (batch 1024 for the big ones, like the other families' Alpa defaults):

======  =====  ======  ======  ======  ============
size    in     hidden  out     layers  params
======  =====  ======  ======  ======  ============
tiny    32     64      16      3       7,312
100M    2560   2560    2560    16      ~104.9M
1B      8192   8192    8192    15      ~1.007B
======  =====  ======  ======  ======  ============
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

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

ACTIVATIONS = ("relu", "gelu")
LOSSES = ("mse", "xent")


@dataclass(frozen=True)
class MLPConfig:
    """Hyper-parameters of the MLP."""

    batch_size: int
    input_dim: int
    hidden_size: int
    output_dim: int
    num_layers: int
    activation: str = "relu"
    loss: str = "mse"
    learning_rate: float = 1e-3
    adam_eps: float = 1e-8
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_config(
            "mlp", self, ("batch_size", "input_dim", "hidden_size", "output_dim", "num_layers")
        )
        choose("mlp", "activation", self.activation, ACTIVATIONS)
        choose("mlp", "loss", self.loss, LOSSES)


SIZES: dict[str, MLPConfig] = {
    "tiny": MLPConfig(
        batch_size=16,
        input_dim=32,
        hidden_size=64,
        output_dim=16,
        num_layers=3,
        learning_rate=1e-2,
        adam_eps=1e-3,
    ),
    "100M": MLPConfig(
        batch_size=1024, input_dim=2560, hidden_size=2560, output_dim=2560, num_layers=16
    ),
    "1B": MLPConfig(
        batch_size=1024, input_dim=8192, hidden_size=8192, output_dim=8192, num_layers=15
    ),
}


def _layer_dims(cfg: MLPConfig) -> list[tuple[int, int]]:
    dims = [cfg.input_dim] + [cfg.hidden_size] * (cfg.num_layers - 1) + [cfg.output_dim]
    return list(zip(dims[:-1], dims[1:], strict=True))


def init_params(rng: jax.Array, cfg: MLPConfig) -> Params:
    """``{"layers": [{"kernel": [din, dout], "bias": [dout]}, ...]}`` with He-normal kernels."""
    dtype = jnp.dtype(cfg.dtype)
    keys = key_stream(rng, cfg.num_layers)
    return {
        "layers": [
            {
                "kernel": normal_init(k, (din, dout), math.sqrt(2.0 / din), dtype),
                "bias": jnp.zeros((dout,), dtype),
            }
            for k, (din, dout) in zip(keys, _layer_dims(cfg), strict=True)
        ]
    }


def forward(params: Params, x: jax.Array, cfg: MLPConfig) -> jax.Array:
    """Outputs ``[B, output_dim]``; no activation after the last layer."""
    act = jax.nn.relu if cfg.activation == "relu" else jax.nn.gelu
    h = x.astype(jnp.dtype(cfg.dtype))
    last = len(params["layers"]) - 1
    for i, layer in enumerate(params["layers"]):  # a Python loop: every layer is visible
        h = h @ layer["kernel"] + layer["bias"]
        if i != last:
            h = act(h)
    return h


def loss_fn(params: Params, batch: Batch, cfg: MLPConfig) -> jax.Array:
    """Mean squared error, or mean cross-entropy when ``cfg.loss == "xent"``."""
    out = forward(params, batch["x"], cfg)
    if cfg.loss == "xent":
        return one_hot_cross_entropy(out, batch["y"])
    return jnp.mean(jnp.square(out.astype(jnp.float32) - batch["y"].astype(jnp.float32)))


def batch_spec(cfg: MLPConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """``{"x": f[B, input_dim], "y": f[B, output_dim] (mse) or int32[B] (xent)}``."""
    dtype = jnp.dtype(cfg.dtype)
    if cfg.loss == "xent":
        y = jax.ShapeDtypeStruct((cfg.batch_size,), jnp.int32)
    else:
        y = jax.ShapeDtypeStruct((cfg.batch_size, cfg.output_dim), dtype)
    return {"x": jax.ShapeDtypeStruct((cfg.batch_size, cfg.input_dim), dtype), "y": y}


def make_batch(rng: jax.Array, cfg: MLPConfig) -> Batch:
    """Random Gaussian inputs and targets (or uniform class labels for ``xent``)."""
    kx, ky = jax.random.split(rng)
    dtype = jnp.dtype(cfg.dtype)
    x = jax.random.normal(kx, (cfg.batch_size, cfg.input_dim), dtype)
    if cfg.loss == "xent":
        y = jax.random.randint(ky, (cfg.batch_size,), 0, cfg.output_dim, jnp.int32)
    else:
        y = jax.random.normal(ky, (cfg.batch_size, cfg.output_dim), dtype)
    return {"x": x, "y": y}


FAMILY = ModelFamily(
    name="mlp",
    init_params=init_params,
    loss_fn=loss_fn,
    batch_spec=batch_spec,
    make_batch=make_batch,
)
