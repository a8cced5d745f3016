"""Reading a plan's JSON field by field: every missing, unknown or mistyped field is a one-line
``PlanError`` naming its place in the plan (``stages[0].device_ids``), never a traceback."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.errors import PlanError
from autopar.plan.specs import ShardingSpec

REQUIRED = object()


def is_int(value: Any) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def string(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a string, got {type(value).__name__}")
    return value


def boolean(value: Any) -> bool:
    """``value``, a JSON true or false (TypeError for anything else)."""
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


def spec_map(key: Any) -> Any:
    """A converter of ``{key: spec JSON}`` to ``{key(k): ShardingSpec}``."""
    def convert(value: Any) -> dict[Any, ShardingSpec]:
        if not isinstance(value, dict):
            raise TypeError(f"an object of sharding specs, got {type(value).__name__}")
        out = {}
        for k, v in value.items():
            try:
                out[key(k)] = ShardingSpec.from_json(v)
            except PlanError as exc:  # a spec that uses an axis twice: name its key
                raise ValueError(f"[{k!r}] {exc}") from None
        return out
    return convert


def field_of(d: dict[str, Any], name: str, convert: Any, label: str,
           default: Any = REQUIRED) -> Any:
    """``convert(d[name])``; a missing field or one ``convert`` refuses is a one-line
    ``PlanError`` naming ``label`` (its place in the plan: ``stages[0].device_ids``)."""
    if name not in d:
        if default is REQUIRED:
            raise PlanError(f"plan is missing the field {label!r}")
        return default
    try:
        return convert(d[name])
    except PlanError:
        raise  # a nested field's own error (a stage's) names that field
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise PlanError(f"plan field {label} is invalid ({type(exc).__name__}: {reason})") \
            from None


def use_key(text: str) -> tuple[int, int]:
    node, operand = text.split(":")
    return int(node), int(operand)


def specs_to_json(specs: dict[Any, ShardingSpec]) -> dict[str, list[list[str]]]:
    return {str(k): v.to_json() for k, v in specs.items()}


def reject_unknown(d: dict[str, Any], known: Iterable[str], where: str) -> None:
    """A field this version does not know is an error, not silently dropped: a hand edit with
    a typo, or a plan from a newer autopar, must not run as something else."""
    unknown = sorted(set(d) - set(known))
    if unknown:
        place = f"{where}." if where else ""
        raise PlanError(f"plan field {place}{unknown[0]} is not a field of this plan format; "
                        f"valid fields: {', '.join(sorted(known))}")


def object_of(value: Any, what: str) -> dict[str, Any]:
    """``value`` if it is a JSON object (TypeError naming ``what`` otherwise)."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} is an object, got {type(value).__name__}")
    return value


Converter = Callable[[Any], Any]


def same(value: Any) -> Any:
    """A value written to JSON as it is."""
    return value


def listed(value: Any) -> list[Any]:
    """A tuple written as a JSON list."""
    return list(value)


def optional(convert: Converter) -> Converter:
    """``convert``, with None (JSON null) kept as None."""
    return lambda value: None if value is None else convert(value)


@dataclass(frozen=True)
class JsonField:
    """One field of a plan object's JSON form: how its value is read back (``load``, which
    refuses what it cannot read with a TypeError or ValueError) and written (``dump``), and
    the value a file that leaves it out gets (``default``; ``REQUIRED``: none, it must be
    there). A class's table names each of its fields once: its JSON form, both ways, and the
    fields a file may hold all come from it."""

    name: str
    load: Converter
    dump: Converter = same
    default: Any = REQUIRED


def dump_fields(obj: Any, table: Sequence[JsonField]) -> dict[str, Any]:
    """``obj``'s JSON object, field by field in the table's order."""
    return {f.name: f.dump(getattr(obj, f.name)) for f in table}


def load_fields(d: dict[str, Any], table: Sequence[JsonField], where: str,
                also: Iterable[str] = ()) -> dict[str, Any]:
    """The fields of the JSON object ``d`` read back by name (``where``: its place in the
    plan, for errors); a field neither in the table nor in ``also`` is an error
    (``reject_unknown``)."""
    reject_unknown(d, [*(f.name for f in table), *also], where)
    place = f"{where}." if where else ""
    return {f.name: field_of(d, f.name, f.load, f"{place}{f.name}", f.default) for f in table}
