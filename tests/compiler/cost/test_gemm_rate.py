"""A device's GEMM rate (``DeviceSpec.gemm_flops`` and ``gemm_threading_s``): a CPU's matrix
multiplications run far above the rate its other ops get, and the cost model prices a
``dot_general`` at the faster of the two, in the ILP's strategies and in the estimates alike
(docs/cost-model.md, "A CPU's GEMM rate")."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from autopar.cluster import DeviceSpec, load_cluster
from autopar.compiler.cost.estimate import node_compute_time_s
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.intra_op.strategies import StrategyContext, strategies_for
from autopar.errors import InvalidOptionError
from autopar.ir.flatten import flatten_step
from autopar.runtime.local_cluster import sharing_one_host


def graph_of(m: int, k: int, n: int):
    x = jax.ShapeDtypeStruct((m, k), jnp.float32)
    w = jax.ShapeDtypeStruct((k, n), jnp.float32)
    return build_graph(flatten_step(lambda x, w: jnp.tanh(x @ w), (x, w)))


def mesh_with(gemm_flops: dict[str, float], threading: float, shape=(1,)) -> LogicalMesh:
    cluster = load_cluster("cpu-sim")
    device = dataclasses.replace(cluster.device, gemm_flops=gemm_flops,
                                 gemm_threading_s=threading, kernel_launch_s=0.0)
    return LogicalMesh.from_cluster(dataclasses.replace(cluster, device=device), shape)


def node(graph, primitive):
    return next(n for n in graph.nodes if n.primitive == primitive)


def general_s(flops: float, mesh: LogicalMesh) -> float:
    return flops / (mesh.device.flops_for("float32") * mesh.compute_efficiency)


def test_a_large_matmul_runs_at_the_gemm_rate_and_a_small_one_at_the_faster():
    described = mesh_with({"float32": 100e9}, 30e-6)
    plain = mesh_with({}, 0.0)
    big = graph_of(1024, 256, 768)
    dot = node(big, "dot_general")
    assert node_compute_time_s(big, dot, plain, 1) == pytest.approx(general_s(dot.flops, plain))
    assert node_compute_time_s(big, dot, described, 1) == pytest.approx(
        dot.flops / 100e9 + 30e-6)
    # a matmul so small that the threading's 30 us exceed its flops at the general rate
    small = graph_of(8, 8, 8)
    tiny = node(small, "dot_general")
    assert general_s(tiny.flops, described) < tiny.flops / 100e9 + 30e-6
    assert node_compute_time_s(small, tiny, described, 1) == pytest.approx(
        general_s(tiny.flops, described))
    # other ops keep the general rate
    tanh = node(big, "tanh")
    assert node_compute_time_s(big, tanh, described, 1) == pytest.approx(
        node_compute_time_s(big, tanh, plain, 1))
    # a dtype the device does not describe keeps the general rate
    other = mesh_with({"bfloat16": 100e9}, 30e-6)
    assert node_compute_time_s(big, dot, other, 1) == pytest.approx(
        general_s(dot.flops, other))


def test_the_ilp_prices_a_matmul_as_the_estimates_do():
    """The dot's strategies on a 4-device mesh: each one's compute is its per-device GEMM at
    the described rate (the replicated one whole, the split ones a quarter of it), as
    ``node_compute_time_s`` prices the node split that many ways."""
    mesh = mesh_with({"float32": 100e9}, 30e-6, shape=(4,))
    graph = graph_of(1024, 256, 768)
    dot = node(graph, "dot_general")
    found = strategies_for(StrategyContext(node=dot, graph=graph, mesh=mesh))
    # (no launches: ``mesh_with`` sets them to 0)
    by_parts = {k: node_compute_time_s(graph, dot, mesh, k) for k in (1, 4)}
    assert by_parts[1] == pytest.approx(dot.flops / 100e9 + 30e-6)
    assert by_parts[4] == pytest.approx(dot.flops / 4 / 100e9 + 30e-6)
    times = sorted({round(s.compute_time_s, 12) for s in found})
    assert times[0] == pytest.approx(by_parts[4]) and times[-1] == pytest.approx(by_parts[1])


def test_the_fields_round_trip_and_are_checked():
    device = dataclasses.replace(load_cluster("cpu-sim").device,
                                 gemm_flops={"float32": 100e9}, gemm_threading_s=5e-6)
    again = DeviceSpec.from_dict(device.to_dict())
    assert again == device and hash(again) == hash(device)
    bare = dataclasses.replace(device, gemm_flops={}, gemm_threading_s=0.0)
    assert "gemm_flops" not in bare.to_dict() and hash(bare) != hash(device)
    with pytest.raises(InvalidOptionError, match="gemm_flops"):
        DeviceSpec.from_dict({**device.to_dict(), "gemm_flops": 1e11})
    with pytest.raises(InvalidOptionError, match="gemm_flops.float32"):
        DeviceSpec.from_dict({**device.to_dict(), "gemm_flops": {"float32": -1}})


def test_devices_sharing_a_host_split_the_gemm_rate_and_its_threading_alike():
    fields = load_cluster("cpu-sim").to_dict()
    fields["device"] = {**fields["device"], "gemm_flops": {"float32": 100e9},
                        "gemm_threading_s": 5e-6}
    shared = sharing_one_host(fields, 4)["device"]
    one = fields["device"]
    assert shared["gemm_flops"] == {k: v / 4 for k, v in one["gemm_flops"].items()}
    assert shared["gemm_threading_s"] == one["gemm_threading_s"] * 4
