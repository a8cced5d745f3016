"""Pipeline schedules: validity, memory, makespans against the papers' formulas, round trip,
errors, and the text / PNG swimlanes. Expected numbers come from the formulas, not the code."""

from __future__ import annotations

import json

import pytest

from autopar.errors import InvalidOptionError, PlanError
from autopar.ir.schedule_orders import make_schedule
from autopar.ir.schedule_timeline import render_text, simulate
from autopar.ir.schedules import (
    Schedule,
    ScheduleName,
    Task,
    TaskKind,
)
from autopar.report.swimlane import save_swimlane_png


def _grid():
    """Every (name, p, m, v) the schedules accept on a small grid, odd shapes included."""
    for p in (1, 2, 3, 4):
        for m in (1, 2, 3, 4, 5, 8):
            for name in ("gpipe", "1f1b", "zb-h1"):
                yield name, p, m, 1
            if m % p == 0:
                for v in (2, 3):
                    yield "interleaved-1f1b", p, m, v


GRID = list(_grid())


@pytest.mark.parametrize(("name", "p", "m", "v"), GRID)
def test_every_schedule_validates_and_simulates_in_dependency_order(name, p, m, v):
    schedule = make_schedule(name, p, m, v)
    schedule.validate()
    kinds_per_pair = 3 if name == "zb-h1" else 2
    assert sum(len(ts) for ts in schedule.tasks) == kinds_per_pair * m * p * v
    timeline = simulate(schedule)
    for task, (start, end) in timeline.spans.items():
        assert end >= start
        for dep in schedule.dependencies(task):
            assert timeline.spans[dep][1] <= start + 1e-12, (task, dep)
    # Each stage runs its list in order and never overlaps itself.
    for stage_tasks in schedule.tasks:
        ends = [timeline.spans[t][1] for t in stage_tasks]
        starts = [timeline.spans[t][0] for t in stage_tasks]
        assert all(s >= e - 1e-12 for e, s in zip(ends, starts[1:], strict=False))


def test_dependencies_follow_the_piece_chain():
    schedule = make_schedule("interleaved-1f1b", 2, 2, 2)  # pieces 0..3; piece = chunk*2 + stage
    f = Task(TaskKind.F, 1, 0, 1)  # piece 2 needs piece 1 = stage 1, chunk 0
    assert schedule.dependencies(f) == (Task(TaskKind.F, 1, 1, 0),)
    last_b = Task(TaskKind.B, 0, 1, 1)  # piece 3 is the last: its B needs only its own F
    assert schedule.dependencies(last_b) == (Task(TaskKind.F, 0, 1, 1),)
    b = Task(TaskKind.B, 0, 0, 0)  # piece 0's B needs piece 1's B and its own F
    assert set(schedule.dependencies(b)) == {Task(TaskKind.B, 0, 1, 0), Task(TaskKind.F, 0, 0, 0)}
    assert schedule.dependencies(Task(TaskKind.F, 0, 0, 0)) == ()
    zb = make_schedule("zb-h1", 2, 2)
    assert zb.dependencies(Task(TaskKind.W, 1, 0)) == (Task(TaskKind.B, 1, 0),)


@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 5), (4, 4), (4, 9), (5, 3), (6, 12)])
def test_memory_1f1b_at_most_p_minus_i_and_gpipe_all_m(p, m):
    one_f_one_b = make_schedule("1f1b", p, m)
    gpipe = make_schedule("gpipe", p, m)
    for stage in range(p):
        assert one_f_one_b.in_flight(stage) == min(p - stage, m)
        assert gpipe.in_flight(stage) == m


@pytest.mark.parametrize(("p", "m"), [(1, 1), (1, 4), (2, 3), (3, 7), (4, 4), (4, 8), (5, 2)])
def test_gpipe_and_1f1b_take_2_m_plus_p_minus_1_unit_slots(p, m):
    for name in ("gpipe", "1f1b"):
        timeline = simulate(make_schedule(name, p, m))
        assert timeline.makespan == 2 * (m + p - 1)
        assert timeline.idle_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert timeline.theoretical_idle_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert all(timeline.busy(s) == 2 * m for s in range(p))


@pytest.mark.parametrize(
    ("p", "m", "v"),
    [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 4), (3, 6, 3), (4, 12, 3), (1, 3, 2)],
)
def test_interleaved_bubble_shrinks_by_v(p, m, v):
    timeline = simulate(make_schedule("interleaved-1f1b", p, m, v))
    # Each stage does 2m of work (2mv tasks of 1/v); Megatron's bubble is (p - 1)(t_f + t_b)/v.
    assert timeline.makespan == pytest.approx(2 * m + 2 * (p - 1) / v)
    if p > 1:
        assert timeline.makespan < simulate(make_schedule("1f1b", p, m)).makespan
    assert timeline.idle_fraction == pytest.approx(timeline.theoretical_idle_fraction)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 5), (3, 3), (4, 4), (4, 8), (5, 12), (6, 6)])
def test_zb_h1_cuts_the_1f1b_bubble_to_a_third(p, m):
    zb = make_schedule("zb-h1", p, m)
    zb_time = simulate(zb).makespan  # F = B = W = 1
    assert zb_time == 3 * m + (p - 1)  # bubble (p-1)(T_F + T_B - T_W)

    def f1_b2(task):
        return 2.0 if task.kind is TaskKind.B else 1.0

    baseline = simulate(make_schedule("1f1b", p, m), f1_b2).makespan
    assert baseline == 3 * (m + p - 1)  # bubble (p-1)(T_F + T_B + T_W)
    for stage in range(p):
        assert zb.in_flight(stage) <= p - stage
        # Held until W, every stage keeps at most p: 1F1B's peak (stage 0's).
        assert zb.in_flight(stage, until=TaskKind.W) <= p


def test_custom_costs_shift_the_timeline():
    schedule = make_schedule("1f1b", 3, 4)
    slow_last = simulate(schedule, lambda t: 3.0 if t.stage == 2 else 1.0)
    # The slowest stage sets the pace: its 2m tasks back to back plus the fill and drain of the
    # two faster stages on either side.
    assert slow_last.makespan == 2 * 4 * 3.0 + 2 * 2 * 1.0
    assert slow_last.busy(2) == 24.0


@pytest.mark.parametrize(
    ("name", "p", "m", "v"), [("1f1b", 3, 5, 1), ("zb-h1", 2, 4, 1), ("interleaved-1f1b", 2, 4, 3)]
)
def test_round_trip_through_json(name, p, m, v):
    schedule = make_schedule(name, p, m, v)
    again = Schedule.from_dict(json.loads(json.dumps(schedule.to_dict())))
    assert again == schedule


def test_from_dict_rejects_a_broken_schedule():
    data = make_schedule("1f1b", 2, 2).to_dict()
    data["tasks"][0].reverse()  # B before its own F on stage 0
    with pytest.raises(PlanError, match="comes before"):
        Schedule.from_dict(data)
    data = make_schedule("1f1b", 2, 2).to_dict()
    data["tasks"][1].pop()
    with pytest.raises(PlanError, match="misses 1 tasks"):
        Schedule.from_dict(data)
    with pytest.raises(PlanError, match="malformed"):
        Schedule.from_dict({"name": "1f1b"})


def test_validate_detects_a_cross_stage_deadlock():
    # Each stage's own order is fine, but stage 0 wants B0 before F1 while stage 1 runs F1 before
    # B0 and cannot get F1 until stage 0 runs it: no global order exists.
    f, b = TaskKind.F, TaskKind.B
    stage0 = (Task(f, 0, 0), Task(b, 0, 0), Task(f, 1, 0), Task(b, 1, 0))
    stage1 = (Task(f, 0, 1), Task(f, 1, 1), Task(b, 0, 1), Task(b, 1, 1))
    with pytest.raises(PlanError, match="deadlocks"):
        Schedule("1f1b", 2, 2, 1, (stage0, stage1)).validate()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("chimera", 2, 4, 1), "gpipe, 1f1b, interleaved-1f1b, zb-h1, pipedream, pipedream-2bw"),
        (("1f1b", 0, 4, 1), "num_stages"),
        (("gpipe", 2, 0, 1), "num_microbatches"),
        (("interleaved-1f1b", 4, 6, 2), "m=6"),
        (("interleaved-1f1b", 2, 4, 1), "num_chunks >= 2"),
        (("1f1b", 2, 4, 2), "valid is 1"),
        (("zb-h1", 2, 4, 3), "valid is 1"),
    ],
)
def test_bad_options_raise_one_line_invalid_option_error(args, needle):
    with pytest.raises(InvalidOptionError) as info:
        make_schedule(*args)
    message = str(info.value)
    assert needle in message and "\n" not in message
    if "m=" in needle:
        assert "p=4" in message


def test_names_match_the_builders():
    assert {
        make_schedule(n, 2, 2, 2 if n == "interleaved-1f1b" else 1).name for n in ScheduleName
    } == set(ScheduleName)
    # plain strings and members name the same schedule
    assert make_schedule("zb-h1", 2, 2).name is ScheduleName.ZB_H1


def test_render_text_rows_and_labels():
    text = render_text(simulate(make_schedule("zb-h1", 3, 4)))
    rows = text.splitlines()
    assert len(rows) == 3 and [r.split("|")[0].strip() for r in rows] == [
        "stage 0",
        "stage 1",
        "stage 2",
    ]
    for label in ("F0", "B3", "W2"):
        assert all(label in row for row in rows)
    assert "." in rows[0]  # stage 0 waits for the first backward
    inter = render_text(simulate(make_schedule("interleaved-1f1b", 2, 4, 2)))
    assert "F3.1" in inter and "B0.1" in inter
    long = render_text(simulate(make_schedule("1f1b", 4, 16)), width=60)
    assert all(len(line) <= 60 for line in long.splitlines())
    assert long.count("stage 3 |") > 1  # wrapped into several blocks


def test_png_is_written(tmp_path):
    path = tmp_path / "swimlane.png"
    save_swimlane_png(simulate(make_schedule("zb-h1", 4, 8)), path, title="test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024
    inter = tmp_path / "inter.png"
    save_swimlane_png(simulate(make_schedule("interleaved-1f1b", 2, 4, 2)), inter)
    assert inter.read_bytes()[:4] == b"\x89PNG"
