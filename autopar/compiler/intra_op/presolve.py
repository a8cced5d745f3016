"""Exact presolve of the sharding ILP: what the MIP still has to decide, and how to recover
every other choice from its answer.

Single-strategy nodes become constants, parallel edges are summed, separable edges fold into
node costs, and free nodes of degree <= 2 are eliminated by min-plus products (exact variable
elimination: chains and trees vanish). ``local_search`` makes the greedy plan that warm-starts
the MIP and stands in when a solver returns nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from autopar.compiler.intra_op.problem import IntraOpProblem


@dataclass
class ReducedProblem:
    """What the MIP still decides after presolve, and how to recover everything else."""

    cost: dict[int, np.ndarray] = field(default_factory=dict)  # free node -> cost vector
    adj: dict[int, dict[int, np.ndarray]] = field(default_factory=dict)  # adj[u][w]: [ku][kw]
    fixed: dict[int, int] = field(default_factory=dict)
    # Eliminated nodes in order: (node, its cost then, [(neighbour, matrix [k_node][k_nbr])]).
    trail: list[tuple[int, np.ndarray, list[tuple[int, np.ndarray]]]] = field(default_factory=list)
    rows: list[tuple[list[tuple[int, np.ndarray]], float]] = field(default_factory=list)
    const: float = 0.0

    def add_edge(self, u: int, w: int, m: np.ndarray, fold: bool) -> None:
        """Add ``m`` to edge (u, w); with ``fold``, an edge whose matrix is a_i + b_j (all-zero
        and constant ones included) moves into the two node costs and disappears."""
        if w in self.adj[u]:
            m = self.adj[u][w] + m
        a, b = m[:, 0], m[0, :] - m[0, 0]
        if fold and _separable(m, a, b):
            self.cost[u] = self.cost[u] + a
            self.cost[w] = self.cost[w] + b
            self.adj[u].pop(w, None)
            self.adj[w].pop(u, None)
        else:
            self.adj[u][w], self.adj[w][u] = m, m.T


def _separable(m: np.ndarray, a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``m[i, j] == a[i] + b[j]`` to within 1e-12 of its largest entry (as
    ``np.allclose`` with that ``atol``, whose general machinery took a tenth of the layer
    ILPs' presolve at published sizes: tens of thousands of small matrices)."""
    magnitude = np.abs(m)
    top = float(magnitude.max())
    if not math.isfinite(top):
        return bool(np.allclose(m, a[:, None] + b[None, :], rtol=0, atol=1e-12 * top))
    return float(np.abs(m - a[:, None] - b[None, :]).max()) <= 1e-12 * max(1.0, top)


def presolve(problem: IntraOpProblem, exact_reductions: bool) -> ReducedProblem:
    """Fold single-strategy nodes into neighbours, sum parallel edges, drop separable edges,
    reduce memory rows, then eliminate free degree-0/1/2 nodes by min-plus products (exact
    variable elimination; it turns chains and trees into nothing). Without
    ``exact_reductions`` only parallel edges and self-loops are merged (to test the raw MIP)."""
    r = ReducedProblem()
    for u, nd in enumerate(problem.nodes):
        if exact_reductions and len(nd.costs) == 1:
            r.fixed[u] = 0
            r.const += nd.costs[0]
        else:
            r.cost[u], r.adj[u] = np.asarray(nd.costs, float), {}
    for e in problem.edges:
        m, u, w = e.costs, e.src, e.dst
        if u == w and u not in r.fixed:  # a self-loop pays its diagonal
            r.cost[u] = r.cost[u] + np.diagonal(m)
        elif u in r.fixed and w in r.fixed:
            r.const += m[0, 0]
        elif u in r.fixed:
            r.cost[w] = r.cost[w] + m[0, :]
        elif w in r.fixed:
            r.cost[u] = r.cost[u] + m[:, 0]
        else:
            r.add_edge(u, w, m, exact_reductions)
    if problem.memory_budget is not None:
        rows: dict[tuple[int, ...], tuple[list[tuple[int, np.ndarray]], float]] = {}
        for live in {frozenset(s) for s in problem.live_sets}:
            rhs, terms = float(problem.memory_budget), []
            for u in sorted(live):
                if problem.nodes[u].memory is None:
                    continue
                mem = np.asarray(problem.nodes[u].memory, float)
                if not exact_reductions:
                    terms.append((u, mem))
                    continue
                # Each node's least memory is spent whatever it picks: move it to the right side,
                # so nodes whose memory does not depend on their choice leave the row.
                rhs -= mem.min()
                if u in r.cost and np.ptp(mem) > 0:
                    terms.append((u, mem - mem.min()))
            if exact_reductions:
                rhs = max(rhs, 0.0)  # >= 0 up to round-off: feasibility was checked before
                if sum(d.max() for _, d in terms) <= rhs:
                    continue  # no choice can break this row
            key = tuple(u for u, _ in terms)
            if key and (key not in rows or rhs < rows[key][1]):
                rows[key] = (terms, rhs)
        r.rows = list(rows.values())
    if exact_reductions:
        eliminate_small_degree(r, {u for terms, _ in r.rows for u, _ in terms})
    return r


def eliminate_small_degree(r: ReducedProblem, pinned: set[int]) -> None:
    queue = [u for u in r.cost if u not in pinned and len(r.adj[u]) <= 2]
    while queue:
        u = queue.pop()
        if u not in r.cost or u in pinned or len(r.adj[u]) > 2:
            continue
        c = r.cost.pop(u)
        nbrs = list(r.adj.pop(u).items())
        for w, _ in nbrs:
            del r.adj[w][u]
        if not nbrs:
            r.const += float(c.min())
        elif len(nbrs) == 1:  # leaf: its neighbour pays the leaf's best answer to each choice
            (w, m), = nbrs
            r.cost[w] = r.cost[w] + (c[:, None] + m).min(axis=0)
        else:  # chain link: a new edge a-b pays min over u's strategies
            (a, ma), (b, mb) = nbrs
            r.add_edge(a, b, (ma.T[:, :, None] + c[None, :, None] + mb[None, :, :]).min(axis=1),
                       True)
        r.trail.append((u, c, nbrs))
        queue.extend(w for w, _ in nbrs)


def complete_choices(r: ReducedProblem, n: int, core: dict[int, int]) -> list[int]:
    """Full choices from the MIP's: eliminated nodes answer their neighbours, last first."""
    ch = {**r.fixed, **core}
    for u, c, nbrs in reversed(r.trail):
        ch[u] = int(np.argmin(c + sum((m[:, ch[w]] for w, m in nbrs), np.zeros_like(c))))
    return [ch[u] for u in range(n)]


def local_search(
    r: ReducedProblem, start: dict[int, int], sweeps: int = 8
) -> dict[int, int] | None:
    """Greedy single-node moves from ``start`` that keep every memory row satisfied: the
    fallback plan when the solver stops without one. None when ``start`` breaks a row."""
    ch = dict(start)
    load = [sum(d[ch[u]] for u, d in terms) for terms, _ in r.rows]
    if any(ld > rhs * (1 + 1e-9) for ld, (_, rhs) in zip(load, r.rows, strict=True)):
        return None
    rows_of: dict[int, list[tuple[int, np.ndarray]]] = {u: [] for u in r.cost}
    for k, (terms, _) in enumerate(r.rows):
        for u, d in terms:
            rows_of[u].append((k, d))
    for _ in range(sweeps):
        moved = False
        for u, c in r.cost.items():
            v = c + sum((m[:, ch[w]] for w, m in r.adj[u].items()), np.zeros_like(c))
            for i in map(int, np.argsort(v, kind="stable")):
                if v[i] >= v[ch[u]] - 1e-12 * abs(v[ch[u]]):
                    break
                if all(load[k] - d[ch[u]] + d[i] <= r.rows[k][1] for k, d in rows_of[u]):
                    for k, d in rows_of[u]:
                        load[k] += d[i] - d[ch[u]]
                    ch[u], moved = i, True
                    break
        if not moved:
            break
    return ch
