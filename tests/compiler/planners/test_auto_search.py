"""The full search (``autopar.AutoParallel``): every method a candidate on one cost model, the
same work costed the same way by every planner, the runtime's own costs, the stage search's
candidates and replicas, and the plan's record of what was compared. Nothing here is timed."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from tanh_mlp import tanh_mlp_step

import autopar
from autopar.cluster import RuntimeCosts, load_cluster
from autopar.compiler.cost.memory_floor import memory_floor
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import trace_step
from autopar.compiler.planners import dispatch
from autopar.compiler.planners.pipeline_search import driver_floor_s, search_pipelines
from autopar.compiler.planners.pipeshard import stage_ilp_notes
from autopar.compiler.planners.stage_costs import (
    STAGE_COST_TIME_LIMIT_S,
    layer_cost_cache,
    range_piece,
)
from autopar.compiler.planners.stage_table import CostClock
from autopar.errors import PlanError, format_bytes
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.models import get_model
from autopar.plan import Plan
from autopar.runtime.local_cluster import local_cluster

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


def mlp_step(opt, widths=(32, 64, 64, 8), batch=16):
    step = tanh_mlp_step(opt)
    params = [jnp.full((a, b), 0.01) for a, b in zip(widths[:-1], widths[1:], strict=False)]
    state = {"params": params, "opt": opt.init(params)}
    data = {"x": jnp.ones((batch, widths[0])), "y": jnp.zeros((batch, widths[-1]))}
    return step, (state, data)


def planned(step, args, method, cluster):
    return dispatch.plan(dispatch.trace(step, args, method, (1,)), cluster).plan


def one_device():
    return local_cluster(jax.devices()[:1])


@pytest.mark.parametrize("opt", [optax.adam(1e-3), optax.sgd(0.1)], ids=["adam", "sgd"])
def test_a_replicated_step_is_estimated_alike_by_every_planner(opt):
    """On one device every plan replicates: the full search, ShardParallel and DataParallel
    estimate the same step the same (one call of one program), and a pipelined plan's device
    work is the same forward, backward, update and preprocessing, plus the accumulation of
    its gradients (its driver on the host comes on top)."""
    step, args = mlp_step(opt)
    cluster = one_device()
    auto = planned(step, args, autopar.AutoParallel(), cluster)
    shard = planned(step, args, autopar.ShardParallel(), cluster)
    data = planned(step, args, autopar.DataParallel(), cluster)
    assert auto.est_step_time_s == pytest.approx(shard.est_step_time_s, rel=0.01)
    assert data.est_step_time_s == pytest.approx(shard.est_step_time_s, rel=0.01)
    one = shard.planning.estimate
    # one call, a buffer in and out for each of the step's arrays on its one device, and the
    # batch's two arrays fed
    graph = dispatch.trace(step, args, autopar.ShardParallel(), (1,)).traced.graph
    arrays = len(graph.inputs) + len(graph.outputs)
    assert arrays == 2 * len(jax.tree.leaves(args[0])) + 2 + 1  # state, batch, loss
    runtime = cluster.runtime
    assert one["runtime_s"] == pytest.approx(runtime.call_s + arrays * runtime.buffer_s
                                             + 2 * runtime.feed_s)
    assert runtime.buffer_s > 0 and runtime.feed_s > 0 and one["communication_s"] == 0
    # the same work, kernels aside: each microbatch starts the forward's and backward's
    # kernels again (docs/cost-model.md, "Kernel launches and devices sharing a host")
    work_only = dataclasses.replace(cluster, device=dataclasses.replace(
        cluster.device, kernel_launch_s=0.0))
    bare = planned(step, args, autopar.ShardParallel(), work_only).planning.estimate
    works = {}
    for m, on in ((1, cluster), (1, work_only), (4, work_only), (4, cluster)):
        pipe = planned(step, args, autopar.PipeshardParallel(num_microbatches=m), on)
        parts = pipe.planning.estimate
        work = parts["schedule_s"] + parts["tails_s"] + parts["before_s"] - parts["accumulate_s"]
        works[(m, on is cluster)] = work
        if m == 1 or on is work_only:
            want = one if on is cluster else bare
            assert work == pytest.approx(want["compute_s"], rel=0.01), (m, on.name)
        assert pipe.est_step_time_s == pytest.approx(work + parts["accumulate_s"]
                                                     + parts["host_s"], rel=1e-9)
        # so on these devices, where every call costs, the full search does not pipeline
        if on is cluster:
            assert pipe.est_step_time_s > auto.est_step_time_s
    assert works[(4, True)] - works[(4, False)] > works[(1, True)] - works[(1, False)]


def test_a_one_stage_call_pays_each_arrays_buffer_on_every_device_it_drives():
    """JAX's dispatch handles every input and output array's buffer on each device, and the
    batch arrives from the host in a piece per device: on 8 devices of one host a one-stage
    step's call pays 8 of each per array; the pipeline's one-program form of the same step
    pays the same."""
    step, args = mlp_step(optax.sgd(0.1))
    cluster = local_cluster()
    graph = dispatch.trace(step, args, autopar.DataParallel(), (1,)).traced.graph
    arrays = len(graph.inputs) + len(graph.outputs)
    data = planned(step, args, autopar.DataParallel(), cluster).planning.estimate
    runtime, fed = cluster.runtime, len(jax.tree.leaves(args[1]))
    assert data["runtime_s"] == pytest.approx(runtime.call_s + cluster.num_devices * (
        arrays * runtime.buffer_s + fed * runtime.feed_s))
    pipe = planned(step, args, autopar.PipeshardParallel(num_microbatches=1, num_stages=1),
                   cluster).planning.estimate
    assert pipe["host_s"] == pytest.approx(data["runtime_s"])


def test_the_full_search_keeps_the_fastest_candidate_and_records_them_all():
    step, args = mlp_step(optax.adam(1e-3))
    plan = planned(step, args, autopar.AutoParallel(prune=False), local_cluster())
    rows = plan.planning.candidates
    names = [r["name"] for r in rows]
    assert {"data", "shard", "zero2", "zero3", "pipeshard: stage DP", "pipeshard: equal-layer",
            "pipeshard: equal-operator"} <= set(names)
    (chosen,) = [r for r in rows if r["chosen"]]
    assert chosen["method"] == plan.method.value  # the plan says which method made it
    fitting = [r["est_step_time_s"] for r in rows if r["fits"] and r["est_step_time_s"]]
    assert plan.est_step_time_s == min(fitting)
    assert plan.planning.method_options["method"] == "auto"
    assert plan.notes[0].startswith("the full search compared")
    # the record survives the strict JSON round trip
    again = Plan.from_json(plan.to_json())
    assert again.planning.candidates == rows and again.planning.estimate == plan.planning.estimate
    # the default skips the pipelines by their bound: the same plan, a row saying why
    pruned = planned(step, args, autopar.AutoParallel(), local_cluster())
    assert (pruned.method, pruned.est_step_time_s) == (plan.method, plan.est_step_time_s)
    skipped = [r for r in pruned.planning.candidates if r["method"] == "pipeshard"]
    assert [r["name"] for r in skipped] == ["pipeshard"]
    assert skipped[0]["note"].startswith("not planned: any pipeline of two or more stages")
    traced = dispatch.trace(step, args, autopar.AutoParallel(), (1,))
    floor = driver_floor_s(traced.pipeline, autopar.AutoParallel().pipeline_method(),
                           local_cluster())
    best_pipeline = min(r["est_step_time_s"] for r in rows if r["method"] == "pipeshard"
                        and r.get("num_stages", 1) > 1)
    assert floor <= best_pipeline  # the bound is one: every pipeline planned costs more
    # PipeshardParallel still means pipelining
    pipe = planned(step, args, autopar.PipeshardParallel(), local_cluster())
    assert pipe.is_pipelined and pipe.method == "pipeshard"


def test_the_one_stage_candidates_include_a_2d_mesh_where_data_x_tensor_wins():
    """A GPT whose hidden size is large for its batch, on 8 devices: neither one-axis plan
    (all data or all tensor) is best; the expert's data x Megatron layout on 2x4 beats both.
    The full search tries ShardParallel on the 2-D meshes too, and its plan is at least as
    good as that expert plan under the same cost model."""
    from autopar.bench.hand_baselines import applicable_hand_plans, plan_hand

    model = get_model("gpt", "tiny", hidden_size=256, num_layers=2, seq_len=32,
                                     batch_size=16, vocab_size=512)
    args = (model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(1)))
    cluster = local_cluster()
    plan = planned(model.train_step, args, autopar.AutoParallel(candidates=("data", "shard")),
                   cluster)
    rows = {r["name"]: r for r in plan.planning.candidates}
    # every 2-D mesh whose second (tensor) axis stays inside the host: 8/t x t for t = 4, 2
    assert set(rows) == {"data", "shard", "shard 2x4", "shard 4x2"}
    chosen = plan.stages[0].logical_mesh_shape
    assert chosen in ((2, 4), (4, 2)) and rows[f"shard {chosen[0]}x{chosen[1]}"]["chosen"]
    traced = trace_step(model.train_step, args)
    (mesh, specs), = [(mesh, specs) for hand, mesh, specs in applicable_hand_plans(traced, cluster)
                      if hand.name == "data-megatron"]
    expert = plan_hand(traced, cluster, mesh, specs, time_limit_s=30.0)
    one_axis = min(rows["data"]["est_step_time_s"], rows["shard"]["est_step_time_s"])
    assert expert.est_step_time_s < one_axis  # the case needs the 2-D mesh
    assert plan.est_step_time_s <= expert.est_step_time_s * (1 + 1e-9)


def test_methods_that_keep_the_state_whole_are_not_planned_over_the_budget():
    """Data parallelism keeps parameters and optimizer state on every device, ZeRO-2 the
    parameters: with a budget below those bytes their rows say so, unplanned, and the
    methods that split the state are planned."""
    widths = (512,) * 13 + (8,)  # twelve equal layers: ZeRO-3 gathers one at a time
    step, args = mlp_step(optax.adam(1e-3), widths=widths)
    params = sum(4 * a * b for a, b in zip(widths[:-1], widths[1:], strict=False))
    # over ZeRO-3's plan on 8 devices (0.83 of the parameters' bytes), under the parameters
    budget = params * 0.95
    plan = planned(step, args, autopar.AutoParallel(candidates=("data", "zero2", "zero3"),
                                                    memory_budget_bytes=budget),
                   local_cluster())
    rows = {r["name"]: r for r in plan.planning.candidates}
    for name, kept in (("data", 3 * params), ("zero2", params)):
        assert rows[name]["est_step_time_s"] is None and not rows[name]["fits"]
        assert rows[name]["note"] == (f"not planned: the state it keeps whole on every "
                                      f"device needs {kept / 2**30:.2f} GiB, over the budget")
    assert rows["zero3"]["fits"] and rows["zero3"]["chosen"]
    assert plan.peak_memory_bytes <= budget


def test_zero3_is_not_planned_below_the_memory_floor():
    """No layout holds less than every tensor split over all the devices (``memory_floor``):
    ZeRO-3, which cannot recompute, is answered by that floor rather than estimated (at
    Megatron's 1T row its estimate took 5 s to say it needs 11,278 GiB)."""
    step, args = mlp_step(optax.adam(1e-3), widths=(64, 256, 256, 8), batch=4096)
    floor = memory_floor(trace_step(step, args).graph, batch_argnums=(1,),
                         num_devices=8).total
    zero3 = planned(step, args, autopar.Zero3Parallel(), local_cluster())
    assert zero3.peak_memory_bytes >= floor  # the floor is a floor
    budget = floor * 0.9
    with pytest.raises(PlanError) as info:
        planned(step, args, autopar.AutoParallel(candidates=("zero3",),
                                                 memory_budget_bytes=budget), local_cluster())
    assert str(info.value) == (
        f"no candidate of the full search fits in {format_bytes(budget)} per device: the "
        f"least memory any needs is {format_bytes(floor)} (zero3); raise "
        "memory_budget_bytes, or use more devices. Each candidate: zero3: not planned: with "
        f"every tensor split over all 8 devices the step still needs {floor / 2**30:.2f} GiB, "
        "over the budget")


def test_one_axis_shard_parallel_is_not_a_candidate_over_several_hosts():
    model = get_model("gpt", "tiny")
    cluster = dataclasses.replace(load_cluster("aws-p3.16xlarge"), num_hosts=2)
    method = autopar.AutoParallel(candidates=("shard",), memory_budget_bytes=1e18)
    step = dispatch.trace(model.train_step, model.abstract_inputs(), method, (1,))
    rows = {r["name"] for r in dispatch.plan(step, cluster).plan.planning.candidates}
    assert rows == {"shard 2x8", "shard 4x4", "shard 8x2"}


def test_candidates_are_restricted_and_checked():
    step, args = mlp_step(optax.sgd(0.1))
    plan = planned(step, args, autopar.AutoParallel(candidates=("data", "zero2")),
                   local_cluster())
    assert {r["name"] for r in plan.planning.candidates} == {"data", "zero2"}
    with pytest.raises(autopar.InvalidOptionError, match="unknown candidate method"):
        autopar.AutoParallel(candidates=("data", "megatron"))


def test_pipelines_win_where_the_runtime_is_cheap_and_lose_where_it_is_not():
    """The same model and devices: with GPU-like per-task costs the pipelined candidates of
    several stages are close to the one-stage ones; with the simulated CPU devices' costs they
    are far behind (their driver issues every task; a one-stage pipeline is one program, as a
    one-stage plan is). Either way the search's answer is the least estimate."""
    step, args = mlp_step(optax.adam(1e-3), widths=(256, 1024, 1024, 1024, 256), batch=64)
    cheap = dataclasses.replace(local_cluster(), runtime=RuntimeCosts())
    dear = local_cluster()
    ratios = {}
    for name, cluster in (("cheap", cheap), ("dear", dear)):
        plan = planned(step, args, autopar.AutoParallel(prune=False), cluster)
        pipelines = [r for r in plan.planning.candidates if r["method"] == "pipeshard"]
        assert any(r["num_stages"] > 1 for r in pipelines)
        best_pipe = min(r["est_step_time_s"] for r in pipelines if r["num_stages"] > 1)
        ratios[name] = best_pipe / plan.est_step_time_s
        assert ratios[name] >= 1.0 or plan.is_pipelined
    # (1.3x here for the candidates of several stages: on the simulated devices every task,
    # transfer and segment of their driver costs hundreds of microseconds; 2.5x before the
    # devices' own work was priced as 8 devices sharing the host, which makes it a larger
    # share of every estimate)
    assert ratios["dear"] > 1.2 * ratios["cheap"]


def test_a_stage_reduces_its_gradients_once_per_step():
    """A data-parallel stage: the gradients' all-reduce is in the per-step tail, not in the
    time per microbatch; the stage candidate spreads it over the microbatches for the DP."""
    step, args = mlp_step(optax.sgd(0.1), widths=(8, 8, 8), batch=4096)
    pp = build_pipeline_program(step, args, (1,), 4)
    method = autopar.PipeshardParallel(num_microbatches=4, layers=1)
    cache = layer_cost_cache(method)
    cluster = load_cluster("cpu-sim").with_devices(1, 4)
    mesh = LogicalMesh.from_cluster(cluster, (4,))
    cost = cache.cost(pp, range_piece(pp, [], 0, 1), mesh)
    assert cost.sync_s > 0  # the batch is split: the gradients are summed over 4 devices
    assert cost.update_s > 0 and cost.param_bytes > 0
    assert cost.per_microbatch_s(4) == pytest.approx(cost.time_s + (cost.sync_s
                                                                   + cost.update_s) / 4)
    assert sum(cache.statuses.values()) == cache.ilp_solves == 1


def test_stage_ilp_notes_count_every_unproven_solve():
    method = autopar.PipeshardParallel()
    cache = layer_cost_cache(method)
    assert stage_ilp_notes(cache) == []
    cache.statuses.update({"proven": 3, "within_gap": 2, "time_limit": 1, "no_solution": 1})
    notes = " | ".join(stage_ilp_notes(cache))
    assert (f"1 of 7 stage-cost ILPs stopped at their time limit "
            f"({STAGE_COST_TIME_LIMIT_S:g} s)") in notes
    assert "2 of 7 stage-cost ILPs stopped within their relative gap" in notes
    assert "1 of 7 stage-cost ILPs: the solver found no plan in time" in notes


def test_the_stage_dp_is_never_worse_than_the_hand_splits_it_is_compared_with():
    step, args = mlp_step(optax.sgd(0.1), widths=(32, 32, 512, 32, 32), batch=32)
    pp = build_pipeline_program(step, args, (1,), 4)
    method = autopar.PipeshardParallel(num_microbatches=4, layers=4)
    cluster = dataclasses.replace(load_cluster("cpu-sim").with_devices(1, 4),
                                  runtime=RuntimeCosts())
    from autopar.compiler.graph.trace import build_graph
    from autopar.compiler.inter_op.layers import layer_positions

    positions = layer_positions(pp, build_graph(pp.forward), 4, 4)
    found = search_pipelines(pp, method, cluster, positions, layer_cost_cache(method),
                             CostClock())
    names = [c.name for c in found]
    assert {"stage DP", "equal-layer", "equal-operator"} <= set(names)
    totals = [c.estimate.total_s for c in found]
    assert totals == sorted(totals)  # the plan is the first: none is estimated faster
    plan = planned(step, args, method, cluster)
    assert plan.est_step_time_s == pytest.approx(totals[0])


def test_pipelines_replicate_over_groups_of_hosts_and_running_one_is_one_line():
    """On a described multi-host cluster the search also tries the pipeline replicated over
    groups of hosts; a plan with replicas does not run here: one line says so."""
    step, args = mlp_step(optax.sgd(0.1), widths=(64, 64, 64, 64), batch=64)
    cluster = load_cluster("aws-p3.16xlarge-8nodes").with_devices(4, 2)
    plan = planned(step, args, autopar.PipeshardParallel(num_microbatches=4, layers=2),
                   cluster)
    replicas = {r["replicas"] for r in plan.planning.candidates}
    assert replicas == {1, 2, 4}
    single = planned(step, args, autopar.PipeshardParallel(num_microbatches=4, layers=2,
                                                          replicas="none"), cluster)
    assert {r["replicas"] for r in single.planning.candidates} == {1}
    for row in plan.planning.candidates:
        assert row["est_step_time_s"] > 0 and row["num_microbatches"] == 4 // row["replicas"]
    # a replicated layout round-trips, and the runtime refuses it in one line
    layout = dataclasses.replace(plan.pipeline, replicas=2)
    replicated = dataclasses.replace(plan, pipeline=layout)
    again = Plan.from_json(replicated.to_json())
    assert again.pipeline.replicas == 2
    run = autopar.parallelize(step, plan=again, devices=jax.devices()[:len(
        {d for s in plan.stages for d in s.device_ids})], cache=False)
    with pytest.raises(PlanError, match="2 data-parallel replicas") as err:
        run(*args)
    assert "\n" not in str(err.value)


def test_data_parallel_repeats_the_update_that_zero_shards():
    """Data parallelism runs the optimizer update whole on every device; ZeRO-2 shards it:
    both priced per node as they run (as the ILP prices them), not as total flops / n."""
    step, args = mlp_step(optax.adam(1e-3), widths=(64, 256, 256, 64), batch=64)
    one = planned(step, args, autopar.DataParallel(), one_device())
    data = planned(step, args, autopar.DataParallel(), local_cluster())
    zero = planned(step, args, autopar.Zero2Parallel(), local_cluster())
    n = local_cluster().num_devices
    compute = {k: p.planning.estimate["compute_s"] for k, p in
               (("one", one), ("data", data), ("zero", zero))}
    assert compute["data"] > compute["one"] / n * 1.2
    assert compute["zero"] < compute["data"]


def test_a_one_stage_pipeline_is_kept_only_when_no_one_stage_plan_fits():
    """Its stage DP chose one stage (the tanh MLP on the simulated devices): that candidate is
    the one-stage step cut into microbatches, estimated as one program like the others, but
    without what the split costs (each microbatch reducing its gradients), so a one-stage
    plan that fits is chosen over it, whatever the estimates."""
    opt = optax.adam(1e-3)
    step = tanh_mlp_step(opt)
    params = [jnp.ones((16, 32)), jnp.ones((32, 8))]
    args = ({"params": params, "opt": opt.init(params)},
            {"x": jnp.ones((16, 16)), "y": jnp.zeros((16, 8))})
    plan = planned(step, args, autopar.AutoParallel(prune=False), local_cluster())
    rows = {r["name"]: r for r in plan.planning.candidates}
    dp = rows["pipeshard: stage DP"]
    assert dp["num_stages"] == 1 and dp["fits"] and not dp["chosen"] and not dp["eligible"]
    assert "a one-stage plan fits" in dp["note"]
    assert not plan.is_pipelined
    # its host cost is one call of one program (runtime.fused_step), not a driver's tasks
    assert dp["estimate"]["driver"] == {"tasks": 0, "small_ops": 0, "transfers": 0, "calls": 1}


def test_a_spent_time_budget_keeps_the_best_plan_found_and_names_what_it_skipped():
    step, args = mlp_step(optax.sgd(0.1))
    whole = planned(step, args, autopar.AutoParallel(candidates=("data", "shard", "zero2")),
                    local_cluster())
    assert {r["name"] for r in whole.planning.candidates} >= {"data", "shard", "zero2"}
    # a budget spent by the first candidate: it is planned (a plan is what the search is
    # for), the others are skipped and named
    cut = planned(step, args, autopar.AutoParallel(candidates=("data", "shard", "zero2"),
                                                   time_budget_s=1e-6), local_cluster())
    rows = {r["name"]: r for r in cut.planning.candidates}
    assert rows["data"]["est_step_time_s"] is not None and cut.method == "data"
    skipped = [n for n, r in rows.items() if r["note"].startswith("skipped: the time budget")]
    assert set(skipped) == set(rows) - {"data"} and "zero2" in skipped
    assert any("time budget" in n and "zero2" in n for n in cut.notes)
    assert cut.planning.method_options["skipped"] == skipped
    with pytest.raises(autopar.InvalidOptionError, match="time_budget_s must be positive"):
        autopar.AutoParallel(time_budget_s=0)


def test_when_nothing_fits_the_error_leads_with_the_least_memory_a_candidate_needed():
    """Issue 35's case in small: under a budget no candidate fits, the one line names the
    least memory any candidate needed (not the first candidate's own reason)."""
    model = get_model("gpt", "tiny").with_value_and_grad(autopar.value_and_grad)
    method = autopar.AutoParallel(memory_budget_bytes=64 * 2**10, measure_candidates=0)
    step = autopar.parallelize(model.train_step, method=method, cache=False)
    with pytest.raises(autopar.PlanError) as err:
        step.get_plan(*model.abstract_inputs())
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("no candidate of the full search fits in 64.00 KiB per device: "
                           "the least memory any needs is ")
    amount, unit = text.split("the least memory any needs is ")[1].split()[:2]
    assert float(amount) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit] > 64 * 2**10
