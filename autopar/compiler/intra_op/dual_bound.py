"""Lower bounds on the sharding ILP by dual ascent, and the strategies they rule out.

The LP relaxation of the ILP (one-hot nodes, pair variables per edge) is tight on sharding
problems, but at the sizes of published runs (a GPT layer's forward, recomputed forward,
backward and Adam update on a 32 x 2 mesh: about 450 free nodes of up to 72 strategies and
half a million pair variables) HiGHS needs minutes for it, and the planner used to stop at its
time limit with a plan twice as slow as the optimum.

The relaxation's dual is a reparametrisation: costs move between a node and its edges without
changing any plan's total, and the sum of every node's and every edge's minimum is then a lower
bound on every plan. Block coordinate ascent over one node's star at a time (the MPLP update of
Globerson and Jaakkola, 2007: the node and its edges' min-marginals are averaged) raises that
bound monotonically, with numpy work per edge and no solver. The bound also prices each
strategy: forced to take strategy ``i``, node ``u`` pays at least the bound plus its own excess
over its minimum and its edges' excess, so a strategy whose bound exceeds a known plan's cost is
in no optimal plan and is dropped (reduced-cost fixing; exact). What is left is small enough for
the MIP to prove optimal in about a second.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from autopar.compiler.intra_op.presolve import ReducedProblem, local_search

# Decode a plan from the reparametrised costs every this many sweeps.
DECODE_EVERY = 5
# Stop ascending once the bound rose less than this fraction of the gap over DECODE_EVERY sweeps.
# The bound creeps before it closes: at 0.02 the zoo's MoE on 2 x 4 stopped at a 2% gap after
# 90 sweeps and left HiGHS a 68k-column MIP (1.2 s); at 0.005 it closed the gap to 0 in 140
# (0.5 s, the same plan). GPT-39B and GPT-3 175B search as fast either way, Megatron's 1T row
# 1.5% slower (40.4 -> 41.0 s, alternated; the same code's bench runs spread 44.9-52.9 s).
STALL_FRACTION = 0.005


@dataclass(frozen=True)
class DualBound:
    """What dual ascent proved about a reduced problem.

    ``lower``: a lower bound on its optimum (constant included); ``upper`` and ``plan``: the best
    plan found (each free node's strategy) and its cost, or ``math.inf`` and None when no decoded
    plan kept the memory rows; ``keep``: per free node, the strategies (ascending indices) whose
    own bound does not exceed ``upper``: every optimal plan picks among them; ``sweeps`` and
    ``time_s``: the work it took."""

    lower: float
    upper: float
    plan: dict[int, int] | None
    keep: dict[int, np.ndarray]
    sweeps: int
    time_s: float

    def gap(self) -> float:
        """The relative gap between the plan and the bound (inf without a plan)."""
        if self.plan is None:
            return math.inf
        return max(0.0, self.upper - self.lower) / max(abs(self.upper), 1e-300)


def reduced_objective(r: ReducedProblem, plan: dict[int, int]) -> float:
    """The cost of ``plan`` (a strategy per free node) in ``r``: its constant, node and edge
    costs; presolve's eliminations folded their nodes' best answers in, so this equals the
    completed plan's objective."""
    total = r.const + math.fsum(float(c[plan[u]]) for u, c in r.cost.items())
    return total + math.fsum(float(m[plan[u], plan[w]]) for u, nbrs in r.adj.items()
                             for w, m in nbrs.items() if w > u)


class _Reparametrisation:
    """Node and edge costs of ``r`` after the messages moved so far (``nodes[u]``,
    ``edges[k]`` with ``ends[k] = (u, w)``: rows are u's strategies)."""

    def __init__(self, r: ReducedProblem) -> None:
        self.nodes = {u: np.asarray(c, float).copy() for u, c in r.cost.items()}
        self.ends: list[tuple[int, int]] = []
        self.edges: list[np.ndarray] = []
        self.star: dict[int, list[tuple[int, int]]] = {u: [] for u in r.cost}
        for u, nbrs in r.adj.items():
            for w, m in nbrs.items():
                if w > u:
                    self.star[u].append((len(self.edges), 0))
                    self.star[w].append((len(self.edges), 1))
                    self.ends.append((u, w))
                    self.edges.append(np.asarray(m, float).copy())
        # the busiest nodes first: their averages feed the most edges
        self.order = sorted(self.star, key=lambda u: -len(self.star[u]))
        self.const = r.const

    def sweep(self) -> None:
        """One MPLP star update per node: the node's costs and its edges' min-marginals toward
        it are set to their common average, which never lowers the bound."""
        for u in self.order:
            star = self.star[u]
            if not star:
                continue
            marginals = [self.edges[k].min(axis=1 - side) for k, side in star]
            share = (self.nodes[u] + sum(marginals)) / (len(star) + 1)
            self.nodes[u] = share
            for (k, side), marginal in zip(star, marginals, strict=True):
                shift = marginal - share
                if side == 0:
                    self.edges[k] -= shift[:, None]
                else:
                    self.edges[k] -= shift[None, :]

    def lower_bound(self) -> float:
        return (self.const + math.fsum(float(c.min()) for c in self.nodes.values())
                + math.fsum(float(m.min()) for m in self.edges))

    def strategy_bounds(self, lower: float) -> dict[int, np.ndarray]:
        """Per free node and strategy, a lower bound on every plan that picks it."""
        excess = {u: c - c.min() for u, c in self.nodes.items()}
        for (u, w), m in zip(self.ends, self.edges, strict=True):
            least = m.min()
            excess[u] = excess[u] + (m.min(axis=1) - least)
            excess[w] = excess[w] + (m.min(axis=0) - least)
        return {u: lower + e for u, e in excess.items()}

    def decode(self) -> dict[int, int]:
        """A plan: nodes in order, each at its cheapest strategy given the nodes decided
        before it (reparametrised costs, as tree-reweighted solvers decode)."""
        plan: dict[int, int] = {}
        for u in self.order:
            cost = self.nodes[u].copy()
            for k, side in self.star[u]:
                a, b = self.ends[k]
                other = b if side == 0 else a
                if other in plan:
                    m = self.edges[k]
                    cost += m[:, plan[other]] if side == 0 else m[plan[other], :]
            plan[u] = int(np.argmin(cost))
        return plan


def tighten(r: ReducedProblem, *, relative_gap: float, deadline: float,
            max_sweeps: int = 300, start: dict[int, int] | None = None) -> DualBound:
    """Dual ascent on ``r`` until the best plan found is within ``relative_gap`` of the bound,
    the bound stalls, ``max_sweeps`` sweeps or ``deadline`` (``time.perf_counter()``); then the
    strategies each node may still take in an optimal plan. ``start``: a plan to beat (each
    free node's strategy), e.g. the greedy one."""
    t0 = time.perf_counter()
    rep = _Reparametrisation(r)
    best_plan: dict[int, int] | None = None
    best = math.inf

    def consider(plan: dict[int, int] | None) -> None:
        nonlocal best, best_plan
        polished = None if plan is None else local_search(r, plan)
        if polished is not None:
            value = reduced_objective(r, polished)
            if value < best:
                best, best_plan = value, polished

    consider(start)
    lower = rep.lower_bound()
    previous = lower
    sweeps = 0
    while sweeps < max_sweeps and time.perf_counter() < deadline:
        rep.sweep()
        sweeps += 1
        if sweeps % DECODE_EVERY and sweeps != max_sweeps:
            continue
        lower = rep.lower_bound()
        consider(rep.decode())
        gap = best - lower
        if gap <= relative_gap * abs(best):
            break
        if lower - previous <= STALL_FRACTION * gap:
            break
        previous = lower
    lower = min(rep.lower_bound(), best)
    bounds = rep.strategy_bounds(lower)
    slack = best + 1e-9 * max(abs(best), 1e-12) if math.isfinite(best) else math.inf
    keep = {}
    for u, b in bounds.items():
        kept = np.flatnonzero(b <= slack)
        if best_plan is not None and best_plan[u] not in kept:  # round-off: keep the plan's own
            kept = np.union1d(kept, [best_plan[u]])
        keep[u] = kept if len(kept) else np.arange(len(b))
    return DualBound(lower, best, best_plan, keep, sweeps, time.perf_counter() - t0)
