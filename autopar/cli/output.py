"""What ``autopar compile`` and ``autopar show`` both write: the report and its files.

``emit_report`` prints the text report and writes the files the options name: ``--json`` (the
report document, which ``autopar show`` reads back), ``--swimlane`` (PNG of the pipeline
schedule), ``--html`` (one self-contained page) and ``--mesh-png`` (the device mesh coloured by
stage). Every failure to write is one line naming the file.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from autopar.errors import InvalidOptionError
from autopar.report.text import CompileReport, plan_timeline

logger = logging.getLogger(__name__)


def emit_report(report: CompileReport, args: argparse.Namespace) -> None:
    """Print ``report`` and write the output files named by ``args``."""
    print(report.to_text())
    if args.swimlane:
        write_swimlane(report, args.swimlane)
    if args.json_path:
        write_text(args.json_path, json.dumps(report.to_dict(), indent=2), "--json")
    if args.html_path:
        from autopar.report.html import save_html

        save_html(report, args.html_path)
        _wrote(args.html_path, "--html")
    if args.mesh_png:
        from autopar.report.pictures import save_mesh_png

        save_mesh_png(report.plan, args.mesh_png)
        _wrote(args.mesh_png, "--mesh-png")


def write_swimlane(report: CompileReport, path: str) -> None:
    """The plan's estimated pipeline schedule as a PNG swimlane."""
    plan = report.plan
    timeline = plan_timeline(plan)
    if timeline is None or plan.pipeline is None:  # (a timeline: a pipelined plan)
        raise InvalidOptionError(
            f"--swimlane draws a pipeline schedule; this plan ({plan.method}, "
            f"{len(plan.stages)} stage(s)) has none"
        )
    from autopar.report.swimlane import save_swimlane_png

    title = f"{report.model}: {plan.pipeline.schedule}"
    try:
        save_swimlane_png(timeline, path, title=title)
    except OSError as exc:
        raise InvalidOptionError(f"cannot write --swimlane file '{path}': "
                                 f"{exc.strerror or exc}") from exc
    _wrote(path, "--swimlane")


def write_text(path_text: str, text: str, flag: str) -> None:
    """Write ``text`` to the file an option names; one line when that fails."""
    path = Path(path_text)
    try:
        path.write_text(text)
    except OSError as exc:
        raise InvalidOptionError(f"cannot write {flag} file '{path}': {exc.strerror}") from exc
    _wrote(path, flag)


def _wrote(path: str | Path, flag: str) -> None:
    logger.debug("%s: wrote %s", flag, path)
    print(f"wrote {path}")
