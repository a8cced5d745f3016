"""The common shape of every zoo model: a frozen config plus pure JAX functions.

A model family (mlp, gpt, moe, wresnet) is a handful of pure functions of ``(..., config)``;
``ZooModel`` binds one family to one config and adds what every family shares: the train state
(``params`` + optax Adam ``opt_state``, plus any extra state such as ``batch_stats``), the Adam
train step, and the abstract (``ShapeDtypeStruct``) views used to trace huge models without
allocating them. Nothing here knows about devices or parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from autopar.errors import InvalidOptionError, choices_text

Params = Any
Batch = dict[str, jax.Array]
State = dict[str, Any]

# State keys owned by ZooModel itself; any other key is family "extra" state (e.g. batch_stats).
_CORE_KEYS = ("params", "opt_state")


@dataclass(frozen=True)
class ModelFamily:
    """The pure functions that define one model family; every one takes the config last.

    ``init_extra``/``loss_with_extra`` are only set by families that carry non-trainable state
    (Wide-ResNet's batch-norm running statistics); the train step threads that state through.
    """

    name: str
    init_params: Callable[[jax.Array, Any], Params]
    loss_fn: Callable[[Params, Batch, Any], jax.Array]
    batch_spec: Callable[[Any], dict[str, jax.ShapeDtypeStruct]]
    make_batch: Callable[[jax.Array, Any], Batch]
    init_extra: Callable[[Any], dict[str, Any]] | None = None
    loss_with_extra: Callable[[Params, dict, Batch, Any], tuple[jax.Array, dict]] | None = None


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo at one named size.

    ``train_step(state, batch) -> (new_state, loss)`` is a pure function (one Adam step) that can
    be passed to ``jax.jit`` or ``jax.make_jaxpr`` as is; the state is
    ``{"params", "opt_state"}`` plus ``"batch_stats"`` for Wide-ResNet, with the same pytree
    structure in and out.
    """

    name: str
    size: str
    config: Any
    family: ModelFamily = field(repr=False, compare=False)
    # how train_step differentiates the loss: jax.value_and_grad, or a drop-in with the same
    # signature (a pipeline parallelizer's, which marks where the loss function is)
    value_and_grad_fn: Callable = field(default=jax.value_and_grad, repr=False, compare=False)

    def with_value_and_grad(self, value_and_grad_fn: Callable) -> ZooModel:
        """This model with ``train_step`` differentiating through ``value_and_grad_fn``."""
        return replace(self, value_and_grad_fn=value_and_grad_fn)

    # -- optimizer --------------------------------------------------------------------------
    @property
    def optimizer(self) -> optax.GradientTransformation:
        """``optax.adam`` at the config's learning rate and epsilon (stateless, rebuilt on demand).

        The ``tiny`` sizes use eps 1e-3 rather than optax's 1e-8. Adam moves each weight by
        ``lr * m / (sqrt(v) + eps)``, whose sensitivity to the gradient near zero is ``lr / eps``:
        with a tiny eps, rounding-level differences in a near-zero gradient element (a parallel
        run sums the batch in another order than the serial one) become whole steps. With 1e-3
        every tiny model's parallel and serial fp32 runs agree to well under 0.1% of a step
        after 3 steps, while every weight still moves by a good fraction of a step.
        """
        return optax.adam(self.config.learning_rate, eps=self.config.adam_eps)

    @property
    def num_layers(self) -> int:
        """The config's ``num_layers`` (for Wide-ResNet the network depth, e.g. 50 or 101)."""
        return int(self.config.num_layers)

    # -- concrete ---------------------------------------------------------------------------
    def init_state(self, rng: jax.Array) -> State:
        """Real initial state: ``{"params", "opt_state"}`` (+ extra state such as batch_stats).

        Runs as one jitted computation (op-by-op init compiles every random draw separately,
        which is slow on CPU); it can itself be wrapped in ``jax.jit``/``jax.eval_shape``.
        """
        return _initial_state(self, rng)

    def _init_state(self, rng: jax.Array) -> State:
        params = self.family.init_params(rng, self.config)
        state: State = {"params": params, "opt_state": self.optimizer.init(params)}
        if self.family.init_extra is not None:
            state.update(self.family.init_extra(self.config))
        return state

    def loss_fn(self, params: Params, batch: Batch) -> jax.Array:
        """Scalar training loss of ``params`` on ``batch``.

        Wide-ResNet: batch norm runs in training mode (statistics of this batch), so the loss does
        not depend on the running ``batch_stats``; ``train_step`` updates those separately.
        """
        return self.family.loss_fn(params, batch, self.config)

    def train_step(self, state: State, batch: Batch) -> tuple[State, jax.Array]:
        """One Adam step; returns ``(new_state, loss)`` where loss is that of the input params."""
        params = state["params"]
        extra = self.extra_state(state)
        if self.family.loss_with_extra is not None:

            def objective(p):
                return self.family.loss_with_extra(p, extra, batch, self.config)

            (loss, new_extra), grads = self.value_and_grad_fn(objective, has_aux=True)(params)
        else:
            loss, grads = self.value_and_grad_fn(self.loss_fn)(params, batch)
            new_extra = extra
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        return {"params": new_params, "opt_state": opt_state, **new_extra}, loss

    def extra_state(self, state: State) -> dict[str, Any]:
        """The state's entries beside ``params`` and ``opt_state`` (Wide-ResNet's
        ``batch_stats``): what the loss reads and returns beside the parameters."""
        return {k: v for k, v in state.items() if k not in _CORE_KEYS}

    def make_batch(self, rng: jax.Array) -> Batch:
        """A concrete random batch at ``config.batch_size`` with valid labels (jitted)."""
        return jax.jit(self.family.make_batch, static_argnums=1)(rng, self.config)

    # -- abstract (no allocation) -----------------------------------------------------------
    def abstract_state(self) -> State:
        """``jax.eval_shape(init_state)``: ShapeDtypeStruct leaves, nothing allocated."""
        return jax.eval_shape(self._init_state, jax.ShapeDtypeStruct((2,), jnp.uint32))

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The batch as ShapeDtypeStruct leaves."""
        return self.family.batch_spec(self.config)

    def abstract_inputs(self) -> tuple[State, dict[str, jax.ShapeDtypeStruct]]:
        """``(abstract_state(), abstract_batch())``: the arguments of ``train_step``."""
        return self.abstract_state(), self.abstract_batch()

    def num_params(self) -> int:
        """Number of trainable parameters, counted from abstract shapes."""
        params = jax.eval_shape(
            lambda k: self.family.init_params(k, self.config),
            jax.ShapeDtypeStruct((2,), jnp.uint32),
        )
        return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


# -- helpers shared by the families -------------------------------------------------------------
def check_config(family: str, cfg: Any, positive: Iterable[str]) -> None:
    """Raise InvalidOptionError unless every named field of ``cfg`` is a positive int."""
    for name in positive:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidOptionError(
                f"invalid {family} config: {name}={value!r} must be a positive integer"
            )
    if not (isinstance(cfg.learning_rate, int | float) and cfg.learning_rate > 0):
        raise InvalidOptionError(
            f"invalid {family} config: learning_rate={cfg.learning_rate!r} must be > 0"
        )
    try:
        jnp.dtype(cfg.dtype)
    except TypeError:
        raise InvalidOptionError(
            f"invalid {family} config: dtype={cfg.dtype!r} is not a JAX dtype "
            "(e.g. float32, bfloat16)"
        ) from None


def choose(family: str, field_name: str, value: Any, choices: Iterable[Any]) -> None:
    """Raise InvalidOptionError unless ``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise InvalidOptionError(
            f"invalid {family} config: {field_name}={value!r}; valid values: "
            f"{choices_text(choices)}"
        )


def key_stream(rng: jax.Array, n: int) -> Iterator[jax.Array]:
    """``n`` independent keys from one ``split``, handed out with ``next()``.

    One split for the whole model instead of a tree of splits: every threefry call is compiled
    separately by XLA, so this keeps init compile time down on CPU.
    """
    return iter(jax.random.split(rng, n))


def normal_init(key: jax.Array, shape: tuple[int, ...], std: float, dtype: Any) -> jax.Array:
    """Gaussian init; ``std`` is a Python float so nothing here forces a concrete value.

    Tensors of rank > 2 (conv kernels, expert weights) are drawn flat and reshaped: XLA:CPU
    compiles a rank-4 random draw markedly slower, and a leading-dim (expert) split of the
    reshaped draw stays contiguous.
    """
    if len(shape) > 2:
        flat = jax.random.normal(key, (math.prod(shape),), jnp.float32).reshape(shape)
    else:
        flat = jax.random.normal(key, shape, jnp.float32)
    return (std * flat).astype(dtype)


def one_hot_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy with integer labels, in float32.

    Uses a one-hot product rather than a gather (take_along_axis) so the loss is plain
    elementwise + reduce ops, which a sharding pass handles like any other einsum.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32)
    return -jnp.mean(jnp.sum(onehot * logp, axis=-1))


def layer_norm(x: jax.Array, p: dict[str, jax.Array], eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last axis with learned ``scale``/``bias`` (statistics in float32)."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"] + p["bias"]).astype(x.dtype)


def layer_norm_params(dim: int, dtype: Any) -> dict[str, jax.Array]:
    """Fresh LayerNorm parameters (scale 1, bias 0)."""
    return {"scale": jnp.ones((dim,), dtype), "bias": jnp.zeros((dim,), dtype)}


@partial(jax.jit, static_argnums=0)
def _initial_state(model: ZooModel, rng: jax.Array) -> State:
    # jitted once per model (name, size, config: the static argument's hash), not once per
    # call: a test session initialises the same few models dozens of times
    return model._init_state(rng)
