"""Matrix multiplications priced by shape (autopar.compiler.cost.gemm): a GEMM's output tiles
run in waves over the GPU's multiprocessors, so a GEMM split into pieces that each leave most
of a wave empty does not get faster in proportion."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest

from autopar.cluster import load_cluster
from autopar.compiler.cost.estimate import node_compute_time_s
from autopar.compiler.cost.gemm import TILE, dot_efficiency, wave_efficiency
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import trace_step
from autopar.compiler.intra_op.strategies import strategies_for
from autopar.compiler.intra_op.strategies.base import StrategyContext


def test_a_full_wave_is_whole_and_one_tile_more_costs_a_wave():
    sms = 108
    assert wave_efficiency(TILE * 12, TILE * 9, 1, sms) == 1.0  # 108 tiles: one full wave
    assert wave_efficiency(TILE * 12, TILE * 9 + 1, 1, sms) == pytest.approx(
        TILE * 12 * (TILE * 9 + 1) / (2 * sms * TILE * TILE))
    # a batch multiplies the tiles; a ragged edge pays its whole tile
    assert wave_efficiency(TILE, TILE, 108, sms) == 1.0
    assert wave_efficiency(TILE // 2, TILE, 108, sms) == 0.5
    # multiprocessors not described (a CPU, a calibrated description): no quantization
    assert wave_efficiency(3, 5, 1, 0) == 1.0


def test_the_batch_split_cuts_the_activations_loop():
    # x (8, 512, 1024) @ W (1024, 4096): rows 8 x 512, columns 4096
    numbers = (((2,), (0,)), ((), ()))
    whole = dot_efficiency((8, 512, 1024), (1024, 4096), numbers, 1, 108)
    split = dot_efficiency((8, 512, 1024), (1024, 4096), numbers, 8, 108)
    assert whole == wave_efficiency(8 * 512, 4096, 1, 108)
    assert split == wave_efficiency(512, 4096, 1, 108)
    # a weight's gradient x^T dy contracts the batch: its output tiles stay whole
    grad = (((0, 1), (0, 1)), ((), ()))
    assert dot_efficiency((8, 512, 1024), (8, 512, 4096), grad, 8, 108) == wave_efficiency(
        1024, 4096, 1, 108)


def _dot_context(cluster, rows: int, width: int, mesh_shape=(4,)):
    x = jax.ShapeDtypeStruct((rows, width), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((width, width), jnp.bfloat16)
    traced = trace_step(lambda a, b: a @ b, (x, w))
    node = next(n for n in traced.graph.nodes if n.primitive == "dot_general")
    mesh = LogicalMesh.from_cluster(cluster, mesh_shape)
    return StrategyContext(node, traced.graph, mesh), traced


def _by_name(strategies):
    return {s.name: s for s in strategies}


def test_splitting_a_one_wave_gemm_gains_nothing_and_a_large_one_scales():
    a100 = load_cluster("a100-80gb-x8")
    flat = replace(a100, device=replace(a100.device, multiprocessors=0))
    # 256 x 256 output: 4 tiles, one wave on 108 multiprocessors split or whole
    small, _ = _dot_context(a100, 256, 256)
    small_flat, _ = _dot_context(flat, 256, 256)
    rows_split = "S(x)R x RR -> S(x)R"
    whole = "RR x RR -> RR"
    got, flat_got = _by_name(strategies_for(small)), _by_name(strategies_for(small_flat))
    assert got[rows_split].compute_time_s == pytest.approx(got[whole].compute_time_s)
    assert flat_got[rows_split].compute_time_s == pytest.approx(
        flat_got[whole].compute_time_s / 4)
    # 16,384 x 4,096 output: 4,096 tiles, 38 waves whole, 10 a quarter: about 4x faster
    large, _ = _dot_context(a100, 16384, 4096)
    got = _by_name(strategies_for(large))
    ratio = got[whole].compute_time_s / got[rows_split].compute_time_s
    assert ratio == pytest.approx(4 * wave_efficiency(4096, 4096, 1, 108)
                                  / wave_efficiency(16384, 4096, 1, 108))
    assert 3.5 < ratio <= 4.0


def test_the_one_stage_planners_price_a_batch_split_dot_as_the_ilp_does():
    a100 = load_cluster("a100-80gb-x8")
    ctx, traced = _dot_context(a100, 1024, 1024)
    got = _by_name(strategies_for(ctx))
    for parts, name in ((1, "RR x RR -> RR"), (4, "S(x)R x RR -> S(x)R")):
        assert node_compute_time_s(traced.graph, ctx.node, ctx.mesh, parts) == pytest.approx(
            got[name].compute_time_s)
