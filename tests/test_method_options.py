"""The methods' shared options: checked once (``method_options``), each bad value refused in one
line that names the option and the valid choices, and a value given as a string or as its
``StrEnum`` member is the same option."""

from __future__ import annotations

import pytest

import autopar
from autopar.errors import InvalidOptionError
from autopar.method_options import LayerMode, RematMode, ReplicaMode, StageMode

ALL_METHODS = (autopar.DataParallel, autopar.ShardParallel, autopar.PipeshardParallel,
               autopar.AutoParallel)
WITH_SOLVER = (autopar.ShardParallel, autopar.PipeshardParallel, autopar.AutoParallel)


@pytest.mark.parametrize("method", WITH_SOLVER)
@pytest.mark.parametrize("option,value", [("time_limit_s", 0), ("time_limit_s", -1.0),
                                          ("time_limit_s", "30"), ("memory_budget_bytes", 0),
                                          ("memory_budget_bytes", float("nan"))])
def test_non_positive_limits_are_refused_in_one_line(method, option, value):
    with pytest.raises(InvalidOptionError) as err:
        method(**{option: value})
    assert str(err.value).startswith(f"{option} must be positive") and "\n" not in str(err.value)


@pytest.mark.parametrize("method", WITH_SOLVER)
def test_no_memory_budget_is_allowed(method):
    assert method(memory_budget_bytes=None).memory_budget_bytes is None


@pytest.mark.parametrize("method", ALL_METHODS)
def test_an_unknown_remat_names_every_mode(method):
    modes = "none, layers, selective, auto"
    with pytest.raises(InvalidOptionError, match=f"unknown remat option 'some'; valid: {modes}$"):
        method(remat="some")


@pytest.mark.parametrize("option,enum", [("replicas", ReplicaMode), ("stages", StageMode),
                                         ("layers", LayerMode)])
def test_an_unknown_pipeline_option_names_its_choices(option, enum):
    with pytest.raises(InvalidOptionError) as err:
        autopar.PipeshardParallel(**{option: "some"})
    assert f"unknown {option} option" in str(err.value)
    assert ", ".join(m.value for m in enum) in str(err.value)


def test_a_string_and_its_member_are_the_same_option():
    assert autopar.PipeshardParallel(remat="layers", replicas="none", stages="uniform",
                                     layers="marked") == autopar.PipeshardParallel(
        remat=RematMode.LAYERS, replicas=ReplicaMode.NONE, stages=StageMode.UNIFORM,
        layers=LayerMode.MARKED)
    assert autopar.AutoParallel().remat == "auto" and autopar.DataParallel().remat == "none"
