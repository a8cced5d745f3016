"""``autopar compile``: plan a step (a zoo model or ``FILE.py:FUNCTION``) and report the plan.

Both kinds of step go through one path: a ``StepSource`` (``cli_sources``), the method from
``--method`` and its options (or the source's own), then ``frontend.planning.plan_train_step`` —
the very function ``autopar.parallelize`` plans with — and, for a plan on the local devices,
the compiled HLO's collectives counted beside the plan's: a one-stage plan's one program, or
every program of one pipelined step (run on zeros; ``runtime.pipeline_hlo``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from autopar.cli.output import emit_report, write_text
from autopar.cli.sources import StepSource, parse_argnums, user_source, zoo_source
from autopar.cluster import ClusterSpec
from autopar.compiler.graph.opgraph import OpGraph
from autopar.errors import InvalidOptionError
from autopar.frontend.progress import Progress
from autopar.method_builders import METHOD_NAMES, method_from_name, pinned
from autopar.methods import METHOD_TYPES, AutoParallel, Method, PipeshardParallel
from autopar.plan import MethodName, Plan

logger = logging.getLogger(__name__)

# The options that set a method's fields: (argparse dest, flag, field of the method dataclass).
METHOD_OPTIONS: tuple[tuple[str, str, str], ...] = (
    ("mesh", "--mesh", "mesh_shape"),
    ("solver", "--solver", "solver"),
    ("time_limit", "--time-limit", "time_limit_s"),
    ("memory_budget", "--memory-budget", "memory_budget_bytes"),
    ("microbatches", "--microbatches", "num_microbatches"),
    ("schedule", "--schedule", "schedule"),
    ("allow_async", "--allow-async", "allow_async"),
    ("stages", "--stages", "stages"),
    ("num_stages", "--num-stages", "num_stages"),
    ("pipeline_layers", "--pipeline-layers", "layers"),
    ("remat", "--remat", "remat"),
    ("time_budget", "--time-budget", "time_budget_s"),
    ("planning_workers", "--planning-workers", "planning_workers"),
    ("measure_candidates", "--measure-candidates", "measure_candidates"),
    ("per_microbatch_statistics", "--per-microbatch-statistics", "per_microbatch_statistics"),
)
# What --degrees takes besides the degrees (``method_builders.pinned``'s keywords).
PINNED_OPTIONS: frozenset[str] = frozenset(
    {"num_microbatches", "schedule", "remat", "memory_budget_bytes", "solver", "time_limit_s"})
_ZOO_OPTIONS = (("--model", "model"), ("--size", "size"), ("--layers", "layers"),
                ("--batch-size", "batch_size"))


@dataclass
class CompileResult:
    """A planned step: the plan, the graph the report describes, and what HLO needs."""

    plan: Plan
    graph: OpGraph
    compile_time_s: float
    program: Any = None  # the FlatProgram of a one-stage plan (None when pipelined)
    pipeline: Any = None  # the PipelineProgram of a pipelined plan (None otherwise)
    dynamic_args: tuple[Any, ...] = ()
    ilp_json: str | None = None


def run_compile(args: argparse.Namespace, log_handler: Any = None) -> int:
    """``autopar compile``; ``log_handler`` (the CLI's) clears the progress line it writes."""
    _check_mode_options(args)
    given = given_method_options(args)  # option errors before the user's file is run
    if args.degrees is not None:
        _pinned_method(args, given)
    elif args.method is not None:
        method_from_name(args.method)
    cluster, local = _cluster(args)  # local devices are set before the user's file starts JAX
    with Progress() as progress:
        if log_handler is not None:
            log_handler.progress = progress
        try:
            report, ilp_json = _compile(args, given, cluster, local, progress)
        finally:
            if log_handler is not None:
                log_handler.progress = None
    emit_report(report, args)
    if args.dump_ilp:
        if ilp_json is None:
            raise InvalidOptionError("--dump-ilp: the plan solved no ILP")
        write_text(args.dump_ilp, ilp_json, "--dump-ilp")
    return 0


def _compile(args: argparse.Namespace, given: dict[str, tuple[str, Any]], cluster: ClusterSpec,
             local: bool, progress: Progress) -> tuple[Any, str | None]:
    """Load the step, plan it, count its HLO collectives: the report and the ILP dumped."""
    from autopar.report.text import CompileReport

    if args.target is None:
        source = _source(args)
    else:
        with progress.phase(f"loading {args.target}"):
            source = _source(args)
    if args.method is not None and source.saved_plan is not None:
        logger.info("--method given: planning anew instead of the step's saved plan")
        source = dataclasses.replace(source, saved_plan=None)
    method, fall_back = resolve_method(args, source, given)
    if args.dump_ilp and source.saved_plan is not None:
        raise InvalidOptionError("--dump-ilp needs an ILP solved; the step runs a saved plan "
                                 "(parallelize(plan=...)): pass --method shard to plan anew")
    if args.dump_ilp and method.name is not MethodName.SHARD:
        raise InvalidOptionError(
            "--dump-ilp needs --method shard (pipeshard solves one ILP per layer and mesh)"
            if method.name is MethodName.PIPESHARD else
            "--dump-ilp needs --method shard (the full search plans several methods)"
            if isinstance(method, AutoParallel) else
            f"--dump-ilp needs an ILP; method '{method.name}' solves none (use --method shard)"
        )
    logger.info("planning %s with %s on %s (%d devices)", source.name, method, cluster.name,
                cluster.num_devices)
    result = plan_source(source, method, cluster, fall_back_to_shard=fall_back,
                         progress=progress, dump_ilp=bool(args.dump_ilp),
                         measure=local and not args.no_hlo)
    hlo, xla_memory, per_stage = None, None, None
    if result.program is not None and local and not args.no_hlo:
        with progress.phase("compiling HLO"):
            hlo, xla_memory = compiled_facts(result)
    elif result.pipeline is not None and local and not args.no_hlo:
        with progress.phase("running one pipelined step on zeros to count its collectives"):
            counted = pipeline_facts(result)
        hlo, per_stage = counted.by_kind(), counted.by_stage()
    report = CompileReport.build(
        model=source.name, plan=result.plan, graph=result.graph, num_params=source.num_params,
        compile_time_s=result.compile_time_s, hlo_collectives=hlo,
    )
    report.xla_memory_bytes = xla_memory
    report.hlo_stage_collectives = per_stage
    return report, result.ilp_json


def _check_mode_options(args: argparse.Namespace) -> None:
    if args.target is not None:
        given = [flag for flag, dest in _ZOO_OPTIONS if getattr(args, dest) is not None]
        if given:
            raise InvalidOptionError(
                f"{', '.join(given)} choose{'s' if len(given) == 1 else ''} a zoo model; the "
                f"target '{args.target}' brings its own step (drop {', '.join(given)} or the "
                "target)"
            )
    elif args.batch_argnums is not None:
        raise InvalidOptionError("--batch-argnums applies to a target FILE.py:FUNCTION; zoo "
                                 "models take the batch as argument 1")


def _source(args: argparse.Namespace) -> StepSource:
    if args.target is None:
        return zoo_source(args.model or "gpt", args.size or "tiny", args.batch_size, args.layers)
    batch = (parse_argnums(args.batch_argnums, "--batch-argnums")
             if args.batch_argnums is not None else None)
    return user_source(args.target, batch)


def _cluster(args: argparse.Namespace) -> tuple[ClusterSpec, bool]:
    """The cluster to plan for, and whether it is this process's devices."""
    from autopar.cluster import load_cluster

    if args.cluster is not None:
        cluster = load_cluster(args.cluster)
        if args.hosts is not None:
            cluster = cluster.with_hosts(args.hosts)
        return cluster, False
    set_local_devices(args.devices if args.devices is not None else 8)
    from autopar.runtime.local_cluster import local_cluster

    return local_cluster(), True


def set_local_devices(count: int) -> None:
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


def resolve_method(args: argparse.Namespace, source: StepSource,
                   given: dict[str, tuple[str, Any]]) -> tuple[Method, bool]:
    """The method to plan with, and whether a step that cannot be pipelined falls back to one
    shard stage. ``--method`` picks a method; otherwise the source's (a ``parallelize(method=
    ...)``, the zoo's full search), else the full search with that fallback. The method's
    options (``given``: ``--mesh``, ``--microbatches``, ...) then replace its fields."""
    if args.degrees is not None:
        return _pinned_method(args, given), False
    if args.method is not None:
        base, fall_back = method_from_name(args.method), False
    elif source.saved_plan is not None:
        if given:
            raise InvalidOptionError(
                f"{', '.join(flag for flag, _ in given.values())}: the step runs a saved plan "
                "(parallelize(plan=...)); pass --method as well to plan anew"
            )
        return _method_of_saved(source.saved_plan), False
    elif source.method is not None:
        base, fall_back = source.method, False
    else:
        base, fall_back = AutoParallel(), True
    fields = {f.name for f in dataclasses.fields(base)}
    pipeline_only = {f.name for f in dataclasses.fields(PipeshardParallel)} - fields
    if isinstance(base, AutoParallel) and args.method is None and set(given) & pipeline_only:
        # --stages / --num-stages ask for one pipeline: plan that rather than the full search
        base, fields = base.pipeline_method(), {f.name for f in dataclasses.fields(
            PipeshardParallel)}
    changes = {}
    for field, (flag, value) in given.items():
        if field not in fields:
            if field == "mesh_shape":
                raise InvalidOptionError("--mesh applies to --method shard/data/zero2/zero3; "
                                         "pipeshard and the full search (auto) choose the "
                                         "logical meshes")
            users = [m.name for m in METHOD_TYPES
                     if field in {f.name for f in dataclasses.fields(m)}]
            raise InvalidOptionError(f"{flag} applies to --method {'/'.join(users)}, not "
                                     f"{base.name}")
        changes[field] = value
    return dataclasses.replace(base, **changes), fall_back


def parse_degrees(text: str) -> tuple[int, int, int]:
    """``DxTxP`` (data x tensor x pipeline; ``DxT`` and ``D`` leave the rest 1) as three
    positive integers; InvalidOptionError (one line) otherwise."""
    parts = text.lower().split("x")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise InvalidOptionError(f"--degrees {text!r}: expected data x tensor x pipeline as "
                                 "positive integers, e.g. 32x2x1")
    d, t, p = ([int(x) for x in parts] + [1, 1])[:3]
    return d, t, p


def _pinned_method(args: argparse.Namespace, given: dict[str, tuple[str, Any]]) -> Method:
    """``method_builders.pinned`` at ``--degrees`` with the options it takes."""
    if args.method is not None:
        raise InvalidOptionError("--degrees pins the configuration: leave --method out")
    bad = [flag for field, (flag, _) in given.items() if field not in PINNED_OPTIONS]
    if bad:
        raise InvalidOptionError(f"{', '.join(bad)}: not an option of --degrees; valid: "
                                 "--microbatches, --schedule, --remat, --memory-budget, "
                                 "--solver, --time-limit")
    d, t, p = parse_degrees(args.degrees)
    return pinned(d, t, p, **{field: value for field, (_, value) in given.items()})


def given_method_options(args: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """field -> (flag, value) for every method option given on the command line."""
    from autopar.cluster import parse_mesh_shape

    out: dict[str, tuple[str, Any]] = {}
    for dest, flag, field in METHOD_OPTIONS:
        value = getattr(args, dest)
        if value is None:
            continue
        if dest == "mesh":
            value = parse_mesh_shape(value)
        elif dest == "memory_budget":
            value = value * 2**30
        elif dest == "pipeline_layers" and value.isdigit():
            value = int(value)
        out[field] = (flag, value)
    return out


def _method_of_saved(plan: Plan) -> Method:
    """A method of the saved plan's kind (plan_train_step takes the plan, not the method)."""
    return method_from_name(plan.method) if plan.method in METHOD_NAMES \
        else AutoParallel()


def plan_source(source: StepSource, method: Method, cluster: ClusterSpec, *,
                fall_back_to_shard: bool, progress: Progress, dump_ilp: bool = False,
                measure: bool = False) -> CompileResult:
    """Trace and plan ``source`` (``plan_train_step``, as ``autopar.parallelize`` does).
    ``measure``: the plan is for this process's devices, and the full search may time its
    candidates on them (``AutoParallel.measure_candidates``, as ``autopar.parallelize``
    does)."""
    from autopar.compiler.graph.trace import trace_step
    from autopar.compiler.planners.status import PlanningStatus
    from autopar.frontend.planning import bind_static_args, plan_train_step

    bound = bind_static_args(source.fn, source.args, source.static_argnums,
                             source.batch_argnums)
    start = time.perf_counter()
    ilp_json = None
    dumped: list[str] = []
    observer = None
    if dump_ilp:  # the same path as without it, remat and all; the last ILP solved is the plan's
        from autopar.compiler.intra_op.problem import problem_to_json

        def observer(problem: Any, solution: Any) -> None:
            dumped.append(problem_to_json(problem, solution))

    choose = None
    if measure:
        import jax

        from autopar.runtime.distributed import global_devices
        from autopar.runtime.measured_choice import measured_chooser

        choose = measured_chooser(method, jax.tree_util.tree_leaves(bound.dynamic_args),
                                  global_devices(), (), {})
    status = PlanningStatus()
    with progress.phase("tracing and planning", detail=status.describe):
        planned = plan_train_step(
            bound.fn, bound.dynamic_args, method, cluster,
            batch_argnums=bound.batch_argnums, fall_back_to_shard=fall_back_to_shard,
            saved_plan=source.saved_plan, cache=None, ilp_observer=observer, status=status,
            choose=choose,
        )
    traced, plan, pipeline = planned.traced, planned.plan, planned.pipeline
    ilp_json = dumped[-1] if dumped else None
    compile_time = time.perf_counter() - start
    logger.info("plan from %s: %s, %d stage(s), est. step time %.3g s",
                "the step's saved plan" if source.saved_plan is not None else "the planner",
                plan.method, len(plan.stages), plan.est_step_time_s)
    for note in plan.notes:
        logger.info("plan note: %s", note)
    graph = traced.graph
    if pipeline is not None:
        # the pipelined trace holds the loss function as one equation: the report describes
        # the whole step (forward, backward, update), as traced without the markers
        with progress.phase("tracing the whole step for the report"):
            graph = trace_step(bound.fn, bound.dynamic_args).graph
    return CompileResult(plan=plan, graph=graph, compile_time_s=compile_time,
                         program=traced.program if pipeline is None else None,
                         pipeline=pipeline,
                         dynamic_args=bound.dynamic_args, ilp_json=ilp_json)


def compiled_facts(result: CompileResult) -> tuple[dict[str, dict[str, int]], int | None]:
    """Compile the one-stage plan's sharded program: its collectives by kind, and the
    per-device bytes XLA's memory analysis gives it (arguments + outputs + temporaries - what
    outputs alias; None where the backend reports none)."""
    import jax

    from autopar.runtime.hlo import count_collectives
    from autopar.runtime.shard import ShardedProgram

    executable = ShardedProgram(result.program, result.plan)
    flat = jax.tree_util.tree_leaves(result.dynamic_args)
    counted = count_collectives(executable.hlo_text(flat), per_run=True).by_kind()
    logger.debug("HLO collectives: %s",
                 {k: v["count"] for k, v in counted.items() if v["count"]} or "none")
    m = executable.compiled(flat).memory_analysis()
    memory = None if m is None else int(
        m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
        - m.alias_size_in_bytes)
    return counted, memory


def pipeline_facts(result: CompileResult) -> Any:
    """Run one step of the pipelined plan on the local devices, on zeros shaped like the
    step's inputs (given arrays as they are), and count the collectives of every program it
    ran: a ``runtime.pipeline_hlo.StepCollectives``. Zeros are fine: what is counted depends
    on shapes and shardings, not values."""
    import jax
    import jax.numpy as jnp

    from autopar.runtime.distributed import global_devices
    from autopar.runtime.pipeline import PipelineRunner
    from autopar.runtime.pipeline_hlo import step_collectives

    runner = PipelineRunner.from_plan(result.pipeline, result.plan, global_devices())
    flat = [jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x
            for x in jax.tree_util.tree_leaves(result.dynamic_args)]
    return step_collectives(runner, flat)
