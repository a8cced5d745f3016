"""Random train steps for differential testing (``benchmarks/fuzz.py``, ``tests/bench``).

A program is plain data (:class:`ProgramSpec`: a batch size, a width, an optimizer and a list
of :class:`Block` s drawn from a grammar of what models contain), so a failing one can be
written out as JSON, shrunk block by block and read back as a reproducer. :func:`build` turns
a spec into a train step (``(state, batch) -> (state, loss)``, differentiated with
``autopar.value_and_grad`` so that pipelines can cut it), its initial state and its batches.

The grammar: each block maps the activations ``h`` (``[batch, width]``, float32) to new
activations of the same shape, with parameters of its own:

* ``dense``: ``h @ W + b`` (or the same as an einsum), ``bf16``: in bfloat16 parameters with
  float32 accumulation (``preferred_element_type``);
* ``act``: an element-wise chain (tanh, relu, gelu, a sigmoid from ``exp``);
* ``layernorm`` and ``softmax`` (over the features, scaled by a parameter);
* ``permute``: reshape, transpose and reshape back (a permutation of the features);
* ``concat``: ``[h, f(h)] @ W2`` and ``slice``: halves sliced, mixed and concatenated back;
* ``embed``: a gather of table rows by the batch's integer tokens, added to ``h``;
  ``scatter``: ``h.at[rows, tokens % width].add(...)``;
* ``batchnorm``: a statistic over the batch (couples the examples, as batch norm does);
* ``conv``: a 1-D convolution over the features seen as ``[length, channels]``;
* ``scan``: ``lax.scan`` over stacked weights; ``cond``: ``lax.cond`` on the batch's tokens;
* ``remat``: a dense block under ``jax.checkpoint`` with a ``checkpoint_name`` inside.

The loss is a mean squared error against float targets or a cross-entropy against integer
labels; the update is SGD, momentum or Adam (optax). Batch sizes include ones that do not
divide 4 or 8 devices, which the planners must refuse with one line or handle.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name

import autopar

BLOCK_KINDS = ("dense", "act", "layernorm", "softmax", "permute", "concat", "slice", "embed",
               "scatter", "batchnorm", "conv", "scan", "cond", "remat")
OPTIMIZERS = ("sgd", "momentum", "adam")
LOSSES = ("mse", "xent")
BATCH_SIZES = (8, 16, 16, 32, 12, 6)
WIDTHS = (8, 16, 24, 32)
VOCAB = 11
LEARNING_RATE = 0.05


@dataclass(frozen=True)
class Block:
    """One block of a generated program: its ``kind`` (``BLOCK_KINDS``) and its choices
    (``variant``: which form of the kind; ``size``: an inner size where it has one)."""

    kind: str
    variant: int = 0
    size: int = 2


@dataclass(frozen=True)
class ProgramSpec:
    """A generated train step, as data: ``seed`` draws its parameters and batches."""

    seed: int
    batch: int
    width: int
    optimizer: str
    loss: str
    blocks: tuple[Block, ...] = field(default_factory=tuple)

    def to_json(self) -> str:
        """The spec as JSON (a reproducer file's contents)."""
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> ProgramSpec:
        """The spec written by :meth:`to_json`."""
        data = json.loads(text)
        blocks = tuple(Block(**b) for b in data.pop("blocks"))
        return ProgramSpec(blocks=blocks, **data)

    def describe(self) -> str:
        """One line: batch, width, optimizer, loss and the blocks in order."""
        names = " ".join(f"{b.kind}{b.variant}" for b in self.blocks)
        return (f"batch {self.batch}, width {self.width}, {self.optimizer}, {self.loss}: "
                f"{names or '(no blocks)'}")


def random_spec(seed: int, max_blocks: int = 5) -> ProgramSpec:
    """A program drawn from the grammar with ``seed`` (the same seed, the same program)."""
    rng = random.Random(seed)
    blocks = tuple(Block(rng.choice(BLOCK_KINDS), rng.randrange(3), rng.choice((2, 3, 4)))
                   for _ in range(rng.randint(1, max_blocks)))
    return ProgramSpec(seed=seed, batch=rng.choice(BATCH_SIZES), width=rng.choice(WIDTHS),
                       optimizer=rng.choice(OPTIMIZERS), loss=rng.choice(LOSSES),
                       blocks=blocks)


@dataclass
class BuiltProgram:
    """A spec made runnable: ``step(state, batch) -> (state, loss)``, the initial state and
    ``batches(i)``, the i-th step's batch."""

    spec: ProgramSpec
    step: Callable[[Any, Any], Any]
    state: Any
    batches: Callable[[int], Any]


def _normal(key: jax.Array, shape: tuple[int, ...], scale: float,
            dtype: Any = jnp.float32) -> jax.Array:
    return (scale * jax.random.normal(key, shape)).astype(dtype)


def _block_params(block: Block, width: int, key: jax.Array) -> dict[str, jax.Array]:
    """The parameters ``block`` reads, initialised from ``key``."""
    k1, k2 = jax.random.split(key)
    glorot = 1.0 / math.sqrt(width)
    if block.kind in ("dense", "remat", "cond"):
        dtype = jnp.bfloat16 if block.kind == "dense" and block.variant == 2 else jnp.float32
        return {"w": _normal(k1, (width, width), glorot, dtype), "b": jnp.zeros((width,), dtype)}
    if block.kind in ("layernorm", "softmax", "batchnorm"):
        return {"scale": jnp.ones((width,)), "shift": jnp.zeros((width,))}
    if block.kind == "concat":
        return {"w": _normal(k1, (2 * width, width), glorot)}
    if block.kind == "slice":
        half = width // 2
        return {"w": _normal(k1, (half, width - half), 1.0 / math.sqrt(half))}
    if block.kind == "embed":
        return {"table": _normal(k1, (VOCAB, width), 0.5)}
    if block.kind == "scatter":
        return {"v": _normal(k1, (), 0.5)}
    if block.kind == "conv":
        channels = _conv_channels(width, block.size)
        return {"kernel": _normal(k1, (3, channels, channels), 1.0 / math.sqrt(3 * channels))}
    if block.kind == "scan":
        return {"ws": _normal(k1, (block.size, width, width), glorot),
                "bs": _normal(k2, (block.size, width), 0.1)}
    return {}


def _conv_channels(width: int, size: int) -> int:
    """Channels of the conv block's ``[length, channels]`` view of ``width`` features."""
    return size if width % size == 0 else 1


def _act(variant: int, h: jax.Array) -> jax.Array:
    if variant == 0:
        return jnp.tanh(h)
    if variant == 1:
        return jax.nn.relu(h) - 0.1 * h
    return h * (1.0 / (1.0 + jnp.exp(-h)))  # a sigmoid-gated unit written out


def _apply(block: Block, p: dict[str, jax.Array], h: jax.Array,
           tokens: jax.Array) -> jax.Array:
    """``block`` on the activations ``h`` (``[batch, width]``); ``tokens``: the batch's ints."""
    batch, width = h.shape
    kind, variant = block.kind, block.variant
    if kind == "dense":
        if variant == 1:
            return jnp.einsum("bi,io->bo", h, p["w"]) + p["b"]
        if variant == 2:  # bfloat16 parameters, float32 accumulation
            out = jax.lax.dot_general(h.astype(jnp.bfloat16), p["w"], (((1,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)
            return out + p["b"].astype(jnp.float32)
        return h @ p["w"] + p["b"]
    if kind == "act":
        return _act(variant, h)
    if kind == "layernorm":
        mean = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
        return (h - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["shift"]
    if kind == "softmax":
        return jax.nn.softmax(h, axis=-1) * p["scale"] * width + p["shift"]
    if kind == "permute":
        k = block.size if width % block.size == 0 else 1
        return h.reshape(batch, width // k, k).transpose(0, 2, 1).reshape(batch, width)
    if kind == "concat":
        return jnp.concatenate([h, _act(variant, h)], axis=-1) @ p["w"]
    if kind == "slice":
        half = width // 2
        left, right = h[:, :half], h[:, half:]
        return jnp.concatenate([left, right + jnp.tanh(left @ p["w"])], axis=-1)
    if kind == "embed":
        rows = jnp.take(p["table"], tokens, axis=0) if variant else p["table"][tokens]
        return h + rows
    if kind == "scatter":
        cols = tokens % width
        return h.at[jnp.arange(batch), cols].add(p["v"] * h[:, 0])
    if kind == "batchnorm":
        mean = jnp.mean(h, axis=0, keepdims=True)
        var = jnp.var(h, axis=0, keepdims=True)
        return (h - mean) * jax.lax.rsqrt(var + 1e-3) * p["scale"] + p["shift"]
    if kind == "conv":
        channels = p["kernel"].shape[1]
        x = h.reshape(batch, width // channels, channels)
        y = jax.lax.conv_general_dilated(x, p["kernel"], (1,), "SAME",
                                         dimension_numbers=("NWC", "WIO", "NWC"))
        return h + y.reshape(batch, width)
    if kind == "scan":
        def body(carry: jax.Array, wb: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
            w, b = wb
            return _act(variant, carry @ w + b), None
        out, _ = jax.lax.scan(body, h, (p["ws"], p["bs"]))
        return out
    if kind == "cond":
        def wide(x: jax.Array) -> jax.Array:
            return jnp.tanh(x @ p["w"] + p["b"])

        def narrow(x: jax.Array) -> jax.Array:
            return x @ p["w"] * 0.5
        # an integer predicate: a float one near its threshold flips with summation order
        return jax.lax.cond(jnp.sum(tokens) % 2 == 0, wide, narrow, h)
    if kind == "remat":
        @jax.checkpoint
        def inner(x: jax.Array) -> jax.Array:
            y = checkpoint_name(x @ p["w"] + p["b"], "dense_out")
            return _act(variant, y)
        return inner(h)
    raise ValueError(f"unknown block kind {kind!r}; valid: {', '.join(BLOCK_KINDS)}")


def _optimizer(name: str) -> optax.GradientTransformation:
    if name == "sgd":
        return optax.sgd(LEARNING_RATE)
    if name == "momentum":
        return optax.sgd(LEARNING_RATE, momentum=0.9)
    return optax.adam(LEARNING_RATE * 0.2, eps=1e-3)  # eps: updates stay smooth in grads


def build(spec: ProgramSpec) -> BuiltProgram:
    """The train step, initial state and batches of ``spec``."""
    width = spec.width
    keys = jax.random.split(jax.random.key(spec.seed), len(spec.blocks) + 2)
    params: dict[str, Any] = {
        "blocks": [_block_params(b, width, k) for b, k in zip(spec.blocks, keys, strict=False)],
        "head": _normal(keys[-1], (width, width), 1.0 / math.sqrt(width)),
    }
    opt = _optimizer(spec.optimizer)
    blocks = spec.blocks

    def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
        h = batch["x"]
        for block, p in zip(blocks, params["blocks"], strict=True):
            h = _apply(block, p, h, batch["tokens"])
        out = h @ params["head"]
        if spec.loss == "xent":
            logp = jax.nn.log_softmax(out, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][:, None], axis=-1))
        return jnp.mean(jnp.square(out - batch["y"]))

    def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[Any, jax.Array]:
        loss, grads = autopar.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt": opt_state}, loss

    def batches(i: int) -> dict[str, jax.Array]:
        kx, ky, kt, kl = jax.random.split(jax.random.key(1000 * spec.seed + 17 + i), 4)
        return {"x": jax.random.normal(kx, (spec.batch, width)),
                "y": jax.random.normal(ky, (spec.batch, width)),
                "tokens": jax.random.randint(kt, (spec.batch,), 0, VOCAB),
                "labels": jax.random.randint(kl, (spec.batch,), 0, width)}

    state = {"params": params, "opt": opt.init(params)}
    return BuiltProgram(spec, step, state, batches)


def smaller(spec: ProgramSpec) -> list[ProgramSpec]:
    """Specs one step simpler than ``spec``, simplest first: a block dropped, the optimizer
    made SGD, the loss made MSE, the batch made 8 (what shrinking tries)."""
    out = [replace(spec, blocks=spec.blocks[:i] + spec.blocks[i + 1:])
           for i in range(len(spec.blocks))]
    if spec.optimizer != "sgd":
        out.append(replace(spec, optimizer="sgd"))
    if spec.loss != "mse":
        out.append(replace(spec, loss="mse"))
    if spec.batch != 8:
        out.append(replace(spec, batch=8))
    return out


def shrink(spec: ProgramSpec, fails: Callable[[ProgramSpec], bool],
           max_tries: int = 60) -> ProgramSpec:
    """The smallest spec found from ``spec`` (greedily, one :func:`smaller` step at a time)
    on which ``fails`` still holds; ``fails(spec)`` is assumed true."""
    tries = 0
    current = spec
    progress = True
    while progress and tries < max_tries:
        progress = False
        for candidate in smaller(current):
            tries += 1
            if fails(candidate):
                current, progress = candidate, True
                break
            if tries >= max_tries:
                break
    return current


def leaves(tree: Any) -> list[np.ndarray]:
    """A state's array leaves, on the host."""
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
