"""Stage construction's inputs and fixed answers: the cost table, the DP's options (in-flight
counts, validation), submesh shapes and placement, the uniform and manual baselines. The DP
itself against brute force: ``test_stages.py``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from autopar.compiler.inter_op.stages import (
    StageCandidate,
    StageCostTable,
    StageDPOptions,
    SubmeshShape,
    manual_stages,
    place_submeshes,
    solve_stages,
    submesh_shapes,
    uniform_stages,
)
from autopar.errors import InvalidOptionError, PlanError
from autopar.ir.schedules import ScheduleName

# ----------------------------------------------------------------------------- table, options


def test_build_calls_fn_once_per_entry():
    calls = []
    shapes = submesh_shapes(2, 4)
    table = StageCostTable.build(5, shapes, lambda s, e, sm: calls.append((s, e, sm)) or [])
    assert len(calls) == 5 * 6 // 2 * len(shapes) == table.num_entries
    assert len(set(calls)) == len(calls)
    table.candidates(0, 5, 0)
    assert len(calls) == table.num_entries


def test_in_flight_and_options():
    assert StageDPOptions(8, "gpipe").activation_counts(3) == (8, 8, 8)
    assert StageDPOptions(8, "1f1b").activation_counts(3) == (3, 2, 1)
    assert StageDPOptions(2, "1f1b").in_flight(0, 5) == 2
    assert StageDPOptions(8, "zb-h1").activation_counts(3) == (3, 3, 3)
    options = StageDPOptions(8, "zb-h1", 1e9, 3, 64)
    assert options.schedule is ScheduleName.ZB_H1  # a plain string is taken as the member
    assert StageDPOptions.from_dict(json.loads(json.dumps(options.to_dict()))) == options
    interleaved = StageDPOptions(8, ScheduleName.INTERLEAVED_1F1B, num_chunks=2)
    assert StageDPOptions.from_dict(json.loads(json.dumps(interleaved.to_dict()))) == interleaved
    assert not interleaved.valid_stage_count(3) and interleaved.valid_stage_count(4)
    with pytest.raises(InvalidOptionError, match="choices: gpipe, 1f1b, interleaved-1f1b, zb-h1"):
        StageDPOptions(4, "chimera")
    with pytest.raises(InvalidOptionError, match="num_chunks >= 2"):
        StageDPOptions(4, "interleaved-1f1b")
    with pytest.raises(InvalidOptionError, match="valid is 1"):
        StageDPOptions(4, "1f1b", num_chunks=2)
    with pytest.raises(InvalidOptionError, match="num_microbatches"):
        StageDPOptions(num_microbatches=0)
    with pytest.raises(InvalidOptionError, match="unknown stage DP option"):
        StageDPOptions.from_dict({"microbatches": 2})


# ----------------------------------------------------------------------------- submeshes


def test_submesh_shapes():
    def as_pairs(shapes):
        return [(s.num_hosts, s.devices_per_host) for s in shapes]

    assert as_pairs(submesh_shapes(1, 8)) == [(1, 1), (1, 2), (1, 4), (1, 8)]
    assert as_pairs(submesh_shapes(3, 4)) == [(1, 1), (1, 2), (1, 4), (2, 4), (3, 4)]
    assert as_pairs(submesh_shapes(2, 6)) == [(1, 1), (1, 2), (1, 6), (2, 6)]  # 4 does not pack
    assert as_pairs(submesh_shapes(1, 1)) == [(1, 1)]
    assert SubmeshShape(2, 4).num_devices == 8
    with pytest.raises(InvalidOptionError):
        submesh_shapes(0, 4)


def test_place_submeshes_keeps_stages_inside_hosts():
    assert place_submeshes([SubmeshShape(1, 2), SubmeshShape(1, 2), SubmeshShape(1, 4)], 2, 4) == [
        [0, 1],
        [2, 3],
        [4, 5, 6, 7],
    ]
    rng = np.random.default_rng(7)
    for hosts, per_host in [(2, 4), (4, 8), (3, 2)]:
        shapes = submesh_shapes(hosts, per_host)
        for _ in range(40):
            chosen, left = [], hosts * per_host
            while left:
                shape = rng.choice([s for s in shapes if s.num_devices <= left])
                chosen.append(shape)
                left -= shape.num_devices
            placed = place_submeshes(chosen, hosts, per_host)
            flat = [d for ids in placed for d in ids]
            assert sorted(flat) == list(range(hosts * per_host))
            for shape, ids in zip(chosen, placed, strict=True):
                assert ids == list(range(ids[0], ids[0] + shape.num_devices))
                if shape.num_hosts == 1 and shape.devices_per_host < per_host:
                    assert ids[0] // per_host == ids[-1] // per_host
                else:
                    assert ids[0] % per_host == 0


def test_dp_skips_slices_that_cannot_always_be_placed():
    """On hosts of 6, three 1x4 stages sum to 12 devices but do not fit in 2 hosts; the DP must
    not use the 1x4 slice even when it is the fastest."""
    shapes = [SubmeshShape(1, 2), SubmeshShape(1, 4), SubmeshShape(1, 6), SubmeshShape(2, 6)]

    def candidates(start, end, shape):
        speed = 100.0 if shape.devices_per_host == 4 else shape.num_devices
        return [StageCandidate((end - start) / speed, 0.0, 0.0, (shape.num_devices,))]

    table = StageCostTable.build(3, shapes, candidates)
    partition = solve_stages(table, 2, 6, StageDPOptions(num_microbatches=4))
    assert SubmeshShape(1, 4) not in partition.submeshes
    place_submeshes(partition.submeshes, 2, 6)
    only_four = StageCostTable.build(3, [SubmeshShape(1, 4)], candidates)
    with pytest.raises(PlanError, match="power-of-two slice dividing 6"):
        solve_stages(only_four, 2, 6, StageDPOptions())


def test_place_submeshes_errors():
    with pytest.raises(PlanError, match=r"\[1x4, 1x4, 1x4\] \(12 devices\) on 2 hosts x 6"):
        place_submeshes([SubmeshShape(1, 4)] * 3, 2, 6)
    with pytest.raises(PlanError, match="need 10 devices but the cluster has 8"):
        place_submeshes([SubmeshShape(2, 4), SubmeshShape(1, 2)], 2, 4)
    with pytest.raises(PlanError, match="submesh 2x2 does not exist"):
        place_submeshes([SubmeshShape(2, 2)], 2, 4)


# ----------------------------------------------------------------------------- baselines


def test_uniform_and_manual_validation():
    table = StageCostTable.build(
        6, submesh_shapes(1, 8), lambda s, e, sm: [StageCandidate(1.0, 0.0, 0.0, (1,))]
    )
    options = StageDPOptions(num_microbatches=2)
    with pytest.raises(PlanError, match=r"4 stages do not split 6 layers and 8 devices.*: 1, 2$"):
        uniform_stages(table, 4, 1, 8, options)
    two = uniform_stages(table, 2, 1, 8, options)
    assert [(s.start, s.end, str(s.submesh)) for s in two.stages] == [(0, 3, "1x4"), (3, 6, "1x4")]
    four = SubmeshShape(1, 4)
    with pytest.raises(PlanError, match=r"range \[2, 6\) should start at 3"):
        manual_stages(table, [(0, 3), (2, 6)], [four, four], 1, 8, options)
    with pytest.raises(PlanError, match="end at layer 5 but the model has 6 layers"):
        manual_stages(table, [(0, 3), (3, 5)], [four, four], 1, 8, options)
    with pytest.raises(PlanError, match="use 12 devices but the cluster has 8"):
        manual_stages(table, [(0, 3), (3, 6)], [four, SubmeshShape(1, 8)], 1, 8, options)


def test_submesh_shapes_on_many_hosts_keep_the_divisors_and_powers_of_two():
    # past 8 hosts only host counts that divide the cluster or are powers of two: the shapes
    # grow with the divisors of the host count, not with it (a Megatron t x p x d layout has
    # stages of H / p hosts, always a divisor)
    hosts = [s.num_hosts for s in submesh_shapes(384, 8) if s.devices_per_host == 8]
    assert hosts == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384]
    assert all(h <= 8 or 384 % h == 0 or h & (h - 1) == 0 for h in hosts)
    for p in (2, 4, 8, 16, 32, 64):  # every uniform pipeline of p stages has its shape
        assert 384 // p in hosts
    assert [s.num_hosts for s in submesh_shapes(8, 8)][4:] == [2, 3, 4, 5, 6, 7, 8]
