"""Reading plan files of format version 1, where the pipeline layout, the rematerialised cuts
and the planning statistics lived in one free-form ``options`` dict beside the run statistics
(compile time, measured idle fraction) that the decorator wrote into it."""

from __future__ import annotations

from typing import Any

from autopar.errors import PlanError

# options keys of version 1 that are run statistics: they belong to the step, not the plan
_RUN_STATISTICS = ("compile_time_s", "measured_idle_fraction")
_RECORD_KEYS = ("planning_time_s", "stage_search", "estimated_idle_fraction",
                "theoretical_idle_fraction", "baseline")


def upgrade(d: dict[str, Any]) -> dict[str, Any]:
    """A version-1 plan dict as a version-2 one (the field checks then run on the result)."""
    out = dict(d)
    options = out.pop("options", {})
    if not isinstance(options, dict):
        raise PlanError(f"plan field options must be an object, got {type(options).__name__}")
    options = dict(options)
    pipeline = options.pop("pipeline", None)
    if isinstance(pipeline, dict):
        pipeline = dict(pipeline)
        pipeline.setdefault("remat_stages", [False] * len(out.get("stages", [])))
    out["pipeline"] = pipeline
    out["remat_positions"] = options.pop("remat_positions", None)
    for key in _RUN_STATISTICS:
        options.pop(key, None)
    record: dict[str, Any] = {k: options.pop(k) for k in _RECORD_KEYS if k in options}
    if "timings" in options:
        record["phases"] = options.pop("timings")
    record["method_options"] = options  # what is left: the method's own options
    out["planning"] = record
    out["format_version"] = 2
    return out
