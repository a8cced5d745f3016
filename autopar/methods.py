"""Parallelization methods: the options a user passes as ``method=``.

Each method is a frozen dataclass of options; the planner for it lives in ``autopar.compiler``.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import InvalidOptionError, choices_text

SOLVERS: tuple[str, ...] = ("auto", "highs", "cbc")


@dataclass(frozen=True)
class DataParallel:
    """Split every batch leaf along its first dimension over all devices; replicate the state.

    ``mesh_shape``: the logical mesh (default: all devices in one axis). The batch is split over
    every axis of it, so the shape only changes how the gradient all-reduce is costed.
    """

    mesh_shape: tuple[int, ...] | None = None

    name = "data"


@dataclass(frozen=True)
class ShardParallel:
    """Choose every tensor's sharding on one logical mesh with an ILP (Alpa's intra-op pass).

    ``mesh_shape``: a 1-D or 2-D logical mesh over the devices (default: all in one axis).
    ``memory_budget_bytes``: per-device memory every plan must fit (default: unlimited).
    ``solver``: ``"auto"`` (HiGHS when available, else CBC), ``"highs"`` or ``"cbc"``.
    ``time_limit_s``: the solver's time limit; past it the best plan found so far is used and
    marked as not proven optimal.
    """

    mesh_shape: tuple[int, ...] | None = None
    memory_budget_bytes: float | None = None
    solver: str = "auto"
    time_limit_s: float = 30.0

    name = "shard"

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS:
            raise InvalidOptionError(
                f"unknown solver '{self.solver}'; valid solvers: {choices_text(SOLVERS)}"
            )
        if self.time_limit_s <= 0:
            raise InvalidOptionError(f"time_limit_s must be positive, got {self.time_limit_s}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise InvalidOptionError(
                f"memory_budget_bytes must be positive, got {self.memory_budget_bytes}"
            )


SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
STAGE_MODES: tuple[str, ...] = ("auto", "uniform")


@dataclass(frozen=True)
class ManualStages:
    """Stages chosen by hand: ``layer_ranges[i] = (first, end)`` (end exclusive) and
    ``submesh_shapes[i] = (hosts, devices per host)`` for stage i."""

    layer_ranges: tuple[tuple[int, int], ...]
    submesh_shapes: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if len(self.layer_ranges) != len(self.submesh_shapes) or not self.layer_ranges:
            raise InvalidOptionError(
                f"ManualStages needs one submesh shape per layer range; got "
                f"{len(self.layer_ranges)} ranges and {len(self.submesh_shapes)} shapes"
            )


@dataclass(frozen=True)
class PipeshardParallel:
    """Pipeline stages on submeshes, each with its own intra-operator plan (Alpa's full search).

    ``num_microbatches``: microbatches per step (must divide the batch size).
    ``layers``: ``"auto"`` (the step's ``autopar.mark_pipeline_boundary`` calls when it has
    any, else automatic clustering), ``"marked"`` (only the marks) or a number of layers to
    cluster the loss forward into.
    ``stages``: ``"auto"`` (the stage DP), ``"uniform"`` (equal layers on equal submeshes;
    ``num_stages`` of them) or a ``ManualStages``.
    ``schedule``: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` (``num_chunks`` model pieces
    per stage, uniform stages) or ``"zb-h1"`` (backward split into input and weight gradients).
    ``num_stages``: fixes the stage count (None: the DP chooses; uniform needs it or uses 2).
    ``memory_budget_bytes``: per-device memory every stage must fit (default: the cluster's).
    """

    num_microbatches: int = 4
    layers: int | str = "auto"
    stages: str | ManualStages = "auto"
    schedule: str = "1f1b"
    num_stages: int | None = None
    num_chunks: int = 2
    memory_budget_bytes: float | None = None
    solver: str = "auto"
    time_limit_s: float = 30.0

    name = "pipeshard"

    def __post_init__(self) -> None:
        if not isinstance(self.num_microbatches, int) or self.num_microbatches < 1:
            raise InvalidOptionError(
                f"num_microbatches must be a positive integer, got {self.num_microbatches!r}"
            )
        if self.schedule not in SCHEDULES:
            raise InvalidOptionError(
                f"unknown schedule '{self.schedule}'; valid schedules: {choices_text(SCHEDULES)}"
            )
        if not isinstance(self.stages, ManualStages) and self.stages not in STAGE_MODES:
            raise InvalidOptionError(
                f"unknown stages option {self.stages!r}; valid: {choices_text(STAGE_MODES)} "
                "or autopar.ManualStages(...)"
            )
        if isinstance(self.layers, str):
            if self.layers not in ("auto", "marked"):
                raise InvalidOptionError(
                    f"unknown layers option '{self.layers}'; valid: auto, marked, or a number"
                )
        elif not isinstance(self.layers, int) or self.layers < 1:
            raise InvalidOptionError(f"layers must be a positive number, got {self.layers!r}")
        if self.num_stages is not None and (
            not isinstance(self.num_stages, int) or self.num_stages < 1
        ):
            raise InvalidOptionError(
                f"num_stages must be a positive integer, got {self.num_stages!r}"
            )
        if self.solver not in SOLVERS:
            raise InvalidOptionError(
                f"unknown solver '{self.solver}'; valid solvers: {choices_text(SOLVERS)}"
            )
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise InvalidOptionError(
                f"memory_budget_bytes must be positive, got {self.memory_budget_bytes}"
            )


Method = DataParallel | ShardParallel | PipeshardParallel

METHOD_TYPES: tuple[type, ...] = (DataParallel, ShardParallel, PipeshardParallel)
METHOD_NAMES: tuple[str, ...] = ("data", "shard", "pipeshard")


def method_from_name(name: str, mesh_shape: tuple[int, ...] | None = None, **options) -> Method:
    """The method for a CLI name (``data``, ``shard``); raises ``InvalidOptionError`` for others."""
    if name == "data":
        return DataParallel(mesh_shape=mesh_shape)
    if name == "shard":
        return ShardParallel(mesh_shape=mesh_shape, **options)
    if name == "pipeshard":
        return PipeshardParallel(**options)
    raise InvalidOptionError(
        f"unknown method '{name}'; valid methods: {choices_text(METHOD_NAMES)}"
    )
