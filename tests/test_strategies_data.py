"""Strategies of the data-movement families: indexing (gather/scatter), slicing, misc, control.

Every case traces a small program, picks a node and generates its strategies on a 1-D mesh of
4 and a 2-D 2x4 mesh. Checks: structure (replicated present, names unique, ranks, divisibility,
costs add up) and truth: the node's own primitive is run under ``jax.jit`` on the simulated
devices with operands placed in the strategy's input specs and outputs constrained to its
output specs; the result must equal the unsharded one, and the compiled HLO must hold exactly
the collectives the strategies claim (kind, bytes and group size of each).

To keep compile time low, all strategies of one node on one mesh run in one program, each on
its own copies of the operands: the HLO's collectives, as a multiset of (kind, bytes, group
size) taken array by array (which also undoes XLA's combining of independent all-reduces into
one tuple all-reduce), must equal the union of the claims. Collectives cannot cancel, so a
strategy claiming none that emitted one would show. On a mismatch each strategy is recompiled
alone so the message names the culprit. The unsharded reference is one plain ``jax.jit`` run.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.compiler.collectives import CollectiveKind
from autopar.compiler.mesh import LogicalMesh, load_cluster
from autopar.compiler.plan import ShardingSpec
from autopar.compiler.strategies import control, indexing, misc, slicing
from autopar.compiler.strategies.base import Strategy, StrategyContext, divisible
from autopar.compiler.trace import TracedStep, trace_step
from autopar.hlo import parse_collectives
from autopar.models import get_model

RULES = {**indexing.RULES, **slicing.RULES, **misc.RULES, **control.RULES}
MESHES = {"1d": ((4,), (4, 5, 6, 7)), "2d": ((2, 4), tuple(range(8)))}


def sds(*shape: int, dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def logical_mesh(kind: str) -> LogicalMesh:
    shape, ids = MESHES[kind]
    return LogicalMesh.from_cluster(load_cluster("cpu-sim"), shape, device_ids=ids)


def jax_mesh(mesh: LogicalMesh) -> Mesh:
    devices = np.array(jax.devices())[list(mesh.device_ids)].reshape(mesh.shape)
    return Mesh(devices, mesh.axis_names)


def pspec(spec: ShardingSpec | None) -> PartitionSpec:
    if spec is None:
        return PartitionSpec()
    return PartitionSpec(*[None if not a else a[0] if len(a) == 1 else tuple(a)
                           for a in spec.dims])


def node_of(traced: TracedStep, primitive: str, which: int = 0):
    return [n for n in traced.graph.nodes if n.primitive == primitive][which]


def context(traced: TracedStep, primitive: str, mesh_kind: str, which: int = 0):
    return StrategyContext(node_of(traced, primitive, which), traced.graph,
                           logical_mesh(mesh_kind))


# -- structure ---------------------------------------------------------------------------------


def check_structure(ctx: StrategyContext, strategies: Sequence[Strategy]) -> None:
    """The contract every generator keeps."""
    assert strategies, "no strategy"
    names = [s.name for s in strategies]
    assert len(names) == len(set(names)), f"duplicate names: {names}"
    full = ctx.compute_time(ctx.node.flops, ())
    rep = next(s for s in strategies if s.name == "replicated")
    assert all(s.is_replicated for s in rep.output_specs)
    assert all((s is None) if t.ndim == 0 else s.is_replicated
               for s, t in zip(rep.input_specs, ctx.inputs, strict=True))
    assert rep.compute_time_s == pytest.approx(full) and rep.communication_time_s == 0
    usable = {a for a in ctx.axis_names if ctx.axis_size(a) > 1}
    for s in strategies:
        assert len(s.output_specs) == len(ctx.outputs) and len(s.input_specs) == len(ctx.inputs)
        pairs = [*zip(s.output_specs, ctx.outputs, strict=True),
                 *zip(s.input_specs, ctx.inputs, strict=True)]
        for spec, info in pairs:
            if info.ndim == 0:
                assert spec is None or spec.ndim == 0, f"{s.name}: rank-0 operand spec {spec}"
                continue
            assert spec is not None and spec.ndim == info.ndim, f"{s.name}: rank of {spec}"
            used = [a for axes in spec.dims for a in axes]
            assert set(used) <= usable and len(used) == len(set(used)), f"{s.name}: {spec}"
            assert all(divisible(n, ctx, axes) for n, axes in zip(info.shape, spec.dims,
                                                                 strict=True)), s.name
        assert s.communication_time_s == pytest.approx(sum(c.time_s for c in s.collectives))
        assert bool(s.collectives) == (s.communication_time_s > 0)
        assert s.compute_time_s <= full * (1 + 1e-9)


# -- truth on devices --------------------------------------------------------------------------


def operand_data(traced: TracedStep, node, bounds: dict[int, int], seed: int = 0) -> list:
    """Random operands: floats normal, ints in [0, bounds[i]) (indices; a bound past the
    indexed size tests out-of-range ids), keys split from one key; literals and constants keep
    their traced values. Host (numpy) arrays, so placing them in a spec is a plain transfer,
    not a compiled resharding program."""
    rng = np.random.default_rng(seed)
    data = []
    for pos, t in enumerate(node.inputs):
        if t in traced.program.values:
            data.append(traced.program.values[t])
            continue
        info = traced.graph.tensors[t]
        if info.dtype.startswith("key"):
            keys = jax.random.split(jax.random.key(seed), max(info.size, 1))
            data.append(keys[0] if info.ndim == 0 else keys.reshape(info.shape))
        elif "int" in info.dtype:
            data.append(rng.integers(0, bounds.get(pos, 2), info.shape).astype(info.dtype))
        elif info.dtype == "bool":
            data.append(rng.integers(0, 2, info.shape).astype(bool))
        else:
            data.append(rng.standard_normal(info.shape).astype(info.dtype))
    return data


def host(x: Any) -> np.ndarray:
    """A result as numpy (PRNG keys as their key data)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def node_fn(traced: TracedStep, node) -> Callable[..., tuple]:
    """The node's primitive with its own params, as a function of its operands."""
    eqn = traced.program.eqns[node.id]
    assert eqn.index == node.id and eqn.name == node.primitive
    params = eqn.primitive.get_bind_params(eqn.params)

    def fn(*xs: Any) -> tuple:
        out = eqn.primitive.bind(*xs, **params)
        return tuple(out) if eqn.primitive.multiple_results else (out,)

    return fn


def compile_group(fn, mesh: Mesh, group: Sequence[Strategy], operands: list):
    """One program running ``fn`` once per strategy, each on its own placed operands."""
    args = [jax.device_put(x, NamedSharding(mesh, pspec(spec)))
            for s in group for x, spec in zip(operands, s.input_specs, strict=True)]
    n = len(operands)

    def program(*flat: Any) -> tuple:
        results = []
        for k, s in enumerate(group):
            outs = fn(*flat[k * n:(k + 1) * n])
            results.append(tuple(lax.with_sharding_constraint(o, NamedSharding(mesh, pspec(sp)))
                                 for o, sp in zip(outs, s.output_specs, strict=True)))
        return tuple(results)

    compiled = jax.jit(program).lower(*args).compile()
    return compiled(*args), emitted(compiled.as_text())


_ITEMSIZE = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "pred": 1, "s8": 1, "u8": 1,
             "f64": 8, "s64": 8, "u64": 8}

Signature = Counter  # (kind, bytes, group size) -> how many


def emitted(hlo_text: str) -> Signature:
    """Every collective of the compiled HLO as (kind, bytes, group size), one entry per array.

    XLA combines independent all-reduces (here: of different strategies compiled together)
    into one tuple-shaped all-reduce; counting its arrays one by one undoes that. Bytes follow
    the cost model's convention (all-reduce: the per-device buffer; all-gather: the result).
    """
    found: Signature = Counter()
    for c in parse_collectives(hlo_text):
        for dtype, dims in c.result_shapes:
            nbytes = _ITEMSIZE[dtype] * math.prod(dims)
            found[(c.kind, nbytes, c.group_size)] += 1
    return found


def claimed(group: Sequence[Strategy], mesh: LogicalMesh) -> Signature:
    found: Signature = Counter()
    for s in group:
        for c in s.collectives:
            size = math.prod(mesh.shape[a] for a in c.axes)
            found[(c.kind.value, int(c.nbytes), size)] += c.count
    return found


def check_truth(traced: TracedStep, node, mesh: LogicalMesh, strategies: Sequence[Strategy],
                operands: list, reference: Sequence[Any]) -> None:
    """All ``strategies`` in one program: each result equals ``reference`` (the unsharded
    run), and the collectives in the HLO are exactly the ones claimed."""
    fn = node_fn(traced, node)
    jm = jax_mesh(mesh)
    results, summary = compile_group(fn, jm, strategies, operands)
    for s, outs in zip(strategies, results, strict=True):
        for got, want in zip(outs, reference, strict=True):
            np.testing.assert_allclose(host(got), host(want), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{node.primitive} {s.name}")
    if summary != claimed(strategies, mesh):
        detail = {s.name: (dict(claimed([s], mesh)),
                           dict(compile_group(fn, jm, [s], operands)[1])) for s in strategies}
        raise AssertionError(f"{node.primitive}: claimed {dict(claimed(strategies, mesh))}, "
                             f"emitted {dict(summary)}; per strategy (claimed, emitted): "
                             f"{detail}")


def check_node(traced: TracedStep, primitive: str, which: int = 0,
               bounds: dict[int, int] | None = None,
               sample_2d: Callable[[Strategy], bool] | None = None,
               ) -> dict[str, dict[str, Strategy]]:
    """Strategies of the node on both meshes, structure and truth checked; by mesh, by name.

    ``sample_2d`` limits the on-device check on the 2-D mesh to some strategies (for ops whose
    compile is slow); the structure of all is still checked."""
    node = node_of(traced, primitive, which)
    operands = operand_data(traced, node, bounds or {})
    reference = jax.jit(node_fn(traced, node))(*operands)
    found = {}
    for kind in MESHES:
        ctx = StrategyContext(node, traced.graph, logical_mesh(kind))
        strategies = RULES[primitive](ctx)
        check_structure(ctx, strategies)
        run = [s for s in strategies if kind == "1d" or sample_2d is None or sample_2d(s)]
        check_truth(traced, node, ctx.mesh, run, operands, reference)
        found[kind] = {s.name: s for s in strategies}
    return found


# -- gather / scatter --------------------------------------------------------------------------

EMB = (sds(16, 8), sds(4, 6, dtype=jnp.int32))  # table [V, H], ids [B, S]


def embed(table, ids):
    return jnp.take(table, ids, axis=0)


def embed_loss(table, ids):
    return jnp.sum(embed(table, ids) ** 2)


def two_roles(s: Strategy) -> bool:
    """A gather/scatter strategy giving the two mesh axes different roles (the 2-D cases the
    1-D mesh cannot show); used to sample the 2-D on-device checks of the larger cases."""
    return " " in s.name


def test_embedding_lookup():
    # ids up to 19 for 16 rows: out-of-range ids read the fill value (NaN) in every strategy
    got = check_node(trace_step(embed, EMB), "gather", bounds={1: 20})
    assert set(got["1d"]) == {"replicated", "batch0:x", "pass1:x", "vocab0:x"}
    # S = 6 is not divisible by 4: no batch1:y
    assert {"batch1:x batch0:y", "vocab0:x+y", "batch0:x vocab0:y", "pass1:x+y"} <= set(got["2d"])
    assert "batch0:x batch1:y" not in got["2d"]
    vocab = got["1d"]["vocab0:x"]
    (ar,) = vocab.collectives
    # the all-reduce carries each device's output buffer (here the whole [B, S, H] output)
    assert ar.kind is CollectiveKind.ALL_REDUCE and ar.nbytes == 4 * 6 * 8 * 4
    assert vocab.input_specs[0].dims == (("x",), ()) and vocab.output_specs[0].is_replicated
    assert vocab.input_specs[1].is_replicated
    (ar,) = got["2d"]["batch0:x vocab0:y"].collectives  # output split on x: half the buffer
    assert ar.nbytes == 4 * 6 * 8 * 4 / 2 and ar.axes == (1,)
    passing = got["1d"]["pass1:x"]
    assert not passing.collectives and passing.output_specs[0].dims == ((), (), ("x",))
    batch = got["1d"]["batch0:x"]
    assert batch.compute_time_s == pytest.approx(vocab.compute_time_s / 4)


def test_embedding_gradient_scatter_add():
    got = check_node(trace_step(jax.grad(embed_loss), EMB), "scatter-add", bounds={1: 16})
    batch = got["1d"]["batch0:x"]
    # updates/indices split on the batch dim, operand and output whole, all-reduce of output
    assert batch.input_specs[2].dims == (("x",), (), ()) and batch.input_specs[0].is_replicated
    assert batch.output_specs[0].is_replicated
    (ar,) = batch.collectives
    assert ar.kind is CollectiveKind.ALL_REDUCE and ar.nbytes == 16 * 8 * 4
    assert not got["1d"]["vocab0:x"].collectives  # each device applies the rows it owns
    # two reducing roles: XLA reduces one dimension at a time, two all-reduces (checked on HLO)
    assert len(got["2d"]["batch1:x batch0:y"].collectives) == 2


def test_scatter_add_nonzero_operand_counted_once():
    """x.at[i].add(u) with x != 0: splitting the updates must not add x once per device."""
    traced = trace_step(lambda x, i, u: x.at[i].add(u, mode="clip"),
                        (sds(16, 8), sds(4, 2, dtype=jnp.int32), sds(4, 2, 8)))
    got = check_node(traced, "scatter-add", bounds={1: 20},  # clipped: ids 16..19 -> row 15
                     sample_2d=lambda s: s.name in ("batch1:x batch0:y", "batch0:x+y"))
    assert got["1d"]["batch0:x"].collectives and got["2d"]["batch1:x batch0:y"].collectives


def test_take_along_axis_and_its_gradient():
    """Batching dims: the operand's batch dim is split with the indices' (no communication)."""
    args = (sds(4, 8), sds(4, 4, dtype=jnp.int32))
    traced = trace_step(lambda x, i: jnp.take_along_axis(x, i, axis=1), args)
    got = check_node(traced, "gather", bounds={1: 8})["1d"]
    assert got["batch0:x"].input_specs[0].dims == (("x",), ())  # operand rows follow
    assert not got["batch0:x"].collectives and got["vocab1:x"].collectives

    def loss(x, i):
        return jnp.sum(jnp.take_along_axis(x, i, axis=1) ** 2)

    got = check_node(trace_step(jax.grad(loss), args), "scatter-add", bounds={1: 8},
                     sample_2d=two_roles)["1d"]
    assert not got["batch0:x"].collectives  # batching dim: each device its own rows
    assert got["batch1:x"].collectives  # plain scatter dim: partial sums


def test_gather_two_indexed_dims():
    traced = trace_step(lambda x, i, j: x[i, :, j],
                        (sds(8, 4, 8), sds(4, dtype=jnp.int32), sds(4, dtype=jnp.int32)))
    got = check_node(traced, "gather", bounds={1: 8, 2: 8}, sample_2d=two_roles)
    assert set(got["1d"]) == {"replicated", "batch0:x", "pass1:x", "vocab0:x", "vocab2:x"}
    assert len(got["2d"]["vocab0:x vocab2:y"].collectives) == 2


@pytest.mark.parametrize("method, primitive", [("set", "scatter"), ("max", "scatter-max")])
def test_non_additive_scatter_has_no_partial_sum_strategy(method, primitive):
    def fn(x, i, u):
        return getattr(x.at[i], method)(u)

    traced = trace_step(fn, (sds(16, 8), sds(4, dtype=jnp.int32), sds(4, 8)))
    got = check_node(traced, primitive, bounds={1: 16},
                     sample_2d=None if method == "set" else two_roles)
    assert set(got["1d"]) == {"replicated", "vocab0:x", "pass1:x"}
    assert all(not s.collectives for s in got["2d"].values())
    assert not any("batch" in name for name in got["2d"])


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


@pytest.mark.parametrize("case", sorted(CONTROL_CASES))
def test_control_flow_batch_strategy(case):
    fn, args, primitive, bounds = CONTROL_CASES[case]
    got = check_node(trace_step(fn, args), primitive, bounds=bounds)
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
    traced = trace_step(fn, args)
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
    assert set(control.RULES) == {"scan", "while", "cond"}
    assert "select_n" not in RULES
    tables = [indexing.RULES, slicing.RULES, misc.RULES, control.RULES]
    assert sum(len(t) for t in tables) == len(RULES)  # no primitive claimed twice
