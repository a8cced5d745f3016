"""What each op's kernel reads and writes from device memory (``graph.fusion``), and the
roofline that prices it: a chain of element-wise ops between matmuls costs one kernel's bytes,
and on a device whose memory bandwidth is described an op is as slow as the slower of its
flops and its bytes."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from scan_steps import scanned_stack, stack_args, unrolled_stack

from autopar.cluster import DeviceSpec, load_cluster
from autopar.compiler.cost.estimate import node_compute_time_s, roofline_time_s
from autopar.compiler.cost.gemm import dot_efficiency
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.fusion import LIBRARY_KERNELS, kernel_bytes
from autopar.compiler.graph.trace import build_graph, trace_step
from autopar.compiler.intra_op.strategies import StrategyContext, strategies_for
from autopar.ir.flatten import flatten_step

X = jax.ShapeDtypeStruct((64, 128), jnp.float32)
W = jax.ShapeDtypeStruct((128, 256), jnp.float32)
OUT_BYTES = 64 * 256 * 4


def graph_of(fn):
    return build_graph(flatten_step(fn, (X, W)))


def fused_bytes(graph):
    return sum(kernel_bytes(graph, n) for n in graph.nodes
               if n.primitive not in LIBRARY_KERNELS)


def test_an_element_wise_chain_after_a_matmul_reads_its_result_once_and_writes_once():
    graph = graph_of(lambda x, w: jnp.tanh(x @ w) * 2.0 + 1.0)
    dot = next(n for n in graph.nodes if n.primitive == "dot_general")
    assert kernel_bytes(graph, dot) == dot.bytes_accessed
    # tanh reads the matmul's result, the add writes the output; the two values between
    # stay in the fused kernel (scalar constants: a few bytes)
    assert 2 * OUT_BYTES <= fused_bytes(graph) <= 2 * OUT_BYTES + 64


def test_a_value_a_matmul_reads_is_written_out():
    def fn(x, w):
        h = jnp.tanh(x @ w)
        # the scaled value feeds a matmul: written out, then read by it
        return jnp.einsum("bi,ji->bj", h * 2.0, w)

    graph = graph_of(fn)
    assert 2 * OUT_BYTES <= fused_bytes(graph) <= 2 * OUT_BYTES + 64

    def two_readers(x, w):
        t = jnp.tanh(x @ w)
        return jnp.sin(t) + jnp.cos(t)  # t is read by two fused ops, and never written

    assert 2 * OUT_BYTES <= fused_bytes(graph_of(two_readers)) <= 2 * OUT_BYTES + 64


def mesh_with(bandwidth):
    cluster = load_cluster("a100-80gb-x8")
    device = dataclasses.replace(cluster.device, memory_bandwidth_bytes_per_s=bandwidth)
    return LogicalMesh.from_cluster(dataclasses.replace(cluster, device=device), (8,))


def test_an_element_wise_op_is_priced_at_the_memory_bandwidth_where_it_is_described():
    graph = graph_of(lambda x, w: jnp.tanh(x @ w) * 2.0 + 1.0)
    tanh = next(n for n in graph.nodes if n.primitive == "tanh")
    flops_only = node_compute_time_s(graph, tanh, mesh_with(0.0), 8)
    roofline = node_compute_time_s(graph, tanh, mesh_with(2.0e12), 8)
    efficiency = load_cluster("a100-80gb-x8").compute_efficiency
    assert flops_only == pytest.approx(tanh.flops / 8 / (19.5e12 * efficiency))  # fp32 peak
    assert roofline == pytest.approx(OUT_BYTES / 8 / 2.0e12)
    assert roofline > 10 * flops_only
    # a big matmul stays bound by its flops (at its GEMM's wave efficiency)
    dot = next(n for n in graph.nodes if n.primitive == "dot_general")
    mesh = mesh_with(2.0e12)
    lhs, rhs = (graph.tensors[t].shape for t in dot.inputs)
    waves = dot_efficiency(lhs, rhs, dot.params["dimension_numbers"], 1,
                           mesh.device.multiprocessors)
    assert roofline_time_s(dot.flops, 0.0, mesh, "float32", waves) == \
        node_compute_time_s(graph, dot, mesh_with(0.0), 1)


def test_the_bandwidth_round_trips_and_is_optional():
    device = load_cluster("a100-80gb-x8").device
    assert device.memory_bandwidth_bytes_per_s == 2.039e12
    assert DeviceSpec.from_dict(device.to_dict()) == device
    bare = dataclasses.replace(device, memory_bandwidth_bytes_per_s=0.0)
    assert "memory_bandwidth_bytes_per_s" not in bare.to_dict()
    assert DeviceSpec.from_dict(bare.to_dict()) == bare


def test_the_ilps_strategies_price_an_op_on_the_same_roofline():
    graph = graph_of(lambda x, w: jnp.tanh(x @ w) * 2.0 + 1.0)
    tanh = next(n for n in graph.nodes if n.primitive == "tanh")
    mesh = mesh_with(2.0e12)
    strategies = strategies_for(StrategyContext(node=tanh, graph=graph, mesh=mesh))
    times = {s.compute_time_s for s in strategies}
    # split over the mesh's 8 devices, or repeated whole on each
    assert min(times) == pytest.approx(node_compute_time_s(graph, tanh, mesh, 8))
    assert max(times) == pytest.approx(OUT_BYTES / 2.0e12)


def test_a_scanned_stack_moves_the_bytes_its_unrolled_layers_move():
    args = stack_args()
    moved = []
    for fn in (unrolled_stack, scanned_stack):
        graph = trace_step(jax.grad(fn, argnums=(0, 1)), args).graph
        moved.append(sum(kernel_bytes(graph, n) for n in graph.nodes))
    # a layer's slice of the stacked weights is read in place by its matmuls either way
    weights = 2 * 4 * 256 * 1024 * 4
    assert moved[1] == pytest.approx(moved[0], rel=0.01)
    # read by the forward's and the backward's matmuls, their gradients written by the
    # weight-gradient matmuls, transposed and assembled into the stacked gradient: five
    # times the weights, and no copy of a slice (slicing each layer's weights out of the
    # stack read the whole stack per slice: 8 times the weights more)
    assert 5 * weights <= moved[0] < 6 * weights
