"""Asynchronous schedules as data: the version every task reads and writes, the stream order,
and the live-version counts, against the algorithms' definitions."""

import json

import pytest

from autopar.errors import InvalidOptionError
from autopar.ir.async_schedules import weight_versions
from autopar.ir.schedule_orders import activation_counts, make_schedule, weight_version_counts
from autopar.ir.schedules import Schedule, TaskKind

SHAPES = [(1, 1), (1, 4), (2, 1), (2, 4), (3, 2), (3, 5), (4, 3), (4, 4), (4, 8), (6, 5)]


def stream(versions, stage, count):
    return [versions.stage_task(stage, k) for k in range(count)]


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_pipedream_forwards_read_the_newest_version_and_backwards_the_stashed_one(p, m):
    versions = weight_versions("pipedream", p, m)
    for stage in range(p):
        newest, forward_read = 0, {}
        for task in stream(versions, stage, 6 * (p + m)):
            use = versions.use(task)
            if task.kind is TaskKind.F:
                assert use.reads == newest  # PipeDream: the forward takes the latest weights
                forward_read[task.microbatch] = use.reads
                assert use.writes is None
            else:
                assert use.reads == forward_read[task.microbatch]  # weight stashing
                assert use.writes == newest + 1  # one update per minibatch
                newest = use.writes
        # staleness in the steady state: p - 1 - stage updates between F and its update
        late = [n for n in forward_read if n >= p]
        assert all(n - forward_read[n] == p - 1 - stage for n in late)


@pytest.mark.parametrize(("p", "m"), [s for s in SHAPES if s[1] >= s[0] - 1])
def test_2bw_reads_the_previous_calls_version_and_updates_once_per_call(p, m):
    versions = weight_versions("pipedream-2bw", p, m)
    for stage in range(p):
        newest = 0
        for task in stream(versions, stage, 6 * (p + m)):
            call = task.microbatch // m
            use = versions.use(task)
            assert use.reads == max(0, call - 1)
            assert use.reads <= newest  # it exists when the task runs
            last_of_call = task.kind is TaskKind.B and task.microbatch % m == m - 1
            assert use.writes == (call + 1 if last_of_call else None)
            newest = use.writes if use.writes is not None else newest


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_the_stream_is_1f1b_without_a_flush_and_task_index_inverts_it(p, m):
    versions = weight_versions("pipedream", p, m)
    calls = 3
    steady = versions.steady_state(calls)
    assert steady.tasks == make_schedule("1f1b", p, calls * m).tasks
    for stage in range(p):
        tasks = steady.tasks[stage]
        # until the final drain the stage's list is its endless stream
        drain = p - 1 - stage
        head = tasks[: len(tasks) - drain]
        assert list(head) == stream(versions, stage, len(head))
        for k, task in enumerate(head):
            assert versions.task_index(task) == k
    versions.check(steady)


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_live_version_counts_are_p_minus_i_for_pipedream_and_2_for_2bw(p, m):
    assert weight_version_counts("pipedream", p, m) == tuple(p - i for i in range(p))
    if m >= p - 1:
        assert weight_version_counts("pipedream-2bw", p, m) == (2,) * p
    for name in ("gpipe", "1f1b", "zb-h1"):
        assert weight_version_counts(name, p, m) == (1,) * p
    # in flight: 1F1B's steady state, p - i on stage i even with fewer microbatches per call
    # (the pipeline is not drained between calls)
    assert activation_counts("pipedream", p, m) == tuple(p - i for i in range(p))
    assert activation_counts("1f1b", p, m) == tuple(min(p - i, m) for i in range(p))


def test_steady_state_round_trips_and_bad_options_are_one_line_errors():
    steady = weight_versions("pipedream-2bw", 3, 4).steady_state(2)
    assert Schedule.from_dict(json.loads(json.dumps(steady.to_dict()))) == steady
    with pytest.raises(InvalidOptionError, match="m=2, p=4") as info:
        make_schedule("pipedream-2bw", 4, 2)
    assert "\n" not in str(info.value)
    with pytest.raises(InvalidOptionError, match="pipedream, pipedream-2bw"):
        weight_versions("1f1b", 2, 4)
    with pytest.raises(InvalidOptionError, match="valid is 1"):
        make_schedule("pipedream", 2, 4, 2)
    with pytest.raises(InvalidOptionError, match="num_calls"):
        weight_versions("pipedream", 2, 4).steady_state(0)


@pytest.mark.parametrize(("p", "m"), [s for s in SHAPES if s[1] >= s[0] - 1])
def test_staleness_is_p_minus_1_minus_i_for_pipedream_and_1_for_2bw(p, m):
    """Updates between the version a gradient is computed at and the one it updates."""
    pipedream, two_bw = weight_versions("pipedream", p, m), weight_versions("pipedream-2bw", p, m)
    assert [pipedream.staleness(s) for s in range(p)] == [p - 1 - s for s in range(p)]
    assert [two_bw.staleness(s) for s in range(p)] == [1] * p
