"""The differential campaign's generator and a fixed-seed slice of it (the full campaign:
``benchmarks/fuzz.py``, docs/benchmarks/fuzz.md), and every reproducer it wrote."""

import json

import numpy as np
import pytest
import repo_paths

from autopar.bench.fuzz_campaign import (
    DEVICE_COUNTS,
    METHODS,
    campaign,
    compare,
    run_case,
    serial_run,
    summary_table,
)
from autopar.bench.fuzz_programs import (
    BLOCK_KINDS,
    Block,
    ProgramSpec,
    random_spec,
    shrink,
)

REPRODUCERS = sorted((repo_paths.REPO / "tests" / "support" / "fuzz_reproducers").glob("*.json"))
# The slice: these programs, each on one device count in turn, under every method.
SLICE_SEEDS = tuple(range(6))


def test_a_seed_is_one_program_and_its_json_reads_back():
    spec = random_spec(7)
    assert random_spec(7) == spec and random_spec(8) != spec
    assert ProgramSpec.from_json(spec.to_json()) == spec
    kinds = {b.kind for s in range(200) for b in random_spec(s).blocks}
    assert kinds == set(BLOCK_KINDS)  # the grammar is drawn from in full


def test_shrinking_keeps_what_fails_and_drops_the_rest():
    spec = ProgramSpec(seed=3, batch=12, width=16, optimizer="adam", loss="xent",
                       blocks=(Block("act"), Block("cond", 1), Block("embed"), Block("dense")))
    small = shrink(spec, lambda s: any(b.kind == "cond" for b in s.blocks))
    assert small == ProgramSpec(seed=3, batch=8, width=16, optimizer="sgd", loss="mse",
                                blocks=(Block("cond", 1),))


def test_compare_finds_a_changed_loss_and_a_changed_leaf():
    ref = ([1.0, 0.5], [np.ones((3,), np.float32), np.arange(4, dtype=np.int32)])
    assert compare(ref, ref, low_precision=False) is None
    assert "loss of step 1" in compare(ref, ([1.0, 0.51], ref[1]), low_precision=False)
    leaf = np.ones((3,), np.float32)
    leaf[1] += 0.01
    assert "state leaf 0" in compare(ref, (ref[0], [leaf, ref[1][1]]), low_precision=False)
    assert compare(ref, (ref[0], [leaf, ref[1][1]]), low_precision=True) is None
    changed = np.arange(4, dtype=np.int32) + 1
    assert "integer" in compare(ref, (ref[0], [ref[1][0], changed]), low_precision=True)


@pytest.mark.e2e
def test_every_block_kind_builds_and_trains_serially():
    # two programs of seven blocks each: every kind once, each variant somewhere
    blocks = [Block(kind, k % 3, 2) for k, kind in enumerate(BLOCK_KINDS)]
    for half in (blocks[::2], blocks[1::2]):
        spec = ProgramSpec(seed=1, batch=8, width=16, optimizer="adam", loss="xent",
                           blocks=tuple(half))
        losses, leaves = serial_run(spec)
        assert all(np.isfinite(losses)) and losses[0] != losses[1], spec.describe()
        assert all(np.all(np.isfinite(x)) for x in leaves if x.dtype.kind == "f")


@pytest.mark.e2e
def test_the_fixed_seed_slice_matches_the_serial_step_or_refuses_in_one_line():
    results = []
    for seed in SLICE_SEEDS:
        devices = DEVICE_COUNTS[seed % len(DEVICE_COUNTS)]
        results += campaign([random_spec(seed)], METHODS, (devices,))
    table = summary_table(results)
    assert not [r for r in results if r.status in ("mismatch", "traceback")], table
    assert all("\n" not in r.detail for r in results)
    assert sum(r.status == "match" for r in results) >= len(results) // 2, table


@pytest.mark.e2e
@pytest.mark.parametrize("path", REPRODUCERS, ids=[p.stem for p in REPRODUCERS])
def test_a_reproducer_no_longer_fails(path):
    case = json.loads(path.read_text())
    spec = ProgramSpec.from_json(json.dumps(case["spec"]))
    result = run_case(spec, case["method"], case["devices"])
    assert result.status in ("match", "refused"), (case["detail"], result.detail)
    assert result.status == case.get("fixed_as", result.status), result.detail


def test_there_are_reproducers():
    assert REPRODUCERS, "the campaign's reproducers are missing"
