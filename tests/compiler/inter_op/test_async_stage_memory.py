"""The stage DP sizes asynchronous stages with their weight versions: a stage holding ``v``
versions needs ``(v - 1)`` times its parameter bytes more (``weight_version_counts``), so the
planner keeps an asynchronous schedule only where that fits."""

import pytest

from autopar.compiler.inter_op.stages import (
    StageCandidate,
    StageCostTable,
    StageDPOptions,
    solve_stages,
    submesh_shapes,
)
from autopar.errors import PlanError

# time, fixed bytes, activation bytes per microbatch, shape, key, tail, host, parameter bytes
FAST = StageCandidate(1.0, 4.0, 1.0, (1,), "fast", param_bytes=2.0)
SLOW = StageCandidate(3.0, 1.0, 1.0, (1,), "slow", param_bytes=1.0)


def table():
    def candidates(start, end, shape):
        if shape.num_devices != 1:
            return [StageCandidate(1.0, 99.0, 99.0, (shape.num_devices,), "too big")]
        return [FAST, SLOW] if end - start == 1 else []

    return StageCostTable.build(2, submesh_shapes(1, 2), candidates)


def chosen(schedule, budget):
    options = StageDPOptions(num_microbatches=4, schedule=schedule, memory_budget_bytes=budget)
    return [s.candidate.key for s in solve_stages(table(), 1, 2, options).stages]


def test_memory_counts_the_versions():
    # stage 0 of 2 holds 2 microbatches; PipeDream 2 versions there, 1 on the last stage;
    # 2BW 2 on both (one microbatch in flight on the last stage)
    assert FAST.memory(2) == 6.0 and FAST.memory(2, 2) == 8.0
    pipedream = StageDPOptions(num_microbatches=4, schedule="pipedream")
    assert [pipedream.weight_versions(s, 2) for s in range(2)] == [2, 1]
    assert pipedream.weight_versions_by_count(4) == {1: 1, 2: 2, 3: 3, 4: 4}
    two_bw = StageDPOptions(num_microbatches=4, schedule="pipedream-2bw")
    assert two_bw.weight_versions_by_count(4) == {1: 2, 2: 2, 3: 2, 4: 2}
    assert StageDPOptions(num_microbatches=4).weight_versions_by_count(4) == {}


@pytest.mark.parametrize(("schedule", "keys"), [
    ("1f1b", ["fast", "fast"]),          # 6 and 5 bytes
    ("pipedream", ["slow", "fast"]),     # fast stage 0 would need 6 + 2
    ("pipedream-2bw", ["slow", "slow"]),  # fast stage 1 would need 5 + 2
])
def test_the_dp_keeps_what_fits_with_its_versions(schedule, keys):
    assert chosen(schedule, 6.0) == keys


def test_no_fit_names_the_budget():
    assert chosen("1f1b", 3.5) == ["slow", "slow"]  # 3 and 2 bytes
    with pytest.raises(PlanError) as raised:
        chosen("pipedream", 3.5)  # slow stage 0 needs 3 + 1
    assert "\n" not in str(raised.value)
