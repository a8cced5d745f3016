"""Whether a loss function treats its examples apart (``graph.batch_coupling``), and the
pipeline refusing one that does not: found by the differential campaign (a batch-norm block and
a branch on the batch's token sum ran under PipeshardParallel with losses 2-15% off the serial
step's, silently)."""

import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar.compiler.graph.batch_coupling import coupled_examples
from autopar.compiler.graph.trace import trace_step
from autopar.errors import BatchSizeError, CoupledBatchError

B, W = 8, 4


def _where(loss_fn):
    params = {"w": jnp.ones((W, W))}
    batch = {"x": jnp.ones((B, W)), "labels": jnp.zeros((B,), jnp.int32)}
    graph = trace_step(loss_fn, (params, batch)).graph
    split = [io.tensor for io in graph.inputs
             if io.arg_index == 1 and graph.tensors[io.tensor].ndim]
    return coupled_examples(graph, split)


def _mse(p, b):
    return jnp.mean(jnp.square(jnp.tanh(b["x"] @ p["w"])))


def _xent(p, b):
    logp = jax.nn.log_softmax(b["x"] @ p["w"], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, b["labels"][:, None], axis=-1))


def _two_terms(p, b):  # a sum of means, each scaled: still a mean over examples
    h = b["x"] @ p["w"]
    return 0.5 * jnp.mean(h) + jnp.sum(jnp.square(h)) / (B * W) - 1.0


def _batch_norm(p, b):
    h = b["x"] @ p["w"]
    h = (h - h.mean(axis=0)) / jnp.sqrt(h.var(axis=0) + 1e-3)
    return jnp.mean(jnp.square(h))


def _branch_on_batch(p, b):
    h = b["x"] @ p["w"]
    return jax.lax.cond(jnp.sum(b["labels"]) % 2 == 0, jnp.mean, jnp.sum, h)


def _log_of_mean(p, b):
    return jnp.log(jnp.mean(jnp.exp(b["x"] @ p["w"])))


def _product_of_means(p, b):
    h = b["x"] @ p["w"]
    return jnp.mean(h) * jnp.mean(jnp.square(h))


def _sorted_over_batch(p, b):
    return jnp.mean(jnp.sort(b["x"] @ p["w"], axis=0)[: B // 2])


def _sliced_per_example(p, b):  # a gather and a concatenation the batch split cannot follow
    h = b["x"] @ p["w"]
    picked = jnp.take(h, jnp.array([1]), axis=1)
    return jnp.mean(jnp.concatenate([picked, jnp.zeros((B, 1)) + 1.0], axis=1))


def _divide_no_nan(p, b):  # Keras's mean: where(count == 0, 0, sum / count)
    total, count = jnp.sum(jnp.square(b["x"] @ p["w"])), jnp.float32(B * W)
    return jnp.where(count == 0, 0.0, total / count)


def _branch_on_a_batch_sum(p, b):
    total = jnp.sum(b["x"] @ p["w"])
    return jnp.where(total > 0, total, -total) / B


@pytest.mark.parametrize("loss_fn", [_mse, _xent, _two_terms, _sliced_per_example,
                                     _divide_no_nan],
                         ids=lambda f: f.__name__)
def test_means_over_examples_are_not_coupled(loss_fn):
    assert _where(loss_fn) is None


@pytest.mark.parametrize("loss_fn, op", [
    (_batch_norm, "per-example value"), (_branch_on_batch, "rem"), (_log_of_mean, "log"),
    (_product_of_means, "mul"), (_sorted_over_batch, "sort runs along the batch"),
    (_branch_on_a_batch_sum, "gt"),
], ids=lambda x: getattr(x, "__name__", x))
def test_batch_statistics_are_found(loss_fn, op):
    where = _where(loss_fn)
    assert where is not None and op in where


def _step(loss_fn):
    def step(state, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(state, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads), loss
    state = {"w": jnp.eye(W)}
    batch = {"x": jax.random.normal(jax.random.key(0), (B, W)),
             "labels": jnp.arange(B, dtype=jnp.int32) % W}
    return step, state, batch


@pytest.mark.e2e
def test_a_pipeline_refuses_a_batch_statistic_in_one_line():
    step, state, batch = _step(_batch_norm)
    method = autopar.PipeshardParallel(num_microbatches=2, num_stages=2)
    parallel = autopar.parallelize(step, method=method, cache=False)
    with pytest.raises(CoupledBatchError) as err:
        parallel(state, batch)
    assert isinstance(err.value, BatchSizeError)
    text = str(err.value)
    assert "\n" not in text and "num_microbatches=1" in text and "mixes the examples" in text
    assert "per_microbatch_statistics=True" in text


@pytest.mark.e2e
def test_one_microbatch_and_the_full_search_still_plan_it():
    step, state, batch = _step(_batch_norm)
    want_state, want_loss = jax.jit(step)(state, batch)
    one = autopar.PipeshardParallel(num_microbatches=1, num_stages=1)
    for method in (one, autopar.AutoParallel(measure_candidates=0)):
        parallel = autopar.parallelize(step, method=method, cache=False)
        got_state, got_loss = parallel(state, batch)
        assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5)
        assert jnp.allclose(got_state["w"], want_state["w"], rtol=1e-5, atol=1e-6)
    plan = parallel.get_plan(state, batch)
    assert plan.method != "pipeshard"
    assert any("mixes the examples" in note for note in plan.notes)


def test_the_option_is_a_flag():
    with pytest.raises(autopar.InvalidOptionError, match="per_microbatch_statistics"):
        autopar.PipeshardParallel(per_microbatch_statistics="yes")
    with pytest.raises(autopar.InvalidOptionError, match="per_microbatch_statistics"):
        autopar.AutoParallel(per_microbatch_statistics=1)
