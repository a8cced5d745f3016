"""The stage DP reads a whole cost table as arrays made at once (``stage_table_arrays``):
they must be, bit for bit, the arrays read entry by entry from ``StageCostTable.candidates``
(the candidates the DP's answer is turned back into), over schedules, replica counts and a
memory budget that makes some entries (not all) take the plans splitting the parameters
more ways; and making them must not solve an ILP that reading the entries would not."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.inter_op.layers import layer_positions
from autopar.compiler.inter_op.stage_dp import candidate_arrays
from autopar.compiler.inter_op.stages import solve_stages
from autopar.compiler.inter_op.submesh import always_packs
from autopar.compiler.planners.stage_costs import layer_cost_cache, stage_dp_options
from autopar.compiler.planners.stage_table import stage_cost_table
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.models import get_model

FIELDS = ("times", "sums", "fixed", "act", "param")


def _program(hosts: int, per_host: int = 8):
    model = get_model("gpt", "tiny", num_layers=4).with_value_and_grad(autopar.value_and_grad)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 4)
    whole = dataclasses.replace(load_cluster("aws-p3.16xlarge-8nodes").with_hosts(hosts),
                                devices_per_host=per_host)
    positions = layer_positions(pp, build_graph(pp.forward), 4, whole.num_devices)
    return pp, whole, positions


@pytest.fixture(scope="module")
def program():
    return _program(2)


@pytest.fixture(scope="module")
def solved(program):
    """One layer cost cache for the module's tables: the layers' ILPs do not depend on the
    schedule, the replicas or the budget, which the tables add."""
    return layer_cost_cache(autopar.PipeshardParallel(num_microbatches=4, layers=4,
                                                      planning_workers=1, remat="auto"))


def _table(program, *, budget=None, schedule="1f1b", replicas=1, cache=None):
    pp, whole, positions = program
    method = autopar.PipeshardParallel(num_microbatches=4, layers=4, planning_workers=1,
                                       remat="auto", schedule=schedule,
                                       memory_budget_bytes=budget)
    group = whole.with_hosts(whole.num_hosts // replicas)
    cache = cache if cache is not None else layer_cost_cache(method)
    m = 4 // replicas
    table = stage_cost_table(pp, positions, method, group, cache, num_microbatches=m,
                             replicas=replicas, whole=whole, prefetch_on=())
    usable = tuple(i for i, sm in enumerate(table.submeshes)
                   if always_packs(sm, group.num_hosts, group.devices_per_host))
    return table, usable, m, method, group, cache


def _assert_same(table, usable, m):
    dense = table.dense(usable, m)
    assert dense is not None
    entries = candidate_arrays(table, usable, m)
    for name in FIELDS:
        made, read = getattr(dense, name), getattr(entries, name)
        assert made.shape == read.shape, name
        assert np.array_equal(made, read), name
    return entries


def _binding_budget(program, cache=None) -> float:
    """A budget between the least and the most memory the unbounded table's candidates
    need with one microbatch in flight."""
    table, usable, m, *_ = _table(program, cache=cache)
    arrays = candidate_arrays(table, usable, m)
    need = (arrays.fixed + arrays.act)[np.isfinite(arrays.times)]
    return float(np.quantile(need, 0.6))


@pytest.mark.parametrize("schedule, replicas", [("1f1b", 1), ("zb-h1", 1), ("1f1b", 2)])
def test_the_arrays_are_the_entries_candidates_to_the_bit(program, solved, schedule,
                                                          replicas):
    table, usable, m, *_ = _table(program, schedule=schedule, replicas=replicas,
                                  cache=solved)
    _assert_same(table, usable, m)


def test_under_a_budget_only_overfilled_entries_take_the_more_split_plans(program, solved):
    budget = _binding_budget(program, solved)
    table, usable, m, method, group, _ = _table(program, budget=budget, cache=solved)
    read = _assert_same(table, usable, m)
    counts = np.isfinite(read.times).sum(axis=-1)
    valid = np.triu(np.ones(counts.shape[:2], dtype=bool), 1)
    per_entry = counts[valid]
    # some entries list more split levels than others: the budget binds for some only
    assert per_entry.max() > per_entry[per_entry > 0].min()
    # the DP's answer is the same read either way, and its candidate is the entry's own
    options = stage_dp_options(method, group, m)
    fast = solve_stages(table, group.num_hosts, group.devices_per_host, options)
    slow_table, *_ = _table(program, budget=budget, cache=solved)
    slow_table.dense = None
    slow = solve_stages(slow_table, group.num_hosts, group.devices_per_host, options)
    assert fast.total_time == slow.total_time
    assert [(s.start, s.end, s.submesh, s.candidate) for s in fast.stages] == \
        [(s.start, s.end, s.submesh, s.candidate) for s in slow.stages]


def test_the_arrays_solve_no_ilp_the_entries_would_not():
    one_host = _program(1, per_host=4)  # fewer meshes: each cache below solves them all
    budget = _binding_budget(one_host)
    fast_table, usable, m, _, _, fast_cache = _table(one_host, budget=budget)
    fast_table.dense(usable, m)
    slow_table, _, _, _, _, slow_cache = _table(one_host, budget=budget)
    candidate_arrays(slow_table, usable, m)
    assert fast_cache.ilp_solves == slow_cache.ilp_solves > 0
    assert set(fast_cache.solved) == set(slow_cache.solved)


