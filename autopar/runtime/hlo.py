"""Count the collectives in compiled HLO text.

Input is ``jax.jit(f).lower(*args).compile().as_text()``: the optimized, SPMD-partitioned,
per-device HLO module. Only the instruction opcode counts (the word right after
``name = <shape>``), so names, ``op_name`` metadata or fused-computation names that mention a
collective are never counted. Recognised opcodes: ``all-reduce``, ``all-gather``,
``reduce-scatter``, ``all-to-all``, ``collective-permute`` and their async ``-start`` forms
(the ``-done`` half is never counted). A tuple-shaped (combined) collective counts once.
A line whose opcode is a collective but whose result shape (or replica groups) cannot be read
raises :class:`~autopar.errors.HloParseError` naming the line: a parse miss never reads as
"no collective".

Bytes follow the cost model's full-tensor convention (:mod:`autopar.compiler.cost.collectives`):

* all-reduce: result bytes; all-gather: the gathered result bytes;
* reduce-scatter: the operand (full) bytes = result bytes x group size;
* all-to-all: the whole logical tensor across the group = result bytes x group size (each
  device's result is one ``1/n`` share of it);
* collective-permute: result bytes.

``HloCollective.result_bytes`` keeps the plain per-device result size.

Replica groups, in every form XLA prints them, are read by ``runtime.hlo_replica_groups``.

Counts are static by default: a collective inside a while-loop body counts once
(``computation`` names the computation that holds it); ``count_collectives(...,
per_run=True)`` counts each as often as one run of the program executes it (a loop's body
times its known trip count).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from autopar.errors import HloParseError
from autopar.plan import CollectiveKind
from autopar.runtime.hlo_calls import COMPUTATION_RE as _COMPUTATION_RE
from autopar.runtime.hlo_calls import computation_runs
from autopar.runtime.hlo_replica_groups import bracket_end, parse_replica_groups

__all__ = [
    "CollectiveSummary",
    "HloCollective",
    "HloParseError",
    "count_collectives",
    "parse_collectives",
]


_KINDS = tuple(k.value for k in CollectiveKind)
_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
         "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64,
         "f64": 64, "c64": 64, "c128": 128, "token": 0, "f4e2m1fn": 4, "f8e8m0fnu": 8}

_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=%]+)\s*=\s*")
_OPCODE_RE = re.compile(r"\s*([a-z][a-z0-9\-_]*)\(")
_ARRAY_RE = re.compile(r"([a-z][a-z0-9_]*)\[([^\]]*)\](?:\{[^}]*\})?")
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_QUICK_RE = re.compile(
    r"\b(?:all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
# A collective as an instruction's opcode: not inside a name (``%all-reduce.3``,
# ``%fused-all-gather``), nor an async ``-done`` half (its ``-start`` is the one counted).
_COLLECTIVE_OP_RE = re.compile(
    r"(?<![\w%.\-])(?:all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\(")
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_LINE_SHOWN = 160  # characters of an unparsable line quoted in the error

Shape = Any  # (dtype, dims) for an array, list of Shape for a tuple


def _parse_shape(text: str, i: int) -> tuple[Shape, int]:
    """Parse an HLO shape starting at ``text[i]``; return it and the index after it."""
    while i < len(text) and text[i] == " ":
        i += 1
    if text.startswith("(", i):
        items: list[Shape] = []
        i += 1
        while True:
            while i < len(text) and text[i] in " ,":
                i += 1
            if i >= len(text):
                raise HloParseError(f"unterminated tuple shape in: {text[:200]}")
            if text[i] == ")":
                return items, i + 1
            item, i = _parse_shape(text, i)
            items.append(item)
    match = _ARRAY_RE.match(text, i)
    if not match:
        raise HloParseError(f"cannot parse a shape at: {text[i:i + 80]}")
    dims = tuple(int(d) for d in re.findall(r"\d+", match.group(2)))
    return (match.group(1), dims), match.end()


def _flatten(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    if isinstance(shape, list):
        return [leaf for item in shape for leaf in _flatten(item)]
    return [shape]


def _array_bytes(dtype: str, dims: tuple[int, ...]) -> int:
    bits = _BITS.get(dtype)
    if bits is None:
        digits = re.search(r"\d+", dtype)  # f8e4m3fn, f8e5m2, ... -> 8 bits
        bits = int(digits.group()) if digits else 32
    return (math.prod(dims) * bits + 7) // 8


@dataclass(frozen=True)
class HloCollective:
    """One collective instruction of the compiled HLO.

    ``kind`` is a :class:`~autopar.compiler.cost.collectives.CollectiveKind` value; ``nbytes``
    follows the full-tensor convention of the module docstring; ``replica_groups`` is ``None``
    when the HLO says ``{}`` (all devices) and for collective-permute, whose pairs are in
    ``source_target_pairs``.
    """

    kind: str
    is_async: bool
    name: str
    result_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    nbytes: int
    replica_groups: tuple[tuple[int, ...], ...] | None
    group_size: int
    source_target_pairs: tuple[tuple[int, int], ...] | None = None
    computation: str = ""

    @property
    def result_bytes(self) -> int:
        """Bytes of the per-device result (sum over a combined collective's results)."""
        return sum(_array_bytes(dtype, dims) for dtype, dims in self.result_shapes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "kind": self.kind,
            "is_async": self.is_async,
            "name": self.name,
            "result_shapes": [[dtype, list(dims)] for dtype, dims in self.result_shapes],
            "nbytes": self.nbytes,
            "replica_groups": None if self.replica_groups is None
            else [list(g) for g in self.replica_groups],
            "group_size": self.group_size,
            "source_target_pairs": None if self.source_target_pairs is None
            else [list(p) for p in self.source_target_pairs],
            "computation": self.computation,
        }


def _module_devices(hlo_text: str) -> int:
    header = hlo_text.lstrip().split("\n", 1)[0]
    partitions = re.search(r"\bnum_partitions=(\d+)", header)
    replicas = re.search(r"\breplica_count=(\d+)", header)
    return (int(partitions.group(1)) if partitions else 1) * (
        int(replicas.group(1)) if replicas else 1)


def _holds_collective_op(line: str) -> bool:
    """Whether ``line`` has a collective opcode outside its strings (``op_name="..."``)."""
    return _COLLECTIVE_OP_RE.search(_STRING_RE.sub('""', line)) is not None


def _unparsable(line: str, what: str) -> HloParseError:
    text = " ".join(line.split())
    if len(text) > _LINE_SHOWN:
        text = text[:_LINE_SHOWN - 3] + "..."
    return HloParseError(f"collective in compiled HLO with {what}: {text}")


def _parse_line(line: str, computation: str, num_devices: int) -> HloCollective | None:
    """The collective ``line`` holds, or None when its instruction is no collective. Raises
    ``HloParseError`` when the line holds a collective opcode but its instruction (name, result
    shape, opcode) cannot be read: a collective is never skipped silently."""
    head = _INSTR_RE.match(line)
    if not head:
        if _holds_collective_op(line):
            raise _unparsable(line, "no 'name = shape' instruction head")
        return None
    try:
        shape, end = _parse_shape(line, head.end())
    except HloParseError:
        if _holds_collective_op(line):
            raise _unparsable(line, "an unparsable result shape") from None
        return None
    op = _OPCODE_RE.match(line, end)
    if not op:
        if _holds_collective_op(line):
            raise _unparsable(line, "no opcode right after its result shape")
        return None
    opcode = op.group(1)
    is_async = opcode.endswith("-start")
    kind = opcode.removesuffix("-start") if is_async else opcode
    if kind not in _KINDS:
        return None
    if is_async and kind != CollectiveKind.ALL_REDUCE.value and isinstance(shape, list) \
            and len(shape) >= 2:
        shape = shape[1]  # (operands, results[, context]) -> results
    results = tuple(_flatten(shape))
    attrs = line[bracket_end(line, op.end() - 1, "(", ")"):]
    attrs = attrs.split("metadata={", 1)[0]
    groups: tuple[tuple[int, ...], ...] | None = None
    pairs: tuple[tuple[int, int], ...] | None = None
    if kind == CollectiveKind.COLLECTIVE_PERMUTE.value:
        found = re.search(r"source_target_pairs=\{((?:\s*\{\s*\d+\s*,\s*\d+\s*\},?)*)\s*\}", attrs)
        text = found.group(1) if found else ""
        pairs = tuple((int(a), int(b)) for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", text))
        group_size = 2
    else:
        found = re.search(r"replica_groups=", attrs)
        groups = parse_replica_groups(attrs[found.end():]) if found else None
        group_size = len(groups[0]) if groups else num_devices
    result_bytes = sum(_array_bytes(dtype, dims) for dtype, dims in results)
    scale = group_size if kind in (CollectiveKind.REDUCE_SCATTER.value,
                                   CollectiveKind.ALL_TO_ALL.value) else 1
    return HloCollective(kind=kind, is_async=is_async, name=head.group(1),
                         result_shapes=results, nbytes=result_bytes * scale,
                         replica_groups=groups, group_size=group_size,
                         source_target_pairs=pairs, computation=computation)


def parse_collectives(hlo_text: str, num_devices: int | None = None) -> list[HloCollective]:
    """Every collective instruction in ``hlo_text``, in text order.

    ``num_devices`` is the group size used for ``replica_groups={}``; by default it is
    ``num_partitions x replica_count`` from the module header.
    """
    devices = num_devices if num_devices is not None else _module_devices(hlo_text)
    found: list[HloCollective] = []
    computation = ""
    for raw in hlo_text.splitlines():
        line = _COMMENT_RE.sub("", raw)
        comp = _COMPUTATION_RE.match(line)
        if comp and " = " not in line.split("(", 1)[0]:
            computation = comp.group(1)
            continue
        if not _QUICK_RE.search(line):
            continue
        collective = _parse_line(line, computation, devices)
        if collective is not None:
            found.append(collective)
    return found


@dataclass
class CollectiveSummary:
    """Counts and bytes of collectives by kind."""

    collectives: list[HloCollective] = field(default_factory=list)

    def count(self, kind: CollectiveKind | str) -> int:
        """Number of collectives of ``kind``."""
        kind = CollectiveKind(kind).value
        return sum(1 for c in self.collectives if c.kind == kind)

    def bytes(self, kind: CollectiveKind | str) -> int:
        """Total ``nbytes`` of collectives of ``kind``."""
        kind = CollectiveKind(kind).value
        return sum(c.nbytes for c in self.collectives if c.kind == kind)

    def by_kind(self) -> dict[str, dict[str, int]]:
        """``{kind: {"count": n, "bytes": b}}`` for every kind (zeros included)."""
        return {k: {"count": self.count(k), "bytes": self.bytes(k)} for k in _KINDS}

    @property
    def total_count(self) -> int:
        """Number of collectives of all kinds."""
        return len(self.collectives)

    @property
    def total_bytes(self) -> int:
        """Sum of ``nbytes`` over all collectives."""
        return sum(c.nbytes for c in self.collectives)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"total_count": self.total_count, "total_bytes": self.total_bytes,
                "by_kind": self.by_kind(),
                "collectives": [c.to_dict() for c in self.collectives]}


def count_collectives(hlo_text: str, num_devices: int | None = None,
                      per_run: bool = False) -> CollectiveSummary:
    """Summary of :func:`parse_collectives`: static (a collective in a while loop's body
    counts once), or with ``per_run`` as one run of the program executes them (each counted
    as many times as its computation runs, :func:`computation_runs`)."""
    found = parse_collectives(hlo_text, num_devices)
    if per_run:
        runs = computation_runs(hlo_text)
        found = [c for c in found for _ in range(runs.get(c.computation, 1))]
    return CollectiveSummary(found)
