"""Compute strategy families (dot, conv, elementwise, reduce, layout): structure, known counts,
and numerical truth — each strategy run under jax.jit on the 8 simulated CPU devices with its
operands placed in its input specs, compared with the unsharded op, and its compiled HLO's
collectives compared with what the strategy claims."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.lax.lax import reduce_xor_p
from jax.extend.random import threefry2x32_p
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autopar.compiler.collectives import CollectiveKind
from autopar.compiler.graph import OpGraph, OpNode, TensorInfo
from autopar.compiler.mesh import LogicalMesh, load_cluster
from autopar.compiler.plan import ShardingSpec
from autopar.compiler.strategies import conv, dot, elementwise, layout, reduce, registry
from autopar.compiler.strategies.base import Strategy, StrategyContext, divisible
from autopar.compiler.strategies.layout import reshape_groups
from autopar.compiler.trace import trace_step
from autopar.hlo import count_collectives

CLUSTER = load_cluster("cpu-sim")
RULES = {**dot.RULES, **conv.RULES, **elementwise.RULES, **elementwise.PRNG_RULES,
         **reduce.RULES, **layout.RULES}


def sds(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


class Case:
    """One op of a traced function on a logical mesh: its context, and a way to run it."""

    def __init__(self, fn, args, mesh_shape, primitive, occurrence=-1, device_ids=None):
        self.traced = trace_step(fn, args)
        nodes = [i for i, n in enumerate(self.traced.graph.nodes) if n.primitive == primitive]
        index = nodes[occurrence]
        self.eqn = self.traced.program.eqns[index]
        self.mesh = LogicalMesh.from_cluster(CLUSTER, mesh_shape, device_ids=device_ids)
        self.ctx = StrategyContext(self.traced.graph.nodes[index], self.traced.graph, self.mesh)
        self.strategies = RULES[primitive](self.ctx)
        self._host: list | None = None
        self._want: list = []

    def by_name(self, name: str) -> Strategy:
        (s,) = [s for s in self.strategies if s.name == name]
        return s

    def run(self, strategy: Strategy):
        """(max relative error vs the unsharded op, collective summary of the compiled HLO)."""
        values = self.traced.program.values
        positions = [k for k, t in enumerate(self.eqn.inputs) if t not in values]
        if self._host is None:  # one set of operands and one reference result per case
            rng = np.random.default_rng(0)
            self._host = [_random(self.ctx.tensor(self.eqn.inputs[k]), rng) for k in positions]
            self._want = jax.jit(lambda *xs: self._op(positions, xs))(*self._host)
        devices = np.array(jax.devices())[self.mesh.device_grid()]
        mesh = Mesh(devices, self.mesh.axis_names)
        placed = [jax.device_put(a, NamedSharding(mesh, pspec(strategy.input_specs[k])))
                  for k, a in zip(positions, self._host, strict=True)]
        outs = [NamedSharding(mesh, pspec(s)) for s in strategy.output_specs]
        sharded = jax.jit(lambda *xs: self._op(positions, xs, outs))
        hlo = sharded.lower(*placed).compile().as_text()
        got = sharded(*placed)
        err = 0.0
        for g, w in zip(got, self._want, strict=True):
            g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
            scale = max(float(np.abs(w64).max(initial=0.0)), 1e-30)
            err = max(err, float(np.abs(g64 - w64).max(initial=0.0)) / scale)
        return err, count_collectives(hlo)

    def _op(self, positions, xs, out_shardings=None):
        """The node's primitive on ``xs`` (its non-literal operands), outputs constrained."""
        values = self.traced.program.values
        operands = [values.get(t) for t in self.eqn.inputs]
        for k, x in zip(positions, xs, strict=True):
            operands[k] = x
        prim = self.eqn.primitive
        out = prim.bind(*operands, **prim.get_bind_params(self.eqn.params))
        outs = list(out) if prim.multiple_results else [out]
        if out_shardings is not None:
            outs = [jax.lax.with_sharding_constraint(o, sh)
                    for o, sh in zip(outs, out_shardings, strict=True)]
        return [jax.random.key_data(o) if _is_key(o) else o for o in outs]


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _random(info: TensorInfo, rng: np.random.Generator):
    if info.dtype.startswith("key"):
        data = rng.integers(0, 1 << 32, (*info.shape, 2), dtype=np.uint32)
        return jax.random.wrap_key_data(data)  # not random.split: that compiles threefry
    dtype = np.dtype(info.dtype)
    if dtype == np.bool_:
        return rng.random(info.shape) > 0.5
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 1 << 20, info.shape).astype(dtype)
    return rng.standard_normal(info.shape).astype(dtype)


def pspec(spec: ShardingSpec | None) -> P:
    """ShardingSpec -> PartitionSpec: () -> None, (a,) -> a, (a, b) -> (a, b)."""
    if spec is None:
        return P()
    return P(*[None if not a else a[0] if len(a) == 1 else tuple(a) for a in spec.dims])


def check_structure(case: Case) -> None:
    """The generator contract, for every strategy of the case."""
    ctx, strategies = case.ctx, case.strategies
    assert strategies
    names = [s.name for s in strategies]
    assert len(set(names)) == len(names), names
    keys = [(s.output_specs, s.input_specs) for s in strategies]
    assert len(set(keys)) == len(keys)
    full = ctx.compute_time(ctx.node.flops, ())
    replicated = [s for s in strategies
                  if all(sp is None or sp.is_replicated for sp in s.input_specs + s.output_specs)]
    assert len(replicated) == 1
    assert replicated[0].compute_time_s == pytest.approx(full)
    assert not replicated[0].collectives
    for s in strategies:
        assert len(s.output_specs) == len(ctx.outputs)
        assert len(s.input_specs) == len(ctx.inputs)
        tensors = list(zip(s.output_specs, ctx.outputs, strict=True))
        tensors += list(zip(s.input_specs, ctx.inputs, strict=True))
        for spec, info in tensors:
            if spec is None:
                assert info.ndim == 0, (s.name, info)
                continue
            assert spec.ndim == info.ndim, (s.name, spec, info.shape)
            used = [a for axes in spec.dims for a in axes]
            assert len(used) == len(set(used)), s.name
            for size, axes in zip(info.shape, spec.dims, strict=True):
                assert all(ctx.axis_size(a) > 1 for a in axes), s.name
                assert divisible(size, ctx, axes), (s.name, info.shape)
        assert s.communication_time_s == pytest.approx(sum(c.time_s for c in s.collectives))
        assert s.compute_time_s >= full / ctx.mesh.num_devices * (1 - 1e-9)


def check_numerics(case: Case, strategies=None, tol: float = 1e-5) -> None:
    """Each strategy computes the unsharded result; its HLO's collectives match its claim."""
    for s in case.strategies if strategies is None else strategies:
        err, hlo = case.run(s)
        assert err <= tol, (s.name, err)
        claims = {c.kind for c in s.collectives}
        if not claims:
            assert hlo.total_count == 0, (s.name, hlo.by_kind())
            continue
        # XLA's CPU pipeline does not form reduce-scatters: a reduce-scatter arrives as an
        # all-reduce plus a local slice (sometimes with a collective-permute to reorder).
        assert hlo.count(CollectiveKind.ALL_GATHER) == 0, (s.name, hlo.by_kind())
        assert hlo.count(CollectiveKind.ALL_TO_ALL) == 0, (s.name, hlo.by_kind())
        reduced = hlo.count(CollectiveKind.ALL_REDUCE) + hlo.count(CollectiveKind.REDUCE_SCATTER)
        assert reduced >= 1, (s.name, hlo.by_kind())
        if claims == {CollectiveKind.ALL_REDUCE}:
            assert hlo.count(CollectiveKind.ALL_REDUCE) >= 1, (s.name, hlo.by_kind())


def sample(strategies: list[Strategy], k: int) -> list[Strategy]:
    """About ``k`` strategies spread evenly over the list (the replicated one is first)."""
    step = max(1, math.ceil(len(strategies) / k))
    return strategies[::step]


def check_best_compute(case: Case, devices: int) -> None:
    full = case.ctx.compute_time(case.ctx.node.flops, ())
    best = min(s.compute_time_s for s in case.strategies)
    assert best == pytest.approx(full / devices)


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


# -- elementwise --------------------------------------------------------------------------------


def test_elementwise_broadcast_operand_and_scalars():
    case = Case(lambda a, b: a + b, (sds(8, 16), sds(1, 16)), (2, 4), "add")
    check_structure(case)
    assert len(case.strategies) == 9  # every spec of an [8, 16] tensor on a 2x4 mesh
    s = case.by_name("S(x)S(y) x RS(y) -> S(x)S(y)")
    assert s.input_specs[1].dims == ((), ("y",))
    check_best_compute(case, 8)
    check_numerics(case, [s, *sample(case.strategies, 3)])
    scaled = Case(lambda a: a * 2.0, (sds(8, 16),), (2, 4), "mul")
    check_structure(scaled)
    assert all(s.input_specs[1] is None for s in scaled.strategies)
    check_numerics(scaled, sample(scaled.strategies, 2))


@pytest.mark.parametrize("fn, args, primitive", [
    (lambda p, a, b: jax.lax.select(p, a, b),
     (sds(8, 16, dtype=jnp.bool_), sds(8, 16), sds(8, 16)), "select_n"),
    (lambda a: a.astype(jnp.bfloat16), (sds(8, 16),), "convert_element_type"),
    (lambda a: jax.lax.bitcast_convert_type(a, jnp.int32), (sds(8, 16),), "bitcast_convert_type"),
    (lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8), (sds(8, 16),), "bitcast_convert_type"),
    (lambda a, b, c, d: threefry2x32_p.bind(a, b, c, d), (sds(8, 16, dtype=jnp.uint32),) * 4,
     "threefry2x32"),
    (jax.random.wrap_key_data, (sds(8, 4, 2, dtype=jnp.uint32),), "random_wrap"),
    (jax.random.key_data, (jax.ShapeDtypeStruct((8, 4), jax.random.key(0).dtype),),
     "random_unwrap"),
    (lambda a, b: jax.lax.optimization_barrier((a, b)), (sds(8, 16), sds(8)),
     "optimization_barrier"),
    (lambda a: jax.lax.reduce_precision(a, 5, 10), (sds(8, 16),), "reduce_precision"),
])
def test_elementwise_family(fn, args, primitive):
    case = Case(fn, args, (2, 4), primitive)
    check_structure(case)
    if primitive in ("random_wrap", "random_unwrap", "bitcast_convert_type"):
        for s in case.strategies:  # the key-data / byte dim never splits
            longer = max([*s.input_specs, *s.output_specs], key=lambda sp: sp.ndim)
            assert longer.ndim == 2 or longer.dims[-1] == ()
    check_numerics(case, sample(case.strategies, 2))


def test_optimization_barrier_follows_one_spec():
    case = Case(lambda a, b: jax.lax.optimization_barrier((a, b)), (sds(8, 16), sds(8)), (2, 4),
                "optimization_barrier")
    s = case.by_name("S(x)S(y) x S(x) -> S(x)S(y), S(x)")
    assert s.output_specs == s.input_specs


# -- reductions ---------------------------------------------------------------------------------


def test_reduce_sum_splits_and_all_reduces():
    case = Case(lambda a: jnp.sum(a, axis=1), (sds(8, 16),), (2, 4), "reduce_sum")
    check_structure(case)
    assert len(case.strategies) == 9
    s = case.by_name("S(x)S(y) -> S(x) | AR(y)")
    (ar,) = s.collectives
    assert (ar.kind, ar.nbytes, ar.axes) == (CollectiveKind.ALL_REDUCE, 8 * 4 / 2, (1,))
    check_best_compute(case, 8)
    check_numerics(case, [s, *sample(case.strategies, 3)])


def test_reduction_on_a_mesh_of_other_devices():
    case = Case(lambda a: jnp.sum(a, axis=0), (sds(8, 16),), (4, 2), "reduce_sum",
                device_ids=(7, 6, 5, 4, 3, 2, 1, 0))
    check_structure(case)
    check_numerics(case, case.strategies[1::2])


@pytest.mark.parametrize("fn, args, primitive", [
    (lambda a: jnp.max(a, axis=(0, 2)), (sds(8, 4, 16),), "reduce_max"),
    (lambda a: jnp.min(a, axis=0), (sds(8, 16),), "reduce_min"),
    (lambda a: jnp.prod(a, axis=0), (sds(8, 16),), "reduce_prod"),
    (lambda a: jnp.all(a, axis=0), (sds(8, 16, dtype=jnp.bool_),), "reduce_and"),
    (lambda a: jnp.any(a, axis=1), (sds(8, 16, dtype=jnp.bool_),), "reduce_or"),
    (lambda a: reduce_xor_p.bind(a, axes=(1,)), (sds(8, 16, dtype=jnp.uint32),), "reduce_xor"),
])
def test_reduction_family(fn, args, primitive):
    case = Case(fn, args, (2, 4), primitive)
    check_structure(case)
    check_numerics(case, sample(case.strategies, 3))


@pytest.mark.parametrize("primitive", ["argmax", "argmin"])
def test_arg_reductions_never_split_the_reduced_dim(primitive):
    fn = jnp.argmax if primitive == "argmax" else jnp.argmin
    case = Case(lambda a: fn(a, axis=1), (sds(8, 16),), (2, 4), primitive)
    check_structure(case)
    assert [s.name for s in case.strategies] == [
        "RR -> R", "S(y)R -> S(y)", "S(x)R -> S(x)", "S(x,y)R -> S(x,y)"]
    check_numerics(case, case.strategies[2:])


# -- layout -------------------------------------------------------------------------------------


def test_broadcast_in_dim_new_and_size_one_dims():
    case = Case(lambda a: jnp.broadcast_to(a[:, None, :1], (8, 4, 16)), (sds(8, 16),), (2, 4),
                "broadcast_in_dim", occurrence=-1)
    assert case.ctx.inputs[0].shape == (8, 1, 1) and case.ctx.outputs[0].shape == (8, 4, 16)
    check_structure(case)
    s = case.by_name("S(x)RR -> S(x)S(y)R")  # y splits a new dim for free
    assert s.input_specs[0].dims == (("x",), (), ())
    check_numerics(case, [s, *sample(case.strategies, 3)])


def test_transpose_and_squeeze():
    case = Case(lambda a: a.transpose(2, 0, 1), (sds(8, 4, 16),), (2, 4), "transpose")
    check_structure(case)
    s = case.by_name("S(y)RS(x) -> S(x)S(y)R")
    assert s.output_specs[0].dims == (("x",), ("y",), ())
    check_numerics(case, [s, *sample(case.strategies, 3)])
    sq = Case(lambda a: jax.lax.squeeze(a, (1,)), (sds(8, 1, 16),), (2, 4), "squeeze")
    check_structure(sq)
    assert len(sq.strategies) == 9
    check_numerics(sq, sample(sq.strategies, 2))


def test_expand_dims_node():
    t = {0: TensorInfo(0, (8, 16), "float32", "input"),
         1: TensorInfo(1, (8, 1, 16), "float32", "intermediate")}
    node = OpNode(0, "expand_dims", (0,), (1,), 0.0, 0.0, {"dimensions": (1,)})
    graph = OpGraph([node], t, [], [])
    ctx = StrategyContext(node, graph, LogicalMesh.from_cluster(CLUSTER, (2, 4)))
    strategies = layout.RULES["expand_dims"](ctx)
    assert len(strategies) == 9
    assert all(s.output_specs[0].dims[1] == () for s in strategies)


def test_reshape_groups():
    assert reshape_groups((8, 16, 64), (128, 64)) == [([0, 1], [0]), ([2], [1])]
    assert reshape_groups((8, 16, 64), (8, 16, 8, 8)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert reshape_groups((6, 4), (4, 6)) == [([0, 1], [0, 1])]
    assert reshape_groups((2, 1, 3), (1, 6, 1)) == [([0, 2], [1])]


@pytest.mark.parametrize("in_shape, out_shape, mesh_shape, expected", [
    # merge: the merged dim splits like its major part (8 over 2x4 ok); the minor part never
    ((8, 16, 64), (128, 64), (2, 4), 9),
    # split: the major piece (8) carries the split of 64; the minor piece never splits
    ((8, 16, 64), (8, 16, 8, 8), (2, 4), 16),
    ((8, 16, 8, 8), (8, 16, 64), (2, 4), 16),
    # regrouping (6, 4) -> (4, 6): only a split both 6 and 4 divide (2)
    ((6, 4), (4, 6), (2,), 2),
    # merge whose major dim (2) is smaller than the axis (4): only what 2 divides
    ((2, 32), (64,), (4,), 1),
])
def test_reshape(in_shape, out_shape, mesh_shape, expected):
    case = Case(lambda a: a.reshape(out_shape), (sds(*in_shape),), mesh_shape, "reshape")
    check_structure(case)
    assert len(case.strategies) == expected, [s.name for s in case.strategies]
    check_numerics(case, sample(case.strategies, 5))  # no collectives at all


def test_registry_serves_these_families():
    merged = registry()
    for module in (dot, conv, elementwise, reduce, layout):
        for name, rule in module.RULES.items():
            assert merged[name] is rule, name
