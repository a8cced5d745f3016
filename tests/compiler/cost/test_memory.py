"""Memory: the model against XLA's own memory analysis, budgets, rematerialisation.

XLA's figure for one compiled program is its arguments plus its outputs plus its temporaries
(less what outputs alias). The memory model must land within 15% of it on the zoo models;
budgets must produce plans that fit, by the model and by XLA; rematerialisation must give the
serial numbers and hold less per microbatch.
"""

import dataclasses
import math

import jax
import pytest
from memory_checks import assert_serial_numbers, xla_bytes

import autopar
from autopar.cluster import ClusterSpec, load_cluster
from autopar.compiler.cost.memory_floor import memory_floor, mesh_memory_floor, most_shards
from autopar.compiler.graph.trace import trace_step
from autopar.compiler.inter_op.remat import state_split_of_key
from autopar.compiler.intra_op.problem import InfeasibleMemoryError
from autopar.compiler.planners.dispatch import plan_traced
from autopar.frontend.planning import plan_train_step
from autopar.models import get_model
from autopar.runtime.hlo import count_collectives

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

TOLERANCE = 0.15  # the model vs XLA's memory analysis, relative


def zoo_inputs(name, **overrides):
    model = get_model(name, "tiny", **overrides)
    return model, model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(1))


# tiny at its own batch, and a "small" variant whose activations weigh more (batch 64)
CASES = [
    ("mlp", {}), ("gpt", {}), ("moe", {}), ("wresnet", {}),
    ("mlp", {"batch_size": 256}), ("gpt", {"batch_size": 64}), ("moe", {"batch_size": 64}),
    ("wresnet", {"batch_size": 64}), ("mlp", {"batch_size": 2048}),
]


@pytest.mark.parametrize("name, overrides", CASES,
                         ids=[f"{n}-{o.get('batch_size', 'tiny')}" for n, o in CASES])
def test_data_parallel_memory_matches_xla(name, overrides):
    model, state, batch = zoo_inputs(name, **overrides)
    step = autopar.parallelize(model.train_step, method=autopar.DataParallel(), cache=False)
    plan = step.get_plan(state, batch)
    measured = xla_bytes(step, state, batch)
    assert plan.peak_memory_bytes == pytest.approx(measured, rel=TOLERANCE)
    parts = plan.stages[0].memory_breakdown
    # replicated state: the parameters are state["params"], the rest is optimizer (and other)
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state["params"]))
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    assert parts["parameters"] == param_bytes
    assert parts["optimizer_state"] == state_bytes - param_bytes
    assert parts["updated_state"] == pytest.approx(
        parts["parameters"] + parts["optimizer_state"], rel=1e-3)


@pytest.mark.parametrize("name", ["mlp", "gpt", "moe"])
def test_shard_parallel_memory_matches_xla(name):
    model, state, batch = zoo_inputs(name)
    step = autopar.parallelize(model.train_step, method=autopar.ShardParallel(), cache=False)
    plan = step.get_plan(state, batch)
    assert plan.peak_memory_bytes == pytest.approx(xla_bytes(step, state, batch), rel=TOLERANCE)


def within_fraction_of_replicated(name, fraction):
    """A ShardParallel step of zoo model ``name`` whose budget is ``fraction`` of what the
    replicated (data-parallel) plan needs."""
    model, state, batch = zoo_inputs(name)
    replicated = autopar.parallelize(model.train_step, method=autopar.DataParallel(),
                                     cache=False).get_plan(state, batch).peak_memory_bytes
    budget = fraction * replicated
    step = autopar.parallelize(
        model.train_step, method=autopar.ShardParallel(memory_budget_bytes=budget), cache=False)
    return model, state, batch, step, replicated, budget


def test_budget_below_replication_still_fits():
    """Half of what the replicated (data-parallel) plan needs: the ILP shards the state, the
    plan fits by the model, and XLA's compiled program fits too."""
    model, state, batch, step, replicated, budget = within_fraction_of_replicated("gpt", 0.5)
    plan = step.get_plan(state, batch)
    assert plan.peak_memory_bytes <= budget
    assert xla_bytes(step, state, batch) <= budget
    parts = plan.stages[0].memory_breakdown
    assert parts["parameters"] < replicated / 10  # the state is sharded, not replicated
    assert_serial_numbers(step, model, 2)


def test_tight_budget_mlp_agrees_with_xla():
    model, state, batch, step, _, budget = within_fraction_of_replicated("mlp", 0.3)
    plan = step.get_plan(state, batch)
    assert plan.peak_memory_bytes <= budget
    assert plan.peak_memory_bytes == pytest.approx(xla_bytes(step, state, batch), rel=TOLERANCE)


@pytest.mark.parametrize("batch_size, dominant", [(8, "updated state"), (1024, "activations")])
def test_impossible_budget_names_the_least_and_what_dominates(batch_size, dominant):
    """A small batch leaves the (sharded) Adam state the biggest part; a big one, activations."""
    model, state, batch = zoo_inputs("mlp", batch_size=batch_size)
    traced = trace_step(model.train_step, (state, batch))
    with pytest.raises(InfeasibleMemoryError) as info:
        plan_traced(traced, autopar.ShardParallel(memory_budget_bytes=1000),
                    load_cluster("cpu-sim"))
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, autopar.AutoparError)
    assert "no sharding plan fits in 1000 B per device" in message
    # far below the floor (every tensor split over all 8 devices): answered before any ILP
    assert "with every tensor split over all 8 devices the step still needs" in message
    assert message.endswith(f"most of it {dominant}")
    assert info.value.min_peak_bytes > 1000 and info.value.split_over == 8


@pytest.mark.parametrize("name", ["mlp", "gpt", "moe"])
def test_the_memory_floor_is_under_every_plan(name):
    """``memory_floor`` (every tensor split over all the devices) is what the one-stage
    planners refuse a budget by before building an ILP: no plan may need less, whichever way
    it lays the step out (fastest, data parallel, the least memory a tight budget forces)."""
    model, state, batch = zoo_inputs(name)
    traced = trace_step(model.train_step, (state, batch))
    base = load_cluster("cpu-sim")
    everywhere = memory_floor(traced.graph, batch_argnums=(1,), num_devices=8).total
    # on a mesh: each tensor split as far as its dimensions divide the mesh's axes
    floor = {shape: mesh_memory_floor(traced.graph, batch_argnums=(1,), mesh_shape=shape).total
             for shape in ((8,), (2, 4))}
    peaks = {shape: [plan_traced(traced, method, base).peak_memory_bytes for method in methods]
             for shape, methods in (
                 ((8,), (autopar.ShardParallel(mesh_shape=(8,)), autopar.DataParallel(),
                         autopar.Zero3Parallel())),
                 ((2, 4), (autopar.ShardParallel(mesh_shape=(2, 4)),)))}
    with pytest.raises(InfeasibleMemoryError) as least:
        plan_traced(traced, autopar.ShardParallel(memory_budget_bytes=floor[(8,)]), base)
    assert least.value.split_over is None  # at the floor the ILP ran and found its least
    peaks[(8,)].append(least.value.min_peak_bytes)
    for shape, found in peaks.items():
        assert 0 < everywhere <= floor[shape] <= min(found), (shape, floor, found)


@pytest.mark.parametrize("shape, mesh, ways", [
    ((20480, 81920), (315, 8), 8),          # GPT 529.6B's weights on Megatron's mesh
    ((2520, 2048, 20480), (315, 8), 2520),  # its activations: the batch takes both axes
    ((12, 12), (8,), 1),
    ((6,), (2, 4), 2),
    ((4, 4), (2, 4), 8),
    ((8,), (2, 4), 8),
    ((3, 5), (2, 4), 1),
    ((), (2, 4), 1),
])
def test_most_shards_is_the_most_a_layout_on_the_mesh_splits(shape, mesh, ways):
    assert most_shards(shape, mesh) == ways


def test_device_memory_is_the_default_budget():
    model, state, batch = zoo_inputs("gpt")
    traced = trace_step(model.train_step, (state, batch))
    base = load_cluster("cpu-sim")
    free = plan_traced(traced, autopar.ShardParallel(), base)
    # a device half-way between the least any plan needs and what the fastest plan needs
    with pytest.raises(InfeasibleMemoryError) as least:
        plan_traced(traced, autopar.ShardParallel(memory_budget_bytes=1.0), base)
    between = (least.value.min_peak_bytes + free.peak_memory_bytes) / 2
    small = dataclasses.replace(base.device, memory_bytes=int(between))
    cluster = ClusterSpec.from_dict(base.to_dict() | {"device": small.to_dict()})
    plan = plan_traced(traced, autopar.ShardParallel(), cluster)
    assert plan.peak_memory_bytes <= small.memory_bytes < free.peak_memory_bytes
    assert any("memory budget" in note for note in plan.notes)


def gpt_pipeline_model():
    """Two layers: the plans below are what four layers get (one stage on all eight devices:
    rematerialised at 0.6 of the data-parallel peak, its memory-lean layouts split 8 ways at
    0.8 of the free plan's), and the parallel step's XLA compile, most of these tests' time,
    takes half as long."""
    return get_model("gpt", "tiny", num_layers=2).with_value_and_grad(autopar.value_and_grad)


def test_gpt_too_big_for_one_device_is_pipelined_to_fit():
    """A described device too small for the whole GPT: the stage search returns stages that
    each fit, and running that plan on the local devices gives the serial numbers."""
    model = gpt_pipeline_model()
    state, batch = model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(1))
    traced = trace_step(model.train_step, (state, batch))
    base = load_cluster("cpu-sim")
    whole = plan_traced(traced, autopar.DataParallel(), base).peak_memory_bytes
    device = dataclasses.replace(base.device, memory_bytes=int(0.6 * whole))
    cluster = ClusterSpec.from_dict(base.to_dict() | {"device": device.to_dict()})
    method = autopar.PipeshardParallel(num_microbatches=2, remat="auto")
    saved = plan_train_step(model.train_step, (state, batch), method, cluster,
                            batch_argnums=(1,)).plan
    assert all(s.peak_memory_bytes <= device.memory_bytes for s in saved.stages)
    assert whole > device.memory_bytes
    step = autopar.parallelize(model.train_step, method=method, plan=saved, cache=False)
    assert_serial_numbers(step, model, 2)


def test_stages_the_fastest_layouts_overfill_split_their_parameters():
    """Stage costs priced with each layer's fastest layouts, which keep parameters whole on
    some mesh axis, overfill a device of 0.8 of that plan's peak: the stage search adds the
    layers' memory-lean plans (every parameter split at least k ways, for the k the mesh's
    axes give, least first), the plan fits, its lean stages hold less than before, split
    their kernels at least k ways, and it runs to the serial numbers."""
    model = gpt_pipeline_model()
    state, batch = model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(1))
    base = load_cluster("cpu-sim")
    method = autopar.PipeshardParallel(num_microbatches=2, layers=2)

    def plan_on(memory_bytes):
        device = dataclasses.replace(base.device, memory_bytes=int(memory_bytes))
        cluster = ClusterSpec.from_dict(base.to_dict() | {"device": device.to_dict()})
        return plan_train_step(model.train_step, (state, batch), method, cluster,
                               batch_argnums=(1,)).plan

    free = plan_on(1e12)
    assert not any("+split" in st["candidate"]["key"]
                   for st in free.planning.stage_search["stages"])
    budget = 0.8 * max(s.peak_memory_bytes for s in free.stages)
    tight = plan_on(budget)
    keys = [st["candidate"]["key"] for st in tight.planning.stage_search["stages"]]
    lean = [k for k, key in enumerate(keys) if "+split" in key]
    assert lean, tight.planning.stage_search["stages"]
    assert all(s.peak_memory_bytes <= budget for s in tight.stages)
    assert max(tight.stages[k].memory_breakdown["fixed"] for k in lean) < \
        min(s.memory_breakdown["fixed"] for s in free.stages)
    for k in lean:
        stage = tight.stages[k]
        width = math.prod(stage.logical_mesh_shape)
        kernels = [spec for path, spec in stage.input_shardings.items()
                   if path.startswith("state/params") and "kernel" in path]
        sizes = dict(zip(stage.axis_names, stage.logical_mesh_shape, strict=True))
        at_least = min(state_split_of_key(keys[k]), width)
        assert kernels and all(spec.num_shards(sizes) >= at_least for spec in kernels), kernels
    step = autopar.parallelize(model.train_step, method=method, plan=tight, cache=False)
    assert_serial_numbers(step, model, 2)


def _stage_plan(model, state, batch, **options):
    step = autopar.parallelize(model.train_step, cache=False,
                               method=autopar.PipeshardParallel(**options))
    return step.get_plan(state, batch)


@pytest.mark.parametrize("name, mode", [("gpt", "layers"), ("mlp", "layers"),
                                        ("gpt", "selective")])
def test_recomputation_equals_serial_and_holds_less(name, mode):
    """Recomputing whole layers, or all of each layer but its matmuls' outputs (selective):
    the serial numbers, less memory than keeping everything and more time; selective
    between the two."""
    model = get_model(name, "tiny", num_layers=2).with_value_and_grad(autopar.value_and_grad)
    options = dict(num_microbatches=4, stages="uniform", num_stages=2, layers=2)
    step = autopar.parallelize(model.train_step, cache=False,
                               method=autopar.PipeshardParallel(**options, remat=mode))
    state = assert_serial_numbers(step, model, 3)
    batch = model.make_batch(jax.random.key(0))
    with_remat = step.get_plan(state, batch)
    without = _stage_plan(model, state, batch, **options)
    assert with_remat.pipeline.remat_stages == (True, True)
    assert with_remat.pipeline.selective_stages == ((True, True) if mode == "selective" else ())
    assert without.pipeline.remat_stages == (False, False)
    for a, b in zip(with_remat.stages, without.stages, strict=True):
        assert (a.memory_breakdown["activations_per_microbatch"]
                < b.memory_breakdown["activations_per_microbatch"])
        assert a.est_time_s > b.est_time_s  # the recompute is paid for
    if mode == "selective":
        whole = _stage_plan(model, state, batch, **options, remat="layers")
        for a, c in zip(with_remat.stages, whole.stages, strict=True):
            assert (a.memory_breakdown["activations_per_microbatch"]
                    > c.memory_breakdown["activations_per_microbatch"])
            assert a.est_time_s < c.est_time_s


def test_remat_option_is_checked():
    with pytest.raises(autopar.InvalidOptionError, match="valid: none, layers, selective, auto"):
        autopar.PipeshardParallel(remat="sometimes")
    assert autopar.ShardParallel(remat="selective").remat == "selective"  # one stage too


def test_prefer_reduce_scatter_shards_optimizer_state_and_equals_serial():
    """The ILP option: optimizer state pinned to its ZeRO-2 layout, the rest chosen by the
    ILP. Same numbers as serial, Adam's moments come back cut in eight, and the gradient and
    gather bytes the plan predicts are what XLA emitted."""
    model, state, batch = zoo_inputs("gpt")
    method = autopar.ShardParallel(prefer_reduce_scatter=True, time_limit_s=120)
    step = autopar.parallelize(model.train_step, method=method, cache=False)
    s = assert_serial_numbers(step, model, 3)
    mu = s["opt_state"][0].mu
    for leaf in jax.tree_util.tree_leaves(mu):
        if leaf.shape[0] % 8 == 0:
            assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // 8
    plan = step.get_plan(state, batch)
    # the whole optimizer state, cut in eight (the free ILP may shard some of it too)
    whole = sum(x.nbytes for x in jax.tree_util.tree_leaves(state["opt_state"]))
    assert plan.stages[0].memory_breakdown["optimizer_state"] <= whole / 7
    hlo = count_collectives(step.get_hlo_text(state, batch))
    predicted = sum(c.nbytes for c in plan.stages[0].collectives
                    if c.kind.value in ("all-reduce", "reduce-scatter"))
    assert hlo.bytes("all-reduce") == pytest.approx(predicted, rel=0.1)
