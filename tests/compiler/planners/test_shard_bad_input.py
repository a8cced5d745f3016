"""ShardParallel's answers to input no plan can satisfy: an impossible memory budget and a mesh
axis that divides no tensor (a solver stopped by its time limit: tests/test_ilp.py)."""

import re

import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar.cli.main import main
from autopar.compiler.intra_op.problem import InfeasibleMemoryError

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


def mlp_step(params, batch):
    def loss(p):
        h = jnp.tanh(batch["x"] @ p["w1"])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, params, grads), value


def mlp_inputs(hidden=64, tokens=32):
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (hidden, 2 * hidden)),
              "w2": jax.random.normal(k[1], (2 * hidden, hidden))}
    batch = {"x": jax.random.normal(k[2], (tokens, hidden)),
             "y": jax.random.normal(k[3], (tokens, hidden))}
    return params, batch


def shard(mesh_shape, **options):
    n = 1
    for s in mesh_shape:
        n *= s
    method = autopar.ShardParallel(mesh_shape=mesh_shape, **options)
    return autopar.parallelize(mlp_step, method=method, devices=jax.devices()[:n])


def test_infeasible_budget_names_the_smallest_memory_and_that_memory_is_enough():
    params, batch = mlp_inputs()
    params_bytes = 2 * 64 * 128 * 4
    # far below: answered from the floor (every tensor split over all four devices), before
    # any ILP is built; the floor holds at least the parameters' quarter each
    with pytest.raises(InfeasibleMemoryError) as err:
        shard((4,), memory_budget_bytes=1024).get_plan(params, batch)
    assert isinstance(err.value, autopar.AutoparError)
    message = str(err.value)
    assert "\n" not in message
    assert re.search(r"no sharding plan fits in 1\.00 KiB per device; with every tensor split "
                     r"over all 4 devices the step still needs [\d.]+ KiB", message), message
    floor = err.value.min_peak_bytes
    assert err.value.split_over == 4 and params_bytes / 4 <= floor
    # at it, the mesh's own floor answers: each tensor split as far as its dimensions divide
    # the mesh, above the first (some of the step's tensors have no dimension four divides)
    with pytest.raises(InfeasibleMemoryError) as err:
        shard((4,), memory_budget_bytes=floor).get_plan(params, batch)
    assert "as far as its dimensions divide (mesh 4), the step still needs" in str(err.value)
    assert err.value.split_over == 4 and err.value.mesh_shape == (4,)
    assert floor < err.value.min_peak_bytes
    floor = err.value.min_peak_bytes
    # at the floor the ILP runs: its least-memory plan states the smallest memory any plan
    # needs, at or above the floor; the memory model is conservative (it counts a merged
    # variable's tensors as live together) but far below holding every tensor of the step whole
    with pytest.raises(InfeasibleMemoryError) as err:
        shard((4,), memory_budget_bytes=floor).get_plan(params, batch)
    assert re.search(r"the smallest per-device memory any plan needs is [\d.]+ KiB",
                     str(err.value)), str(err.value)
    need = err.value.min_peak_bytes
    assert err.value.split_over is None and floor <= need < 4 * params_bytes
    # the stated minimum is exact: it is enough, and a little less is not
    plan = shard((4,), memory_budget_bytes=need).get_plan(params, batch)
    assert plan.stages[0].input_shardings["params/w1"].to_string() != "P(None, None)"
    with pytest.raises(InfeasibleMemoryError):
        shard((4,), memory_budget_bytes=need * 0.99).get_plan(params, batch)


def test_cli_infeasible_budget_is_one_line_and_exit_2(capsys):
    argv = ["compile", "--model", "mlp", "--method", "shard", "--devices", "8", "--mesh", "2x4",
            "--memory-budget", "1e-6", "--no-hlo"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no sharding plan fits in" in err[0] and "still needs" in err[0]


def test_a_mesh_axis_that_divides_nothing_replicates_with_a_note():
    def step(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    w = jnp.ones((5, 3))
    x = jnp.ones((7, 5))
    method = autopar.ShardParallel(mesh_shape=(2,))
    par = autopar.parallelize(step, method=method, devices=jax.devices()[:2])
    plan = par.get_plan(w, x)
    assert any("mesh axis" in n and "splits no tensor" in n for n in plan.notes), plan.notes
    assert {s.to_string() for s in plan.stages[0].input_shardings.values()} == {"P(None, None)"}
    assert float(par(w, x)) == pytest.approx(float(jax.jit(step)(w, x)))
