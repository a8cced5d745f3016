"""Reading a plan's JSON field by field: every missing, unknown or mistyped field is a one-line
``PlanError`` naming its place in the plan (``stages[0].device_ids``), never a traceback."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
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
