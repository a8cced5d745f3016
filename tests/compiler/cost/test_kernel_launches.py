"""The fixed seconds of each kernel a device starts (``device.kernel_launch_s``, counted by
``graph.fusion.kernel_launches``), and the local devices' description as devices sharing one
host (``runtime.local_cluster.sharing_one_host``): what brings the estimate for the local CPU
devices to the clock (docs/cost-model.md, "Kernel launches and devices sharing a host")."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from autopar.cluster import ClusterSpec, DeviceSpec, load_cluster
from autopar.compiler.cost.estimate import launch_time_s, node_compute_time_s
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.fusion import kernel_launches
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.intra_op.strategies import StrategyContext, strategies_for
from autopar.ir.flatten import flatten_step
from autopar.runtime.local_cluster import local_cluster, sharing_one_host

X = jax.ShapeDtypeStruct((64, 128), jnp.float32)
W = jax.ShapeDtypeStruct((128, 256), jnp.float32)


def graph_of(fn):
    return build_graph(flatten_step(fn, (X, W)))


def launches(graph):
    return {n.primitive: kernel_launches(graph, n) for n in graph.nodes}


def test_a_matmul_and_the_fused_chain_after_it_are_two_kernels():
    graph = graph_of(lambda x, w: jnp.sum(jnp.tanh(x @ w) * 2.0))
    counted = launches(graph)
    # the matmul is a library kernel; tanh and the product stay inside the chain the sum
    # ends, whose result is the step's output
    assert counted["dot_general"] == 1
    assert counted["tanh"] == 0 and counted["mul"] == 0
    assert counted["reduce_sum"] == 1
    assert sum(kernel_launches(graph, n) for n in graph.nodes) == 2


def test_a_value_a_matmul_reads_ends_its_chain():
    graph = graph_of(lambda x, w: jnp.einsum("bi,ji->bj", jnp.tanh(x @ w) * 2.0, w))
    # dot, the chain written out for the second dot, the second dot
    assert sum(kernel_launches(graph, n) for n in graph.nodes) == 3


def cpu_mesh(launch: float, shape=(8,)) -> LogicalMesh:
    cluster = load_cluster("cpu-sim")
    device = dataclasses.replace(cluster.device, kernel_launch_s=launch)
    return LogicalMesh.from_cluster(dataclasses.replace(cluster, device=device), shape)


def test_the_ilp_leaves_launches_out_and_the_estimates_add_them():
    graph = graph_of(lambda x, w: jnp.sum(jnp.tanh(x @ w) * 2.0))
    dot = next(n for n in graph.nodes if n.primitive == "dot_general")
    tanh = next(n for n in graph.nodes if n.primitive == "tanh")
    for node, kernels in ((dot, 1), (tanh, 0)):
        # the same under every strategy: left out of the ILP, whose relative gap a constant
        # would only loosen
        plain = strategies_for(StrategyContext(node=node, graph=graph, mesh=cpu_mesh(0.0)))
        launched = strategies_for(StrategyContext(node=node, graph=graph,
                                                  mesh=cpu_mesh(7e-6)))
        assert [s.compute_time_s for s in plain] == [s.compute_time_s for s in launched]
        # the one-stage estimates price a node with its launches
        for parts in (1, 8):
            assert node_compute_time_s(graph, node, cpu_mesh(7e-6), parts) == pytest.approx(
                node_compute_time_s(graph, node, cpu_mesh(0.0), parts) + kernels * 7e-6)
    assert launch_time_s(graph, cpu_mesh(7e-6)) == pytest.approx(2 * 7e-6)
    assert launch_time_s(graph, cpu_mesh(7e-6), skip={dot.id}) == pytest.approx(7e-6)
    assert launch_time_s(graph, cpu_mesh(0.0)) == 0.0


def test_the_launch_round_trips_and_is_optional():
    device = load_cluster("cpu-sim").device
    assert device.kernel_launch_s > 0
    assert DeviceSpec.from_dict(device.to_dict()) == device
    bare = dataclasses.replace(device, kernel_launch_s=0.0)
    assert "kernel_launch_s" not in bare.to_dict()
    assert DeviceSpec.from_dict(bare.to_dict()) == bare


def test_devices_sharing_a_host_divide_everything_they_do_but_the_drivers_costs():
    alone = load_cluster("cpu-sim")
    shared = ClusterSpec.from_dict(sharing_one_host(alone.to_dict(), 4))
    assert shared.device.flops_for("float32") == alone.device.flops_for("float32") / 4
    assert shared.device.kernel_launch_s == alone.device.kernel_launch_s * 4
    for link in ("intra_host", "inter_host"):
        a, s = getattr(alone, link), getattr(shared, link)
        assert s.latency_s == a.latency_s * 4
        assert s.bandwidth_bytes_per_s == a.bandwidth_bytes_per_s / 4
    assert shared.runtime.accumulate_bytes_per_s == alone.runtime.accumulate_bytes_per_s / 4
    for kept in ("call_s", "task_s", "transfer_s", "buffer_s", "feed_s"):
        assert getattr(shared.runtime, kept) == getattr(alone.runtime, kept)
    assert sharing_one_host(alone.to_dict(), 1) == alone.to_dict()


def test_the_local_description_divides_the_host_among_the_devices_in_use():
    devices = jax.devices()
    alone = load_cluster("cpu-sim").device.flops_for("float32")
    for n in (1, 2, 8):
        cluster = local_cluster(devices[:n])
        assert cluster.num_devices == n
        assert cluster.device.flops_for("float32") == pytest.approx(alone / n)


def test_sharing_the_host_moves_the_estimate_not_the_plan():
    import autopar
    from autopar.compiler.planners import dispatch
    from autopar.models import get_model

    model = get_model("gpt", "tiny").with_value_and_grad(autopar.value_and_grad)
    method = autopar.ShardParallel(mesh_shape=(4, 2))
    step = dispatch.trace(model.train_step, model.abstract_inputs(), method, (1,))
    alone = dataclasses.replace(load_cluster("cpu-sim"), name="alone")
    shared = local_cluster(jax.devices()[:8])
    plans = [dispatch.plan(step, cluster).plan for cluster in (alone, shared)]
    # every cost the ILP weighs is divided alike: the same choices
    assert plans[0].stages[0].tensor_shardings == plans[1].stages[0].tensor_shardings
    assert plans[0].stages[0].input_shardings == plans[1].stages[0].input_shardings
    # and 8 devices' work on one host's processors, each 8 times slower, its kernels'
    # launches included
    work = [p.stages[0].est_time_s for p in plans]
    assert work[1] == pytest.approx(8 * work[0], rel=1e-6)
    launches = launch_time_s(step.traced.graph, LogicalMesh.from_cluster(alone, (4, 2)))
    assert 0 < launches < plans[0].stages[0].est_compute_time_s
    bare = dataclasses.replace(alone, device=dataclasses.replace(alone.device,
                                                                 kernel_launch_s=0.0))
    without = dispatch.plan(step, bare).plan.stages[0]
    assert without.tensor_shardings == plans[0].stages[0].tensor_shardings
    assert plans[0].stages[0].est_compute_time_s == pytest.approx(
        without.est_compute_time_s + launches)
