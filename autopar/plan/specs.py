"""The plan's vocabulary: how a tensor is split (:class:`ShardingSpec`) and the collectives a
plan predicts (:class:`CollectiveKind`, :class:`CollectiveEstimate`), as plain data."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from autopar.errors import InvalidOptionError, PlanError, choices_text


class CollectiveKind(StrEnum):
    """Collective operations; values are the HLO opcode names."""

    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    COLLECTIVE_PERMUTE = "collective-permute"


def collective_kind(kind: CollectiveKind | str) -> CollectiveKind:
    """``kind`` as a :class:`CollectiveKind` (InvalidOptionError naming the valid ones)."""
    if isinstance(kind, CollectiveKind):
        return kind
    try:
        return CollectiveKind(kind)
    except ValueError:
        raise InvalidOptionError(
            f"unknown collective '{kind}'; valid collectives: "
            f"{choices_text(k.value for k in CollectiveKind)}") from None


@dataclass(frozen=True)
class CollectiveEstimate:
    """A predicted collective: ``count`` occurrences of ``kind`` moving ``nbytes`` (the
    full-tensor convention of ``autopar.compiler.cost.collectives``) over mesh ``axes``;
    ``time_s`` is the total for all ``count``."""

    kind: CollectiveKind
    count: int
    nbytes: float
    axes: tuple[int, ...]
    time_s: float

    def __post_init__(self) -> None:
        # the cost model makes tens of thousands per layer ILP, already of these types
        if type(self.kind) is not CollectiveKind:
            object.__setattr__(self, "kind", collective_kind(self.kind))
        if type(self.axes) is not tuple or any(type(a) is not int for a in self.axes):
            object.__setattr__(self, "axes", tuple(int(a) for a in self.axes))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"kind": self.kind.value, "count": self.count, "nbytes": self.nbytes,
                "axes": list(self.axes), "time_s": self.time_s}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CollectiveEstimate:
        """Inverse of :meth:`to_dict`."""
        return cls(kind=collective_kind(data["kind"]), count=int(data["count"]),
                   nbytes=float(data["nbytes"]), axes=tuple(data["axes"]),
                   time_s=float(data["time_s"]))


@dataclass(frozen=True)
class ShardingSpec:
    """How a tensor is split: for each tensor dimension, the mesh axes that split it.

    ``dims[d] == ()`` means dimension ``d`` is whole on every device; ``("x", "y")`` means it is
    split over both mesh axes (x major). A mesh axis appears at most once per spec.
    """

    dims: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        used = [a for axes in self.dims for a in axes]
        if len(used) != len(set(used)):
            raise PlanError(f"sharding spec {self.dims} uses a mesh axis twice")

    def __hash__(self) -> int:
        # specs key the planner's caches (a GPT-39B search hashes them millions of times) and
        # a tuple of tuples rehashes every element each time: hashed once
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash(self.dims)
            object.__setattr__(self, "_hash", found)
        return found

    def __getstate__(self) -> dict[str, Any]:
        return {"dims": self.dims}  # not the hash: another process hashes strings anew

    @classmethod
    def replicated(cls, ndim: int) -> ShardingSpec:
        return cls(tuple(() for _ in range(ndim)))

    @classmethod
    def split(cls, ndim: int, dim: int, axes: tuple[str, ...]) -> ShardingSpec:
        """Dimension ``dim`` split over ``axes``; every other dimension whole."""
        return cls(tuple(tuple(axes) if d == dim else () for d in range(ndim)))

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def is_replicated(self) -> bool:
        return all(not axes for axes in self.dims)

    def num_shards(self, axis_sizes: dict[str, int]) -> int:
        """How many pieces the tensor is cut into on a mesh with these axis sizes."""
        count = 1
        for axes in self.dims:
            for a in axes:
                count *= axis_sizes[a]
        return count

    def to_string(self) -> str:
        """PartitionSpec notation: ``P('x', None)``, ``P(('x', 'y'),)``, ``P()`` for a scalar."""
        parts = []
        for axes in self.dims:
            if not axes:
                parts.append("None")
            elif len(axes) == 1:
                parts.append(repr(axes[0]))
            else:
                parts.append("(" + ", ".join(repr(a) for a in axes) + ")")
        if len(parts) == 1:
            return f"P({parts[0]},)" if parts[0].startswith("(") else f"P({parts[0]})"
        return "P(" + ", ".join(parts) + ")"

    @classmethod
    def from_string(cls, text: str) -> ShardingSpec:
        """Parse :meth:`to_string`'s notation back."""
        m = re.fullmatch(r"\s*P\((.*)\)\s*", text)
        if not m:
            raise PlanError(f"invalid sharding spec {text!r}; expected P(...) notation")
        body = m.group(1).strip().rstrip(",").strip()
        if not body:
            return cls(())
        dims: list[tuple[str, ...]] = []
        for token in re.findall(r"\([^)]*\)|[^,]+", body):
            token = token.strip()
            if token == "None":
                dims.append(())
            elif token.startswith("("):
                dims.append(tuple(re.findall(r"'([^']*)'", token)))
            else:
                dims.append((token.strip("'\""),))
        return cls(tuple(dims))

    def to_json(self) -> list[list[str]]:
        return [list(axes) for axes in self.dims]

    @classmethod
    def from_json(cls, data: list[list[str]]) -> ShardingSpec:
        return cls(tuple(tuple(axes) for axes in data))
