"""Strategies of the contraction families (dot_general, conv_general_dilated): known
strategy lists and counts, collective sizes, the generator contract, and numerical truth on the
8 simulated CPU devices (see strategy_compute_checks.py for the harness)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from strategy_compute_checks import Case, check_best_compute, check_numerics, check_structure
from strategy_helpers import sample, sds

from autopar.plan import CollectiveKind, ShardingSpec

# -- dot_general --------------------------------------------------------------------------------


def matmul(a, b):
    return a @ b


def test_dot_known_strategies_on_1d_mesh():
    case = Case(matmul, (sds(64, 32), sds(32, 16)), (4,), "dot_general")
    check_structure(case)
    assert [s.name for s in case.strategies] == [
        "RR x RR -> RR",
        "S(x)R x RR -> S(x)R",
        "RR x RS(x) -> RS(x)",
        "RS(x) x S(x)R -> RR | AR(x)",
        "RS(x) x S(x)R -> S(x)R | RS(x)",
        "RS(x) x S(x)R -> RS(x) | RS(x)",
    ]
    (ar,) = case.by_name("RS(x) x S(x)R -> RR | AR(x)").collectives
    assert (ar.kind, ar.nbytes, ar.axes) == (CollectiveKind.ALL_REDUCE, 64 * 16 * 4, (0,))
    rs = case.by_name("RS(x) x S(x)R -> S(x)R | RS(x)")
    assert rs.output_specs == (ShardingSpec((("x",), ())),)
    assert [(c.kind, c.nbytes) for c in rs.collectives] == [
        (CollectiveKind.REDUCE_SCATTER, 64 * 16 * 4)]
    check_best_compute(case, 4)
    check_numerics(case)


def test_dot_on_2x4_mesh_counts_and_numerics():
    case = Case(matmul, (sds(64, 32), sds(32, 16)), (2, 4), "dot_general")
    check_structure(case)
    # 4 x 4 assignments of x and y to {none, M, N, K}; the 7 with K split get 2 scatters each.
    assert len(case.strategies) == 16 + 7 * 2
    # partial sums after x on K and y on M: per-device output 64*16*4 / 4 bytes
    s = case.by_name("S(y)S(x) x S(x)R -> S(y)R | AR(x)")
    assert s.collectives[0].nbytes == 64 * 16 * 4 / 4 and s.collectives[0].axes == (0,)
    # a scatter onto a dim y already splits leaves x minor to y
    s = case.by_name("S(y)S(x) x S(x)R -> S(y,x)R | RS(x)")
    assert s.output_specs[0].dims == (("y", "x"), ())
    check_best_compute(case, 8)
    check_numerics(case, [s, *sample(case.strategies, 8)])


def test_dot_size_one_axis_is_never_used():
    a = Case(matmul, (sds(64, 32), sds(32, 16)), (1, 4), "dot_general")
    assert [s.name.replace("y", "x") for s in a.strategies] == [
        s.name for s in Case(matmul, (sds(64, 32), sds(32, 16)), (4,), "dot_general").strategies]


def test_batched_dot_and_vector_dot():
    case = Case(lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
                (sds(4, 8, 16), sds(4, 16, 8)), (2, 4), "dot_general")
    check_structure(case)
    batch = case.by_name("S(x)RS(y) x S(x)S(y)R -> S(x)RR | AR(y)")
    assert batch.input_specs[0].dims == (("x",), (), ("y",))
    check_best_compute(case, 8)
    check_numerics(case, [batch, *sample(case.strategies, 4)])
    vec = Case(lambda a, b: a @ b, (sds(32), sds(32)), (2, 4), "dot_general")
    check_structure(vec)
    assert len(vec.strategies) == 4  # replicated, K over x, y, (x, y); no output dim to scatter
    check_numerics(vec, vec.strategies[::3])


# -- conv_general_dilated -----------------------------------------------------------------------


def conv2d(groups=1):
    def f(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=groups,
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return f


def weight_grad(groups):
    def f(x, w):
        return jax.grad(lambda w: jnp.sum(conv2d(groups)(x, w) ** 2))(w)
    return f


def test_conv_plain():
    case = Case(conv2d(), (sds(8, 6, 6, 8), sds(3, 3, 8, 16)), (2, 4), "conv_general_dilated")
    check_structure(case)
    assert len(case.strategies) == 30  # like a matmul: {none, N, O, C} per axis, 7 x 2 scatters
    assert case.by_name("S(x)RRS(y) x RRS(y)R -> S(x)RRR | AR(y)")
    check_best_compute(case, 8)
    check_numerics(case, sample(case.strategies, 5))
    nchw = Case(lambda x, w: jax.lax.conv_general_dilated(
        x, w, (2, 2), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW")),
        (sds(8, 8, 7, 7), sds(16, 8, 3, 3)), (2, 4), "conv_general_dilated")
    check_structure(nchw)
    assert len(nchw.strategies) == 30
    check_numerics(nchw, [nchw.by_name("S(x)S(y)RR x RS(y)RR -> S(x,y)RRR | RS(y)"),
                          nchw.by_name("S(y)RRR x S(x)RRR -> S(y)S(x)RR")])


def test_conv_depthwise_and_grouped():
    dw = Case(conv2d(8), (sds(8, 6, 6, 8), sds(3, 3, 1, 16)), (2, 4), "conv_general_dilated")
    check_structure(dw)
    # {none, batch, groups} per axis, groups (8) divisible by 8: all 9
    assert len(dw.strategies) == 9
    groups = dw.by_name("RRRS(x,y) x RRRS(x,y) -> RRRS(x,y)")
    check_numerics(dw, [groups, dw.by_name("S(x)RRS(y) x RRRS(y) -> S(x)RRS(y)")])
    grouped = Case(conv2d(4), (sds(8, 6, 6, 8), sds(3, 3, 2, 16)), (2, 4), "conv_general_dilated")
    assert [s.name for s in grouped.strategies] == ["RRRR x RRRR -> RRRR"]
    check_numerics(grouped)


def test_conv_weight_gradient_with_batch_groups():
    case = Case(weight_grad(8), (sds(8, 6, 6, 8), sds(3, 3, 1, 8)), (2, 4),
                "conv_general_dilated")
    assert case.ctx.node.params["batch_group_count"] == 8
    check_structure(case)
    names = {s.name for s in case.strategies}
    # batch groups (lhs N = dim 3 here, rhs O, out C) split freely ...
    assert {"RRRS(x) x RRRS(x) -> RRRS(x)", "RRRS(x,y) x RRRS(x,y) -> RRRS(x,y)"} <= names
    # ... summed splits only when every mesh axis is used (XLA all-reduces over the whole mesh
    # otherwise) and scatters only onto unsplit dims
    assert "S(x)RRS(y) x S(x)RRS(y) -> RRRS(y) | AR(x)" in names
    assert "S(x)RRR x S(x)RRR -> RRRR | AR(x)" not in names
    assert "S(x)RRS(y) x S(x)RRS(y) -> RRRS(y,x) | RS(x)" not in names
    check_numerics(case, case.strategies[1:])  # few compile fast; the replicated one is plain
    on_1d = Case(weight_grad(4), (sds(8, 6, 6, 8), sds(3, 3, 2, 16)), (4,),
                 "conv_general_dilated")
    assert on_1d.ctx.node.params["batch_group_count"] == 4
    ar = on_1d.by_name("S(x)RRR x S(x)RRR -> RRRR | AR(x)")
    check_numerics(on_1d, [ar])


def test_conv_weight_gradient_data_parallel():
    case = Case(weight_grad(1), (sds(8, 6, 6, 8), sds(3, 3, 8, 16)), (2, 4),
                "conv_general_dilated")
    check_structure(case)
    dp = case.by_name("S(x,y)RRR x S(x,y)RRR -> RRRR | AR(x,y)")  # batch is the contraction
    assert dp.collectives[0].nbytes == 3 * 3 * 8 * 16 * 4
    check_numerics(case, [dp, *sample(case.strategies, 3)], tol=1e-4)
