"""Identical-layer tying labels each op by its wiring (``tying.structural_labels``); the labels
depend on the graph and the ops' strategy signatures only, so a graph built into problems on
several logical meshes (the full search's one-stage candidates) is labelled once, and each
problem is the one a fresh graph gives."""

from __future__ import annotations

import numpy as np

from autopar.cluster import load_cluster
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import trace_step
from autopar.compiler.intra_op import tying
from autopar.compiler.intra_op.sharding_ilp import IntraOpOptions, build_problem
from autopar.models import get_model

OPTIONS = IntraOpOptions(batch_argnums=(1,))


def _graph():
    model = get_model("gpt", "tiny", num_layers=4)
    return trace_step(model.train_step, model.abstract_inputs()).graph


def _same(a, b) -> None:
    assert [n.name for n in a.nodes] == [n.name for n in b.nodes]
    for x, y in zip(a.nodes, b.nodes, strict=True):
        assert np.array_equal(x.costs, y.costs)
    assert [(e.src, e.dst) for e in a.edges] == [(e.src, e.dst) for e in b.edges]


def test_a_graph_is_labelled_once_for_every_mesh_and_each_problem_is_a_fresh_graphs(
        monkeypatch):
    refined = []
    real = tying._refined_labels

    def counted(*args):
        refined.append(args[0])
        return real(*args)

    monkeypatch.setattr(tying, "_refined_labels", counted)
    cluster = load_cluster("cpu-sim")
    meshes = [LogicalMesh.from_cluster(cluster, shape) for shape in ((2, 2), (4,))]
    shared = _graph()
    built = [build_problem(shared, mesh, OPTIONS)[0] for mesh in meshes]
    assert len(refined) == 1
    # tying merged repeated layers' decisions: fewer variables than ops
    assert len(built[0].nodes) < len(shared.nodes)
    for mesh, problem in zip(meshes, built, strict=True):
        _same(problem, build_problem(_graph(), mesh, OPTIONS)[0])
    assert len(refined) == 1 + len(meshes)


def test_other_signatures_are_labelled_anew():
    graph = _graph()
    signatures = {node.id: ("op", node.primitive) for node in graph.nodes}
    first = tying.structural_labels(graph, (1,), 2, signatures)
    again = tying.structural_labels(graph, (1,), 2, signatures)
    assert again == first
    renamed = {**signatures, graph.nodes[0].id: ("another",)}
    changed = tying.structural_labels(graph, (1,), 2, renamed)
    assert changed[graph.nodes[0].id] != first[graph.nodes[0].id]
    assert changed == tying._refined_labels(graph, (1,), 2, renamed)
