"""Every primitive JAX can emit has sharding strategies or a written reason to run
replicated: the primitives ``jax.lax`` defines, and those ``jnp``, ``jax.nn`` and autodiff
emit on the functions model code uses, walked the way autopar traces a step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive

from autopar.compiler.intra_op.strategies import registry
from autopar.compiler.intra_op.strategies.coverage import REPLICATED_BY_DESIGN
from autopar.ir.flatten import flatten_step
from tests.support.repo_paths import REPO


def lax_primitives() -> set[str]:
    return {v.name for v in vars(jax.lax).values() if isinstance(v, Primitive)}


def model_code(x, w, idx):
    """What model code calls: attention, norms, activations, rotary tables, losses."""
    h = jnp.einsum("bd,de->be", x, w)
    h = jax.nn.gelu(h) + jax.nn.silu(h) + jax.nn.relu(h) + jax.nn.sigmoid(h)
    h = h * jax.lax.rsqrt(jnp.mean(h**2, axis=-1, keepdims=True) + 1e-6)
    h = (h - h.mean(-1, keepdims=True)) / (h.std(-1, keepdims=True) + 1e-5)
    cos, sin = jnp.cos(h), jnp.sin(h)
    rot = jnp.stack([h * cos, h * sin], axis=-1).reshape(h.shape[0], -1)
    a, b = jnp.unstack(rot.reshape(h.shape[0], -1, 2), axis=-1)
    h = jnp.concatenate([a, b], axis=-1)[:, : w.shape[1]]
    mask = jnp.tril(jnp.ones((h.shape[0], h.shape[0]), bool))
    scores = jnp.where(mask, h @ h.T, -1e9)
    h = jax.nn.softmax(scores, axis=-1) @ h
    h = jnp.tile(h, (1, 2))[:, : w.shape[1]] + jnp.roll(h, 1, axis=0)
    h = jnp.pad(h, ((0, 0), (1, 1)))[:, 1:-1] + jnp.cumsum(h, axis=0)
    h = jnp.clip(h, -3.0, 3.0) + jnp.take(w, idx, axis=0)[:, : h.shape[1]]
    top, _ = jax.lax.top_k(h, 2)
    order = jnp.argsort(h, axis=-1)
    logits = jax.nn.log_softmax(h, axis=-1)
    onehot = jax.nn.one_hot(idx, h.shape[1])
    loss = -jnp.mean(jnp.sum(onehot * logits, -1)) + jnp.mean(top) + 1e-3 * jnp.mean(order)
    loss += jnp.mean(jax.nn.logsumexp(h, axis=-1)) + jnp.linalg.norm(h) * 1e-3
    keep = jax.random.bernoulli(jax.random.key(0), 0.9, h.shape)
    return loss + jnp.mean(jnp.where(keep, h, 0.0)) + jnp.max(jax.lax.erf(h))


def emitted_primitives() -> set[str]:
    args = (jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 16),
            jnp.float32), jax.ShapeDtypeStruct((8,), jnp.int32))

    def forward_and_backward(x, w, idx):
        return jax.value_and_grad(model_code, argnums=(0, 1))(x, w, idx)

    program = flatten_step(forward_and_backward, args)
    return {e.name for e in program.eqns}


def test_every_lax_primitive_has_strategies_or_a_reason():
    known = set(registry())
    missing = sorted(lax_primitives() - known - set(REPLICATED_BY_DESIGN))
    assert not missing, f"no strategies and no reason to run replicated: {missing}"
    stale = sorted(known & set(REPLICATED_BY_DESIGN))
    assert not stale, f"strategies exist, but a reason to run replicated is still listed: {stale}"


def test_what_model_code_emits_is_covered():
    emitted = emitted_primitives()
    # the battery really reaches the primitives this test is about
    assert {"stack", "unstack", "tile", "dot_general", "sort", "top_k"} <= emitted, emitted
    missing = sorted(emitted - set(registry()) - set(REPLICATED_BY_DESIGN))
    assert not missing, f"emitted with no strategies and no reason: {missing}"


def test_the_docs_table_lists_every_primitive_run_replicated_on_purpose():
    text = (REPO / "docs" / "intra-op.md").read_text()
    absent = [name for name in REPLICATED_BY_DESIGN if f"`{name}`" not in text]
    assert not absent, f"docs/intra-op.md does not list {absent}"
