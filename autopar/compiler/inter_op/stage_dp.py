"""The stage-construction search: Alpa's inter-operator dynamic program over a cost table.

:mod:`autopar.compiler.inter_op.stages` hands this module a :class:`StageCostTable` (one
:class:`StageCandidate` per tried logical mesh of every (layer range, submesh) pair) and gets
back the stages minimising the pipeline latency

    total = sum_i t_i + (m - 1) * max_i t_i          (m microbatches)

using all devices of the cluster, with every stage's per-device memory (fixed memory plus one
set of activations per in-flight microbatch) within the budget.

Search. For a cap ``t_max`` the DP ``F(s, k, d)`` (min sum of stage times covering layers
``k..L-1`` with ``s`` stages on ``d`` devices, every stage time <= t_max, every stage within the
memory budget with the in-flight microbatches of its position) is solved with numpy over all
(k, e, d) at once per stage count. Rather than sweeping every distinct candidate time, the caps
are searched by branch and bound: a DP answer at cap T with slowest stage M dominates every
partition whose slowest stage lies in [M, T] (no smaller sum, no smaller max), and a range of
caps [a, b] below a known answer of sum S can hold nothing better than S + (m - 1) a. The
uncapped DP and a min-max DP (the smallest feasible cap) bound the range. This is exact; only
after ``max_tmax_candidates`` DP runs are the caps still open thinned with Alpa's relative gap,
and :class:`~autopar.compiler.inter_op.stage_search.StageSearch` reports the gap (0 when exact).
The search over caps lives in :mod:`autopar.compiler.inter_op.stage_search`; this module holds
the DP itself.

In-flight microbatches come from the schedule (``StageDPOptions.activation_counts``, the
simulated task lists). ``F(s, k, d)`` indexes stages from the end, so one DP over every stage
count is exact only when a stage's count depends on its position from the end alone (GPipe,
1F1B: checked on the simulated counts, not by name). When it also depends on the total stage
count p (ZB-H1 keeps min(p, m) on every stage; interleaved 1F1B more on early stages the more
stages there are), :func:`prepare_problems` gives one problem per valid p with the stage count
fixed and that p's counts, and :func:`search_stages` searches them with one shared incumbent:
every p gets its min-max and uncapped DPs, which bound its best total from below, and the caps
of a p are searched (best bound first) only while that bound can beat the best answer so far.

Stages here are (start, end, usable submesh j) index triples; turning them back into the
table's submeshes and candidates is the caller's job. Pure Python + numpy; no devices, no JAX.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autopar.compiler.inter_op.stage_options import StageDPOptions
from autopar.compiler.inter_op.submesh import CandidateArrays, StageCostTable, always_packs
from autopar.errors import InvalidOptionError, PlanError, choices_text

__all__ = [
    "Combine",
    "DPAnswer",
    "StageDPProblem",
    "backtrack",
    "best_stage_count",
    "candidate_arrays",
    "pipeline_time",
    "prepare_problems",
    "run_dp",
    "solve_capped",
]


def pipeline_time(stage_times: Sequence[float], num_microbatches: int,
                  sum_times: Sequence[float] | None = None) -> float:
    """``sum(s_i) + (m - 1) * max(t_i)``: one iteration's latency through the pipeline, where
    ``s_i`` (``sum_times``, default ``t_i``) is what the stage adds once (its time per
    microbatch and its per-step parts) and ``t_i`` its time per microbatch."""
    summed = stage_times if sum_times is None else sum_times
    return float(sum(summed) + (num_microbatches - 1) * max(stage_times))


# ----------------------------------------------------------------------------- the DP


@dataclass(frozen=True)
class StageDPProblem:
    """The cost table as dense arrays over (start k, end e, usable submesh j[, candidate]).

    A candidate has two times: what the max term sees (its time per microbatch, the per-step
    tail spread over the microbatches) and what the sum term sees (that plus the host's time;
    ``StageCandidate.max_part`` / ``sum_part``). ``fit_time[f]`` / ``fit_sum[f]`` (k, e, j, c)
    are those of the candidates fitting the budget with ``f`` microbatches in flight (inf for
    the others); ``best_time[f]`` the least ``fit_time`` per entry (inf if none), and
    ``least_memory[f]`` the smallest memory any candidate needs with ``f`` in flight. Under a
    stage-time cap a stage takes, among the fitting candidates meeting the cap, the one of
    least sum (:meth:`capped`); when the two times are equal that is the fastest, as before.
    """

    num_layers: int
    num_devices: int
    table_index: tuple[int, ...]  # usable submesh j -> index in the table
    sizes: np.ndarray  # devices of usable submesh j
    top_stages: int  # largest stage count the DP builds
    fixed_stages: int | None
    # in_flight[s]: microbatches in flight on the stage s stages from the end, s = 1..top_stages
    # (index 0 unused); fractional for interleaved schedules
    in_flight: tuple[float, ...]
    best_time: Mapping[float, np.ndarray]
    least_memory: Mapping[float, np.ndarray]
    fit_time: Mapping[float, np.ndarray]
    fit_sum: Mapping[float, np.ndarray]

    def per_stage_count(self, by_in_flight: Mapping[float, np.ndarray]) -> list[np.ndarray]:
        """``costs[s]`` for s = 1..top (``costs[0]`` is unused)."""
        return [by_in_flight[self.in_flight[max(s, 1)]] for s in range(self.top_stages + 1)]

    def capped(self, t_max: float) -> tuple[dict[float, np.ndarray], dict[float, np.ndarray]]:
        """Per in-flight count: the least sum of a fitting candidate whose time is at most
        ``t_max`` (inf if none), and its index in the table entry."""
        sums, index = {}, {}
        for f, times in self.fit_time.items():
            masked = np.where(times <= t_max, self.fit_sum[f], np.inf)
            index[f] = np.argmin(masked, axis=-1)
            sums[f] = np.take_along_axis(masked, index[f][..., None], axis=-1)[..., 0]
        return sums, index


@dataclass(frozen=True)
class _DenseTable:
    """The table's candidates as (k, e, j, candidate) arrays, padding slots infinite; and,
    per in-flight count, the fitting candidates' times (filled as counts are asked for)."""

    num_layers: int
    num_devices: int
    table_index: tuple[int, ...]
    sizes: np.ndarray
    times: np.ndarray
    sums: np.ndarray
    fixed: np.ndarray
    act: np.ndarray
    param: np.ndarray
    versions: Mapping[float, int]  # weight versions held with each in-flight count (else 1)
    budget: float
    by_count: dict[float, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]

    def for_count(self, f: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(best time, least memory, fitting times, fitting sums) with ``f`` in flight."""
        if f not in self.by_count:
            # inf for padding slots: they never fit
            need = self.fixed + f * self.act + (self.versions.get(f, 1) - 1) * self.param
            fits = need <= self.budget
            fitting_times = np.where(fits, self.times, np.inf)
            fitting_sums = np.where(fits, self.sums, np.inf)
            self.by_count[f] = (fitting_times.min(axis=-1), need.min(axis=-1), fitting_times,
                                fitting_sums)
        return self.by_count[f]

    def problem(self, top: int, fixed_stages: int | None,
                in_flight: tuple[float, ...]) -> StageDPProblem:
        counts = sorted(set(in_flight[1:]))
        found = {f: self.for_count(f) for f in counts}
        return StageDPProblem(
            num_layers=self.num_layers,
            num_devices=self.num_devices,
            table_index=self.table_index,
            sizes=self.sizes,
            top_stages=top,
            fixed_stages=fixed_stages,
            in_flight=in_flight,
            best_time={f: found[f][0] for f in counts},
            least_memory={f: found[f][1] for f in counts},
            fit_time={f: found[f][2] for f in counts},
            fit_sum={f: found[f][3] for f in counts},
        )


def candidate_arrays(table: StageCostTable, usable: Sequence[int],
                     num_microbatches: int) -> CandidateArrays:
    """The table's candidates on the ``usable`` submeshes as arrays, entry by entry."""
    layers = table.num_layers
    entries = [
        (k, e, j, table.candidates(k, e, i))
        for k in range(layers)
        for e in range(k + 1, layers + 1)
        for j, i in enumerate(usable)
    ]
    width = max([1] + [len(found) for *_, found in entries])
    shape = (layers, layers + 1, len(usable), width)
    times, fixed, act = np.full(shape, np.inf), np.full(shape, np.inf), np.zeros(shape)
    param = np.zeros(shape)
    sums = np.full(shape, np.inf)
    m = num_microbatches
    at = [(k, e, j, c) for k, e, j, found in entries for c in range(len(found))]
    if at:
        where = tuple(np.array(axis) for axis in zip(*at, strict=True))
        chosen = [entry[3][c] for entry in entries for c in range(len(entry[3]))]
        times[where] = [c.max_part(m) for c in chosen]
        sums[where] = [c.sum_part(m) for c in chosen]
        fixed[where] = [c.fixed_memory for c in chosen]
        act[where] = [c.activation_memory_per_microbatch for c in chosen]
        param[where] = [c.param_bytes for c in chosen]
    return CandidateArrays(times, sums, fixed, act, param)


def _densify(
    table: StageCostTable, devices: int, usable: tuple[int, ...], options: StageDPOptions
) -> _DenseTable:
    layers = table.num_layers
    m = options.num_microbatches
    arrays = table.dense(usable, m) if table.dense is not None else None
    if arrays is None:
        arrays = candidate_arrays(table, usable, m)
    budget = np.inf if options.memory_budget_bytes is None else options.memory_budget_bytes
    return _DenseTable(
        num_layers=layers,
        num_devices=devices,
        table_index=usable,
        sizes=np.array([table.submeshes[i].num_devices for i in usable]),
        times=arrays.times,
        sums=arrays.sums,
        fixed=arrays.fixed,
        act=arrays.act,
        param=arrays.param,
        versions=options.weight_versions_by_count(min(layers, devices)),
        budget=float(budget),
        by_count={},
    )


def prepare_problems(
    table: StageCostTable, num_hosts: int, per_host: int, options: StageDPOptions
) -> list[StageDPProblem]:
    """Densify ``table`` for the DP on ``num_hosts`` x ``per_host`` devices.

    One problem over every stage count when the schedule's in-flight counts depend only on the
    position from the end (or the count is fixed); else one per stage count the schedule runs
    on, each with that count fixed and its own counts. Keeps only the submeshes that always
    pack onto the cluster. PlanError (one line) when none does, or when ``options.num_stages``
    exceeds the layers or devices or the schedule does not run on that many stages.
    """
    layers, devices = table.num_layers, num_hosts * per_host
    usable = tuple(
        i for i, sm in enumerate(table.submeshes) if always_packs(sm, num_hosts, per_host)
    )
    if not usable:
        raise PlanError(
            f"no submesh of the cost table ({choices_text(table.submeshes)}) is usable on "
            f"{num_hosts} hosts x {per_host} devices (whole hosts, or a power-of-two slice "
            f"dividing {per_host})"
        )
    wanted = options.num_stages
    if wanted is not None and (wanted > layers or wanted > devices):
        raise PlanError(
            f"num_stages={wanted} is more than the {layers} layers or the {devices} devices "
            f"({num_hosts} hosts x {per_host}); choose at most {min(layers, devices)}"
        )
    dense = _densify(table, devices, usable, options)

    def from_end(counts: tuple[float, ...]) -> tuple[float, ...]:
        return (0.0, *reversed(counts))  # [s]: the stage s stages from the end

    if wanted is not None:
        try:
            counts = options.activation_counts(wanted)
        except InvalidOptionError as exc:  # e.g. interleaved with m % p != 0
            raise PlanError(f"num_stages={wanted}: {exc}") from None
        return [dense.problem(wanted, wanted, from_end(counts))]
    top = min(layers, devices)
    shared = options.counts_by_stages_from_end(top)
    if shared is not None:
        return [dense.problem(top, None, shared)]
    return [
        dense.problem(p, p, from_end(options.activation_counts(p)))
        for p in range(1, top + 1)
        if options.valid_stage_count(p)
    ]


Combine = Callable[..., np.ndarray]  # np.add (sum of stage times) or np.maximum (bottleneck)


def run_dp(
    problem: StageDPProblem, costs: Sequence[np.ndarray], combine: Combine
) -> list[np.ndarray]:
    """``tables[s][k, d]``: best value covering layers k..L-1 with s stages on d devices.

    Built one stage count at a time: ``F(s, k, d) = min over e > k, j of
    cost_s[k, e, j] (+ or max) F(s - 1, e, d - n_j)``, vectorised over k, e and d. Only stage
    lengths up to the longest finite entry of each submesh are visited: under a low stage-time
    cap, long ranges on small submeshes are all infinite, which shrinks the work several-fold.
    """
    layers, devices = problem.num_layers, problem.num_devices
    lengths = np.arange(layers + 1)[None, :] - np.arange(layers)[:, None]  # e - k
    bands: dict[int, np.ndarray] = {}  # id(cost array) -> longest finite stage per submesh
    empty = np.full((layers + 1, devices + 1), np.inf)
    empty[layers, 0] = 0.0  # zero stages cover zero layers on zero devices
    tables = [empty]
    for s in range(1, problem.top_stages + 1):
        cost = costs[s]
        if id(cost) not in bands:
            bands[id(cost)] = np.where(np.isfinite(cost), lengths[..., None], 0).max(axis=(0, 1))
        band = bands[id(cost)]
        # Earlier stages need a layer each (when the count is fixed); later ones too.
        k_low = 0 if problem.fixed_stages is None else problem.fixed_stages - s
        k_high, e_high = layers - s, layers - s + 1
        current = np.full((layers + 1, devices + 1), np.inf)
        starts = np.arange(max(k_low, 0), k_high + 1)
        if s == 1:
            for j, size in enumerate(problem.sizes):
                if size <= devices:
                    column = combine(cost[starts, layers, j], 0.0)
                    current[starts, size] = np.minimum(current[starts, size], column)
        elif len(starts) and band.max() > 0:
            reach = int(min(band.max(), e_high - starts[0]))
            ends = starts[:, None] + np.arange(1, reach + 1)[None, :]  # (k, offset)
            beyond = ends > e_high
            ends = np.minimum(ends, e_high)
            rest = tables[-1][ends]  # (k, offset, d): the best of the stages after this one
            stage_costs = np.where(beyond[..., None], np.inf, cost[starts[:, None], ends])
            best = np.full((len(starts), devices + 1), np.inf)
            scratch = np.empty_like(rest)
            for j, size in enumerate(problem.sizes):
                width = int(min(band[j], reach))
                if size > devices or width == 0:
                    continue
                view = scratch[:, :width]
                view[:, :, :size] = np.inf
                combine(
                    stage_costs[:, :width, j, None],
                    rest[:, :width, : devices + 1 - size],
                    out=view[:, :, size:],
                )
                np.minimum(best, view.min(axis=1), out=best)
            current[starts] = best
        tables.append(current)
        if not np.isfinite(current).any():
            break  # more stages cannot do better than none
    return tables


def best_stage_count(problem: StageDPProblem, tables: Sequence[np.ndarray]) -> tuple[int, float]:
    """(stage count, value) of the best answer for all layers on all devices."""
    counts = [problem.fixed_stages] if problem.fixed_stages is not None else range(1, len(tables))
    values = [(tables[s][0, problem.num_devices], s) for s in counts if s < len(tables)]
    value, count = min(values, default=(np.inf, 0))
    return count, float(value)


def backtrack(
    problem: StageDPProblem,
    tables: Sequence[np.ndarray],
    costs: Sequence[np.ndarray],
    combine: Combine,
    count: int,
) -> list[tuple[int, int, int]]:
    """The (start, end, submesh j) stages of the answer with ``count`` stages.

    Recomputes the DP step only along the answer's path: the value at each state equals, bit
    for bit, the combine of its chosen predecessor, so the first exact match is a valid choice.
    """
    layers, d, k = problem.num_layers, problem.num_devices, 0
    stages = []
    for s in range(count, 0, -1):
        target = tables[s][k, d]
        ends = np.arange(k + 1, layers + 1)
        left = d - problem.sizes
        ok = left >= 0
        rest = np.full((len(ends), len(problem.sizes)), np.inf)
        rest[:, ok] = tables[s - 1][ends][:, left[ok]]
        values = combine(costs[s][k, k + 1 :], rest)
        e_pos, j = np.argwhere(values == target)[0]
        stages.append((k, int(ends[e_pos]), int(j)))
        k, d = int(ends[e_pos]), int(left[j])
    return stages


# ----------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class DPAnswer:
    """One DP answer: stages as (start, end, usable submesh j, in-flight count), the index of
    each stage's candidate in its table entry, their times (max term) and the sum term."""

    stages: tuple[tuple[int, int, int, float], ...]
    times: tuple[float, ...]
    stage_sum: float
    max_time: float
    total: float
    candidates: tuple[int, ...] = ()


def solve_capped(problem: StageDPProblem, t_max: float, num_microbatches: int) -> DPAnswer | None:
    """Min-sum stages with every stage time <= ``t_max``; None if there are none."""
    sums, index = problem.capped(t_max)
    costs = problem.per_stage_count(sums)
    tables = run_dp(problem, costs, np.add)
    count, value = best_stage_count(problem, tables)
    if not math.isfinite(value):
        return None
    path = backtrack(problem, tables, costs, np.add, count)
    stages = tuple((k, e, j, problem.in_flight[count - i]) for i, (k, e, j) in enumerate(path))
    chosen = tuple(int(index[f][k, e, j]) for k, e, j, f in stages)
    times = tuple(float(problem.fit_time[f][k, e, j, c])
                  for (k, e, j, f), c in zip(stages, chosen, strict=True))
    summed = tuple(float(sums[f][k, e, j]) for k, e, j, f in stages)
    total = pipeline_time(times, num_microbatches, summed)
    return DPAnswer(stages, times, float(sum(summed)), max(times), total, chosen)
