"""Two small models written the ordinary Flax way (nothing here knows autopar's planner):
a linen CNN with dropout trained from a ``TrainState``, and an NNX transformer block trained
functionally from ``nnx.split`` state. Their train steps differentiate with
``autopar.value_and_grad``, which is ``jax.value_and_grad`` under plain ``jax.jit``."""

import jax
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
