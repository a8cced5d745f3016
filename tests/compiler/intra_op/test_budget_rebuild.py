"""A sharding ILP built without a memory budget and given one afterwards
(``with_memory_budget``, what ShardParallel does when its fastest plan does not fit) is the
problem built with that budget: the same nodes, strategy memory, edges and live sets."""

from __future__ import annotations

import numpy as np

from autopar.cluster import load_cluster
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import trace_step
from autopar.compiler.intra_op.sharding_ilp import (
    IntraOpOptions,
    build_problem,
    solve_intra_op,
    with_memory_budget,
)
from autopar.models import get_model


def test_a_budget_added_to_a_built_problem_is_the_budget_built_in():
    model = get_model("gpt", "tiny")
    graph = trace_step(model.train_step, model.abstract_inputs()).graph
    # a 2-D mesh, both axes split: on 2x4 the same checks hold, each budgeted solve taking
    # about 5 s rather than 2
    mesh = LogicalMesh.from_cluster(load_cluster("cpu-sim"), (2, 2))
    # the budget's size is not what is checked (the rows are built alike at any size): one
    # well above the free plan's peak solves in about 2 s where one near it (3 MB) took 3.5
    budget = 1e7
    options = IntraOpOptions(memory_budget_bytes=budget, batch_argnums=(1,))
    fresh, _ = build_problem(graph, mesh, options)
    built: dict = {}
    solve_intra_op(graph, mesh, IntraOpOptions(batch_argnums=(1,)), built=built)
    ((problem, parts),) = built.values()
    assert problem.memory_budget is None and all(n.memory is None for n in problem.nodes)
    given = with_memory_budget(problem, parts, options)
    assert given.memory_budget == fresh.memory_budget == budget
    assert given.live_sets == fresh.live_sets and given.live_sets
    assert [n.name for n in given.nodes] == [n.name for n in fresh.nodes]
    for a, b in zip(given.nodes, fresh.nodes, strict=True):
        assert np.allclose(a.costs, b.costs) and a.memory == b.memory
    assert [(e.src, e.dst) for e in given.edges] == [(e.src, e.dst) for e in fresh.edges]
    assert all(np.allclose(a.costs, b.costs) for a, b in zip(given.edges, fresh.edges,
                                                              strict=True))
    # solved from the same built problem under the budget, as one built with it
    again = solve_intra_op(graph, mesh, options, built=built)
    assert again.solution.objective == solve_intra_op(graph, mesh, options).solution.objective
