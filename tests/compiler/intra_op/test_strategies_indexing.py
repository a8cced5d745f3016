"""Strategies of the indexing family (gather, scatter and its reducing variants): embedding
lookups and their gradients, batching dims, several indexed dims, non-additive scatters. Each
node's strategies are checked for structure and for truth on devices on a 1-D and a 2-D mesh
(see strategy_data_checks.py for the harness)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from strategy_data_checks import check_node
from strategy_helpers import sds

from autopar.compiler.graph.trace import trace_step
from autopar.compiler.intra_op.strategies.base import Strategy
from autopar.plan import CollectiveKind

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
