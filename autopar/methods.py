"""Parallelization methods: the options a user passes as ``method=``.

Each method is a frozen dataclass of options; the planner for it lives in ``autopar.compiler``.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import InvalidOptionError, choices_text


@dataclass(frozen=True)
class DataParallel:
    """Split every batch leaf along its first dimension over all devices; replicate the state.

    ``mesh_shape``: the logical mesh (default: all devices in one axis). The batch is split over
    every axis of it, so the shape only changes how the gradient all-reduce is costed.
    """

    mesh_shape: tuple[int, ...] | None = None

    name = "data"


Method = DataParallel

METHOD_TYPES: tuple[type, ...] = (DataParallel,)
METHOD_NAMES: tuple[str, ...] = ("data",)


def method_from_name(name: str, mesh_shape: tuple[int, ...] | None = None) -> Method:
    """The method for a CLI name (``data``); raises ``InvalidOptionError`` for others."""
    if name == "data":
        return DataParallel(mesh_shape=mesh_shape)
    raise InvalidOptionError(
        f"unknown method '{name}'; valid methods: {choices_text(METHOD_NAMES)}"
    )
