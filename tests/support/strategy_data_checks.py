"""The on-device harness of the data-movement strategy families (indexing, slicing, misc,
control).

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
from jax.sharding import Mesh, NamedSharding
from strategy_helpers import pspec

from autopar.cluster import load_cluster
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import TracedStep
from autopar.compiler.intra_op.strategies import control, indexing, misc, slicing
from autopar.compiler.intra_op.strategies.base import Strategy, StrategyContext, divisible
from autopar.runtime.hlo import parse_collectives

RULES = {**indexing.RULES, **slicing.RULES, **misc.RULES, **control.RULES}
MESHES = {"1d": ((4,), (4, 5, 6, 7)), "2d": ((2, 4), tuple(range(8)))}


def logical_mesh(kind: str) -> LogicalMesh:
    """The "1d" (4 devices, ids 4..7) or "2d" (2x4, all 8) mesh of the simulated cluster."""
    shape, ids = MESHES[kind]
    return LogicalMesh.from_cluster(load_cluster("cpu-sim"), shape, device_ids=ids)


def jax_mesh(mesh: LogicalMesh) -> Mesh:
    """The JAX device mesh behind a logical mesh."""
    devices = np.array(jax.devices())[list(mesh.device_ids)].reshape(mesh.shape)
    return Mesh(devices, mesh.axis_names)


def node_of(traced: TracedStep, primitive: str, which: int = 0):
    """The ``which``-th node of ``primitive`` in the traced graph."""
    return [n for n in traced.graph.nodes if n.primitive == primitive][which]


def context(traced: TracedStep, primitive: str, mesh_kind: str, which: int = 0):
    """The strategy context of that node on the ``mesh_kind`` mesh."""
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
