"""Stage-construction DP: equals brute force, schedule memory (in-flight counts from the
schedule, per stage count where they depend on it), errors. Its cost table, options, submeshes
and baselines: ``test_stage_submeshes.py``."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass

import numpy as np
import pytest

from autopar.compiler.inter_op.stage_dp import prepare_problems
from autopar.compiler.inter_op.stages import (
    StageCandidate,
    StageCostTable,
    StageDPOptions,
    manual_stages,
    pipeline_time,
    place_submeshes,
    solve_stages,
    submesh_shapes,
    uniform_stages,
)
from autopar.errors import PlanError
from autopar.ir.schedule_orders import make_schedule
from autopar.ir.schedules import ScheduleName, TaskKind

CLUSTERS = [(1, 8), (2, 4), (1, 4), (2, 2), (1, 2), (4, 2)]


# ----------------------------------------------------------------------------- helpers


def random_table(rng: np.random.Generator, layers: int, hosts: int, per_host: int):
    """Random candidates per (range, submesh); some entries empty, times on a coarse grid so
    that ties happen."""
    weights = rng.integers(1, 6, size=layers)
    entries = {}
    for shape_index, shape in enumerate(submesh_shapes(hosts, per_host)):
        for start in range(layers):
            for end in range(start + 1, layers + 1):
                found = []
                for _ in range(rng.integers(0, 4)):
                    # Work shrinks with devices, a per-stage overhead does not: more stages
                    # lower the slowest stage but raise the sum, the trade-off t_max explores.
                    speedup = shape.num_devices ** rng.uniform(0.3, 1.0)
                    work = float(weights[start:end].sum()) * rng.uniform(0.7, 1.3) / speedup
                    time = round(work + rng.uniform(0.0, 2.0), 1)
                    found.append(
                        StageCandidate(
                            time=time,
                            fixed_memory=float(rng.integers(1, 10) * (end - start)),
                            activation_memory_per_microbatch=float(rng.integers(0, 4)),
                            logical_mesh_shape=(shape.num_devices,),
                            key=f"{start}:{end}:{shape}:{len(found)}",
                        )
                    )
                entries[(start, end, shape_index)] = found
    shapes = submesh_shapes(hosts, per_host)
    return StageCostTable.build(layers, shapes, lambda s, e, sm: entries[(s, e, shapes.index(sm))])


def compositions(layers: int):
    """Every split of 0..layers-1 into contiguous non-empty ranges."""
    for mask in range(2 ** (layers - 1)):
        cuts = [i + 1 for i in range(layers - 1) if mask >> i & 1]
        bounds = [0, *cuts, layers]
        yield list(itertools.pairwise(bounds))


@dataclass
class Exhaustive:
    """What enumerating every assignment found (inf where no assignment exists)."""

    best: float = math.inf  # least total time
    least_memory: float = math.inf  # least per-device memory any assignment needs
    least_sum: float = math.inf  # least sum of stage times
    least_max: float = math.inf  # least slowest stage
    best_sum_and_max: tuple[float, float] = (math.inf, math.inf)


def brute_force(table, hosts, per_host, options) -> Exhaustive:
    """Every contiguous partition x every submesh per stage (devices summing to the cluster) x
    every candidate per stage, with the DP's objective and memory rule."""
    devices = hosts * per_host
    m = options.num_microbatches
    found_all = Exhaustive()
    for ranges in compositions(table.num_layers):
        count = len(ranges)
        if options.num_stages is not None and count != options.num_stages:
            continue
        if not options.valid_stage_count(count):
            continue  # the schedule does not run on this many stages (interleaved, m % p)
        for shape_ids in itertools.product(range(len(table.submeshes)), repeat=count):
            shapes = [table.submeshes[i] for i in shape_ids]
            if sum(s.num_devices for s in shapes) != devices:
                continue
            if not all(s.fits(hosts, per_host) for s in shapes):
                continue
            per_stage, memory_needs = [], []
            for position, ((start, end), index) in enumerate(zip(ranges, shape_ids, strict=True)):
                in_flight = options.in_flight(position, count)
                found = table.candidates(start, end, index)
                memory_needs.append(min((c.memory(in_flight) for c in found), default=math.inf))
                per_stage.append([c for c in found if options.fits(c.memory(in_flight))])
            found_all.least_memory = min(found_all.least_memory, max(memory_needs))
            for choice in itertools.product(*per_stage):
                times = [c.time for c in choice]
                total = pipeline_time(times, m)
                found_all.least_sum = min(found_all.least_sum, sum(times))
                found_all.least_max = min(found_all.least_max, max(times))
                if total < found_all.best:
                    found_all.best = total
                    found_all.best_sum_and_max = (sum(times), max(times))
    return found_all


def check_partition(partition, table, hosts, per_host, options):
    """The answer is a valid assignment whose reported total matches its stages."""
    stages = partition.stages
    assert stages[0].start == 0 and stages[-1].end == table.num_layers
    assert all(a.end == b.start for a, b in itertools.pairwise(stages))
    assert sum(s.submesh.num_devices for s in stages) == hosts * per_host
    for position, stage in enumerate(stages):
        index = table.submesh_index(stage.submesh)
        assert stage.candidate in table.candidates(stage.start, stage.end, index)
        assert options.fits(stage.candidate.memory(options.in_flight(position, len(stages))))
    times = [s.candidate.time for s in stages]
    assert partition.total_time == pytest.approx(pipeline_time(times, options.num_microbatches))
    assert partition.max_stage_time == max(times)
    place_submeshes(partition.submeshes, hosts, per_host)
    json.dumps(partition.to_dict())


def random_options(rng, table, hosts, per_host, with_budget: bool) -> StageDPOptions:
    devices = hosts * per_host
    fixed = None
    if rng.random() < 0.3:
        fixed = int(rng.integers(1, min(table.num_layers, devices) + 1))
    budget = None
    if with_budget:
        budget = float(rng.integers(4, 30))
    schedule = ScheduleName(rng.choice(list(ScheduleName)))
    return StageDPOptions(
        num_microbatches=int(rng.choice([1, 2, 4, 8, 16, 32])),
        schedule=schedule,
        memory_budget_bytes=budget,
        num_stages=fixed,
        num_chunks=2 if schedule == ScheduleName.INTERLEAVED_1F1B else 1,
    )


# ----------------------------------------------------------------------------- the DP


@pytest.mark.parametrize("seed", range(50))
def test_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    hosts, per_host = CLUSTERS[seed % len(CLUSTERS)]
    layers = int(rng.integers(1, 7))
    table = random_table(rng, layers, hosts, per_host)
    options = random_options(rng, table, hosts, per_host, with_budget=seed % 3 != 0)
    exhaustive = brute_force(table, hosts, per_host, options)
    expected, least_memory = exhaustive.best, exhaustive.least_memory
    if math.isinf(expected):
        with pytest.raises(PlanError) as raised:
            solve_stages(table, hosts, per_host, options)
        message = str(raised.value)
        assert "\n" not in message
        if math.isfinite(least_memory):
            assert f"the smallest needs {least_memory:.0f} bytes" in message
        return
    partition = solve_stages(table, hosts, per_host, options)
    assert partition.exact
    assert partition.total_time == pytest.approx(expected, rel=1e-12)
    check_partition(partition, table, hosts, per_host, options)


def pipeline_like_table(rng, layers, hosts, per_host):
    """Times that shrink sub-linearly with devices plus a small per-stage overhead: the best
    pipeline is often neither the least-sum nor the least-max assignment, so the search has to
    walk the stage-time caps in between."""
    weights = rng.uniform(0.5, 3.0, size=layers)
    shapes = submesh_shapes(hosts, per_host)
    entries = {}
    for index, shape in enumerate(shapes):
        for start in range(layers):
            for end in range(start + 1, layers + 1):
                entries[(start, end, index)] = [
                    StageCandidate(
                        float(
                            weights[start:end].sum()
                            * rng.uniform(0.8, 1.2)
                            / shape.num_devices ** rng.uniform(0.6, 1.0)
                            + rng.uniform(0.0, 0.3)
                        ),
                        0.0,
                        0.0,
                        (shape.num_devices,),
                    )
                    for _ in range(rng.integers(1, 3))
                ]
    return StageCostTable.build(layers, shapes, lambda s, e, sm: entries[(s, e, shapes.index(sm))])


def test_tmax_search_equals_brute_force():
    in_between = 0
    for seed in range(24):
        rng = np.random.default_rng(1000 + seed)
        hosts, per_host = [(1, 8), (2, 4)][seed % 2]
        table = pipeline_like_table(rng, 6, hosts, per_host)
        options = StageDPOptions(num_microbatches=int(rng.choice([2, 3, 4, 6, 8])))
        exhaustive = brute_force(table, hosts, per_host, options)
        partition = solve_stages(table, hosts, per_host, options)
        assert partition.exact
        assert partition.total_time == pytest.approx(exhaustive.best, rel=1e-12)
        check_partition(partition, table, hosts, per_host, options)
        best_sum, best_max = exhaustive.best_sum_and_max
        in_between += best_sum > exhaustive.least_sum and best_max > exhaustive.least_max
    assert in_between >= 3  # the instances do exercise caps strictly inside the range


def test_memory_rules_some_candidates_out():
    """The fast candidate of a layer needs 4 + 3 f bytes with f microbatches in flight, the slow
    one 1 + 2.5 f, the budget is 9: under 1F1B the first stage (f = 2) must run slow and the
    last (f = 1) can run fast; under GPipe (f = 4 everywhere) nothing fits, and the least any
    assignment needs is 11 bytes (the slow candidate)."""
    fast = StageCandidate(1.0, 4.0, 3.0, (1,), "fast")
    slow = StageCandidate(3.0, 1.0, 2.5, (1,), "slow")

    def candidates(start, end, shape):
        if shape.num_devices != 1:
            return []
        return [fast, slow] if end - start == 1 else [StageCandidate(5.0, 9.0, 9.0, (1,))]

    table = StageCostTable.build(2, submesh_shapes(1, 2), candidates)
    one_f_one_b = StageDPOptions(num_microbatches=4, schedule="1f1b", memory_budget_bytes=9.0)
    partition = solve_stages(table, 1, 2, one_f_one_b)
    assert [s.candidate.key for s in partition.stages] == ["slow", "fast"]
    assert partition.total_time == pytest.approx(3.0 + 1.0 + 3 * 3.0)
    with pytest.raises(PlanError, match=r"smallest needs 11 bytes .*schedule gpipe"):
        solve_stages(table, 1, 2, StageDPOptions(4, "gpipe", memory_budget_bytes=9.0))


def test_heavy_layer_beats_uniform():
    """One layer 8x heavier than the other seven, and data parallelism costs log2(n) per stage:
    equal stages put the heavy layer with others; the DP gives it a stage of its own."""
    weights = [8.0] + [1.0] * 7

    def candidates(start, end, shape):
        devices = shape.num_devices
        time = sum(weights[start:end]) / devices + math.log2(devices) + 0.1
        return [StageCandidate(time, 1.0, 1.0, (devices,))]

    table = StageCostTable.build(8, submesh_shapes(1, 8), candidates)
    options = StageDPOptions(num_microbatches=16)
    best = solve_stages(table, 1, 8, options)
    for count in (1, 2, 4, 8):
        assert best.total_time < uniform_stages(table, count, 1, 8, options).total_time
    assert [(s.start, s.end) for s in best.stages] == [(0, 1), (1, 8)]
    # The DP's own stages, re-evaluated as a manual partition, give the same total.
    ranges = [(s.start, s.end) for s in best.stages]
    again = manual_stages(table, ranges, best.submeshes, 1, 8, options)
    assert again.total_time == pytest.approx(best.total_time)


def test_thinning_reports_inexact_and_stays_valid():
    seen_inexact = False
    for seed in range(12):
        rng = np.random.default_rng(100 + seed)
        table = random_table(rng, 6, 1, 8)
        options = StageDPOptions(num_microbatches=3, max_tmax_candidates=1)
        expected = brute_force(table, 1, 8, options).best
        if math.isinf(expected):
            continue
        partition = solve_stages(table, 1, 8, options)
        check_partition(partition, table, 1, 8, options)
        assert partition.total_time >= expected - 1e-9
        assert partition.exact == (partition.tmax_relative_gap == 0.0)
        seen_inexact |= not partition.exact
    assert seen_inexact


# ----------------------------------------------------------------------------- schedule memory


def schedule_grid():
    """(name, m, v) with m in 1..8 and v = 1, or 2 and 3 for interleaved."""
    for m in range(1, 9):
        for name in (ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B, ScheduleName.ZB_H1):
            yield name, m, 1
        for v in (2, 3):
            yield ScheduleName.INTERLEAVED_1F1B, m, v


def simulated_counts(name, p, m, v) -> list[float]:
    """Straight from the schedule's task lists: pairs in flight until W (zb-h1) or B, per v."""
    schedule = make_schedule(name, p, m, v)
    until = TaskKind.W if name == ScheduleName.ZB_H1 else TaskKind.B
    return [schedule.in_flight(stage, until=until) / v for stage in range(p)]


ONES = StageCostTable.build(
    4, submesh_shapes(1, 4), lambda s, e, sm: [StageCandidate(1.0, 1.0, 1.0, (1,))]
)


@pytest.mark.parametrize(("name", "m", "v"), list(schedule_grid()))
def test_dp_counts_equal_the_schedules_simulation(name, m, v):
    """For every p-stage pipeline (p = 1..4) the schedule runs, the in-flight count the DP's
    problem gives each stage position, free or fixed stage count, is the simulated one."""
    free = StageDPOptions(m, name, num_chunks=v)
    problems = prepare_problems(ONES, 1, 4, free)
    valid = [p for p in range(1, 5) if m % p == 0 or name != ScheduleName.INTERLEAVED_1F1B]
    # the free search covers exactly the stage counts the schedule runs on
    covered = {p for pr in problems for p in
               (range(1, pr.top_stages + 1) if pr.fixed_stages is None else [pr.fixed_stages])}
    assert covered == set(valid)
    for p in valid:
        expected = simulated_counts(name, p, m, v)
        assert [free.in_flight(stage, p) for stage in range(p)] == expected
        (problem,) = [pr for pr in problems if pr.fixed_stages in (None, p)]
        assert [problem.in_flight[p - stage] for stage in range(p)] == expected
        fixed = StageDPOptions(m, name, num_stages=p, num_chunks=v)
        (problem,) = prepare_problems(ONES, 1, 4, fixed)
        assert [problem.in_flight[p - stage] for stage in range(p)] == expected
        # and the keys the DP indexes its tables by are those counts (fractional included)
        assert set(problem.best_time) == set(expected)
    # 1F1B and GPipe counts depend on the position from the end alone: the DP runs once
    if name in (ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B):
        assert len(problems) == 1 and problems[0].fixed_stages is None


def test_zb_h1_plan_the_old_formula_accepted_does_not_fit():
    """Two one-layer stages, m = 4, budget 9 bytes. Fast candidate: 4 + 3 f bytes, slow one:
    1 + 2 f. The old closed form gave the last stage f = min(1, m) = 1 under every 1F1B-family
    schedule, so (slow, fast) "fit" (5 and 7 bytes); ZB-H1 really keeps 2 microbatches on
    both stages (layer inputs until W), so the fast last stage needs 10 > 9: the DP must run
    both stages slow, and with a budget of 4 bytes nothing fits."""
    fast = StageCandidate(1.0, 4.0, 3.0, (1,), "fast")
    slow = StageCandidate(3.0, 1.0, 2.0, (1,), "slow")

    def candidates(start, end, shape):
        if shape.num_devices != 1:
            return [StageCandidate(1.0, 99.0, 99.0, (shape.num_devices,), "too big")]
        return [fast, slow] if end - start == 1 else []

    table = StageCostTable.build(2, submesh_shapes(1, 2), candidates)
    zb = StageDPOptions(num_microbatches=4, schedule="zb-h1", memory_budget_bytes=9.0)
    old_counts = [min(2 - stage, 4) for stage in range(2)]  # the formula the DP used to use
    assert old_counts == [2, 1] and zb.activation_counts(2) == (2, 2)
    assert zb.fits(fast.memory(old_counts[1])) and not zb.fits(fast.memory(2))
    partition = solve_stages(table, 1, 2, zb)
    assert [s.candidate.key for s in partition.stages] == ["slow", "slow"]
    assert partition.total_time == pytest.approx(3.0 + 3.0 + 3 * 3.0)
    for position, stage in enumerate(partition.stages):
        assert zb.fits(stage.candidate.memory(zb.in_flight(position, 2)))
    # the same table under 1F1B (whose last stage does hold one microbatch) keeps the fast one
    one_f_one_b = StageDPOptions(num_microbatches=4, schedule="1f1b", memory_budget_bytes=9.0)
    assert [s.candidate.key for s in solve_stages(table, 1, 2, one_f_one_b).stages] == [
        "slow", "fast"]
    tight = StageDPOptions(num_microbatches=4, schedule="zb-h1", memory_budget_bytes=4.0)
    with pytest.raises(PlanError) as raised:
        solve_stages(table, 1, 2, tight)
    message = str(raised.value)
    assert "\n" not in message
    assert "the smallest needs 5 bytes" in message and "schedule zb-h1" in message


def test_interleaved_stages_are_sized_with_fractional_microbatches():
    """p = 4, m = 8, v = 2: the stages hold 5.5, 4.5, 3.5 and 2.5 microbatches' activations
    (the old formula: 4, 3, 2, 1). With 1 byte per microbatch and a 5-byte budget the first
    stage does not fit; with 5.5 bytes every stage does, at exactly its count."""
    table = StageCostTable.build(
        8, submesh_shapes(1, 4), lambda s, e, sm: [StageCandidate(1.0, 0.0, 1.0, (1,), "c")]
    )
    options = StageDPOptions(8, "interleaved-1f1b", memory_budget_bytes=5.0, num_chunks=2)
    assert options.activation_counts(4) == (5.5, 4.5, 3.5, 2.5)
    with pytest.raises(PlanError, match=r"stage 0 .* 5.5 microbatches in flight"):
        uniform_stages(table, 4, 1, 4, options)
    roomy = StageDPOptions(8, "interleaved-1f1b", memory_budget_bytes=5.5, num_chunks=2)
    partition = uniform_stages(table, 4, 1, 4, roomy)
    assert [s.candidate.memory(roomy.in_flight(k, 4)) for k, s in
            enumerate(partition.stages)] == [5.5, 4.5, 3.5, 2.5]
    # the DP over a fixed stage count sizes them the same way
    assert len(solve_stages(table, 1, 4, StageDPOptions(
        8, "interleaved-1f1b", memory_budget_bytes=5.5, num_stages=4, num_chunks=2)).stages) == 4
    with pytest.raises(PlanError, match="num_stages=3: interleaved-1f1b needs"):
        solve_stages(table, 1, 4, StageDPOptions(8, "interleaved-1f1b", num_stages=3,
                                                 num_chunks=2))


@pytest.mark.parametrize("seed", range(30))
def test_stage_count_dependent_schedules_equal_brute_force(seed):
    """ZB-H1 and interleaved: one search per stage count, one shared incumbent, still exact."""
    rng = np.random.default_rng(500 + seed)
    hosts, per_host = CLUSTERS[seed % len(CLUSTERS)]
    table = random_table(rng, int(rng.integers(2, 7)), hosts, per_host)
    interleaved = seed % 2 == 1
    options = StageDPOptions(
        num_microbatches=int(rng.choice([2, 4, 6, 8, 12])),
        schedule="interleaved-1f1b" if interleaved else "zb-h1",
        memory_budget_bytes=float(rng.integers(6, 40)) if seed % 3 else None,
        num_chunks=int(rng.choice([2, 3])) if interleaved else 1,
    )
    problems = prepare_problems(table, hosts, per_host, options)
    assert all(pr.fixed_stages is not None for pr in problems) or options.num_microbatches == 1
    exhaustive = brute_force(table, hosts, per_host, options)
    if math.isinf(exhaustive.best):
        with pytest.raises(PlanError):
            solve_stages(table, hosts, per_host, options)
        return
    partition = solve_stages(table, hosts, per_host, options)
    assert partition.exact
    assert partition.total_time == pytest.approx(exhaustive.best, rel=1e-12)
    check_partition(partition, table, hosts, per_host, options)


def test_stage_count_errors():
    table = StageCostTable.build(
        3, submesh_shapes(1, 4), lambda s, e, sm: [StageCandidate(1.0, 0.0, 0.0, (1,))]
    )
    with pytest.raises(PlanError, match=r"num_stages=4 is more than the 3 layers"):
        solve_stages(table, 1, 4, StageDPOptions(num_stages=4))
    with pytest.raises(PlanError, match=r"candidate for every stage"):
        empty = StageCostTable.build(2, submesh_shapes(1, 2), lambda s, e, sm: [])
        solve_stages(empty, 1, 2, StageDPOptions())
