"""Submeshes for pipeline stages: their shapes, what a stage costs on each, where they go.

Following Alpa, a stage runs either on a slice of one host, ``(1, n)`` with ``n`` a power of
two dividing ``D``, or on whole hosts, ``(h, D)``. Restricting shapes this way keeps the
stage-construction DP one-dimensional (it only counts devices) while every chosen set of shapes
whose sizes sum to the cluster can still be laid out: whole-host stages take whole hosts, and
the power-of-two slices pack into the remaining hosts without gaps when placed largest first
at addresses aligned to their size (each host is a row of aligned blocks of the largest power
of two dividing ``D``). With ``D`` a power of two that is every ``(1, 2^k)``; for other ``D``
(say 6) a slice of 4 is left out, since three of them on 2 hosts of 6 cannot be placed.

Device ids are host-major: device ``host * D + local``, as in :class:`ClusterSpec`.

The caller prices a layer range on a submesh as :class:`StageCandidate` s (one per logical
mesh shape it tried), collected in a :class:`StageCostTable` that the stage DP
(:mod:`autopar.compiler.inter_op.stages`) reads.

Pure Python; no devices, no JAX.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.errors import InvalidOptionError, PlanError, choices_text

__all__ = [
    "CandidateArrays",
    "CandidateFn",
    "DenseFn",
    "always_packs",
    "StageCandidate",
    "StageCostTable",
    "SubmeshShape",
    "place_submeshes",
    "submesh_shapes",
]


def _check_positive(value: object, what: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise InvalidOptionError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SubmeshShape:
    """``num_hosts`` hosts x ``devices_per_host`` devices of each, as one stage's device slice."""

    num_hosts: int
    devices_per_host: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_hosts", _check_positive(self.num_hosts, "num_hosts"))
        object.__setattr__(
            self, "devices_per_host", _check_positive(self.devices_per_host, "devices_per_host")
        )

    @property
    def num_devices(self) -> int:
        """Devices in the submesh."""
        return self.num_hosts * self.devices_per_host

    def fits(self, num_hosts: int, devices_per_host: int) -> bool:
        """Whether this shape exists on a cluster of ``num_hosts`` x ``devices_per_host``.

        A multi-host submesh must use every device of its hosts (Alpa's rule), so only a
        single-host submesh may be narrower than a host.
        """
        if self.num_hosts > num_hosts or self.devices_per_host > devices_per_host:
            return False
        return self.num_hosts == 1 or self.devices_per_host == devices_per_host

    def __str__(self) -> str:
        return f"{self.num_hosts}x{self.devices_per_host}"

    def to_dict(self) -> dict[str, int]:
        """JSON-able form."""
        return {"num_hosts": self.num_hosts, "devices_per_host": self.devices_per_host}


def always_packs(shape: SubmeshShape, num_hosts: int, devices_per_host: int) -> bool:
    """Whether any mix of such shapes summing to at most the cluster can always be placed:
    whole hosts, or a single-host slice whose width is a power of two dividing the host."""
    if not shape.fits(num_hosts, devices_per_host):
        return False
    width = shape.devices_per_host
    is_power_of_two = width & (width - 1) == 0
    return width == devices_per_host or (is_power_of_two and devices_per_host % width == 0)


# Whole-host stage shapes of every host count up to this many are considered (see
# ``submesh_shapes``); the published testbeds (Alpa's 8 hosts) keep all of theirs.
SMALL_HOST_COUNT = 8


def submesh_shapes(num_hosts: int, devices_per_host: int) -> tuple[SubmeshShape, ...]:
    """The shapes the stage DP considers on a ``num_hosts`` x ``devices_per_host`` cluster.

    ``(1, 1), (1, 2), (1, 4), ..., (1, D)`` (powers of two dividing ``D``, then ``D`` itself),
    followed by ``(h, D)`` for every host count ``h`` up to ``SMALL_HOST_COUNT``, and beyond it
    the host counts that divide ``H`` or are powers of two; ordered by device count.

    Past a few hosts, a stage on a host count that neither divides the cluster nor is a power
    of two can only sit beside stages of other sizes, and identical layers want equal stages:
    a Megatron-style t x p x d layout always has stages of ``H / p`` hosts. Leaving those
    counts out keeps the search linear in the divisors of ``H`` rather than in ``H``
    (384 hosts: 16 whole-host shapes, not 383).
    """
    hosts = _check_positive(num_hosts, "num_hosts")
    per_host = _check_positive(devices_per_host, "devices_per_host")
    widths = []
    width = 1
    while width < per_host and per_host % width == 0:
        widths.append(width)
        width *= 2
    widths.append(per_host)
    shapes = [SubmeshShape(1, w) for w in widths]
    shapes += [SubmeshShape(h, per_host) for h in range(2, hosts + 1)
               if h <= SMALL_HOST_COUNT or hosts % h == 0 or h & (h - 1) == 0]
    return tuple(shapes)


def _block_starts(shape: SubmeshShape, num_hosts: int, per_host: int) -> list[int]:
    """First device ids where ``shape`` may start: host boundaries for whole-host shapes,
    offsets aligned to the width inside a host otherwise (so a slice never straddles hosts)."""
    if shape.devices_per_host == per_host:
        return [h * per_host for h in range(num_hosts - shape.num_hosts + 1)]
    width = shape.devices_per_host
    return [
        h * per_host + offset
        for h in range(num_hosts)
        for offset in range(0, per_host - width + 1, width)
    ]


def _try_place(
    shapes: Sequence[SubmeshShape],
    order: Sequence[int],
    num_hosts: int,
    per_host: int,
    start_after_previous: bool,
) -> list[list[int]] | None:
    """Place stages in ``order``, each at the first free aligned block; None if one does not fit.

    With ``start_after_previous`` the search for a stage's block begins where the previous
    stage ended (wrapping around), which keeps neighbouring stages on neighbouring devices.
    """
    total = num_hosts * per_host
    free = [True] * total
    placed: list[list[int]] = [[] for _ in shapes]
    cursor = 0
    for stage in order:
        shape = shapes[stage]
        size = shape.num_devices
        starts = _block_starts(shape, num_hosts, per_host)
        if start_after_previous:
            starts = sorted(starts, key=lambda s: (s < cursor, s))
        start = next((s for s in starts if all(free[s : s + size])), None)
        if start is None:
            return None
        free[start : start + size] = [False] * size
        placed[stage] = list(range(start, start + size))
        cursor = start + size
    return placed


def place_submeshes(
    shapes: Sequence[SubmeshShape], num_hosts: int, devices_per_host: int
) -> list[list[int]]:
    """Concrete device ids for each stage's submesh, in stage order.

    Whole-host submeshes take whole hosts; single-host slices sit at offsets aligned to their
    width, so every stage is contiguous inside a host (or spans whole consecutive hosts).
    Consecutive stages are placed next to each other when that works; otherwise the stages are
    placed largest first, which always succeeds for shapes that :func:`always_packs` accepts
    (the only ones the stage DP uses) whose sizes sum to at most the cluster. Other shapes are
    tried the same way; raises :class:`PlanError` when they cannot be placed.
    """
    hosts = _check_positive(num_hosts, "num_hosts")
    per_host = _check_positive(devices_per_host, "devices_per_host")
    for index, shape in enumerate(shapes):
        if not shape.fits(hosts, per_host):
            raise PlanError(
                f"stage {index} submesh {shape} does not exist on a cluster of {hosts} hosts x "
                f"{per_host} devices (multi-host submeshes must use whole hosts)"
            )
    needed = sum(shape.num_devices for shape in shapes)
    if needed > hosts * per_host:
        raise PlanError(
            f"the stages need {needed} devices but the cluster has {hosts * per_host} "
            f"({hosts} hosts x {per_host} devices)"
        )
    in_order = list(range(len(shapes)))
    largest_first = sorted(in_order, key=lambda i: -shapes[i].num_devices)
    attempts: list[Callable[[], list[list[int]] | None]] = [
        lambda: _try_place(shapes, in_order, hosts, per_host, start_after_previous=True),
        lambda: _try_place(shapes, in_order, hosts, per_host, start_after_previous=False),
        lambda: _try_place(shapes, largest_first, hosts, per_host, start_after_previous=False),
    ]
    for attempt in attempts:
        placed = attempt()
        if placed is not None:
            return placed
    listed = ", ".join(str(shape) for shape in shapes)
    raise PlanError(
        f"cannot place submeshes [{listed}] ({needed} devices) on {hosts} hosts x {per_host} "
        "devices so that each is contiguous inside one host or spans whole hosts"
    )


def _non_negative(value: Any, what: str) -> float:
    if type(value) is float and 0.0 <= value < math.inf:
        return value  # the common case, without the ABC check (the stage DP makes ~10^6)
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise InvalidOptionError(f"{what} must be a finite non-negative number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class StageCandidate:
    """One way to run a layer range on a submesh (one logical mesh shape).

    ``time``: device seconds per microbatch, forward plus backward. ``fixed_memory``: bytes per
    device independent of the microbatch count (parameters, gradients, optimizer state).
    ``activation_memory_per_microbatch``: bytes per device kept for one in-flight microbatch.
    ``key`` is opaque here; the caller uses it to find the matching intra-operator plan.
    ``tail_time``: device seconds once per step, after the stage's last backward (the
    gradients' reduction, the optimizer update). ``host_time``: the driver's seconds per step
    for this stage's tasks and transfers (issued one after the other by one host thread, so
    they add up over stages rather than overlap). ``param_bytes``: the stage's parameter bytes
    per device (its gradient accumulators and stashed weights are as large).

    The stage DP charges ``sum(time + tail_time / m + host_time) + (m - 1) max(time +
    tail_time / m)`` (:meth:`sum_part`, :meth:`max_part`): the per-step tail spread over the
    microbatches, which for one stage is exact.
    """

    time: float
    fixed_memory: float
    activation_memory_per_microbatch: float
    logical_mesh_shape: tuple[int, ...]
    key: str = ""
    tail_time: float = 0.0
    host_time: float = 0.0
    param_bytes: float = 0.0

    def __post_init__(self) -> None:
        shape = self.logical_mesh_shape
        # the stage search makes hundreds of thousands (GPT-3 175B on 1,024 A100s: 271,000;
        # GPT 1T 591,000), almost all already plain finite floats and an int tuple: nothing
        # to convert (checked in a plain loop: ``all`` over a generator was most of the cost)
        for v in (self.time, self.fixed_memory, self.activation_memory_per_microbatch,
                  self.tail_time, self.host_time, self.param_bytes):
            if type(v) is not float or not 0.0 <= v < math.inf:
                break
        else:
            if type(shape) is tuple and all(type(n) is int for n in shape):
                return
        for name in ("time", "fixed_memory", "activation_memory_per_microbatch", "tail_time",
                     "host_time", "param_bytes"):
            object.__setattr__(self, name, _non_negative(getattr(self, name), name))
        object.__setattr__(self, "logical_mesh_shape", tuple(int(n) for n in shape))

    def max_part(self, num_microbatches: int) -> float:
        """What the DP's max term sees: the time per microbatch with the tail spread over the
        ``num_microbatches``."""
        return self.time + self.tail_time / max(num_microbatches, 1)

    def sum_part(self, num_microbatches: int) -> float:
        """What the DP's sum term sees: :meth:`max_part` and the host's time."""
        return self.max_part(num_microbatches) + self.host_time

    def memory(self, in_flight: float, weight_versions: int = 1) -> float:
        """Peak bytes per device with ``in_flight`` microbatches' activations held (fractional
        under interleaved schedules, whose chunks each hold a share of the stage's layers) and
        ``weight_versions`` versions of the parameters (asynchronous schedules stash more than
        the one ``fixed_memory`` counts)."""
        return (self.fixed_memory + in_flight * self.activation_memory_per_microbatch
                + (weight_versions - 1) * self.param_bytes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "time": self.time,
            "fixed_memory": self.fixed_memory,
            "activation_memory_per_microbatch": self.activation_memory_per_microbatch,
            "logical_mesh_shape": list(self.logical_mesh_shape),
            "key": self.key,
            "tail_time": self.tail_time,
            "host_time": self.host_time,
            "param_bytes": self.param_bytes,
        }


CandidateFn = Callable[[int, int, SubmeshShape], Sequence[StageCandidate]]


@dataclass(frozen=True)
class CandidateArrays:
    """A whole table's candidates as the stage DP reads them, over (start k, end e, usable
    submesh j, candidate c), each entry's candidates in the order ``candidates`` returns them
    and padded after: ``times`` (``max_part``), ``sums`` (``sum_part``) and ``fixed`` infinite
    in padding, ``act`` and ``param`` zero there."""

    times: Any
    sums: Any
    fixed: Any
    act: Any
    param: Any


# A table's candidates made as arrays at once, for the usable submesh indices and the DP's
# microbatch count (None where it cannot, left to ``candidates``): see ``StageCostTable``
DenseFn = Callable[[Sequence[int], int], "CandidateArrays | None"]


class StageCostTable:
    """Candidates for every layer range ``[start, end)`` and submesh index.

    Entries come from ``fn(start, end, submesh)``, called at most once per entry and only when
    the entry is first read; :meth:`build` reads them all at once, i.e. it calls ``fn``
    ``L (L + 1) / 2 * len(submeshes)`` times. An empty sequence means "cannot run here". A
    caller that already has the candidates (a cache, a parallel sweep) can pass ``fn`` as a
    dictionary lookup. ``dense``: the same candidates as arrays for the whole table at once
    (``CandidateArrays``), which the DP reads instead of calling ``fn`` per entry (GPT-3 175B's
    search reads 14 tables of 19,000 candidates each); ``fn`` still gives the chosen ones.
    """

    def __init__(self, num_layers: int, submeshes: Sequence[SubmeshShape], fn: CandidateFn,
                 dense: DenseFn | None = None):
        if not isinstance(num_layers, numbers.Integral) or num_layers < 1:
            raise InvalidOptionError(f"num_layers must be a positive integer, got {num_layers!r}")
        if not submeshes:
            raise InvalidOptionError("a stage cost table needs at least one submesh shape")
        self.num_layers: int = int(num_layers)
        self.submeshes: tuple[SubmeshShape, ...] = tuple(submeshes)
        self._fn: CandidateFn = fn
        self.dense: DenseFn | None = dense
        self._entries: dict[tuple[int, int, int], tuple[StageCandidate, ...]] = {}

    @classmethod
    def build(
        cls, num_layers: int, submeshes: Sequence[SubmeshShape], fn: CandidateFn
    ) -> StageCostTable:
        """A table with every entry filled now (``L (L + 1) / 2 * len(submeshes)`` calls)."""
        table = cls(num_layers, submeshes, fn)
        for start in range(num_layers):
            for end in range(start + 1, num_layers + 1):
                for index in range(len(table.submeshes)):
                    table.candidates(start, end, index)
        return table

    @property
    def num_entries(self) -> int:
        """Number of (range, submesh) entries: ``L (L + 1) / 2 * len(submeshes)``."""
        return self.num_layers * (self.num_layers + 1) // 2 * len(self.submeshes)

    def submesh_index(self, shape: SubmeshShape) -> int:
        """Index of ``shape`` in :attr:`submeshes`; PlanError naming the choices if absent."""
        if shape not in self.submeshes:
            raise PlanError(
                f"submesh {shape} is not in the cost table; choices: {choices_text(self.submeshes)}"
            )
        return self.submeshes.index(shape)

    def candidates(self, start: int, end: int, submesh_index: int) -> tuple[StageCandidate, ...]:
        """Candidates for layers ``[start, end)`` on ``submeshes[submesh_index]``."""
        key = (start, end, submesh_index)
        if key not in self._entries:
            if not (
                0 <= start < end <= self.num_layers and 0 <= submesh_index < len(self.submeshes)
            ):
                raise PlanError(
                    f"no cost table entry for layers [{start}, {end}) on submesh index "
                    f"{submesh_index}: the table has layers 0..{self.num_layers - 1} and "
                    f"{len(self.submeshes)} submeshes"
                )
            found = tuple(self._fn(start, end, self.submeshes[submesh_index]))
            if not all(isinstance(c, StageCandidate) for c in found):
                raise PlanError(
                    f"the candidate function returned something other than StageCandidates "
                    f"for layers [{start}, {end}) on {self.submeshes[submesh_index]}"
                )
            self._entries[key] = found
        return self._entries[key]
