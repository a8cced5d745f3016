"""Strategies of the slicing, misc (iota, random) and control-flow families, and the rule
tables of all data-movement families. Each node's strategies are checked for structure and for
truth on devices on a 1-D and a 2-D mesh (see strategy_data_checks.py for the harness)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from strategy_data_checks import (
    MESHES,
    RULES,
    check_node,
    check_structure,
    context,
    logical_mesh,
)
from strategy_helpers import sds

from autopar.compiler.graph.trace import TracedStep, build_graph, trace_step
from autopar.compiler.intra_op.strategies import control, indexing, misc, slicing
from autopar.compiler.intra_op.strategies.base import Strategy, StrategyContext
from autopar.ir.flatten import flatten_step
from autopar.ir.program import SCAN_ENTER, SCAN_EXIT
from autopar.models import get_model
from autopar.plan import CollectiveKind

# -- slicing family ----------------------------------------------------------------------------


def maxpool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


SLICING_CASES: dict[str, tuple[Callable, tuple, str, dict[int, int], set[int]]] = {
    # name: (fn, args, primitive, int bounds, dims that must never be split on the output)
    "slice": (lambda x: x[:, 1:5], (sds(8, 8),), "slice", {}, {1}),
    "pad": (lambda x: jnp.pad(x, ((0, 0), (1, 2))), (sds(8, 8),), "pad", {}, {1}),
    "pad_interior": (lambda x: lax.pad(x, 0.0, ((1, -1, 0), (0, 0, 1))), (sds(8, 8),), "pad",
                     {}, {0, 1}),
    "rev": (lambda x: jnp.flip(x, 1), (sds(8, 8),), "rev", {}, {1}),
    "concatenate": (lambda x, y: jnp.concatenate([x, y], 1), (sds(8, 8), sds(8, 4)),
                    "concatenate", {}, {1}),
    "split": (lambda x: jnp.split(x, 2, axis=1), (sds(8, 8),), "split", {}, {1}),
    "dynamic_slice": (lambda x, i: lax.dynamic_slice(x, (0, i), (8, 2)),
                      (sds(8, 8), sds(dtype=jnp.int32)), "dynamic_slice", {1: 6}, {1}),
    "dynamic_update_slice": (lambda x, u, i: lax.dynamic_update_slice(x, u, (0, i)),
                             (sds(8, 8), sds(8, 2), sds(dtype=jnp.int32)),
                             "dynamic_update_slice", {2: 6}, {1}),
    "cumsum": (lambda x: jnp.cumsum(x, 1), (sds(8, 8),), "cumsum", {}, {1}),
    "cummax_reverse": (lambda x: lax.cummax(x, 0, reverse=True), (sds(8, 8),), "cummax", {},
                       {0}),
    "cumlogsumexp": (lambda x: lax.cumlogsumexp(x, 1), (sds(8, 8),), "cumlogsumexp", {}, {1}),
    "sort": (lambda x: jnp.sort(x, 1), (sds(8, 8),), "sort", {}, {1}),
    "argsort": (lambda x: jnp.argsort(x, 0), (sds(8, 8),), "sort", {}, {0}),
    "top_k": (lambda x: lax.top_k(x, 3), (sds(8, 8),), "top_k", {}, {1}),
    "approx_top_k": (lambda x: lax.approx_max_k(x, 3), (sds(8, 16),), "approx_top_k", {}, {1}),
    "maxpool": (maxpool, (sds(4, 8, 8, 8),), "reduce_window_max", {}, {1, 2}),
    "maxpool_grad": (jax.grad(lambda x: jnp.sum(maxpool(x) ** 2)), (sds(4, 8, 8, 8),),
                     "select_and_scatter_add", {}, {1, 2}),
    "maxpool_jvp": (lambda x, t: jax.jvp(maxpool, (x,), (t,))[1],
                    (sds(4, 8, 8, 4), sds(4, 8, 8, 4)), "select_and_gather_add", {}, {1, 2}),
    "avgpool_same": (lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 1, 1, 1),
                                                 "SAME"), (sds(4, 8, 8, 8),),
                     "reduce_window_sum", {}, {1, 2}),
    "reduce_window_generic": (lambda x: lax.reduce_window(x, 1.0, lax.mul, (1, 3), (1, 1),
                                                          "SAME"), (sds(8, 8),),
                              "reduce_window", {}, {1}),
}
# select_and_scatter_add compiles slowly on CPU (~0.4 s per strategy): on the 2-D mesh only
# one strategy using both axes (on two different dims) runs on devices.
SAMPLED = {"maxpool_grad": lambda s: s.name == "P('x', None, None, 'y')"}


@pytest.mark.parametrize("case", sorted(SLICING_CASES))
def test_slicing_family(case):
    fn, args, primitive, bounds, blocked = SLICING_CASES[case]
    got = check_node(trace_step(fn, args), primitive, bounds=bounds,
                     sample_2d=SAMPLED.get(case))
    for by_name in got.values():
        for s in by_name.values():
            assert not any(s.output_specs[0].dims[d] for d in blocked), (case, s.name)
            # one spec for every operand and output of the op's rank (rank-0 ones: None)
            assert all(spec is None or spec == s.output_specs[0] for spec in s.input_specs)
            assert all(spec == s.output_specs[0] for spec in s.output_specs)
            if primitive != "top_k":
                assert not s.collectives
            elif s.name != "replicated":  # XLA all-gathers the operand (see slicing.py)
                (ag,) = s.collectives
                assert ag.kind is CollectiveKind.ALL_GATHER and ag.nbytes == 8 * 8 * 4
    expected_1d = 1 if case == "pad_interior" else 2 if len(args[0].shape) == 2 else 3
    assert len(got["1d"]) == expected_1d  # pad_interior pads every dim: replicated only


# -- misc ----------------------------------------------------------------------------------------


def test_iota_any_spec_is_free():
    got = check_node(trace_step(lambda: lax.broadcasted_iota(jnp.int32, (8, 8), 1), ()), "iota")
    assert len(got["1d"]) == 3 and len(got["2d"]) == 9
    assert all(not s.collectives and not s.input_specs
               for by_name in got.values() for s in by_name.values())


def test_random_is_replicated_only():
    def fn(raw):
        key = jax.random.wrap_key_data(raw)
        a = jax.random.bits(jax.random.fold_in(key, 3), (8,))
        return a, jax.random.key_data(jax.random.split(key, 4))

    traced = trace_step(fn, (sds(2, dtype=jnp.uint32),))
    for primitive in ("random_wrap", "random_fold_in", "random_bits", "random_split",
                      "random_unwrap"):
        for kind in MESHES:
            ctx = context(traced, primitive, kind)
            got = RULES[primitive](ctx)
            check_structure(ctx, got)
            assert names(got) == {"replicated"}
    # on devices once: the replicated bits equal the single-device bits
    check_node(traced, "random_bits")


# -- control flow --------------------------------------------------------------------------------


def scan_elementwise(c, xs, w):
    return lax.scan(lambda c, x: (c * w + x, jnp.sin(c) * x + 1.0), c, xs)


CONTROL_CASES: dict[str, tuple[Callable, tuple, str, dict[int, int]]] = {
    "scan": (scan_elementwise, (sds(8, 4), sds(5, 8, 4), sds(8, 4)), "scan", {}),
    "while": (lambda x: lax.while_loop(lambda s: s[0] < 3,
                                       lambda s: (s[0] + 1, s[1] * 2.0 + 1.0), (0, x)),
              (sds(8, 4),), "while", {}),
    "cond": (lambda p, x: lax.cond(p, lambda x: x * 2, jnp.zeros_like, x),
             (sds(dtype=jnp.int32), sds(8, 4)), "cond", {0: 2}),
}


def trace_whole(fn, args) -> TracedStep:
    """Traced with scans kept as single nodes, as the pipeline pass's programs keep them
    (one-stage planning expands them into regions: tests/compiler/intra_op/test_scan*.py)."""
    program = flatten_step(fn, tuple(args))
    return TracedStep(program, build_graph(program))


@pytest.mark.parametrize("case", sorted(CONTROL_CASES))
def test_control_flow_batch_strategy(case):
    fn, args, primitive, bounds = CONTROL_CASES[case]
    got = check_node(trace_whole(fn, args), primitive, bounds=bounds)
    assert set(got["1d"]) == {"replicated", "batch:x"}
    assert set(got["2d"]) == {"replicated", "batch:x", "batch:y", "batch:x+y"}
    s = got["1d"]["batch:x"]
    if case == "scan":  # consts (w) and carry split on dim 0, xs and ys on dim 1
        assert [sp.dims for sp in s.input_specs] == [(("x",), ()), (("x",), ()),
                                                    ((), ("x",), ())]
        assert [sp.dims for sp in s.output_specs] == [(("x",), ()), ((), ("x",), ())]
    else:  # the loop counter and the cond index are rank 0: no requirement
        assert s.input_specs[0] is None
    assert s.compute_time_s == pytest.approx(got["1d"]["replicated"].compute_time_s / 4)


@pytest.mark.parametrize("fn, args, primitive", [
    (lambda c, xs: lax.scan(lambda c, x: (c + jnp.sum(x), x), c, xs),
     (sds(8, 4), sds(5, 8, 4)), "scan"),  # reduction in the body
    (lambda x: lax.while_loop(lambda s: jnp.any(s < 10.0), lambda s: s * 2.0, x),
     (sds(8, 4),), "while"),  # the trip count depends on the whole array
    (lambda p, x: lax.cond(p, lambda x: x @ x, lambda x: x, x),
     (sds(dtype=jnp.bool_), sds(4, 4)), "cond"),  # a dot mixes rows
    (lambda c, xs: lax.scan(lambda c, x: (c + jnp.arange(8.0)[:, None], x), c, xs),
     (sds(8, 4), sds(5, 8, 4)), "scan"),  # iota / array broadcast: position-dependent
])
def test_control_flow_outside_the_accepted_bodies_is_replicated(fn, args, primitive):
    traced = trace_whole(fn, args)
    ctx = context(traced, primitive, "2d")
    got = RULES[primitive](ctx)
    check_structure(ctx, got)
    assert names(got) == {"replicated"}


def test_replicated_fallback_for_any_primitive():
    traced = trace_step(lambda a, b: jnp.tanh(a @ b), (sds(8, 16), sds(16, 4)))
    for node in traced.graph.nodes:
        ctx = StrategyContext(node, traced.graph, logical_mesh("2d"))
        s = control.replicated_strategy(ctx)
        check_structure(ctx, [s])
        assert s.compute_time_s == pytest.approx(ctx.compute_time(node.flops, ()))


def test_zoo_model_nodes_keep_the_contract():
    """Every node of the MoE train step these families own (embedding gather and its
    scatter-add, cumsum for expert positions, iota) yields valid strategies on both meshes."""
    model = get_model("moe")
    traced = trace_step(model.train_step, model.abstract_inputs())
    seen = set()
    for node in traced.graph.nodes:
        if node.primitive in RULES:
            seen.add(node.primitive)
            for kind in MESHES:
                ctx = StrategyContext(node, traced.graph, logical_mesh(kind))
                check_structure(ctx, RULES[node.primitive](ctx))
    assert {"gather", "scatter-add", "cumsum", "iota"} <= seen


def names(strategies: Sequence[Strategy]) -> set[str]:
    return {s.name for s in strategies}


def test_rule_tables_cover_the_primitive_names():
    assert set(indexing.RULES) == {"gather", "scatter", "scatter-add", "scatter-sub",
                                   "scatter-mul", "scatter-min", "scatter-max"}
    assert {"slice", "pad", "rev", "dynamic_slice", "dynamic_update_slice", "concatenate",
            "split", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "top_k",
            "reduce_window_max", "reduce_window_min", "reduce_window_sum", "reduce_window",
            "select_and_scatter_add", "select_and_gather_add"} <= set(slicing.RULES)
    assert {"iota", "random_bits", "random_seed", "random_fold_in", "random_split",
            "rng_bit_generator", "rng_uniform"} <= set(misc.RULES)
    assert set(control.RULES) == {"scan", "while", "cond", SCAN_ENTER.name, SCAN_EXIT.name}
    assert "select_n" not in RULES
    tables = [indexing.RULES, slicing.RULES, misc.RULES, control.RULES]
    assert sum(len(t) for t in tables) == len(RULES)  # no primitive claimed twice
