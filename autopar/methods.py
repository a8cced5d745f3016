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


Method = DataParallel | ShardParallel

METHOD_TYPES: tuple[type, ...] = (DataParallel, ShardParallel)
METHOD_NAMES: tuple[str, ...] = ("data", "shard")


def method_from_name(name: str, mesh_shape: tuple[int, ...] | None = None, **options) -> Method:
    """The method for a CLI name (``data``, ``shard``); raises ``InvalidOptionError`` for others."""
    if name == "data":
        return DataParallel(mesh_shape=mesh_shape)
    if name == "shard":
        return ShardParallel(mesh_shape=mesh_shape, **options)
    raise InvalidOptionError(
        f"unknown method '{name}'; valid methods: {choices_text(METHOD_NAMES)}"
    )
