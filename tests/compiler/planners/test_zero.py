"""Zero2Parallel and Zero3Parallel: the serial step's numbers, the state really sharded, and the
communication the plan predicts set beside what XLA compiled.

XLA on CPU (jax 0.10.2) never emits a ``reduce-scatter`` opcode: a gradient constrained to a
sharded layout is all-reduced (one tuple-shaped all-reduce for all of them) and each device
slices its part out. The checks therefore compare the plan's reduce-scatter + all-reduce bytes
with the HLO's all-reduce + reduce-scatter bytes, and show the scatter by the sharded layouts
of what the update produced.
"""

import functools

import jax
import numpy as np
import pytest
from serial_reference import serial_run as serial_losses_and_state

import autopar
from autopar.compiler.cost.memory_model import BREAKDOWN_KEYS
from autopar.errors import BatchSizeError
from autopar.method_builders import method_from_name
from autopar.methods import Zero2Parallel, Zero3Parallel
from autopar.models import get_model
from autopar.plan import Plan
from autopar.runtime.hlo import count_collectives, parse_collectives
from autopar.runtime.shard import ShardedProgram

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

STEPS = 3
# fraction of the learning rate parameters may differ by after 3 Adam steps (as in
# test_shard_numerics; see ZooModel.optimizer)
PARAM_ATOL_IN_LR = 2e-3
METHODS = {2: Zero2Parallel, 3: Zero3Parallel}


@functools.cache
def serial_run(name, vocab_size=None):
    return serial_losses_and_state(tiny(name, vocab_size), STEPS)


def tiny(name, vocab_size=None):
    """The tiny zoo model; GPT with another vocabulary when ``vocab_size`` is given."""
    return get_model(name, "tiny", **({} if vocab_size is None else {"vocab_size": vocab_size}))


def kinds(plan: Plan) -> dict[str, tuple[int, float]]:
    """The plan's predicted collectives: kind -> (count, bytes)."""
    return {c.kind.value: (c.count, c.nbytes) for c in plan.stages[0].collectives}


def is_split_eightfold(leaf: jax.Array) -> bool:
    """Each device holds 1/8 of the leaf (and there are 8 devices)."""
    shard = leaf.addressable_shards[0].data
    return len(leaf.sharding.device_set) == 8 and shard.size * 8 == leaf.size


def divisible(leaf) -> bool:
    return any(d % 8 == 0 for d in leaf.shape)


# GPT with a 32-token vocabulary: its embedding table (8 KiB) is smaller than the batch's
# lookup gradient (33 KiB), so the plan reduce-scatters the table's second gradient rather than
# gathering the batch (the 256-token default goes the other way)
@pytest.mark.parametrize(
    "name, stage, mesh, vocab",
    [("mlp", 2, (8,), None), ("mlp", 3, (2, 4), None), ("gpt", 2, (2, 4), None),
     ("gpt", 3, (8,), 32), ("moe", 2, (4, 2), None)],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_zero_equals_serial_and_shards_the_state(name, stage, mesh, vocab):
    model = tiny(name, vocab)
    step = autopar.parallelize(model.train_step, method=METHODS[stage](mesh_shape=mesh))
    ref_losses, ref_leaves = serial_run(name, vocab)
    state = par = model.init_state(jax.random.key(0))
    for i in range(STEPS):
        batch = model.make_batch(jax.random.key(10 + i))
        par, loss = step(par, batch)
        assert float(loss) == pytest.approx(ref_losses[i], rel=1e-5, abs=1e-6)
    atol = PARAM_ATOL_IN_LR * model.config.learning_rate
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(par)]
    for path, want, got in zip(paths, ref_leaves, jax.tree_util.tree_leaves(par), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol, err_msg=path)

    # the optimizer state the step returned is cut in eight; parameters are whole (ZeRO-2) or
    # cut too (ZeRO-3)
    adam = par["opt_state"][0]
    moments = jax.tree_util.tree_leaves((adam.mu, adam.nu))
    assert all(is_split_eightfold(m) for m in moments if divisible(m))
    params = [p for p in jax.tree_util.tree_leaves(par["params"]) if divisible(p)]
    if stage == 2:
        assert all(p.addressable_shards[0].data.shape == p.shape for p in params)
    else:
        assert all(is_split_eightfold(p) for p in params)

    # communication: the plan's prediction against the compiled program
    plan = step.get_plan(state, batch)
    assert plan.method == f"zero{stage}"
    predicted = kinds(plan)
    assert set(predicted) == {"all-reduce", "reduce-scatter", "all-gather"}
    hlo = count_collectives(step.get_hlo_text(state, batch))
    assert hlo.count("all-to-all") == 0 and hlo.count("collective-permute") == 0
    summed = predicted["all-reduce"][1] + predicted["reduce-scatter"][1]
    assert hlo.bytes("all-reduce") + hlo.bytes("reduce-scatter") == summed
    assert (hlo.count("all-gather"), hlo.bytes("all-gather")) == predicted["all-gather"]
    # every parameter's summed gradient is scattered once, and every parameter is gathered
    # once: after the update (ZeRO-2) or for the forward and backward together (ZeRO-3)
    param_shapes = [p.shape for p in jax.tree_util.tree_leaves(par["params"])]
    param_bytes = sum(p.nbytes for p in jax.tree_util.tree_leaves(par["params"]))
    gathered = [c.result_shapes[0][1] for c in parse_collectives(step.get_hlo_text(state, batch))
                if c.kind == "all-gather"]
    if "wte" not in par["params"]:
        assert predicted["reduce-scatter"][1] == param_bytes
        assert sorted(gathered) == sorted(param_shapes)
    elif vocab is None:
        # GPT's and MoE's tied token embedding gets a second gradient from its lookup:
        # scattering the batch's (8, 16) ids into the sharded (256, 64) table, the batch's ids
        # and (8, 16, 64) updates are gathered and each device scatters into its own rows
        assert predicted["reduce-scatter"][1] == param_bytes
        assert sorted(gathered) == sorted(param_shapes + [(8, 16, 1), (8, 16, 64)])
    else:
        # ... and with the small table, that second gradient is reduce-scattered as well
        assert predicted["reduce-scatter"][1] == param_bytes + par["params"]["wte"].nbytes
        assert sorted(gathered) == sorted(param_shapes)

    # per-device bytes of the compiled program's arguments are the plan's params + optimizer
    # state + batch shares
    memory = plan.stages[0].memory_breakdown
    flat = jax.tree_util.tree_leaves((state, batch))
    program = ShardedProgram(step.get_traced(state, batch).program, plan)
    analysis = program.compiled(flat).memory_analysis()
    if analysis is not None:
        assert analysis.argument_size_in_bytes == (
            memory["parameters"] + memory["optimizer_state"] + memory["batch"])


@pytest.mark.parametrize("name", ["mlp", "gpt", "moe", "wresnet"])
def test_parameters_and_optimizer_state_are_told_apart_from_the_graph(name):
    # the rule reads the graph, not the names; the names show it got every leaf right
    model = get_model(name, "tiny")
    step = autopar.parallelize(model.train_step, method=autopar.Zero2Parallel())
    plan = step.get_plan(*model.abstract_inputs())
    specs = plan.stages[0].input_shardings
    state_leaves = [
        ("state/" + jax.tree_util.keystr(path, simple=True, separator="/"), leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(model.abstract_state())
    ]
    for key, leaf in state_leaves:
        spec = specs[key]
        if key.startswith("state/params/"):
            assert spec.is_replicated, key
        elif divisible(leaf):
            # Adam's moments, and Wide-ResNet's batch-norm running statistics: the loss does
            # not read them
            assert spec.num_shards({"x": 8}) == 8, key
        else:
            assert spec.is_replicated, key  # the step count
    memory = plan.stages[0].memory_breakdown
    assert set(memory) == set(BREAKDOWN_KEYS)
    other = [leaf for key, leaf in state_leaves if not key.startswith("state/params/")]
    # every divisible leaf cut in eight; the step count whole
    assert memory["optimizer_state"] == sum(
        leaf.size * leaf.dtype.itemsize // (8 if divisible(leaf) else 1) for leaf in other)


def test_zero3_plan_round_trips_and_names_work():
    model = get_model("mlp", "tiny")
    plan = autopar.parallelize(model.train_step, method=autopar.Zero3Parallel(mesh_shape=(2, 4))
                               ).get_plan(*model.abstract_inputs())
    again = Plan.from_json(plan.to_json())
    assert again.to_dict() == plan.to_dict()
    assert again.stages[0].operand_shardings  # the parameters' gathers at their uses
    assert method_from_name("zero2", (2, 4)) == Zero2Parallel(mesh_shape=(2, 4))
    assert method_from_name("zero3") == Zero3Parallel()
    memory = plan.stages[0].memory_breakdown
    whole = sum(leaf.size * leaf.dtype.itemsize
                for leaf in jax.tree_util.tree_leaves(model.abstract_state()["params"]))
    assert memory["parameters"] <= whole / 4  # the kernels cut in eight, small biases whole


def test_indivisible_batch_is_a_batch_size_error():
    model = get_model("mlp", "tiny", batch_size=12)
    step = autopar.parallelize(model.train_step, method=autopar.Zero3Parallel())
    with pytest.raises(BatchSizeError, match=r"leading dimension 12, not divisible by .* 8"):
        step.get_plan(*model.abstract_inputs())


def momentum_step(params, velocity, stats, batch):
    """A hand-written step outside the zoo: SGD with momentum, state in three arguments, two of
    them look-alike pytrees, so only the graph tells the parameters from the velocity. The
    forward centres the hidden layer on its batch mean, which the step also keeps a running
    average of (as batch norm does): a summed value both the forward and the update read."""

    def loss_fn(p):
        h = batch["x"] @ p["w1"]
        mean = jax.numpy.mean(h, axis=0)
        out = jax.numpy.tanh(h - mean) @ p["w2"]
        return jax.numpy.mean((out - batch["y"]) ** 2), mean

    (loss, mean), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    velocity = jax.tree_util.tree_map(lambda v, g: 0.9 * v + g, velocity, grads)
    params = jax.tree_util.tree_map(lambda p, v: p - 0.05 * v, params, velocity)
    return params, velocity, 0.9 * stats + 0.1 * mean, loss


@pytest.mark.parametrize("stage", [2, 3])
def test_a_hand_written_step_with_state_in_three_arguments(stage):
    keys = jax.random.split(jax.random.key(1), 4)
    params = {"w1": jax.random.normal(keys[0], (16, 32)) / 4,
              "w2": jax.random.normal(keys[1], (32, 8)) / 6}
    velocity = jax.tree_util.tree_map(jax.numpy.zeros_like, params)
    state = (params, velocity, jax.numpy.zeros(32))
    batches = [{"x": jax.random.normal(jax.random.fold_in(keys[2], i), (16, 16)),
                "y": jax.random.normal(jax.random.fold_in(keys[3], i), (16, 8))}
               for i in range(STEPS)]
    step = autopar.parallelize(momentum_step, method=METHODS[stage](), batch_argnums=(3,))
    ref = par = state
    for batch in batches:
        *ref, ref_loss = jax.jit(momentum_step)(*ref, batch)
        *par, loss = step(*par, batch)
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    for want, got in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(par),
                         strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    new_params, new_velocity, new_stats = par
    assert all(is_split_eightfold(v) for v in jax.tree_util.tree_leaves((new_velocity,
                                                                        new_stats)))
    for p in jax.tree_util.tree_leaves(new_params):
        whole = p.addressable_shards[0].data.shape == p.shape
        assert is_split_eightfold(p) if stage == 3 else whole
    # the batch mean is summed whole for the forward and sliced for the running average: the
    # only gathers are the two parameters' (nothing leaks back into the forward)
    plan = step.get_plan(*state, batches[0])
    predicted = kinds(plan)
    hlo = count_collectives(step.get_hlo_text(*state, batches[0]))
    assert predicted["all-gather"] == (2, 16 * 32 * 4 + 32 * 8 * 4)
    assert (hlo.count("all-gather"), hlo.bytes("all-gather")) == predicted["all-gather"]
    assert hlo.bytes("all-reduce") == predicted["all-reduce"][1] + predicted["reduce-scatter"][1]
