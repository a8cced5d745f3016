"""The ``autopar`` command.

``autopar compile --model gpt --size tiny --devices 8 --mesh 2x4 --method data`` traces a zoo
model's train step, plans it and prints the report; ``--cluster NAME`` plans for a described
cluster instead of the local devices. Every user error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from autopar.errors import AutoparError, InvalidOptionError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and an AutoparError, not usage text + exit."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise InvalidOptionError(f"{message}; see 'autopar {self.prog.split()[-1]} --help'")


def build_parser() -> argparse.ArgumentParser:
    from autopar import __version__

    parser = _Parser(prog="autopar", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"autopar {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    c = sub.add_parser("compile", help="trace, plan and report a zoo model's train step")
    c.add_argument("--model", default="gpt", help="zoo model: mlp, gpt, moe, wresnet")
    c.add_argument("--size", default="tiny", help="model size (tiny, or the Alpa sizes)")
    c.add_argument("--batch-size", type=int, default=None, help="override the global batch")
    c.add_argument("--layers", type=int, default=None, help="override the number of layers")
    c.add_argument(
        "--method", default="pipeshard",
        help="parallelization method: pipeshard (default: the full search of stages, submeshes "
             "and intra-operator plans), shard, data",
    )
    c.add_argument("--mesh", default=None, help="logical mesh shape, e.g. 2x4 or 8")
    c.add_argument(
        "--devices", type=int, default=None,
        help="simulate N CPU devices when no accelerator is present (default 8)",
    )
    c.add_argument("--cluster", default=None, help="plan for a described cluster (name or JSON)")
    c.add_argument("--hosts", type=int, default=None, help="number of hosts of --cluster")
    c.add_argument("--json", dest="json_path", default=None, help="write plan + report as JSON")
    c.add_argument("--no-hlo", action="store_true", help="skip compiling the sharded program")
    c.add_argument("--dump-ilp", default=None, help="write the sharding ILP instance as JSON")
    c.add_argument("--solver", default="auto", help="ILP solver: auto, highs, cbc")
    c.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit (seconds)")
    c.add_argument(
        "--memory-budget", type=float, default=None, help="per-device memory budget in GiB"
    )
    p = c.add_argument_group("pipeline (--method pipeshard)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step")
    p.add_argument("--schedule", default="1f1b",
                   help="gpipe, 1f1b, interleaved-1f1b, zb-h1")
    p.add_argument("--stages", default="auto", help="auto (the stage DP) or uniform")
    p.add_argument("--num-stages", type=int, default=None, help="fix the number of stages")
    p.add_argument("--pipeline-layers", default="auto",
                   help="layers to cluster the loss forward into: auto, marked, or a number")
    p.add_argument("--swimlane", default=None, help="write the schedule's swimlane as PNG")
    return parser


def _set_local_devices(count: int) -> None:
    """Ask for ``count`` simulated CPU devices; must run before JAX touches a backend."""
    import jax

    if count < 1:
        raise InvalidOptionError(f"--devices must be at least 1, got {count}")
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        present = jax.device_count()
        if present != count and jax.devices()[0].platform == "cpu":
            raise InvalidOptionError(
                f"--devices {count} asked for after JAX started with {present} devices; "
                f"pass --devices {present} or start a new process"
            ) from None


def run_compile(args: argparse.Namespace) -> int:
    from autopar.compiler.mesh import load_cluster, parse_mesh_shape
    from autopar.compiler.planner import plan_step
    from autopar.compiler.trace import trace_step
    from autopar.methods import method_from_name
    from autopar.models import get_model
    from autopar.report import CompileReport

    overrides = {"num_layers": args.layers} if args.layers is not None else {}
    model = get_model(args.model, args.size, batch_size=args.batch_size, **overrides)
    mesh_shape = parse_mesh_shape(args.mesh) if args.mesh else None
    shard_options = {"solver": args.solver, "time_limit_s": args.time_limit}
    if args.memory_budget is not None:
        shard_options["memory_budget_bytes"] = args.memory_budget * 2**30
    if args.method == "pipeshard":
        method = _pipeshard_method(args)
    else:
        method = method_from_name(
            args.method, mesh_shape, **(shard_options if args.method == "shard" else {})
        )
    if args.cluster is not None:
        cluster = load_cluster(args.cluster)
        if args.hosts is not None:
            cluster = cluster.with_hosts(args.hosts)
    else:
        _set_local_devices(args.devices if args.devices is not None else 8)
        from autopar.api import local_cluster

        cluster = local_cluster()
    start = time.perf_counter()
    if args.method == "pipeshard":
        return _compile_pipeshard(args, model, method, cluster, start)
    traced = trace_step(model.train_step, model.abstract_inputs())
    dumped: list[str] = []

    def dump_ilp(problem: object, solution: object) -> None:
        from autopar.compiler.ilp import problem_to_json

        dumped.append(problem_to_json(problem, solution))

    plan = plan_step(
        traced, method, cluster, batch_argnums=(1,),
        ilp_observer=dump_ilp if args.dump_ilp else None,
    )
    compile_time = time.perf_counter() - start
    hlo = None
    if args.cluster is None and not args.no_hlo:
        from autopar.hlo import count_collectives
        from autopar.runtime.shard import ShardedProgram

        executable = ShardedProgram(traced.program, plan)
        text = executable.hlo_text(
            [leaf for leaf in _leaves(model.abstract_inputs())]
        )
        hlo = count_collectives(text).by_kind()
    report = CompileReport.build(
        model=f"{args.model} {args.size}",
        plan=plan,
        graph=traced.graph,
        num_params=model.num_params(),
        compile_time_s=compile_time,
        hlo_collectives=hlo,
    )
    print(report.to_text())
    if args.dump_ilp:
        if not dumped:
            raise InvalidOptionError(
                f"--dump-ilp needs an ILP; method '{args.method}' solves none (use --method shard)"
            )
        _write(args.dump_ilp, dumped[-1], "--dump-ilp")
    if args.json_path:
        _write(args.json_path, json.dumps(report.to_dict(), indent=2), "--json")
    return 0


def _pipeshard_method(args: argparse.Namespace):
    from autopar.methods import PipeshardParallel

    layers: int | str = args.pipeline_layers
    if isinstance(layers, str) and layers.isdigit():
        layers = int(layers)
    options = {"solver": args.solver, "time_limit_s": args.time_limit}
    if args.memory_budget is not None:
        options["memory_budget_bytes"] = args.memory_budget * 2**30
    return PipeshardParallel(
        num_microbatches=args.microbatches, layers=layers, stages=args.stages,
        schedule=args.schedule, num_stages=args.num_stages, **options,
    )


def _compile_pipeshard(args: argparse.Namespace, model, method, cluster, start: float) -> int:
    """Plan the zoo model as a pipeline: it differentiates with autopar.value_and_grad."""
    import autopar
    from autopar.compiler.pipeshard import plan_pipeshard
    from autopar.compiler.trace import trace_step
    from autopar.pipeline_program import build_pipeline_program
    from autopar.report import CompileReport, plan_timeline

    if args.mesh:
        raise InvalidOptionError("--mesh applies to --method shard/data; pipeshard chooses a "
                                 "logical mesh per stage")
    marked = model.with_value_and_grad(autopar.value_and_grad)
    inputs = marked.abstract_inputs()
    pp = build_pipeline_program(marked.train_step, inputs, (1,), method.num_microbatches)
    plan = plan_pipeshard(pp, method, cluster)
    compile_time = time.perf_counter() - start
    graph = trace_step(model.train_step, inputs).graph
    report = CompileReport.build(
        model=f"{args.model} {args.size}", plan=plan, graph=graph,
        num_params=model.num_params(), compile_time_s=compile_time,
    )
    print(report.to_text())
    if args.swimlane:
        from autopar.swimlane import save_swimlane_png

        title = f"{args.model} {args.size}: {plan.options['pipeline']['schedule']}"
        try:
            save_swimlane_png(plan_timeline(plan), args.swimlane, title=title)
        except OSError as exc:
            raise InvalidOptionError(f"cannot write --swimlane file '{args.swimlane}': "
                                     f"{exc.strerror}") from exc
        print(f"wrote {args.swimlane}")
    if args.dump_ilp:
        raise InvalidOptionError("--dump-ilp needs --method shard (pipeshard solves one ILP "
                                 "per layer and mesh)")
    if args.json_path:
        _write(args.json_path, json.dumps(report.to_dict(), indent=2), "--json")
    return 0


def _write(path_text: str, text: str, flag: str) -> None:
    path = Path(path_text)
    try:
        path.write_text(text)
    except OSError as exc:
        raise InvalidOptionError(f"cannot write {flag} file '{path}': {exc.strerror}") from exc
    print(f"wrote {path}")


def _leaves(tree: object) -> list:
    import jax

    return jax.tree_util.tree_leaves(tree)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        if args.command == "compile":
            return run_compile(args)
        raise InvalidOptionError(f"unknown command '{args.command}'; valid commands: compile")
    except AutoparError as exc:
        print(f"autopar: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
