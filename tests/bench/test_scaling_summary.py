"""The scaling sweep's summary against devices is read off its rows: a step that got slower
with more devices is named, planning seconds per ILP are reported."""

from autopar.bench.scaling_summary import device_points, device_scaling_lines, slower_steps


def row(devices, est, total=10.0, ilps=100, axis="devices"):
    return {"kind": "scaling", "axis": axis, "devices": devices, "est_step_time_s": est,
            "microbatches": 1024, "batch": 1024, "ilp_solves": ilps,
            "planning": {"total_s": total}}


def test_a_step_that_gets_slower_with_more_devices_is_named():
    rows = [row(64, 5.0), row(8, 40.0), row(512, 6.0, total=40.0, ilps=200),
            row(64, 1.0, axis="layers")]
    points = device_points(rows)
    assert [p["devices"] for p in points] == [8, 64, 512]
    assert [(a["devices"], b["devices"]) for a, b in slower_steps(points)] == [(64, 512)]
    text = " ".join(device_scaling_lines(rows))
    assert "got slower at 64 -> 512 devices (5 -> 6 s)" in text
    assert "0.1-0.2 (from 100 to 200 ILPs)" in text


def test_a_step_that_never_gets_slower_says_so():
    text = " ".join(device_scaling_lines([row(8, 40.0), row(64, 5.0), row(512, 5.0)]))
    assert "never got slower from 8 to 512 devices (40 s to 5 s)" in text
    assert device_scaling_lines([row(8, 40.0)]) == []
