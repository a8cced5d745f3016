"""Running a whole suite: every case and scaling point in order, rows written as they come,
then the Markdown page and the plots.

Output files in ``out_dir``, named after the suite: ``bench-{suite}.jsonl`` (one row per case
or scaling point), ``bench-{suite}.md`` and ``bench-{suite}-{plot}.png``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.bench.machine import load_average, machine_info
from autopar.bench.outputs import JsonlWriter, RunInfo, markdown_page
from autopar.bench.plots import write_plots
from autopar.bench.runner import Phase, RunOptions, run_case
from autopar.bench.scaling_point import run_scaling_point
from autopar.bench.suites import Suite
from autopar.errors import AutoparError

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class SuiteResult:
    """The rows of a run and the files written."""

    rows: tuple[dict[str, Any], ...]
    files: tuple[Path, ...]


DEFAULT_LOCAL_DEVICES = 8


def output_prefix(suite: Suite, devices: int = DEFAULT_LOCAL_DEVICES) -> str:
    """The stem every output file of ``suite`` shares: ``bench-local``, and
    ``bench-local-2-devices`` for a suite with local cases run on other than the default 8
    local devices (so that both runs' pages live side by side)."""
    local = any(case.local for case in suite.cases)
    if local and devices != DEFAULT_LOCAL_DEVICES:
        return f"bench-{suite.name}-{devices}-devices"
    return f"bench-{suite.name}"


def run_suite(suite: Suite, options: RunOptions, out_dir: str | os.PathLike, *,
              phase: Phase, echo: Callable[[str], None], command: str,
              calibrated_name: str | None = None) -> SuiteResult:
    """Run every case and scaling point of ``suite``; write the JSON lines (as each row is
    made), the Markdown page and the plots into ``out_dir``. ``phase`` shows progress (a
    ``Progress.phase``), ``echo`` gets one line per finished row."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = output_prefix(suite, options.devices)
    machine, load_before, start = machine_info(), load_average(), time.perf_counter()
    rows: list[dict[str, Any]] = []
    writer = JsonlWriter(out / f"{prefix}.jsonl")
    total = len(suite.cases) + len(suite.scaling)
    try:
        for i, case in enumerate(suite.cases, 1):
            try:
                row = run_case(case, options, _numbered(phase, i, total))
            except Exception as err:  # noqa: BLE001 (recorded; the run goes on, exit 1)
                row = {"kind": "case", "case": case.name, "model": case.model,
                       "where": "local" if case.local else "described",
                       "error": _failure(case.name, err)}
            row["suite"] = suite.name
            rows.append(row)
            writer.write(row)
            echo(_case_line(i, total, row))
        for i, point in enumerate(suite.scaling, len(suite.cases) + 1):
            try:
                row = run_scaling_point(point, _numbered(phase, i, total))
            except Exception as err:  # noqa: BLE001 (recorded; the run goes on, exit 1)
                row = {"kind": "scaling", "axis": point.axis.value, "case": point.name,
                       "error": _failure(point.name, err)}
            row["suite"] = suite.name
            rows.append(row)
            writer.write(row)
            echo(_scaling_line(i, total, row))
    finally:
        writer.close()
    with phase("writing the page and plots"):
        plots = write_plots(rows, out, prefix)
        info = RunInfo(suite=suite.name, command=command, machine=machine,
                       load_before=load_before, load_after=load_average(),
                       wall_s=time.perf_counter() - start, local_devices=options.devices,
                       calibrated=calibrated_name)
        page = out / f"{prefix}.md"
        page.write_text(markdown_page(rows, info, plots))
    return SuiteResult(tuple(rows), (writer.path, page, *plots))


def _failure(name: str, err: Exception) -> str:
    """One line for a failed case; an error that is not autopar's own (a bug, not bad input)
    is logged with its traceback, so a long run keeps the rows it made and still says where."""
    if isinstance(err, AutoparError):
        return " ".join(str(err).split())
    logger.warning("%s failed", name, exc_info=err)
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _numbered(phase: Phase, i: int, total: int) -> Phase:
    def numbered(name: str) -> Any:
        return phase(f"[{i}/{total}] {name}")

    return numbered


def _case_line(i: int, total: int, row: dict[str, Any]) -> str:
    if row.get("error"):
        return f"[{i}/{total}] {row['case']}: error: {row['error']}"
    measured = (row.get("measured") or {}).get("step_time_s")
    ran = f", measured {measured:.4g} s" if measured else ""
    return (f"[{i}/{total}] {row['case']}: planned in {row['planning']['total_s']:.1f} s, "
            f"{row['plan']['num_stages']} stage(s), est. {row['est_step_time_s']:.4g} s/step"
            f"{ran}")


def _scaling_line(i: int, total: int, row: dict[str, Any]) -> str:
    if row.get("error"):
        return f"[{i}/{total}] scaling {row['case']}: error: {row['error']}"
    return (f"[{i}/{total}] scaling {row['case']}: planned in {row['planning']['total_s']:.1f} "
            f"s, {row['ilp_solves']} ILP solves")
