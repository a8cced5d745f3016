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
from dataclasses import dataclass, field

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
    # the messages it ended with, by (node, neighbour): a warm start for a nested problem
    messages: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

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
    """The costs of ``r`` after the messages moved so far, kept as messages: ``msg`` holds, per
    free node ``u`` and neighbour ``w``, what the edge (u, w) has moved into u's costs
    (``mu[u, w]``, one entry per strategy of u). Node ``u``'s costs are then its own plus its
    messages, and edge (u, w)'s are its own less ``mu[u, w]`` on the rows and ``mu[w, u]`` on
    the columns: every plan's total is unchanged.

    A sweep updates the nodes in classes of pairwise non-adjacent ones (a greedy colouring,
    busiest first): their stars share no edge, so each class's updates are one set of numpy
    operations over flat arrays rather than a few per edge (at published sizes, ~46 nodes and
    ~85 edges, the per-edge form spent most of a sweep's 2.2 ms in numpy's call overhead; this
    one takes about a quarter of that, profiled alike)."""

    def __init__(self, r: ReducedProblem,
                 warm: dict[tuple[int, int], np.ndarray] | None = None) -> None:
        self.const = r.const
        self.nodes = list(r.cost)
        self.nbrs = {u: sorted(r.adj.get(u, {})) for u in self.nodes}
        self.size = {u: len(r.cost[u]) for u in self.nodes}
        # messages: node u's block is [neighbour k][strategy i], at base[u]
        self.base: dict[int, int] = {}
        total = 0
        for u in self.nodes:
            self.base[u] = total
            total += len(self.nbrs[u]) * self.size[u]
        self.msg = np.zeros(total)
        self.pos = {u: {w: k for k, w in enumerate(ws)} for u, ws in self.nbrs.items()}
        # every node's costs (own plus messages), flat, at first[u]: a star update sets them
        self.first = dict(zip(self.nodes, np.cumsum([0] + [self.size[u] for u in self.nodes]),
                              strict=False))
        self.belief = np.concatenate([np.asarray(r.cost[u], float) for u in self.nodes])
        # each edge once (u < w), raveled into one array, with each entry's two messages
        self.ends = [(u, w) for u in self.nodes for w in self.nbrs[u] if w > u]
        self.index = {ends: k for k, ends in enumerate(self.ends)}
        self.edge_costs = np.concatenate([np.asarray(r.adj[u][w], float).ravel()
                                          for u, w in self.ends] or [np.zeros(0)])
        self.edge_at = np.cumsum([0] + [self.size[u] * self.size[w] for u, w in self.ends])
        self.edge_rows, self.edge_cols = self._edge_message_slots()
        if warm:
            self._start_from(warm)
        # the busiest nodes first: their averages feed the most edges
        self.order = sorted(self.nodes, key=lambda u: -len(self.nbrs[u]))
        self.classes = [self._flatten(group, r) for group in self._colouring()]

    def _start_from(self, warm: dict[tuple[int, int], np.ndarray]) -> None:
        """Messages given for edges of this problem (any messages keep every plan's total, so
        any are a valid start), each node's costs made to agree with them."""
        for u in self.nodes:
            moved = [(w, warm[(u, w)]) for w in self.nbrs[u] if (u, w) in warm]
            for w, message in moved:
                if len(message) == self.size[u]:
                    self.msg[self._slot(u, w)] = message
            if moved:
                at = self.first[u]
                self.belief[at:at + self.size[u]] += sum(
                    self.msg[self._slot(u, w)] for w, _ in moved)

    def messages(self) -> dict[tuple[int, int], np.ndarray]:
        """Every message, by (node, neighbour)."""
        return {(u, w): self.msg[self._slot(u, w)].copy()
                for u in self.nodes for w in self.nbrs[u]}

    def _edge_message_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """For each entry (i, j) of the raveled edges (u, w), where ``mu[u, w][i]`` and
        ``mu[w, u][j]`` lie in ``msg``: in numpy over every entry at once (per edge, the
        repeats and tiles took a fifth of the ascent on GPT-39B's layer ILPs)."""
        if not self.ends:
            return np.zeros(0, int), np.zeros(0, int)
        rows_at = np.array([self.base[u] + self.pos[u][w] * self.size[u] for u, w in self.ends])
        cols_at = np.array([self.base[w] + self.pos[w][u] * self.size[w] for u, w in self.ends])
        width = np.array([self.size[w] for _, w in self.ends])
        edge = np.repeat(np.arange(len(self.ends)), np.diff(self.edge_at))
        i, j = np.divmod(np.arange(self.edge_at[-1]) - self.edge_at[edge], width[edge])
        return rows_at[edge] + i, cols_at[edge] + j

    def _slot(self, u: int, w: int) -> np.ndarray:
        """Where ``mu[u, w]``'s entries lie in ``msg``."""
        at = self.base[u] + self.pos[u][w] * self.size[u]
        return np.arange(at, at + self.size[u])

    def _colouring(self) -> list[list[int]]:
        colour: dict[int, int] = {}
        for u in self.order:
            if self.nbrs[u]:
                taken = {colour[w] for w in self.nbrs[u] if w in colour}
                colour[u] = next(c for c in range(len(taken) + 1) if c not in taken)
        groups: list[list[int]] = [[] for _ in range(max(colour.values(), default=-1) + 1)]
        for u in self.order:
            if u in colour:
                groups[colour[u]].append(u)
        return groups

    def _flatten(self, group: list[int], r: ReducedProblem) -> tuple[np.ndarray, ...]:
        """One class's arrays: its stars' edge costs row by row (u, i, then each neighbour's
        strategies) and where each entry's column message lies in ``msg``; where each (u, i,
        w) segment and each (u, i) row starts; the nodes' own costs, their degrees plus one
        and their degrees per row; where the new messages and costs go. Index arrays in numpy
        over the whole class (per node, they were a sixth of the ascent at published sizes)."""
        sizes = np.array([self.size[u] for u in group])
        degrees = np.array([len(self.nbrs[u]) for u in group])
        # the class's (u, w) pairs in star order: mu[w, u]'s place and w's strategy count
        pair_at = np.array([self.base[w] + self.pos[w][u] * self.size[w]
                            for u in group for w in self.nbrs[u]])
        pair_size = np.array([self.size[w] for u in group for w in self.nbrs[u]])
        first_pair = _starts(degrees)
        # per node, the star's column slots one neighbour after another
        star_len = np.add.reduceat(pair_size, first_pair) if len(pair_size) else degrees * 0
        star_pos = np.repeat(pair_at - _starts(pair_size), pair_size) + np.arange(pair_size.sum())
        # entries (u, i, j): node u's row i, its star's column j
        node = np.repeat(np.arange(len(group)), sizes * star_len)
        j = (np.arange(node.size) - _starts(sizes * star_len)[node]) % star_len[node]
        gather = star_pos[_starts(star_len)[node] + j]
        # rows (u, i, k): node u's row i, its k-th neighbour
        node_k = np.repeat(np.arange(len(group)), sizes * degrees)
        i, k = np.divmod(np.arange(node_k.size) - _starts(sizes * degrees)[node_k],
                         degrees[node_k])
        lengths = pair_size[first_pair[node_k] + k]
        base = np.array([self.base[u] for u in group])
        scatter = base[node_k] + k * sizes[node_k] + i
        first = np.array([self.first[u] for u in group])
        costs_at = np.repeat(first - _starts(sizes), sizes) + np.arange(sizes.sum())
        per_row = np.repeat(degrees, sizes)
        costs = np.concatenate([np.hstack([r.adj[u][w] for w in self.nbrs[u]]).ravel()
                                for u in group])
        theta = np.concatenate([np.asarray(r.cost[u], float) for u in group])
        return (costs, gather, _starts(lengths), _starts(per_row), theta,
                np.repeat(degrees + 1.0, sizes), scatter, per_row, costs_at)

    def sweep(self) -> None:
        """One MPLP star update per node (Globerson and Jaakkola, 2007): the node's costs and
        its edges' min-marginals toward it are set to their common average, which never
        lowers the bound."""
        for costs, gather, segments, rows, theta, count, scatter, per_row, at in self.classes:
            marginals = np.minimum.reduceat(costs - self.msg[gather], segments)
            share = (theta + np.add.reduceat(marginals, rows)) / count
            self.msg[scatter] = marginals - np.repeat(share, per_row)
            self.belief[at] = share

    def node_costs(self, u: int) -> np.ndarray:
        return self.belief[self.first[u]:self.first[u] + self.size[u]]

    def flat_edges(self) -> np.ndarray:
        """Every edge's costs now, raveled one after another (as ``edge_costs``): what
        ``lower_bound``, ``edges`` and ``decode`` read, computed once where they read the
        same messages."""
        return self.edge_costs - self.msg[self.edge_rows] - self.msg[self.edge_cols]

    def edges(self, flat: np.ndarray | None = None) -> list[np.ndarray]:
        """Every edge's costs now (rows: the lower-numbered end's strategies; ``flat``:
        ``flat_edges`` of the messages as they are)."""
        flat = self.flat_edges() if flat is None else flat
        return [flat[a:b].reshape(self.size[u], self.size[w])
                for (u, w), a, b in zip(self.ends, self.edge_at[:-1], self.edge_at[1:],
                                        strict=True)]

    def lower_bound(self, flat: np.ndarray | None = None) -> float:
        flat = self.flat_edges() if flat is None else flat
        node_least = np.minimum.reduceat(self.belief, [self.first[u] for u in self.nodes]) \
            if self.nodes else np.zeros(0)
        edge_least = np.minimum.reduceat(flat, self.edge_at[:-1]) if self.ends else np.zeros(0)
        return self.const + math.fsum(node_least.tolist()) + math.fsum(edge_least.tolist())

    def strategy_bounds(self, lower: float) -> dict[int, np.ndarray]:
        """Per free node and strategy, a lower bound on every plan that picks it."""
        excess = {}
        for u in self.nodes:
            c = self.node_costs(u)
            excess[u] = c - c.min()
        for (u, w), m in zip(self.ends, self.edges(), strict=True):
            least = m.min()
            excess[u] = excess[u] + (m.min(axis=1) - least)
            excess[w] = excess[w] + (m.min(axis=0) - least)
        return {u: lower + e for u, e in excess.items()}

    def decode(self, flat: np.ndarray | None = None) -> dict[int, int]:
        """A plan: nodes in order, each at its cheapest strategy given the nodes decided
        before it (reparametrised costs, as tree-reweighted solvers decode)."""
        edges = self.edges(flat)
        plan: dict[int, int] = {}
        for u in self.order:
            cost = self.node_costs(u)
            for w in self.nbrs[u]:
                if w in plan:
                    if u < w:
                        cost = cost + edges[self.index[(u, w)]][:, plan[w]]
                    else:
                        cost = cost + edges[self.index[(w, u)]][plan[w], :]
            plan[u] = int(np.argmin(cost))
        return plan


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Where each of consecutive segments of these lengths starts."""
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)


def tighten(r: ReducedProblem, *, relative_gap: float, deadline: float,
            max_sweeps: int = 300, start: dict[int, int] | None = None,
            warm: dict[tuple[int, int], np.ndarray] | None = None) -> DualBound:
    """Dual ascent on ``r`` until the best plan found is within ``relative_gap`` of the bound,
    the bound stalls, ``max_sweeps`` sweeps or ``deadline`` (``time.perf_counter()``); then the
    strategies each node may still take in an optimal plan. ``start``: a plan to beat (each
    free node's strategy), e.g. the greedy one. ``warm``: messages to start from, by (node,
    neighbour), each over the node's strategies (a nested problem's ascent ended with them:
    ``WarmMessages``)."""
    t0 = time.perf_counter()
    rep = _Reparametrisation(r, warm)
    best_plan: dict[int, int] | None = None
    best = math.inf

    seen: set[tuple[int, ...]] = set()

    def consider(plan: dict[int, int] | None) -> None:
        nonlocal best, best_plan
        if plan is not None:  # decoded plans repeat as the bound creeps: polished once
            key = tuple(plan.values())
            if key in seen:
                return
            seen.add(key)
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
        flat = rep.flat_edges()
        lower = rep.lower_bound(flat)
        consider(rep.decode(flat))
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
    return DualBound(lower, best, best_plan, keep, sweeps, time.perf_counter() - t0,
                     rep.messages())


@dataclass
class WarmMessages:
    """Dual messages carried from one solve to the next of nested problems: the same
    problem's memory-lean variants, each a restriction of the one before (``ilp.restrict``).
    ``strategies``: per node of the problem solved next, the original index of each of its
    strategies (None: all of them, in order), set by the caller before each solve; ``kept``:
    the messages by (node, neighbour), as original strategy indices and values (float32: a
    start need not be exact, any messages are valid), so a restriction reads its own entries;
    ``made``: how many solves have replaced them. Started from them, the ascent on GPT-39B's
    memory-lean layer ILPs ends in fewer sweeps (docs/ilp-format.md, "Large problems")."""

    kept: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    strategies: list[np.ndarray] | None = None
    made: int = 0

    def _ids(self, u: int, count: int) -> np.ndarray:
        return np.arange(count) if self.strategies is None else np.asarray(self.strategies[u])

    def start(self, r: ReducedProblem) -> dict[tuple[int, int], np.ndarray]:
        """The kept messages on ``r``'s edges, over its nodes' strategies (0 where none)."""
        out = {}
        for u, nbrs in r.adj.items():
            if u not in r.cost:
                continue
            ids = self._ids(u, len(r.cost[u]))
            for w in nbrs:
                found = self.kept.get((u, w))
                if found is None:
                    continue
                known, values = found
                at = np.clip(np.searchsorted(known, ids), 0, len(known) - 1)
                out[(u, w)] = np.where(known[at] == ids, values[at], 0.0)
        return out

    def keep(self, r: ReducedProblem, messages: dict[tuple[int, int], np.ndarray]) -> None:
        """Keep what a solve of ``r`` ended with, by original strategy index (in place of
        what was kept)."""
        kept = {}
        for (u, w), values in messages.items():
            ids = self._ids(u, len(r.cost[u]))
            order = np.argsort(ids, kind="stable")
            kept[(u, w)] = (ids[order].astype(np.int32), values[order].astype(np.float32))
        self.kept = kept
        self.made += 1
