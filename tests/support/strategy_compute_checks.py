"""The on-device harness of the compute strategy families (dot, conv, elementwise, reduce,
layout): one op of a traced function on a logical mesh, its generated strategies, the
generator contract, and numerical truth — each strategy run under jax.jit on the 8 simulated
CPU devices with its operands placed in its input specs, compared with the unsharded op, and
its compiled HLO's collectives compared with what the strategy claims."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from strategy_helpers import pspec

from autopar.cluster import load_cluster
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.opgraph import TensorInfo
from autopar.compiler.graph.trace import trace_step
from autopar.compiler.intra_op.strategies import conv, dot, elementwise, layout, reduce
from autopar.compiler.intra_op.strategies.base import Strategy, StrategyContext, divisible
from autopar.plan import CollectiveKind
from autopar.runtime.hlo import count_collectives

CLUSTER = load_cluster("cpu-sim")
RULES = {**dot.RULES, **conv.RULES, **elementwise.RULES, **elementwise.PRNG_RULES,
         **reduce.RULES, **layout.RULES}


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


def check_best_compute(case: Case, devices: int) -> None:
    full = case.ctx.compute_time(case.ctx.node.flops, ())
    best = min(s.compute_time_s for s in case.strategies)
    assert best == pytest.approx(full / devices)
