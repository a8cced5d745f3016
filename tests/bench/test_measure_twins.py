"""Plans timed together (``bench.measure.measure_plans``): a plan given under two names is one
program, timed once. The default plan the clock kept is a copy of its candidate with the
timings recorded, and two timings of one program differ by 5-20% on XLA:CPU's simulated
devices: timed twice, the bench reported the default as slower than itself (0.94-0.95 on 2
devices, 2026-12-06)."""

import dataclasses

import jax
import pytest

import autopar
from autopar.bench import measure
from autopar.models import get_model

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


def test_a_plan_and_its_recorded_copy_are_timed_as_one_program(monkeypatch):
    model = get_model("mlp", "tiny").with_value_and_grad(autopar.value_and_grad)
    devices = jax.devices()[:2]
    inputs = measure.make_inputs(model)

    def plan_of(method):
        step = autopar.parallelize(model.train_step, method=method, devices=devices,
                                   cache=False)
        return step.get_plan(inputs.state, inputs.batch)

    shard, data = plan_of(autopar.ShardParallel()), plan_of(autopar.DataParallel())
    # what the clock's choice records: its planning record and a note, nothing the runtime reads
    recorded = shard.noted("kept by the clock", first=True).with_planning(
        candidates=[{"name": "shard", "measured_step_time_s": 0.001}])
    assert recorded is not shard and recorded != shard
    assert measure.same_program(recorded, shard)
    assert not measure.same_program(shard, data)
    # a layout that differs is another program, however it was made
    moved = dataclasses.replace(shard, num_microbatches=shard.num_microbatches + 1)
    assert not measure.same_program(moved, shard)

    built = []
    parallelize = autopar.parallelize

    def counting(*args, **kwargs):
        built.append(kwargs.get("plan"))
        return parallelize(*args, **kwargs)

    monkeypatch.setattr(autopar, "parallelize", counting)
    timed = measure.measure_plans(model.train_step, {"autopar": recorded, "intra-op": shard,
                                                     "data": data},
                                  inputs, devices, warmup=1, repeats=1, rounds=1)
    assert len(built) == 2  # the shard plan's program once, the data plan's
    assert timed["autopar"] is timed["intra-op"]
    assert timed["data"] is not timed["autopar"]
    assert len(timed["data"].step_times_s) == len(timed["autopar"].step_times_s) == 1
