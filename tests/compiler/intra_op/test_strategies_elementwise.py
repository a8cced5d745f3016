"""Strategies of the elementwise, reduction and layout families (and the registry that
serves them with dot and conv): the generator contract, known counts, and numerical truth on
the 8 simulated CPU devices (see strategy_compute_checks.py for the harness)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax._src.lax.lax import reduce_xor_p
from jax.extend.random import threefry2x32_p
from strategy_compute_checks import (
    CLUSTER,
    Case,
    check_best_compute,
    check_numerics,
    check_structure,
)
from strategy_helpers import sample, sds

from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.opgraph import OpGraph, OpNode, TensorInfo
from autopar.compiler.intra_op.strategies import conv, dot, elementwise, layout, reduce, registry
from autopar.compiler.intra_op.strategies.base import StrategyContext
from autopar.compiler.intra_op.strategies.layout import reshape_groups
from autopar.plan import CollectiveKind

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


def test_stack_splits_every_dim_its_operands_share():
    case = Case(lambda a, b: jnp.stack([a, b], axis=1), (sds(8, 16), sds(8, 16)), (2, 4),
                "stack")
    check_structure(case)
    s = case.by_name("S(x)S(y) x S(x)S(y) -> S(x)RS(y)")
    assert s.communication_time_s == 0 and not s.collectives
    # the stacked dim stays whole: XLA exchanged the operands all-to-all to split it
    assert all(st.output_specs[0].dims[1] == () for st in case.strategies)
    check_numerics(case)  # every strategy: none may make XLA communicate


def test_unstack_keeps_the_unstacked_dim_whole():
    case = Case(lambda a: jnp.unstack(a, axis=1), (sds(8, 2, 16),), (2, 4), "unstack")
    check_structure(case)
    assert all(s.input_specs[0].dims[1] == () for s in case.strategies)
    assert case.by_name("S(x)RS(y) -> S(x)S(y), S(x)S(y)") is not None
    check_numerics(case)  # every strategy: none may make XLA communicate


def test_tile_keeps_the_repeated_dim_whole():
    case = Case(lambda a: jnp.tile(a, (1, 2)), (sds(8, 16),), (2, 4), "tile")
    check_structure(case)
    assert all(s.output_specs[0].dims[1] == () for s in case.strategies)
    assert case.by_name("S(x,y)R -> S(x,y)R") is not None
    check_numerics(case)
