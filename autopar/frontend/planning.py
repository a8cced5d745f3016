"""From a train step and its arguments to a Plan: the shell around the compiler shared by the
decorator and the CLI.

``plan_train_step`` is its two halves, ``trace_train_step`` then ``plan_traced``: the plan comes
from the saved plan it was given (checked against the step), or from the on-disk cache, or from
the compiler (``compiler.planners.dispatch``: trace, then plan), in that order. It touches no
devices: the caller builds the executable (``runtime/``) from what it returns.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from autopar.cluster import ClusterSpec
from autopar.compiler.graph.trace import TracedStep, trace_step
from autopar.compiler.planners import dispatch
from autopar.compiler.planners.status import PlanningStatus
from autopar.compiler.planners.step_program import StepProgram
from autopar.errors import InvalidOptionError, PlanError, TraceError
from autopar.frontend.static_leaves import (
    StaticOutputs,
    array_leaves,
    is_array_leaf,
    split_leaves,
)
from autopar.ir.flatten import argument_names, leaf_path
from autopar.methods import Method
from autopar.plan import Plan


@dataclass
class PlannedStep:
    """A traced step and its plan; ``pipeline`` is the pipeline cut when the plan is pipelined."""

    traced: TracedStep
    plan: Plan
    pipeline: Any = None  # autopar.ir.pipeline_program.PipelineProgram
    from_cache: bool = False
    # the full search's candidates, by name (``PlannedProgram``s): planned afresh only
    candidates: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StaticBinding:
    """A step with its static parts bound: ``fn(*dynamic_args)`` is ``step(*all arguments)``
    with the static arguments (``static_argnums``) and the static (non-array) leaves of the
    other arguments put back, returning the outputs' array leaves only (``outputs`` puts their
    static leaves back; see ``autopar.frontend.static_leaves``)."""

    fn: Callable
    dynamic_args: tuple[Any, ...]  # each with None in place of its static leaves
    batch_argnums: tuple[int, ...]  # positions among the dynamic arguments
    dynamic_argnums: tuple[int, ...] = ()  # positions of the dynamic arguments in the call
    outputs: StaticOutputs = field(default_factory=StaticOutputs)

    def array_inputs(self, args: Sequence[Any]) -> list[Any]:
        """The flat inputs of the traced program for a call with ``args`` (same signature)."""
        return [leaf for i in self.dynamic_argnums for leaf in array_leaves(args[i])]


def bind_static_args(
    step: Callable, args: Sequence[Any], static_argnums: Sequence[int],
    batch_argnums: Sequence[int],
) -> StaticBinding:
    """Close ``step`` over the arguments at ``static_argnums`` and over the non-array leaves of
    the other arguments (their values are part of the input signature, as with ``jax.jit``'s
    static arguments and ``eqx.filter_jit``'s non-array leaves); the bound function keeps the
    names of the dynamic parameters, so plans still name leaves ``state/params/w``.

    A batch argument must be arrays only (``TraceError`` naming the first leaf that is not).
    """
    static = set(static_argnums)
    for i in static_argnums:
        if i >= len(args):
            raise InvalidOptionError(f"static_argnums names argument {i} but the step was "
                                     f"called with {len(args)} argument(s)")
    if static & set(batch_argnums):
        raise InvalidOptionError(f"argument(s) {sorted(static & set(batch_argnums))} are in both "
                                 "static_argnums and batch_argnums; a batch must be arrays")
    names = argument_names(step, len(args))
    for i in batch_argnums:
        if i < len(args):
            _check_batch_leaves(names[i], args[i])
    dynamic_positions = [i for i in range(len(args)) if i not in static]
    fixed = {i: args[i] for i in static}
    splits = {i: split_leaves(args[i])[0] for i in dynamic_positions}
    dynamic_args = tuple(
        splits[i].arrays_only(jax.tree_util.tree_leaves(args[i]), f"argument '{names[i]}'")
        if splits[i].has_static else args[i]
        for i in dynamic_positions)
    outputs = StaticOutputs()

    def bound(*dynamic: Any) -> Any:
        merged = dict(fixed)
        for i, arg in zip(dynamic_positions, dynamic, strict=True):
            # the traced leaves of `arg` are the array leaves of args[i], in order
            merged[i] = splits[i].merge(jax.tree_util.tree_leaves(arg)) \
                if splits[i].has_static else arg
        return outputs.record(step(*(merged[i] for i in range(len(args)))))

    bound.__name__ = getattr(step, "__name__", "train_step")
    try:
        params = list(inspect.signature(step).parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        kept = [positional[i] for i in dynamic_positions if i < len(positional)]
        # what inspect.signature reads first; functions' type does not declare it
        bound.__signature__ = inspect.Signature(kept)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        pass  # no signature: leaves are named arg0, arg1, ...
    remap = {old: new for new, old in enumerate(dynamic_positions)}
    return StaticBinding(bound, dynamic_args, tuple(remap[i] for i in batch_argnums),
                         tuple(dynamic_positions), outputs)


def _check_batch_leaves(name: str, batch: Any) -> None:
    """A batch is split by data parallelism and into microbatches: every leaf must be an array."""
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if not is_array_leaf(leaf):
            shown = f" ({leaf!r})" if isinstance(leaf, (str, int, float, bool)) \
                and len(repr(leaf)) <= 40 else ""
            raise TraceError(
                f"batch leaf '{leaf_path(name, keypath)}' is a {type(leaf).__name__}{shown}, not "
                "an array; a batch must be a pytree of arrays (non-array leaves are static only "
                "in the other arguments)")


def plan_train_step(
    fn: Callable,
    args: Sequence[Any],
    method: Method,
    cluster: ClusterSpec,
    *,
    batch_argnums: tuple[int, ...],
    fall_back_to_shard: bool = False,
    saved_plan: Plan | None = None,
    cache: Any = None,
    ilp_observer: Callable[[Any, Any], None] | None = None,
    status: PlanningStatus | None = None,
    choose: Callable[[PlannedStep], PlannedStep] | None = None,
) -> PlannedStep:
    """Trace ``fn(*args)`` and plan it with ``method`` on ``cluster``: ``trace_train_step``,
    then ``plan_traced`` (the arguments as there)."""
    traced = trace_train_step(fn, args, method, batch_argnums=batch_argnums,
                              fall_back_to_shard=fall_back_to_shard, saved_plan=saved_plan)
    return plan_traced(traced, cluster, cache=cache, ilp_observer=ilp_observer, status=status,
                       choose=choose)


@dataclass(frozen=True)
class TracedTrainStep:
    """A train step traced for planning: the compiler's program of it (``step``), or, given a
    saved plan, that plan already checked against the trace and cut as it says (``saved``).
    ``fn`` and ``args``: what was traced (a cached plan made from the rematerialised step is
    traced again with its cuts)."""

    fn: Callable
    args: tuple[Any, ...]
    batch_argnums: tuple[int, ...]
    step: StepProgram | None = None
    saved: PlannedStep | None = None

    @property
    def traced(self) -> TracedStep:
        """The traced program and its OpGraph."""
        if self.saved is not None:
            return self.saved.traced
        assert self.step is not None, "one of step and saved is set"
        return self.step.traced


def trace_train_step(
    fn: Callable,
    args: Sequence[Any],
    method: Method,
    *,
    batch_argnums: tuple[int, ...],
    fall_back_to_shard: bool = False,
    saved_plan: Plan | None = None,
) -> TracedTrainStep:
    """Trace ``fn(*args)`` for ``method`` (``compiler.planners.dispatch.trace``).

    ``fall_back_to_shard``: when the method is the default full search and the step cannot be
    pipelined (no ``autopar.value_and_grad``, or a batch the microbatches do not divide), plan
    one stage with the intra-operator pass instead, with a note in the plan.
    ``saved_plan``: the plan to run instead of planning: the step is traced as the plan was
    made (its pipeline cut, its recomputation) and checked against it (``PlanError``).
    """
    if saved_plan is not None:
        return TracedTrainStep(fn, tuple(args), batch_argnums,
                               saved=_with_saved_plan(fn, args, saved_plan, batch_argnums))
    step = dispatch.trace(fn, args, method, batch_argnums, fall_back_to_shard=fall_back_to_shard)
    return TracedTrainStep(fn, tuple(args), batch_argnums, step=step)


def plan_traced(
    traced: TracedTrainStep,
    cluster: ClusterSpec,
    *,
    cache: Any = None,
    ilp_observer: Callable[[Any, Any], None] | None = None,
    status: PlanningStatus | None = None,
    choose: Callable[[PlannedStep], PlannedStep] | None = None,
) -> PlannedStep:
    """The plan of a traced step on ``cluster``: the saved plan it was traced with, else the
    on-disk cache's, else the compiler's (``compiler.planners.dispatch.plan``).

    ``cache``: an ``autopar.frontend.plan_cache.PlanCache`` to take the plan from, keyed by the
    traced program, method, cluster and batch arguments, and to store a new plan in.
    ``ilp_observer(problem, solution)``: called with each one-stage sharding ILP solved
    (``--dump-ilp``; the cache is then not read). ``status``: what the planner is doing, kept
    up to date for a progress display to show. ``choose``: given a plan made afresh (with its
    candidates), the plan to keep and cache instead (the caller's measured choice: this
    module touches no devices).
    """
    if traced.saved is not None:
        return traced.saved
    step = traced.step
    assert step is not None, "a traced step without a saved plan has its program"
    if status is not None:
        step.status = status
    key = None if ilp_observer is not None else _cache_key(cache, step, cluster)
    cached = _cached_plan(cache, key, step.traced)
    if cached is not None:
        if cached.remat_positions is not None or cached.attention_kernel:
            # its ids name the rematerialised trace, or the one with the attention kernel
            step = dispatch.trace_for_plan(traced.fn, traced.args, cached,
                                           traced.batch_argnums)
        program, pipeline = step.parts_for(cached)
        if cached.is_pipelined and pipeline is None:  # a foreign entry: plan anew
            return _planned(step, cluster, cache, key, ilp_observer, choose)
        return PlannedStep(program, cached, pipeline, from_cache=True)
    return _planned(step, cluster, cache, key, ilp_observer, choose)


def _planned(step: StepProgram, cluster: ClusterSpec, cache: Any, key: str | None,
             ilp_observer: Callable[[Any, Any], None] | None,
             choose: Callable[[PlannedStep], PlannedStep] | None = None) -> PlannedStep:
    planned = dispatch.plan(step, cluster, ilp_observer=ilp_observer)
    found = PlannedStep(planned.traced, planned.plan, planned.pipeline,
                        candidates=dict(planned.candidates))
    if choose is not None:
        found = choose(found)
    _store(cache, key, found.plan)
    return found


def _cache_key(cache: Any, step: StepProgram, cluster: ClusterSpec) -> str | None:
    if cache is None:
        return None
    from autopar.frontend.plan_cache import cache_key, program_fingerprint

    fingerprint = "+".join(program_fingerprint(p) for p in step.programs)
    # the full search plans the user's committed layout too: it is part of what it planned
    return cache_key(fingerprint, method=step.method, cluster=cluster,
                     batch_argnums=step.batch_argnums, devices=None,
                     extra=None if step.annotations is None
                     else {"annotations": repr(step.annotations)})


def _cached_plan(cache: Any, key: str | None, traced: TracedStep) -> Plan | None:
    if key is None:
        return None
    plan = cache.get(key)
    if plan is None:
        return None
    try:  # a hash collision or a hand-edited entry must not run a foreign plan
        check_signature(plan, traced)
    except PlanError:
        return None
    return plan


def _store(cache: Any, key: str | None, plan: Plan) -> None:
    if key is not None:
        cache.put(key, plan)


def _with_saved_plan(
    fn: Callable, args: Sequence[Any], plan: Plan, batch_argnums: tuple[int, ...]
) -> PlannedStep:
    plan.check()  # a Plan built in code gets the checks a loaded one had
    if plan.is_pipelined:
        shapes = [getattr(leaf, "shape", ()) for i in batch_argnums if i < len(args)
                  for leaf in jax.tree_util.tree_leaves(args[i])]
        sizes = {int(shape[0]) for shape in shapes if shape}
        if len(sizes) == 1 and min(sizes) % plan.num_microbatches:
            raise PlanError(f"plan field num_microbatches={plan.num_microbatches} does not "
                            f"divide this step's batch size {min(sizes)}")
    elif plan.remat_positions is not None or plan.attention_kernel:
        # the signature is checked on the plain trace first: tracing with the plan's remat
        # cuts of another step would fail with a less helpful error
        check_signature(plan, trace_step(fn, args))
    step = dispatch.trace_for_plan(fn, args, plan, batch_argnums)
    check_signature(plan, step.traced)
    # a pipeline stage's value ids are the loss forward's (a pipelined plan's step is traced
    # with its pipeline cut: ``trace_for_plan``)
    _check_spec_ranks(plan, step.pipeline.forward if step.pipeline is not None
                      else step.traced.program)
    return PlannedStep(step.traced, plan, step.pipeline)


def _check_spec_ranks(plan: Plan, program: Any) -> None:
    """A spec of a value the program has must have one entry per dimension of that value:
    ``PlanError`` naming the field otherwise (a hand-edited plan), not an error from JAX."""
    outputs = dict(zip(program.out_paths, program.out_ids, strict=True))

    def check(where: str, vid: int | None, spec: Any) -> None:
        aval = program.avals.get(vid) if vid is not None else None
        shape = getattr(aval, "shape", None)
        if shape is not None and len(shape) != spec.ndim:
            raise PlanError(f"plan field {where} has {spec.ndim} dimension(s) but the value it "
                            f"shards has the shape {list(shape)}")

    for i, stage in enumerate(plan.stages):
        for vid, spec in stage.tensor_shardings.items():
            check(f"stages[{i}].tensor_shardings['{vid}']", vid, spec)
        for vid, spec in stage.cotangent_shardings.items():
            check(f"stages[{i}].cotangent_shardings['{vid}']", vid, spec)
        if plan.is_pipelined:
            continue  # the runner places outputs and operands without these
        for path, spec in stage.output_shardings.items():
            check(f"stages[{i}].output_shardings[{path!r}]", outputs.get(path), spec)
        for (node, operand), spec in stage.operand_shardings.items():
            inputs = program.eqns[node].inputs if 0 <= node < len(program.eqns) else ()
            read = inputs[operand] if 0 <= operand < len(inputs) else None
            check(f"stages[{i}].operand_shardings['{node}:{operand}']", read, spec)


def check_signature(plan: Plan, traced: TracedStep) -> None:
    """A saved plan names tensors of one trace: the step's inputs must be the plan's."""
    graph = traced.graph
    have = [(io.path, graph.tensors[io.tensor].shape, graph.tensors[io.tensor].dtype)
            for io in graph.inputs]
    want = [(s.path, tuple(s.shape), s.dtype) for s in plan.signature]
    if have == want:
        return
    if len(have) != len(want):
        raise PlanError(f"the plan does not match this step: it was made for {len(want)} input "
                        f"leaves, the step has {len(have)}")
    (hp, hs, hd), (wp, ws, wd) = next((h, w) for h, w in zip(have, want, strict=True) if h != w)
    raise PlanError(f"the plan does not match this step: input {hp!r} is {hd}{list(hs)} here "
                    f"but the plan has {wp!r} as {wd}{list(ws)}")
