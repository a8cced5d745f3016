"""The option values the methods share (solvers, recomputation, replicas, the schedule the
planner chooses) and their checks: each raises ``InvalidOptionError`` in one line naming the
valid choices. ``autopar.methods`` builds its option dataclasses from them."""

from __future__ import annotations

from enum import StrEnum

from autopar.errors import InvalidOptionError, choices_text


class Solver(StrEnum):
    """The intra-operator ILP's solvers (``AUTO``: HiGHS when installed, else CBC). Members
    equal their strings, so options take ``"highs"`` as well as ``Solver.HIGHS``."""

    AUTO = "auto"
    HIGHS = "highs"
    CBC = "cbc"


def check_solver(value: object) -> None:
    """Raise ``InvalidOptionError`` (one line, naming the choices) unless ``value`` is a
    solver name."""
    if not (isinstance(value, str) and value in {s.value for s in Solver}):
        raise InvalidOptionError(
            f"unknown solver '{value}'; valid solvers: {choices_text(Solver)}"
        )


REMAT_MODES: tuple[str, ...] = ("none", "layers", "auto")
SCHEDULE_AUTO = "auto"  # PipeshardParallel(schedule=...): the planner compares schedules
REPLICA_MODES: tuple[str, ...] = ("auto", "none")


def check_replicas(value: str) -> None:
    """Raise ``InvalidOptionError`` unless ``value`` is a replicas mode."""
    if value not in REPLICA_MODES:
        raise InvalidOptionError(
            f"unknown replicas option {value!r}; valid: {choices_text(REPLICA_MODES)}"
        )


def check_remat(value: str) -> None:
    """Raise ``InvalidOptionError`` unless ``value`` is a remat mode."""
    if value not in REMAT_MODES:
        raise InvalidOptionError(
            f"unknown remat option {value!r}; valid: {choices_text(REMAT_MODES)}"
        )


def check_flag(name: str, value: object) -> None:
    """Raise ``InvalidOptionError`` unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise InvalidOptionError(f"{name} must be True or False, got {value!r}")


def check_workers(value: object) -> None:
    """Raise ``InvalidOptionError`` unless ``value`` is None or a positive integer."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 1):
        raise InvalidOptionError(f"planning_workers must be a positive integer or None, got "
                                 f"{value!r}")
