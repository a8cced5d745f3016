"""The ``autopar`` command.

``autopar compile`` traces a train step, plans it and prints the report: a zoo model
(``--model gpt --size tiny``) or your own step (``autopar compile path/to/file.py:make_step``,
where ``make_step()`` returns ``(step, args)``); ``--cluster NAME`` plans for a described cluster
instead of the local devices. ``autopar show plan.json`` prints the report of a saved plan.
Every user error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn

from autopar.cli.options import add_log_level
from autopar.errors import AutoparError, InvalidOptionError, choices_text
from autopar.ir.schedules import ScheduleName
from autopar.methods import Solver

EXIT_USAGE = 2
LOG_FORMAT = "autopar: %(levelname)s: %(message)s"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and an AutoparError, not usage text + exit."""

    def error(self, message: str) -> NoReturn:
        raise InvalidOptionError(f"{message}; see 'autopar {self.prog.split()[-1]} --help'")


def build_parser() -> argparse.ArgumentParser:
    from autopar.version import __version__

    parser = _Parser(prog="autopar", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"autopar {__version__}")
    add_log_level(parser, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    c = sub.add_parser(
        "compile", help="trace, plan and report a train step (a zoo model or FILE.py:FUNCTION)",
        description="Trace, plan and report a train step: a zoo model (default: gpt tiny) or "
                    "the (step, args) returned by FUNCTION() in FILE.py.",
    )
    c.add_argument(
        "target", nargs="?", default=None, metavar="FILE.py:FUNCTION",
        help="plan your own step: FUNCTION() takes no arguments and returns (step, args); step "
             "is a train-step function or autopar.parallelize(...), args a tuple of arrays or "
             "jax.ShapeDtypeStruct pytrees (default: a zoo model, see --model)",
    )
    add_log_level(c, argparse.SUPPRESS)
    z = c.add_argument_group("zoo model (without a target)")
    z.add_argument("--model", default=None,
                   help="zoo model: mlp, gpt (default), moe, wresnet, llama; gpt-scan, "
                   "llama-scan: with their layers under jax.lax.scan")
    z.add_argument("--size", default=None, help="model size: tiny (default) or the Alpa sizes")
    z.add_argument("--batch-size", type=int, default=None, help="override the global batch")
    z.add_argument("--layers", type=int, default=None, help="override the number of layers")
    u = c.add_argument_group("your step (with a target)")
    u.add_argument(
        "--batch-argnums", default=None, metavar="I[,J...]",
        help="positional arguments holding the batch (default: the parallelize() step's, else 1)",
    )
    m = c.add_argument_group("method and devices")
    m.add_argument(
        "--method", default=None,
        help="auto (the full search: data, shard, zero2, zero3 and the pipelined stage search "
             "compared on one cost model), pipeshard (pipeline stages on submeshes with "
             "intra-operator plans), shard, data, zero2, zero3 (default: the step's "
             "parallelize(method=...), else auto, which leaves pipelines out for a step "
             "without autopar.value_and_grad)",
    )
    m.add_argument("--mesh", default=None,
                   help="logical mesh shape for shard/data/zero2/zero3, e.g. 2x4 or 8")
    m.add_argument("--degrees", default=None, metavar="DxTxP",
                   help="plan a hand configuration as given: data x tensor x pipeline degrees "
                        "(e.g. 32x2x1), with --microbatches, --schedule and --remat (default "
                        "layers); instead of --method")
    m.add_argument("--remat", default=None,
                   help="rematerialisation: none, layers (each layer under jax.checkpoint) or "
                        "auto (only where memory is short)")
    m.add_argument(
        "--devices", type=int, default=None,
        help="simulate N CPU devices when no accelerator is present (default 8)",
    )
    m.add_argument("--cluster", default=None, help="plan for a described cluster (name or JSON)")
    m.add_argument("--hosts", type=int, default=None, help="number of hosts of --cluster")
    m.add_argument("--no-hlo", action="store_true",
                   help="skip compiling on the local devices (the HLO's collectives, and "
                        "timing the full search's candidates there)")
    m.add_argument("--dump-ilp", default=None, metavar="FILE",
                   help="write the sharding ILP instance as JSON (--method shard)")
    m.add_argument("--solver", default=None,
                   help=f"ILP solver: {choices_text(Solver)} (default {Solver.AUTO})")
    m.add_argument("--time-limit", type=float, default=None,
                   help="ILP time limit in seconds (default 30)")
    m.add_argument("--memory-budget", type=float, default=None,
                   help="per-device memory budget in GiB")
    m.add_argument("--measure-candidates", type=int, default=None, metavar="N",
                   help="the full search on the present devices: how many candidate plans "
                        "to compile and time before keeping the fastest measured (default "
                        "3; 0: keep the estimate's choice)")
    m.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="planning seconds the full search may spend: the best plan found "
                        "within them, the report naming what was skipped")
    p = c.add_argument_group("pipeline (--method pipeshard, and auto's pipelined candidates)")
    p.add_argument("--planning-workers", type=int, default=None, metavar="N",
                   help="processes the stage search's layer ILPs are split over (default: "
                        "every core; 1: none forked); the plan is the same")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step (default 4)")
    p.add_argument("--schedule", default=None,
                   help=f"{choices_text(ScheduleName)}, or auto: the planner compares them "
                        f"(default {ScheduleName.ONE_F_ONE_B})")
    p.add_argument("--per-microbatch-statistics", action="store_true", default=None,
                   help="pipeline a step whose loss mixes the examples of its batch (batch "
                        "norm) with each microbatch's own statistics (GPipe's semantics: "
                        "another loss than the step's); without it such a step is not "
                        "pipelined")
    p.add_argument("--allow-async", action="store_true", default=None,
                   help="with --schedule auto, let the planner choose an asynchronous "
                        "schedule (pipedream, pipedream-2bw): it changes the training "
                        "algorithm")
    p.add_argument("--stages", default=None, help="auto (the stage DP; default) or uniform")
    p.add_argument("--num-stages", type=int, default=None, help="fix the number of stages")
    p.add_argument("--pipeline-layers", default=None,
                   help="layers to cluster the loss forward into: auto (default), marked, or a "
                        "number")
    _add_outputs(c)

    s = sub.add_parser(
        "show", help="print the report of a saved plan (Plan.save or 'compile --json')",
        description="Print the report of a saved plan: a file written by Plan.save or a report "
                    "written by 'autopar compile --json'.",
    )
    s.add_argument("plan_path", metavar="PLAN.json", help="the saved plan or --json report")
    add_log_level(s, argparse.SUPPRESS)
    _add_outputs(s)
    from autopar.cli.profile import add_profile_parser  # light: imports no JAX

    add_profile_parser(sub, _Parser)
    from autopar.cli.bench import add_bench_parser  # light: imports no JAX

    add_bench_parser(sub, _Parser)
    from autopar.cli.launch import add_launch_parser

    add_launch_parser(sub, _Parser)
    return parser


def _add_outputs(parser: argparse.ArgumentParser) -> None:
    o = parser.add_argument_group("output files")
    o.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                   help="write the report and the whole plan as JSON ('autopar show' reads it)")
    o.add_argument("--swimlane", default=None, metavar="FILE",
                   help="write the pipeline schedule's swimlane as PNG (pipelined plans)")
    o.add_argument("--html", dest="html_path", default=None, metavar="FILE",
                   help="write the report as one self-contained HTML file")
    o.add_argument("--mesh-png", default=None, metavar="FILE",
                   help="write the device mesh, coloured by stage, as PNG")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (tests swap it), clearing a progress
    line first when one is shown."""

    def __init__(self) -> None:
        super().__init__()
        self.progress = None  # an autopar.frontend.progress.Progress whose line to clear first

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass  # always sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        if self.progress is not None:
            self.progress.clear_line()
        super().emit(record)


@contextmanager
def cli_logging(level: str) -> Iterator[_StderrHandler]:
    """Log the ``autopar`` logger hierarchy at ``level`` and above to stderr as
    ``autopar: LEVEL: message`` for the duration of a command; restored afterwards."""
    logger = logging.getLogger("autopar")
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(getattr(logging, level.upper()))
    logger.propagate = False  # the command owns stderr: no second copy from the root logger
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def one_line(text: str) -> str:
    """An error message as one line (a multi-line message is joined with spaces)."""
    return re.sub(r"\s*\n\s*", " ", text.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        with cli_logging(getattr(args, "log_level", "warning")) as handler:
            if args.command == "compile":
                from autopar.cli.compile import run_compile

                return run_compile(args, handler)
            if args.command == "show":
                from autopar.cli.show import run_show

                return run_show(args)
            if args.command == "profile":
                from autopar.cli.profile import run_profile

                return run_profile(args)
            if args.command == "bench":
                from autopar.cli.bench import run_bench

                return run_bench(args, handler)
            if args.command == "launch":
                from autopar.cli.launch import run_launch

                return run_launch(args)
        raise InvalidOptionError(f"unknown command '{args.command}'; valid commands: compile, "
                                 "show, profile, bench, launch")
    except AutoparError as exc:
        print(f"autopar: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (``autopar compile ... | head``): stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout
        except (OSError, ValueError, AttributeError):
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
