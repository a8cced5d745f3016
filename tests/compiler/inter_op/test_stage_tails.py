"""The stage DP with per-step parts: a candidate's tail (spread over the microbatches, in both
terms) and host time (in the sum only) change which candidate and which partition win; the
search stays exact against brute force."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from autopar.compiler.inter_op.stages import (
    StageCandidate,
    StageCostTable,
    StageDPOptions,
    pipeline_time,
    solve_stages,
    submesh_shapes,
    uniform_stages,
)

CLUSTERS = [(1, 4), (2, 2), (1, 8)]


def table_with_tails(rng: np.random.Generator, layers: int, hosts: int, per_host: int):
    entries = {}
    shapes = submesh_shapes(hosts, per_host)
    for index, shape in enumerate(shapes):
        for start in range(layers):
            for end in range(start + 1, layers + 1):
                found = []
                for k in range(int(rng.integers(1, 4))):
                    work = (end - start) * rng.uniform(0.5, 1.5) / shape.num_devices ** 0.8
                    found.append(StageCandidate(
                        time=round(float(work), 2),
                        fixed_memory=float(rng.integers(1, 8)),
                        activation_memory_per_microbatch=float(rng.integers(0, 3)),
                        logical_mesh_shape=(shape.num_devices,),
                        key=f"{start}:{end}:{index}:{k}",
                        tail_time=round(float(rng.uniform(0.0, 3.0)), 2),
                        host_time=round(float(rng.uniform(0.0, 2.0)), 2),
                    ))
                entries[(start, end, index)] = found
    return StageCostTable.build(layers, shapes, lambda s, e, sm: entries[(s, e, shapes.index(sm))])


def brute_force(table, hosts, per_host, options) -> float:
    m, best = options.num_microbatches, math.inf
    devices = hosts * per_host
    for mask in range(2 ** (table.num_layers - 1)):
        cuts = [i + 1 for i in range(table.num_layers - 1) if mask >> i & 1]
        ranges = list(itertools.pairwise([0, *cuts, table.num_layers]))
        count = len(ranges)
        for ids in itertools.product(range(len(table.submeshes)), repeat=count):
            shapes = [table.submeshes[i] for i in ids]
            if sum(s.num_devices for s in shapes) != devices:
                continue
            if not all(s.fits(hosts, per_host) for s in shapes):
                continue
            per_stage = []
            for position, ((a, b), i) in enumerate(zip(ranges, ids, strict=True)):
                flight = options.in_flight(position, count)
                per_stage.append([c for c in table.candidates(a, b, i)
                                  if options.fits(c.memory(flight))])
            for choice in itertools.product(*per_stage):
                best = min(best, pipeline_time([c.max_part(m) for c in choice], m,
                                               [c.sum_part(m) for c in choice]))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_dp_with_tails_and_host_time_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    hosts, per_host = CLUSTERS[seed % len(CLUSTERS)]
    table = table_with_tails(rng, int(rng.integers(1, 5)), hosts, per_host)
    options = StageDPOptions(num_microbatches=int(rng.choice([1, 2, 4, 8])),
                             memory_budget_bytes=float(rng.integers(6, 20)))
    expected = brute_force(table, hosts, per_host, options)
    if math.isinf(expected):
        return
    found = solve_stages(table, hosts, per_host, options)
    assert found.total_time == pytest.approx(expected, rel=1e-12)
    m = options.num_microbatches
    chosen = [st.candidate for st in found.stages]
    assert found.total_time == pytest.approx(pipeline_time(
        [c.max_part(m) for c in chosen], m, [c.sum_part(m) for c in chosen]))


def test_host_time_makes_fewer_stages_win():
    """Two layers on 2 devices (work that shrinks with the square root of the devices): two
    stages beat one on both devices, until each stage's host time, which adds up, is large
    enough."""
    def table(host: float) -> StageCostTable:
        def fn(start, end, submesh):
            work = (end - start) / math.sqrt(submesh.num_devices)
            return [StageCandidate(work, 0.0, 0.0, (submesh.num_devices,), host_time=host)]
        return StageCostTable.build(2, submesh_shapes(1, 2), fn)

    options = StageDPOptions(num_microbatches=4)
    assert len(solve_stages(table(0.0), 1, 2, options).stages) == 2
    assert len(solve_stages(table(10.0), 1, 2, options).stages) == 1
    # an evaluated split prices its stages the same way
    split = uniform_stages(table(10.0), 2, 1, 2, options)
    assert split.total_time == pytest.approx(2 * (1.0 + 10.0) + 3 * 1.0)
