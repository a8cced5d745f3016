"""The runtime's own costs in the cluster description: optional in the JSON (older files load
with the defaults), strict about unknown fields, round-tripped, and fitted from samples."""

import json

import pytest

from autopar.calibration_samples import RuntimeSample
from autopar.cluster import (
    ClusterSpec,
    RuntimeCosts,
    available_clusters,
    load_cluster,
)
from autopar.compiler.cost.calibration_fit import fit_runtime
from autopar.errors import InvalidOptionError

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


def test_every_shipped_cluster_describes_its_runtime():
    for name in available_clusters():
        runtime = load_cluster(name).runtime
        assert runtime.call_s > 0 and runtime.task_s > 0 and runtime.transfer_s > 0
        assert runtime.accumulate_bytes_per_s > 0
    # simulated CPU devices pay far more per call than a GPU launch
    assert load_cluster("cpu-sim").runtime.task_s > 10 * load_cluster("h100-80gb-x8").runtime.task_s


def test_a_cluster_file_without_runtime_loads_with_the_defaults(tmp_path):
    data = load_cluster("aws-p3.16xlarge").to_dict()
    del data["runtime"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert load_cluster(str(path)).runtime == RuntimeCosts()
    partial = dict(data, runtime={"task_s": 1e-3})
    path.write_text(json.dumps(partial))
    loaded = load_cluster(str(path)).runtime
    assert loaded.task_s == 1e-3 and loaded.call_s == RuntimeCosts().call_s


def test_runtime_round_trips_and_rejects_unknown_or_negative_fields():
    cluster = load_cluster("cpu-sim")
    assert ClusterSpec.from_dict(cluster.to_dict()) == cluster
    with pytest.raises(InvalidOptionError, match="unknown field 'runtime.launch_s'"):
        ClusterSpec.from_dict(cluster.to_dict() | {"runtime": {"launch_s": 1e-6}})
    with pytest.raises(InvalidOptionError, match="runtime.task_s"):
        ClusterSpec.from_dict(cluster.to_dict() | {"runtime": {"task_s": -1.0}})


def test_fit_runtime_takes_the_medians_and_the_accumulation_slope():
    base = RuntimeCosts(call_s=1.0, task_s=1.0, transfer_s=1.0, accumulate_bytes_per_s=1.0)
    samples = [RuntimeSample("call", 8, 0.0, 2e-4), RuntimeSample("task", 4, 0.0, 3e-4),
               RuntimeSample("task", 4, 0.0, 5e-4), RuntimeSample("transfer", 1, 1024, 1e-4),
               RuntimeSample("accumulate", 1, 1e6, 1e-4 + 1e6 / 5e9),
               RuntimeSample("accumulate", 1, 16e6, 1e-4 + 16e6 / 5e9)]
    fitted = fit_runtime(samples, base)
    assert fitted.call_s == 2e-4 and fitted.transfer_s == 1e-4
    assert fitted.task_s == pytest.approx(4e-4)
    assert fitted.accumulate_bytes_per_s == pytest.approx(5e9)
    # nothing measured: the base's
    assert fit_runtime([], base) == base


def test_each_buffer_of_a_call_is_the_passing_programs_slope_per_device_buffer():
    base = RuntimeCosts(buffer_s=7.0)
    # 8 devices, each array one buffer in and one out on each: 16 buffers of 0.5 us an array
    passing = [RuntimeSample("buffers", 8, 0.0, 1e-4 + k * 16 * 0.5e-6, count=k)
               for k in (4, 36)]
    assert fit_runtime(passing, base).buffer_s == pytest.approx(0.5e-6)
    # one count, or no rise: not measured, the base's
    assert fit_runtime(passing[:1], base).buffer_s == 7.0
    flat = [RuntimeSample("buffers", 8, 0.0, 1e-4, count=k) for k in (4, 36)]
    assert fit_runtime(flat, base).buffer_s == 7.0


def test_each_piece_of_a_fed_array_is_the_fed_programs_slope_over_the_placed_ones():
    base = RuntimeCosts(feed_s=7.0)
    # 8 devices: fed arrays cost 8 pieces of 20 us each beyond the same arrays in place
    placed = [RuntimeSample("placed", 8, 0.0, 1e-4 + k * 3e-6, count=k) for k in (4, 36)]
    fed = [RuntimeSample("feeds", 8, 0.0, 2e-4 + k * (3e-6 + 8 * 20e-6), count=k)
           for k in (4, 36)]
    assert fit_runtime(placed + fed, base).feed_s == pytest.approx(20e-6)
    # without the placed programs there is nothing to take off: not measured
    assert fit_runtime(fed, base).feed_s == 7.0
