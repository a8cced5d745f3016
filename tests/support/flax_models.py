"""Small models written the ordinary Flax way (nothing here knows autopar's planner): a linen
CNN with dropout trained from a ``TrainState``, and an NNX transformer block trained
functionally from ``nnx.split`` state, whose train steps differentiate with
``autopar.value_and_grad`` (``jax.value_and_grad`` under plain ``jax.jit``); and small language
models whose layers run under ``nn.scan`` / ``nnx.scan`` (``scan_lm_setup``)."""

import jax
import jax.numpy as jnp
import optax
from flax import linen, nnx
from flax.training import train_state

import autopar

BATCH = 16


class LinenCNN(linen.Module):
    """conv -> relu -> conv -> relu -> pool -> dropout -> dense."""

    classes: int = 10
    dropout: float = 0.2

    @linen.compact
    def __call__(self, x, train: bool):
        x = linen.relu(linen.Conv(8, (3, 3))(x))
        x = linen.relu(linen.Conv(16, (3, 3))(x))
        x = x.mean(axis=(1, 2))
        x = linen.Dropout(self.dropout, deterministic=not train)(x)
        return linen.Dense(self.classes)(x)


def linen_optimizer() -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=2, decay_steps=20)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-4))


def linen_setup(dropout: float = 0.2) -> tuple[train_state.TrainState, dict, jax.Array]:
    """A TrainState, a batch and a typed PRNG key for dropout."""
    model = LinenCNN(dropout=dropout)
    kx, ky, kinit = jax.random.split(jax.random.key(0), 3)
    batch = {"image": jax.random.normal(kx, (BATCH, 8, 8, 3)),
             "label": jax.random.randint(ky, (BATCH,), 0, 10)}
    params = model.init(kinit, batch["image"][:1], train=False)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=linen_optimizer())
    return state, batch, jax.random.key(7)


def linen_train_step(state: train_state.TrainState, batch: dict, key: jax.Array):
    dropout_key = jax.random.fold_in(key, state.step)

    def loss_fn(params, batch):
        logits = state.apply_fn({"params": params}, batch["image"], train=True,
                                rngs={"dropout": dropout_key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss, grads = autopar.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), loss


class NNXBlock(nnx.Module):
    """Embedding -> one pre-norm transformer block -> vocabulary head."""

    def __init__(self, rngs: nnx.Rngs, vocab: int = 32, dim: int = 16, heads: int = 2):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        # no q/k/v biases: a key bias shifts every logit of a row equally, so its gradient is
        # zero up to rounding, and Adam turns that rounding noise into full-size steps
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False,
                                           use_bias=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        n = self.norm1(x)
        x = x + self.attn(n, n, n, mask=nnx.make_causal_mask(tokens))
        x = x + self.down(jax.nn.gelu(self.up(self.norm2(x))))
        return self.head(x)


NNX_OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))


def nnx_setup() -> tuple[nnx.GraphDef, dict, dict]:
    """The model's graph definition, the train state ``{params, opt}`` and a batch."""
    model = NNXBlock(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (BATCH, 9), 0, 32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return graphdef, {"params": params, "opt": NNX_OPT.init(params)}, batch


def make_nnx_train_step(graphdef: nnx.GraphDef):
    def train_step(state: dict, batch: dict):
        def loss_fn(params, batch):
            logits = nnx.merge(graphdef, params)(batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["targets"]).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt = NNX_OPT.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    return train_step


# -- layers under scan: Flax linen ``nn.scan`` (optionally ``nn.remat`` around the block) and
# NNX ``nnx.scan`` over ``nnx.vmap``-stacked blocks; plain ``jax.value_and_grad`` steps --------

SCAN_LAYERS = 2


class LinenScanBlock(linen.Module):
    """A pre-norm transformer block in ``nn.scan``'s ``(carry, x) -> (carry, y)`` form."""

    dim: int
    heads: int = 2

    @linen.compact
    def __call__(self, x, _):
        n = linen.LayerNorm()(x)
        mask = linen.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + linen.MultiHeadDotProductAttention(num_heads=self.heads, use_bias=False)(
            n, n, mask=mask)
        h = linen.Dense(4 * self.dim)(linen.LayerNorm()(x))
        return x + linen.Dense(self.dim)(jax.nn.gelu(h)), None


class LinenScanLM(linen.Module):
    """Embedding -> ``SCAN_LAYERS`` blocks under ``nn.scan`` -> vocabulary head."""

    vocab: int = 32
    dim: int = 16
    remat: bool = False

    @linen.compact
    def __call__(self, tokens):
        x = linen.Embed(self.vocab, self.dim)(tokens)
        block = linen.remat(LinenScanBlock, prevent_cse=False) if self.remat else LinenScanBlock
        x, _ = linen.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                          length=SCAN_LAYERS)(self.dim)(x, None)
        return linen.Dense(self.vocab)(x)


class NNXScanBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dim: int = 16, heads: int = 2):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False,
                                           use_bias=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x):
        n = self.norm1(x)
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(n, n, n, mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class NNXScanLM(nnx.Module):
    """Embedding -> ``SCAN_LAYERS`` blocks made by ``nnx.vmap``, run by ``nnx.scan`` -> head."""

    def __init__(self, rngs: nnx.Rngs, vocab: int = 32, dim: int = 16):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)

        @nnx.split_rngs(splits=SCAN_LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return NNXScanBlock(rngs, dim)

        self.blocks = make_blocks(rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return self.head(run(self.embed(tokens), self.blocks))


SCAN_OPT = optax.adam(1e-2, eps=1e-3)


def scan_lm_setup(kind: str):
    """``(train_step, state, batch)`` of a scanned LM: ``kind`` is ``linen``, ``linen-remat``
    (``nn.remat`` around the scanned block) or ``nnx``. The step differentiates with plain
    ``jax.value_and_grad`` (the default search plans it as one stage)."""
    tokens = jax.random.randint(jax.random.key(1), (BATCH, 9), 0, 32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if kind == "nnx":
        graphdef, params = nnx.split(NNXScanLM(nnx.Rngs(0)), nnx.Param)

        def apply(p, x):
            return nnx.merge(graphdef, p)(x)
    else:
        model = LinenScanLM(remat=kind == "linen-remat")
        params = model.init(jax.random.key(0), batch["inputs"])["params"]

        def apply(p, x):
            return model.apply({"params": p}, x)

    def train_step(state, batch):
        def loss_fn(params):
            return optax.softmax_cross_entropy_with_integer_labels(
                apply(params, batch["inputs"]), batch["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = SCAN_OPT.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    return train_step, {"params": params, "opt": SCAN_OPT.init(params)}, batch
