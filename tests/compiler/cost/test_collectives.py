"""Collective cost model (autopar.compiler.cost.collectives): every formula pinned by hand."""

from __future__ import annotations

import json
import math

import pytest

from autopar.cluster import DeviceSpec, load_cluster
from autopar.compiler.cost.collectives import (
    AllReduceAlgorithm,
    all_to_all_time,
    allgather_time,
    allreduce_schedule,
    allreduce_time,
    allreduce_traffic,
    cheapest_allreduce,
    collective_permute_time,
    collective_time,
    estimate_collective,
    reduce_scatter_time,
)
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.errors import InvalidOptionError, MeshError
from autopar.plan import CollectiveEstimate, CollectiveKind

A = AllReduceAlgorithm
# The reference case: n = 4 workers, M = 1000 bytes, alpha = 10 us, beta = 1 ns/byte.
N, M, ALPHA, BETA = 4, 1000.0, 1e-5, 1e-9


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)


# ---------------------------------------------------------------- all-reduce times
def test_ring_time():
    # 2(n-1)(alpha + beta M/n) = 6 * (1e-5 + 1e-9 * 250) = 6 * 1.025e-5
    assert close(allreduce_time(M, N, ALPHA, BETA, A.RING), 6.15e-5)


def test_tree_time():
    # 2 ceil(log2 4)(alpha + beta M) = 4 * (1e-5 + 1e-6)
    assert close(allreduce_time(M, N, ALPHA, BETA, A.TREE), 4.4e-5)


def test_butterfly_time():
    # ceil(log2 4)(alpha + beta M) = 2 * 1.1e-5
    assert close(allreduce_time(M, N, ALPHA, BETA, A.BUTTERFLY), 2.2e-5)


def test_naive_time():
    # alpha + (n-1) M beta = 1e-5 + 3 * 1000 * 1e-9
    assert close(allreduce_time(M, N, ALPHA, BETA, A.NAIVE), 1.3e-5)


def test_parameter_server_time():
    # 2 (alpha + n M beta) = 2 * (1e-5 + 4e-6)
    assert close(allreduce_time(M, N, ALPHA, BETA, A.PARAMETER_SERVER), 2.8e-5)


def test_algorithm_accepts_strings():
    assert allreduce_time(M, N, ALPHA, BETA, "ring") == allreduce_time(M, N, ALPHA, BETA, A.RING)
    with pytest.raises(InvalidOptionError, match="unknown all-reduce algorithm 'fast'; valid "
                       "algorithms: parameter_server, naive, ring, tree, butterfly"):
        allreduce_time(M, N, ALPHA, BETA, "fast")


def test_non_power_of_two_tree_and_butterfly():
    # n = 5: ceil(log2 5) = 3 rounds per phase.
    assert close(allreduce_time(M, 5, ALPHA, BETA, A.TREE), 6 * 1.1e-5)
    assert close(allreduce_time(M, 5, ALPHA, BETA, A.BUTTERFLY), 3 * 1.1e-5)
    # Binomial tree reduce over 5 workers: 2, 1, 1 senders -> 4 = n - 1 edges.
    sched = allreduce_schedule(A.TREE, 5, M)
    assert [r.senders for r in sched.rounds] == [2, 1, 1, 1, 1, 2]
    assert sched.traffic == 2 * 4 * M


# ---------------------------------------------------------------- traffic table
def test_traffic_exact_values():
    assert allreduce_traffic(A.PARAMETER_SERVER, N, M) == 8000  # 2NM
    assert allreduce_traffic(A.NAIVE, N, M) == 12000  # N(N-1)M
    assert allreduce_traffic(A.RING, N, M) == 6000  # 2(N-1)M exact (seeds: 2NM = 8000)
    assert allreduce_traffic(A.TREE, N, M) == 6000  # 2(N-1)M exact (seeds: 2NM = 8000)
    assert allreduce_traffic(A.BUTTERFLY, N, M) == 8000  # NM log2 N = 4 * 1000 * 2


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64, 1024])
def test_traffic_matches_the_seeds_table(n):
    seeds_2nm = 2 * n * M
    assert allreduce_traffic(A.PARAMETER_SERVER, n, M) == seeds_2nm
    assert allreduce_traffic(A.NAIVE, n, M) == n * (n - 1) * M
    assert allreduce_traffic(A.BUTTERFLY, n, M) == n * M * math.log2(n)
    for algo in (A.RING, A.TREE):
        # The exact schedules move 2(N-1)M: the seeds' 2NM is its leading-order value.
        assert close(allreduce_traffic(algo, n, M) / seeds_2nm, (n - 1) / n)


def test_ring_and_tree_approach_2nm():
    ratios = [allreduce_traffic(A.RING, n, M) / (2 * n * M) for n in (2, 8, 64, 4096)]
    assert ratios == sorted(ratios) and ratios[0] == 0.5 and ratios[-1] > 0.999


def test_schedules_describe_rounds():
    ring = allreduce_schedule(A.RING, N, M)
    assert len(ring.rounds) == 6 and {r.bytes_per_sender for r in ring.rounds} == {250.0}
    ps = allreduce_schedule(A.PARAMETER_SERVER, N, M)
    assert [(r.senders, r.bytes_per_sender, r.bottleneck_bytes) for r in ps.rounds] == [
        (4, 1000.0, 4000.0), (1, 4000.0, 4000.0)]  # the server's link is the bottleneck
    naive = allreduce_schedule(A.NAIVE, N, M)
    assert [(r.senders, r.bytes_per_sender) for r in naive.rounds] == [(4, 3000.0)]
    fly = allreduce_schedule(A.BUTTERFLY, 8, M)
    assert len(fly.rounds) == 3 and all(r.senders == 8 for r in fly.rounds)
    for algo in A:
        sched = allreduce_schedule(algo, N, M)
        assert close(sched.time(ALPHA, BETA), allreduce_time(M, N, ALPHA, BETA, algo))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 12, 100, 3072])
def test_runs_of_equal_rounds_price_as_the_rounds_one_by_one(n):
    """A schedule keeps its rounds as runs (a ring over 3,072 workers: one run of 6,142);
    the runs hold the same rounds, and price and count them as the rounds one by one; the
    binomial tree's senders per round are the workers i with i mod 2d == d."""
    for algo in A:
        sched = allreduce_schedule(algo, n, M)
        assert [r for r, count in sched.runs for _ in range(count)] == list(sched.rounds)
        assert math.isclose(sched.time(ALPHA, BETA),
                            math.fsum(r.time(ALPHA, BETA) for r in sched.rounds), rel_tol=1e-12)
        assert math.isclose(sched.traffic, math.fsum(r.traffic for r in sched.rounds),
                            rel_tol=1e-12)
    tree = allreduce_schedule(A.TREE, n, M)
    levels = (n - 1).bit_length()
    senders = [sum(1 for i in range(n) if i % (2 << k) == 1 << k) for k in range(levels)]
    assert [r.senders for r in tree.rounds] == senders + senders[::-1]


# ---------------------------------------------------------------- cheapest
def test_cheapest_latency_bound_small_group():
    # n = 8, M = 1000: ring 14 * (1e-5 + 1.25e-7) = 1.4175e-4, tree 6 * 1.1e-5 = 6.6e-5,
    # butterfly 3 * 1.1e-5 = 3.3e-5, naive 1e-5 + 7e-6 = 1.7e-5, PS 2 * (1e-5 + 8e-6) = 3.6e-5.
    algo, t = cheapest_allreduce(1000, 8, ALPHA, BETA)
    assert algo is A.NAIVE and close(t, 1.7e-5)
    assert allreduce_time(1000, 8, ALPHA, BETA) == t


def test_cheapest_latency_bound_large_group():
    # n = 64, M = 1e4: butterfly 6 * (1e-5 + 1e-5) = 1.2e-4; tree 12 * 2e-5 = 2.4e-4;
    # naive 1e-5 + 63 * 1e-5 = 6.4e-4; ring 126 * (1e-5 + 1.5625e-7) = 1.2796875e-3.
    algo, t = cheapest_allreduce(1e4, 64, ALPHA, BETA)
    assert algo is A.BUTTERFLY and close(t, 1.2e-4)
    assert close(allreduce_time(1e4, 64, ALPHA, BETA, A.RING), 1.2796875e-3)


def test_cheapest_bandwidth_bound():
    # n = 8, M = 1e9: ring 14 * (1e-5 + 0.125) = 1.75014, butterfly 3 * 1.00001 = 3.00003.
    algo, t = cheapest_allreduce(1e9, 8, ALPHA, BETA)
    assert algo is A.RING and close(t, 1.75014)


# ---------------------------------------------------------------- other collectives
def test_allgather_reduce_scatter_all_to_all_permute():
    # (n-1)(alpha + beta M/n) = 3 * (1e-5 + 2.5e-7)
    assert close(allgather_time(M, N, ALPHA, BETA), 3.075e-5)
    assert close(reduce_scatter_time(M, N, ALPHA, BETA), 3.075e-5)
    # (n-1)(alpha + beta M/n^2) = 3 * (1e-5 + 6.25e-8)
    assert close(all_to_all_time(M, N, ALPHA, BETA), 3.01875e-5)
    # alpha + beta M
    assert close(collective_permute_time(M, N, ALPHA, BETA), 1.1e-5)


def test_single_device_costs_nothing():
    for algo in A:
        assert allreduce_time(M, 1, ALPHA, BETA, algo) == 0.0
        assert allreduce_traffic(algo, 1, M) == 0.0
    assert cheapest_allreduce(M, 1, ALPHA, BETA)[1] == 0.0
    for fn in (allgather_time, reduce_scatter_time, all_to_all_time, collective_permute_time):
        assert fn(M, 1, ALPHA, BETA) == 0.0


def test_bad_group_size():
    with pytest.raises(InvalidOptionError, match="group size must be a positive integer"):
        allgather_time(M, 0, ALPHA, BETA)


# ---------------------------------------------------------------- on a mesh
DEV = DeviceSpec("d", {"float32": 1e12}, 2**30)
# axis 0: slow (alpha 1e-4, beta 1e-8); axis 1: fast (alpha 1e-5, beta 1e-9)
MESH = LogicalMesh((2, 4), ("x", "y"), tuple(range(8)), (1e-4, 1e-5), (1e-8, 1e-9), DEV, 0.5)


def test_collective_time_one_axis():
    # all-gather over y (n = 4), 8000 bytes: 3 * (1e-5 + 1e-9 * 2000) = 3.6e-5
    assert close(collective_time(CollectiveKind.ALL_GATHER, 8000, MESH, (1,)), 3.6e-5)
    # ring all-reduce over x (n = 2), 8000 bytes: 2 * (1e-4 + 1e-8 * 4000) = 2.8e-4
    assert close(collective_time("all-reduce", 8000, MESH, 0, algorithm="ring"), 2.8e-4)
    # all-to-all over y: 3 * (1e-5 + 1e-9 * 8000 / 16) = 3 * 1.05e-5 = 3.15e-5
    assert close(collective_time(CollectiveKind.ALL_TO_ALL, 8000, MESH, (1,)), 3.15e-5)
    # collective permute over x: 1e-4 + 1e-8 * 8000 = 1.8e-4
    assert close(collective_time(CollectiveKind.COLLECTIVE_PERMUTE, 8000, MESH, (0,)), 1.8e-4)
    assert close(collective_time(CollectiveKind.REDUCE_SCATTER, 8000, MESH, (1,)), 3.6e-5)


def test_collective_time_two_axes_uses_slowest_link():
    # all-gather over (x, y): n = 8, alpha = max = 1e-4, beta = max = 1e-8:
    # 7 * (1e-4 + 1e-8 * 8000 / 8) = 7 * 1.1e-4 = 7.7e-4
    assert close(collective_time(CollectiveKind.ALL_GATHER, 8000, MESH, (0, 1)), 7.7e-4)
    assert collective_time(CollectiveKind.ALL_GATHER, 8000, MESH, (1, 0)) == \
        collective_time(CollectiveKind.ALL_GATHER, 8000, MESH, (0, 1))
    # all-reduce over both, cheapest of n = 8 with alpha 1e-4, beta 1e-8, M = 8000:
    # ring 14 * (1e-4 + 1e-5) = 1.54e-3, butterfly 3 * (1e-4 + 8e-5) = 5.4e-4,
    # naive 1e-4 + 7 * 8e-5 = 6.6e-4, tree 6 * 1.8e-4 = 1.08e-3, PS 2 * (1e-4 + 6.4e-4).
    assert close(collective_time(CollectiveKind.ALL_REDUCE, 8000, MESH, (0, 1)), 5.4e-4)


def test_collective_time_on_a_cluster_mesh():
    cluster = load_cluster("aws-p3.16xlarge-8nodes")
    mesh = LogicalMesh.from_cluster(cluster, (8, 8))
    inter, intra = cluster.inter_host, cluster.intra_host
    nbytes = 64e6
    expect_inter = 7 * (inter.alpha + inter.beta * nbytes / 8)
    expect_intra = 7 * (intra.alpha + intra.beta * nbytes / 8)
    assert close(collective_time(CollectiveKind.ALL_GATHER, nbytes, mesh, (0,)), expect_inter)
    assert close(collective_time(CollectiveKind.ALL_GATHER, nbytes, mesh, (1,)), expect_intra)
    assert expect_inter > 100 * expect_intra


def test_collective_time_size_one_axes_and_errors():
    mesh = LogicalMesh((1, 8), (), tuple(range(8)), (1e-4, 1e-5), (1e-8, 1e-9), DEV, 0.5)
    for kind in CollectiveKind:
        assert collective_time(kind, 8000, mesh, (0,)) == 0.0
        assert collective_time(kind, 8000, mesh, ()) == 0.0
    with pytest.raises(MeshError, match="mesh axis 2 out of range"):
        collective_time(CollectiveKind.ALL_GATHER, 8000, MESH, (2,))
    with pytest.raises(InvalidOptionError, match="unknown collective 'broadcast'"):
        collective_time("broadcast", 8000, MESH, (0,))


def test_kind_values_are_hlo_opcodes():
    assert [k.value for k in CollectiveKind] == [
        "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"]
    assert CollectiveKind.ALL_REDUCE == "all-reduce"


def test_collective_estimate_round_trip():
    est = estimate_collective(CollectiveKind.ALL_GATHER, 8000, MESH, (1,), count=3)
    assert est.count == 3 and est.axes == (1,)
    assert close(est.time_s, 3 * 3.6e-5)
    data = json.loads(json.dumps(est.to_dict()))
    assert data["kind"] == "all-gather"
    assert CollectiveEstimate.from_dict(data) == est
