"""The model zoo: pure JAX + optax training steps at named sizes.

``get_model(name, size)`` returns a :class:`~autopar.models.base.ZooModel` whose ``train_step``
is a plain ``(state, batch) -> (new_state, loss)`` function. Families: ``mlp``, ``gpt``, ``moe``
(GShard top-2), ``wresnet``, ``llama`` (Llama 3: RMSNorm, grouped-query attention with RoPE,
SwiGLU); sizes are ``tiny`` (for tests) and the Alpa benchmark sizes (for ``llama`` the Llama 3
8B, 70B and 405B shapes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autopar.errors import InvalidOptionError, choices_text
from autopar.models import gpt, llama, mlp, moe, wide_resnet
from autopar.models.base import ModelFamily, ZooModel

MODEL_NAMES: tuple[str, ...] = ("mlp", "gpt", "moe", "wresnet", "llama")

_REGISTRY: dict[str, tuple[ModelFamily, dict[str, Any]]] = {
    "mlp": (mlp.FAMILY, mlp.SIZES),
    "gpt": (gpt.FAMILY, gpt.SIZES),
    "moe": (moe.FAMILY, moe.SIZES),
    "wresnet": (wide_resnet.FAMILY, wide_resnet.SIZES),
    "llama": (llama.FAMILY, llama.SIZES),
}


def _lookup(name: str) -> tuple[ModelFamily, dict[str, Any]]:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise InvalidOptionError(
            f"unknown model {name!r}; valid models: {choices_text(MODEL_NAMES)}"
        ) from None


def model_sizes(name: str) -> tuple[str, ...]:
    """Named sizes of model ``name``, ``"tiny"`` first, then increasing."""
    return tuple(_lookup(name)[1])


def get_model(
    name: str, size: str = "tiny", *, batch_size: int | None = None, **overrides: Any
) -> ZooModel:
    """Model ``name`` at ``size``; ``batch_size`` and ``overrides`` replace config fields.

    Raises InvalidOptionError (one line naming the valid choices) for an unknown model, size or
    override field, or an invalid resulting config (e.g. hidden size not divisible by heads).
    """
    family, sizes = _lookup(name)
    try:
        config = sizes[size]
    except (KeyError, TypeError):
        raise InvalidOptionError(
            f"unknown size {size!r} for model {name!r}; valid sizes: {choices_text(sizes)}"
        ) from None
    valid = [f.name for f in dataclasses.fields(config)]
    unknown = [k for k in overrides if k not in valid]
    if unknown:
        raise InvalidOptionError(
            f"unknown {name} config field {unknown[0]!r}; valid fields: {choices_text(valid)}"
        )
    if batch_size is not None:
        overrides["batch_size"] = batch_size
    if overrides:
        config = dataclasses.replace(config, **overrides)  # re-validated in __post_init__
    return ZooModel(name=name, size=size, config=config, family=family)


__all__ = ["MODEL_NAMES", "ZooModel", "get_model", "model_sizes"]
