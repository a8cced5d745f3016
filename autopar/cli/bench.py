"""``autopar bench``: run a benchmark suite and write its results (see ``autopar.bench``).

``autopar bench --suite smoke --out DIR`` plans (and, for local cases, runs) every case of the
suite, shows progress on a terminal, prints one line per finished case and writes
``bench-{suite}.jsonl``, ``bench-{suite}.md`` and ``bench-{suite}-*.png`` into ``DIR``
(default ``docs/benchmarks``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from typing import Any

from autopar.bench.suites import SUITE_NAMES

DEFAULT_OUT = "docs/benchmarks"
PUBLISHED = "published"  # planned on described clusters only: its own runner


def add_bench_parser(sub: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    """Add the ``bench`` command to the ``autopar`` subparsers ``sub`` (made with
    ``parser_class``, the CLI's parser whose usage errors are one line)."""
    from autopar.cli.options import LOG_LEVELS

    b = sub.add_parser(
        "bench", help="run a benchmark suite: plans, baselines, timings; JSONL, Markdown, PNG",
        description="Run a benchmark suite: the full search against baselines on described "
                    "clusters (planned) and local devices (planned, run and timed); write "
                    "bench-SUITE.jsonl, bench-SUITE.md and bench-SUITE-*.png.",
    )
    b.add_argument("--suite", required=True, choices=(*SUITE_NAMES, PUBLISHED),
                   help="smoke (a minute: every code path), local (small models run here), "
                        "paper (Alpa sizes, described), scaling (planning time vs layers and "
                        "devices), full (local + paper + scaling), published (Megatron-LM's "
                        "Table 1 and Alpa's Figure 7 GPT runs at their sizes: the published "
                        "configuration pinned and the full search, beside the measurement)")
    b.add_argument("--runs", default=None, metavar="TEXT",
                   help="published suite: only the runs whose label contains TEXT")
    b.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="published suite: start no run after this many seconds (the page "
                        "lists the runs left)")
    b.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"directory for the results (default {DEFAULT_OUT})")
    b.add_argument("--calibrated", default=None, metavar="FILE",
                   help="a cluster JSON describing the local devices ('autopar profile'): "
                        "local cases are also estimated under it")
    b.add_argument("--devices", type=int, default=None, metavar="N",
                   help="simulate N CPU devices for local cases when no accelerator is "
                        "present (default 8)")
    b.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS,
                   help="log messages of this level and above to stderr (default warning)")


def run_bench(args: argparse.Namespace, log_handler: Any = None) -> int:
    """``autopar bench``; ``log_handler`` (the CLI's) clears the progress line it writes."""
    from autopar.bench.harness import run_suite
    from autopar.bench.runner import RunOptions
    from autopar.bench.suites import get_suite
    from autopar.cli.compile import set_local_devices
    from autopar.cluster import load_cluster

    if args.suite == PUBLISHED:
        return _run_published(args, log_handler)
    suite = get_suite(args.suite)
    calibrated = load_cluster(args.calibrated) if args.calibrated else None
    devices = args.devices if args.devices is not None else 8
    set_local_devices(devices)  # before JAX starts a backend
    options = RunOptions(devices=_check_devices(devices), calibrated=calibrated)
    command = f"autopar bench --suite {args.suite}"
    if args.devices is not None:
        command += f" --devices {devices}"
    if args.calibrated:
        command += f" --calibrated {shlex.quote(args.calibrated)}"
    result = _with_progress(log_handler, lambda progress, echo: run_suite(
        suite, options, args.out, phase=progress.phase, echo=echo, command=command,
        calibrated_name=args.calibrated))
    for path in result.files:
        print(f"wrote {path}")
    failed = [r["case"] for r in result.rows if r.get("error")]
    if failed:
        print(f"autopar: {len(failed)} case(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _run_published(args: argparse.Namespace, log_handler: Any = None) -> int:
    """``autopar bench --suite published``: planned only, on described clusters."""
    from autopar.bench.published import PUBLISHED_RUNS
    from autopar.bench.published_suite import run_suite
    from autopar.errors import InvalidOptionError

    runs = [r for r in PUBLISHED_RUNS if args.runs is None or args.runs in r.label]
    if not runs:
        raise InvalidOptionError(f"--runs {args.runs!r} matches no published run; labels: "
                                 + ", ".join(r.label for r in PUBLISHED_RUNS))
    command = f"autopar bench --suite {PUBLISHED}"
    if args.runs is not None:
        command += f" --runs {shlex.quote(args.runs)}"
    if args.stop_after is not None:
        command += f" --stop-after {args.stop_after:g}"
    files = _with_progress(log_handler, lambda progress, echo: run_suite(
        args.out, command=command, echo=echo, runs=runs, stop_after_s=args.stop_after))
    for path in files:
        print(f"wrote {path}")
    return 0


def _with_progress(log_handler: Any, run: Callable[[Any, Callable[[str], None]], Any]) -> Any:
    """``run(progress, echo)`` under a progress line that ``echo`` clears before each row it
    prints (and the CLI's ``log_handler`` before each log line)."""
    from autopar.frontend.progress import Progress

    with Progress() as progress:
        if log_handler is not None:
            log_handler.progress = progress

        def echo(line: str) -> None:
            progress.clear_line()
            print(line, flush=True)

        try:
            return run(progress, echo)
        finally:
            if log_handler is not None:
                log_handler.progress = None


def _check_devices(count: int) -> int:
    """``count``, if this process has that many devices (else a one-line error)."""
    import jax

    from autopar.errors import InvalidOptionError

    present = jax.device_count()
    if present < count:
        raise InvalidOptionError(f"--devices {count}: this process has {present} device(s)")
    return count
