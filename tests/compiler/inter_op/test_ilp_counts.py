"""The stage search solves each structurally identical (layer, logical mesh) pair once:
counted, not timed. Every entry of the stage DP's cost table is read; no ILP is built twice
for one layer structure on one mesh, and the repeated blocks of a GPT share one structure."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.inter_op import piece_cost
from autopar.compiler.inter_op.layers import layer_positions
from autopar.compiler.planners.stage_costs import layer_cost_cache
from autopar.compiler.planners.stage_table import stage_cost_table
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.models import get_model

BUILD_PROBLEM = piece_cost.build_problem


def cost_table_builds(num_layers: int, monkeypatch, workers: int = 1
                      ) -> tuple[int, list[tuple], dict]:
    """Every entry of the stage DP's cost table for a GPT of ``num_layers`` blocks (one
    pipeline layer each) on 2 described hosts of 8: the ILPs the cache solved, the (layer
    structure, mesh) of each ILP built in this process, and the table's entries. ``workers``:
    the processes the layer ILPs are split over (builds in other processes are not seen)."""
    builds: list[tuple] = []

    def counting(graph, mesh, options, caches=None):
        builds.append((id(graph), tuple(mesh.shape), tuple(mesh.alpha), tuple(mesh.beta)))
        return BUILD_PROBLEM(graph, mesh, options, caches)

    monkeypatch.setattr(piece_cost, "build_problem", counting)
    model = get_model("gpt", "tiny", num_layers=num_layers).with_value_and_grad(
        autopar.value_and_grad)
    cluster = dataclasses.replace(load_cluster("aws-p3.16xlarge"), num_hosts=2)
    method = autopar.PipeshardParallel(num_microbatches=4, layers=num_layers,
                                       planning_workers=workers)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 4)
    positions = layer_positions(pp, build_graph(pp.forward), num_layers, cluster.num_devices)
    cache = layer_cost_cache(method)
    table = stage_cost_table(pp, positions, method, cluster, cache)
    entries = {(start, end, index): table.candidates(start, end, index)
               for start in range(table.num_layers)
               for end in range(start + 1, table.num_layers + 1)
               for index in range(len(table.submeshes))}
    return cache.ilp_solves, builds, entries


NUM_LAYERS = 8


@pytest.fixture(scope="module")
def one_process():
    """``cost_table_builds`` of the 8-block GPT in this process alone: what both tests below
    read (built once for the two)."""
    with pytest.MonkeyPatch.context() as patch:
        return cost_table_builds(NUM_LAYERS, patch, workers=1)


def test_identical_layers_and_meshes_are_solved_once(one_process):
    num_layers = NUM_LAYERS
    solves, builds, _ = one_process
    # no (layer structure, mesh) pair is built twice, and the cache counts every build
    assert len(builds) == len(set(builds)) == solves > 0
    structures = {b[0] for b in builds}
    meshes = {b[1:] for b in builds}
    # one ILP per structure and mesh: the blocks share theirs; the embedding, the head and
    # the two parts of the block the clustering cut to balance the head are their own
    assert solves == len(structures) * len(meshes)
    assert len(structures) <= 5 and solves <= num_layers * len(meshes) * 5 / 8


def test_layer_ilps_split_over_processes_give_the_same_table(one_process, monkeypatch):
    """Two processes (the parent and a forked child) solve the layer ILPs: the same solves,
    the same candidates for every entry, and the parent built only its share."""
    serial_solves, serial_builds, serial = one_process
    solves, builds, split = cost_table_builds(NUM_LAYERS, monkeypatch, workers=2)
    assert solves == serial_solves
    assert 0 < len(builds) < len(serial_builds)  # the child built the rest
    assert split == serial


def test_a_prefetch_builds_each_structure_once_per_mesh_through_its_memory_lean_rungs(
        monkeypatch):
    """A prefetch solves a mesh's every structure, then their more split rungs: each rung
    restricts its structure's built problem. With more structures than the cache keeps built
    problems (one kept here; GPT-39B's equal-operator split has 17 structures against 8 kept),
    none is built again for its next rung."""
    from autopar.compiler.inter_op import layer_costs

    monkeypatch.setattr(layer_costs, "BUILT_PROBLEMS_KEPT", 1)
    monkeypatch.setattr(layer_costs, "PARALLEL_MIN_SOLVES", 0)
    # the prefetch's solves in this process, in order (a forked child's builds are not seen)
    monkeypatch.setattr(layer_costs, "run_pulled",
                        lambda tasks, solve, workers, meanwhile=None: [solve(t) for t in tasks])
    builds: list[tuple] = []

    def counting(graph, mesh, options, caches=None):
        builds.append((id(graph), tuple(mesh.shape), tuple(mesh.alpha), tuple(mesh.beta)))
        return BUILD_PROBLEM(graph, mesh, options, caches)

    monkeypatch.setattr(piece_cost, "build_problem", counting)
    model = get_model("gpt", "tiny", num_layers=2).with_value_and_grad(autopar.value_and_grad)
    described = load_cluster("aws-p3.16xlarge")
    # a device far too small for any layer: every mesh's every rung is solved
    cluster = dataclasses.replace(described, num_hosts=1, device=dataclasses.replace(
        described.device, memory_bytes=1024))
    method = autopar.PipeshardParallel(num_microbatches=4, layers=2, planning_workers=2)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 4)
    positions = layer_positions(pp, build_graph(pp.forward), 2, cluster.num_devices)
    cache = layer_cost_cache(method)
    stage_cost_table(pp, positions, method, cluster, cache)
    structures = {b[0] for b in builds}
    assert len(structures) > 1  # more than the one problem kept
    # memory-lean rungs were solved (more ILPs than structure and mesh pairs)...
    assert cache.ilp_solves + cache.derived_levels > len(set(builds))
    # ...each from its structure's problem built once on its mesh
    assert len(builds) == len(set(builds))
