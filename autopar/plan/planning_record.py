"""How a plan was found: the :class:`PlanningRecord` of planning times, the stage search's
statistics and the candidates compared, which only reports and benchmarks read (nothing runs
from it), and its strict JSON form (a field of the plan's, ``planning``).
"""

from __future__ import annotations

from collections.abc import Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

from autopar.plan.fields import (
    JsonField,
    dump_fields,
    field_of,
    load_fields,
    object_of,
    optional,
    string,
)


@dataclass(frozen=True)
class PlanningRecord:
    """How the plan was found, for reports and benchmarks only (nothing runs from it).

    ``planning_time_s``: seconds from the traced step to the plan. ``phases``: those seconds
    split by phase (pipelined plans: ``layers_s``, ``stage_costs_s``, ``stage_dp_s``,
    ``stage_plans_s``, ``total_s``). ``stage_search``: the stage DP's statistics.
    ``estimated_idle_fraction`` / ``theoretical_idle_fraction``: the pipeline's bubble under
    the cost model and as (p - 1) / (m + p - 1). ``method_options``: the options the method
    was given. ``baseline``: the hand plan a benchmark built this as, if any.
    ``candidates``: the plans the search compared, each a JSON object with at least ``name``,
    ``method`` and ``est_step_time_s`` (None when it could not be planned; ``note`` says why)
    and ``chosen``. ``estimate``: the parts of ``est_step_time_s`` (seconds per step:
    ``compute_s``, ``communication_s`` and ``runtime_s`` for one program; ``schedule_s``,
    ``tails_s``, ``before_s`` and ``host_s`` for a pipeline).
    """

    planning_time_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    stage_search: dict[str, Any] | None = None
    estimated_idle_fraction: float | None = None
    theoretical_idle_fraction: float | None = None
    method_options: dict[str, Any] = field(default_factory=dict)
    baseline: str | None = None
    candidates: Sequence[dict[str, Any]] = ()
    estimate: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates", tuple(self.candidates))

    def to_dict(self) -> dict[str, Any]:
        return dump_fields(self, RECORD_JSON)

    @classmethod
    def from_dict(cls, d: Any, where: str = "planning") -> PlanningRecord:
        d = field_of({"v": d}, "v", lambda v: object_of(v, "a planning record"), where)
        return cls(**load_fields(d, RECORD_JSON, where))




def _candidates(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise TypeError(f"a list of candidates, got {type(value).__name__}")
    out = []
    for i, item in enumerate(value):
        entry = dict(object_of(item, f"candidates[{i}]"))
        for name in ("name", "method"):
            if not isinstance(entry.get(name), str):
                raise TypeError(f"candidates[{i}].{name} must be a string")
        est = entry.get("est_step_time_s")
        if est is not None and (isinstance(est, bool) or not isinstance(est, int | float)):
            raise TypeError(f"candidates[{i}].est_step_time_s must be a number or null")
        out.append(entry)
    return out


def _phases(value: Any) -> dict[str, float]:
    return {str(k): float(x) for k, x in object_of(value, "phases").items()}


def _object(what: str) -> Any:
    return lambda value: dict(object_of(value, what))


# PlanningRecord's JSON form, field by field (``fields.JsonField``): every field may be left out;
# nested values are written as copies (the record's own stay the record's)
RECORD_JSON = (
    JsonField("planning_time_s", optional(float), default=None),
    JsonField("phases", _phases, dict, {}),
    JsonField("stage_search", optional(_object("stats")), deepcopy, None),
    JsonField("estimated_idle_fraction", optional(float), default=None),
    JsonField("theoretical_idle_fraction", optional(float), default=None),
    JsonField("method_options", _object("options"), deepcopy, {}),
    JsonField("baseline", optional(string), default=None),
    JsonField("candidates", _candidates, lambda rows: deepcopy(list(rows)), ()),
    JsonField("estimate", _object("estimate"), deepcopy, {}),
)
