"""How many microbatches' activations each stage holds: ``activation_counts``, the one source of
that fact, against an independent recount on the simulated timeline, and the issue's examples."""

from __future__ import annotations

import pytest

from autopar.errors import InvalidOptionError
from autopar.ir.schedule_orders import activation_counts, make_schedule
from autopar.ir.schedule_timeline import simulate
from autopar.ir.schedules import ScheduleName, TaskKind


def _grid():
    """Every (name, p, m, v) with p in 1..4, m in 1..8 the schedules accept."""
    for p in range(1, 5):
        for m in range(1, 9):
            for name in (ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B, ScheduleName.ZB_H1):
                yield name, p, m, 1
            if m % p == 0:
                for v in (2, 3):
                    yield ScheduleName.INTERLEAVED_1F1B, p, m, v


GRID = list(_grid())


def recount_on_timeline(name, p, m, v) -> list[float]:
    """Per stage, the most (microbatch, chunk) activation sets alive at one instant of the
    simulated run, divided by v. A set lives from its forward's start until the task that frees
    it ends: the weight gradient W where the schedule has one (it still reads the layer
    inputs), else the backward B. Counted from task times, not from the lists' order."""
    schedule = make_schedule(name, p, m, v)
    spans = simulate(schedule).spans
    frees = TaskKind.W if any(t.kind is TaskKind.W for t in spans) else TaskKind.B
    peaks = []
    for stage in range(p):
        lives = [
            (spans[t][0], spans[schedule.task_at(frees, t.microbatch, t.piece(p))][1])
            for t in spans
            if t.stage == stage and t.kind is TaskKind.F
        ]
        # the peak is reached at some forward's start
        peak = max(sum(1 for a, b in lives if a <= start < b) for start, _ in lives)
        peaks.append(peak / v)
    return peaks


@pytest.mark.parametrize(("name", "p", "m", "v"), GRID)
def test_counts_equal_a_recount_on_the_simulated_timeline(name, p, m, v):
    counts = activation_counts(name, p, m, v)
    assert len(counts) == p
    assert list(counts) == recount_on_timeline(name, p, m, v)
    # and what the schedule itself says: in flight until W (split backward) or B, per chunk
    schedule = make_schedule(name, p, m, v)
    until = TaskKind.W if name == ScheduleName.ZB_H1 else TaskKind.B
    assert counts == tuple(schedule.in_flight(s, until=until) / v for s in range(p))


def test_the_issues_two_examples():
    # interleaved 1F1B, p=4, m=8, v=2: in-flight (microbatch, chunk) pairs / v per stage
    assert activation_counts("interleaved-1f1b", 4, 8, 2) == (5.5, 4.5, 3.5, 2.5)
    # ZB-H1 keeps every layer input until its W: p microbatches on every stage
    assert activation_counts("zb-h1", 4, 8) == (4, 4, 4, 4)
    assert make_schedule("zb-h1", 4, 8).in_flight(0, until=TaskKind.W) == 4
    # the closed form the stage DP used before (min(stages from the end, m)) holds for 1F1B only
    assert activation_counts("1f1b", 4, 8) == (4, 3, 2, 1)
    assert activation_counts("gpipe", 4, 8) == (8, 8, 8, 8)


def test_counts_depend_on_the_stage_count_for_zb_h1_and_interleaved():
    """The last stage of ZB-H1 holds min(p, m), not one microbatch; interleaved stages hold more
    the more stages follow: a count is not a function of the position from the end alone."""
    assert [activation_counts("zb-h1", p, 8)[-1] for p in (1, 2, 3, 4)] == [1, 2, 3, 4]
    assert [activation_counts("1f1b", p, 8)[-1] for p in (1, 2, 3, 4)] == [1, 1, 1, 1]
    assert activation_counts("interleaved-1f1b", 2, 8, 2)[-1] == 1.5
    assert activation_counts("interleaved-1f1b", 4, 8, 2)[-1] == 2.5


def test_strings_and_members_share_the_cache_and_errors_are_one_line():
    a = activation_counts("zb-h1", 3, 5)
    assert activation_counts(ScheduleName.ZB_H1, 3, 5) is a  # one cache entry
    with pytest.raises(InvalidOptionError) as info:
        activation_counts("chimera", 2, 4)
    assert "gpipe, 1f1b, interleaved-1f1b, zb-h1, pipedream, pipedream-2bw" in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(InvalidOptionError, match="m=6"):
        activation_counts("interleaved-1f1b", 4, 6, 2)
