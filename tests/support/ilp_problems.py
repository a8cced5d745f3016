"""Random sharding ILPs for the solver tests: small ones for brute force, and spec-shaped ones
(resharding costs from a metric between specs) like the real problems."""

from __future__ import annotations

import random

import numpy as np

from autopar.compiler.intra_op.problem import IntraOpProblem, ProblemEdge, ProblemNode


def random_problem(seed: int, n: int = 6, kmin: int = 1, kmax: int = 4, p_edge: float = 0.45,
                   memory: bool = False) -> IntraOpProblem:
    """Random DAG: some single-strategy nodes, some all-zero and some sparse edge matrices."""
    rng = random.Random(seed)
    nodes = []
    for u in range(n):
        k = rng.randint(kmin, kmax)
        mem = [float(rng.randint(1, 10)) for _ in range(k)] if memory else None
        nodes.append(ProblemNode(f"op#{u}", [rng.uniform(0, 1) for _ in range(k)],
                                 [f"S{i}" for i in range(k)], mem))
    edges = []
    for v in range(n):
        for u in range(v):
            if rng.random() < p_edge:
                zero = rng.random() < 0.25
                ku, kv = len(nodes[u].costs), len(nodes[v].costs)
                edges.append(ProblemEdge(u, v, [
                    [0.0 if zero else rng.choice([0.0, rng.uniform(0, 1)]) for _ in range(kv)]
                    for _ in range(ku)], note=f"t{u} -> op{v}"))
    live = [sorted(rng.sample(range(n), rng.randint(1, n))) for _ in range(3)] if memory else []
    return IntraOpProblem(nodes, edges, None, live)


def spec_problem(seed: int, n: int, k: int) -> IntraOpProblem:
    """Shaped like the real ILP: strategies have output/input specs, edges cost tensor size
    times a resharding metric between specs, and each node reads 1-3 recent producers."""
    rng = np.random.default_rng(seed)
    metric = np.array([[0, 0, 0, 0], [1, 0, .5, .5], [1, .5, 0, .5], [1.5, 1, 1, 0]]) * 1e-3
    outs = rng.integers(0, 4, (n, k))
    ins = rng.integers(0, 4, (n, k, 3))
    nodes = [ProblemNode(f"op#{u}", list(rng.uniform(1e-4, 1e-2) * np.where(outs[u] == 0, 1, .5)),
                         [f"S{i}" for i in range(k)]) for u in range(n)]
    edges = []
    for v in range(1, n):
        preds = sorted(set(rng.integers(max(0, v - 10), v, size=rng.integers(1, 4)).tolist()))
        for slot, u in enumerate(preds):
            m = rng.uniform(0.1, 10) * metric[outs[u][:, None], ins[v][None, :, slot]]
            edges.append(ProblemEdge(u, v, m.tolist()))
    return IntraOpProblem(nodes, edges)
