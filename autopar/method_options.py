"""The option values the methods share (solvers, recomputation, replicas, stages, layers, the
schedule the planner chooses) and their checks: each raises ``InvalidOptionError`` in one line
naming the valid choices. ``autopar.methods`` builds its option dataclasses from them. Each is
a ``StrEnum`` whose members equal their strings: users pass ``remat="layers"``, the code
compares with ``RematMode.LAYERS``."""

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


class RematMode(StrEnum):
    """``remat=``: keep every activation (``NONE``), recompute each layer's forward in the
    backward (``LAYERS``), recompute each layer but its matmuls' outputs (``SELECTIVE``:
    the attention core and the element-wise chains, Korthikanti et al.'s selective
    recomputation), or let the planner choose per candidate (``AUTO``: for one-stage
    plans none, then whole layers where that does not fit; pipeline stages choose among all
    three)."""

    NONE = "none"
    LAYERS = "layers"
    SELECTIVE = "selective"
    AUTO = "auto"


class ReplicaMode(StrEnum):
    """``replicas=``: search how many data-parallel copies of the pipeline to run (``AUTO``)
    or run one (``NONE``)."""

    AUTO = "auto"
    NONE = "none"


class StageMode(StrEnum):
    """``stages=``: the stage DP chooses the stages (``AUTO``) or the layers are split into
    equal stages (``UNIFORM``); a ``ManualStages`` gives them by hand."""

    AUTO = "auto"
    UNIFORM = "uniform"


class LayerMode(StrEnum):
    """``layers=`` besides a count: cut at the planner's choice (``AUTO``: the user's
    ``autopar.mark_pipeline_boundary`` calls where there are any) or at those marks only
    (``MARKED``)."""

    AUTO = "auto"
    MARKED = "marked"


SCHEDULE_AUTO = "auto"  # PipeshardParallel(schedule=...): the planner compares schedules


def check_choice(kind: str, value: object, choices: type[StrEnum], besides: str = "") -> None:
    """Raise ``InvalidOptionError`` unless ``value`` is one of ``choices`` (its members or
    their strings); ``besides`` names what else the option takes, for the message."""
    if not (isinstance(value, str) and value in {c.value for c in choices}):
        raise InvalidOptionError(f"unknown {kind} option {value!r}; valid: "
                                 f"{choices_text(choices)}{besides}")


def check_replicas(value: str) -> None:
    """Raise ``InvalidOptionError`` unless ``value`` is a replicas mode."""
    check_choice("replicas", value, ReplicaMode)


def check_remat(value: str, *, pipelined: bool = False) -> None:
    """Raise ``InvalidOptionError`` unless ``value`` is a remat mode (every method takes
    every mode; ``pipelined`` is kept for callers that name their kind)."""
    valid = [m.value for m in RematMode]
    if not (isinstance(value, str) and value in valid):
        raise InvalidOptionError(f"unknown remat option {value!r}; valid: {', '.join(valid)}")


def check_positive(name: str, value: object, *, optional: bool = False) -> None:
    """Raise ``InvalidOptionError`` unless ``value`` is a positive number (or None, when the
    option is ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidOptionError(f"{name} must be positive, got {value}")


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
