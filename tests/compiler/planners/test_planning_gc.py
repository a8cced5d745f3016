"""Planning runs with fewer full collections of Python's cyclic collector, none of them
scanning what was alive before it began, and puts the collector back as it was after,
whatever happens."""

from __future__ import annotations

import gc

import pytest

from autopar.cluster import load_cluster
from autopar.compiler.planners.common import FULL_COLLECTION_EVERY, fewer_full_collections
from autopar.compiler.planners.dispatch import plan, trace
from autopar.errors import PlanError
from autopar.methods import ShardParallel
from autopar.models import get_model

DEFAULT = (700, 10, 10)  # Python's own


@pytest.fixture
def default_thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(*DEFAULT)
    yield
    gc.set_threshold(*saved)


@pytest.fixture
def nothing_frozen():
    """A process that froze nothing (whatever an earlier test of the process left frozen is
    released here and frozen again after; what the test froze is released after it: a
    process left frozen makes every later plan count the frozen objects, and every test after
    this one in its worker plans, 37 CPU-seconds of the suite on 2026-12-07)."""
    was_frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    yield
    gc.unfreeze()
    if was_frozen:
        gc.freeze()


def test_full_collections_are_rarer_inside_and_restored_after(default_thresholds):
    with fewer_full_collections():
        assert gc.get_threshold() == (700, 10, FULL_COLLECTION_EVERY)
    assert gc.get_threshold() == DEFAULT
    with pytest.raises(PlanError), fewer_full_collections():
        raise PlanError("no plan")
    assert gc.get_threshold() == DEFAULT


def test_what_was_alive_before_is_frozen_inside_and_released_after(nothing_frozen):
    before = [object() for _ in range(3)]
    with fewer_full_collections():
        assert gc.get_freeze_count() >= len(before)
    assert gc.get_freeze_count() == 0
    with pytest.raises(PlanError), fewer_full_collections():
        raise PlanError("no plan")
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_objects_itself_keeps_them_frozen(nothing_frozen):
    gc.freeze()
    frozen = gc.get_freeze_count()
    with fewer_full_collections():
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == frozen


def test_planning_runs_with_them_and_leaves_them_as_they_were(default_thresholds,
                                                             nothing_frozen):
    model = get_model("mlp", "tiny")
    step = trace(model.train_step, model.abstract_inputs(), ShardParallel(), (1,))
    during = []
    plan(step, load_cluster("cpu-sim").with_devices(1, 8),
         ilp_observer=lambda problem, solution: during.append(
             (gc.get_threshold(), gc.get_freeze_count() > 0)))
    assert during and all(t == ((700, 10, FULL_COLLECTION_EVERY), True) for t in during)
    assert gc.get_threshold() == DEFAULT and gc.get_freeze_count() == 0
