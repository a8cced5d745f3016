"""``autopar.parallelize``: the decorator that traces, plans and runs a train step.

The first call with a new input signature (pytree structure, shapes, dtypes, static values)
traces the step, plans it for the local devices (or takes the plan from the on-disk cache) and
compiles it; later calls with the same signature reuse that.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax

from autopar.errors import InvalidOptionError
from autopar.frontend.static_leaves import signature_part
from autopar.ir.flatten import argument_names
from autopar.methods import METHOD_TYPES, AutoParallel, Method
from autopar.plan import Plan
from autopar.stages import Compiled, Traced, trace

if TYPE_CHECKING:
    from autopar.compiler.graph.trace import TracedStep
    from autopar.runtime.pipeline_hlo import StepCollectives

@dataclass(frozen=True)
class RunStatistics:
    """What running a plan measured (kept on the step, not in the plan, which stays as the
    compiler made it): ``compile_time_s`` (trace, plan or cache look-up, and building the
    executable), ``plan_from_cache``, and for pipelined steps the idle fraction measured by
    the last :meth:`ParallelizedStep.timed_call` (None before one)."""

    compile_time_s: float
    plan_from_cache: bool
    measured_idle_fraction: float | None = None


def _check_argnums(name: str, argnums: Sequence[int]) -> tuple[int, ...]:
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in argnums):
        raise InvalidOptionError(f"{name}={tuple(argnums)!r} must be non-negative argument indices")
    return tuple(argnums)


class ParallelizedStep:
    """A train step wrapped by :func:`parallelize`: call it like the original."""

    def __init__(
        self,
        fn: Callable,
        method: Method,
        batch_argnums: Sequence[int],
        devices: Sequence[Any] | None = None,
        plan: Plan | None = None,
        static_argnums: Sequence[int] = (),
        donate_argnums: Sequence[int] = (),
        cache: Any = None,  # autopar.frontend.plan_cache.PlanCache, or None: no on-disk cache
    ):
        if not callable(fn):
            raise InvalidOptionError(f"parallelize needs a function, got {type(fn).__name__}")
        if not isinstance(method, METHOD_TYPES):
            raise InvalidOptionError(
                f"method={method!r} is not a parallelization method; valid methods: "
                + ", ".join(f"autopar.{t.__name__}()" for t in METHOD_TYPES)
            )
        self.fn = fn
        self.method = method
        self.batch_argnums = _check_argnums("batch_argnums", batch_argnums)
        self.static_argnums = _check_argnums("static_argnums", static_argnums)
        self.donate_argnums = _check_argnums("donate_argnums", donate_argnums)
        for other, why in ((self.donate_argnums, "only arrays can be donated"),
                           (self.batch_argnums, "a batch must be arrays")):
            name = "donate_argnums" if other is self.donate_argnums else "batch_argnums"
            both = set(self.static_argnums) & set(other)
            if both:
                raise InvalidOptionError(f"argument(s) {sorted(both)} are in both static_argnums "
                                         f"and {name}; {why}")
        self.devices = None if devices is None else list(devices)
        self.cache = cache
        self._compiled_steps: dict[tuple, Compiled] = {}
        self._argument_names: dict[int, list[str]] = {}  # per argument count
        self.saved_plan = plan  # run this plan instead of planning (checked against each trace)
        self.method_defaulted = False  # parallelize() without method=: the full search
        # the step's name and docstring, not its attributes: a library's wrapper (Equinox's
        # filter_jit keeps its function in a field named ``fn``) would overwrite this
        # object's own
        functools.update_wrapper(self, fn, updated=())

    def signature_key(self, args: Sequence[Any]) -> tuple:
        """The input signature of a call with ``args``: static arguments by value; for the
        others the tree structure, each array leaf's shape and dtype and each non-array
        (static) leaf's type and value. A new signature traces, plans and compiles anew."""
        return self._signature(args, None)

    def _signature(self, args: Sequence[Any], arrays: list[Any] | None) -> tuple:
        """``signature_key``; ``arrays``, when given, gets the array leaves of the non-static
        arguments appended: the program's flat inputs, read in the same pass."""
        parts: list[Any] = []
        names = self._argument_names.get(len(args))
        if names is None:  # inspecting the signature on every call costs more than the rest
            names = self._argument_names[len(args)] = argument_names(self.fn, len(args))
        for i, arg in enumerate(args):
            if i in self.static_argnums:
                try:
                    hash(arg)
                except TypeError:
                    raise InvalidOptionError(
                        f"static argument {i} has unhashable type {type(arg).__name__}; static "
                        "arguments must be hashable (as with jax.jit)"
                    ) from None
                parts.append(("static", arg))
                continue
            parts.append(signature_part(names[i], arg, arrays))
        return tuple(parts)

    def trace(self, *args: Any) -> Traced:
        """Stage 1 of what a call does (``autopar.stages``): the step traced for these
        arguments' input signature (arrays or ``jax.ShapeDtypeStruct``); ``.plan()`` and then
        ``.compile()`` give the later stages. Each call traces anew; calling the step reuses
        what it compiled per signature."""
        for name, argnums in (("batch_argnums", self.batch_argnums),
                              ("static_argnums", self.static_argnums),
                              ("donate_argnums", self.donate_argnums)):
            if any(i >= len(args) for i in argnums):
                raise InvalidOptionError(
                    f"{name}={argnums} names argument {max(argnums)} but the step was called "
                    f"with {len(args)} argument(s)"
                )
        return trace(self, args, self.signature_key(args))

    def _compiled(self, args: Sequence[Any], key: tuple | None = None) -> Compiled:
        key = self.signature_key(args) if key is None else key
        found = self._compiled_steps.get(key)
        if found is None:
            found = self.trace(*args).plan().compile()
            self._compiled_steps[key] = found
        return found

    def __call__(self, *args: Any) -> Any:
        flat: list[Any] = []
        key = self._signature(args, flat)
        return self._compiled(args, key).run(args, flat=flat)

    def timed_call(self, *args: Any) -> tuple[Any, list[Any]]:
        """Run one step of a pipelined step with every task waited for and timed; returns the
        outputs and the task records (stage, kind, microbatch, start, end); the measured idle
        fraction is then in :meth:`run_statistics`."""
        compiled = self._compiled(args)
        if not compiled.executable.pipelined:
            raise InvalidOptionError("timed_call times pipeline tasks; this step is not "
                                     f"pipelined (method {compiled.plan.method})")
        from autopar.runtime.program_calls import measured_idle_fraction

        out = compiled.run(args, record=True)
        records = compiled.executable.records
        compiled.measured_idle_fraction = measured_idle_fraction(
            records, len(compiled.plan.stages))
        return out, records

    def get_plan(self, *args: Any) -> Plan:
        """The plan for these arguments (arrays or ``jax.ShapeDtypeStruct``)."""
        return self._compiled(args).plan

    def input_shardings(self, *args: Any) -> list[jax.sharding.Sharding]:
        """Where the plan for these arguments (arrays or ``jax.ShapeDtypeStruct``) wants each
        array leaf of the non-static arguments, in ``jax.tree_util.tree_leaves`` order
        (``autopar.runtime.input_layouts``; a checkpoint's restore target:
        :func:`autopar.restore_target`). The step accepts its inputs in any layout."""
        compiled = self._compiled(args)
        return compiled.executable.input_shardings(compiled.flat_inputs(args))

    def run_statistics(self, *args: Any) -> RunStatistics:
        """What was measured for these arguments' signature (see :class:`RunStatistics`)."""
        compiled = self._compiled(args)
        return RunStatistics(compiled.compile_time_s, compiled.from_cache,
                             compiled.measured_idle_fraction)

    def plan_was_cached(self, *args: Any) -> bool:
        """Whether the plan for these arguments came from the on-disk cache."""
        return self._compiled(args).from_cache

    def get_hlo_text(self, *args: Any) -> str:
        """The compiled, optimized HLO text of the sharded program for these arguments."""
        compiled = self._compiled(args)
        if compiled.executable.pipelined:
            raise InvalidOptionError(
                "get_hlo_text covers one sharded program; a pipelined step compiles one "
                "program per stage task (see get_plan for its stages)"
            )
        return compiled.executable.hlo_text(compiled.flat_inputs(args))

    def get_hlo_collectives(self, *args: Any) -> dict[str, dict[str, int]]:
        """The collectives one step emits, counted in its compiled HLO: per kind (every kind
        listed), ``{"count": n, "bytes": b}`` (bytes in the cost model's full-tensor
        convention, as the plan's ``StagePlan.collectives``), each counted as often as one
        run executes it (a scanned layer's, once per layer). A one-stage step is one program
        (compiled, not run); a pipelined step runs one step on these arguments (real arrays)
        and counts every program its driver ran, each times its calls
        (``autopar.runtime.pipeline_hlo``); its stages apart: ``pipeline_collectives``."""
        compiled = self._compiled(args)
        if not compiled.executable.pipelined:
            from autopar.runtime.hlo import count_collectives

            return count_collectives(self.get_hlo_text(*args), per_run=True).by_kind()
        return self.pipeline_collectives(*args).by_kind()

    def pipeline_collectives(self, *args: Any) -> StepCollectives:
        """A pipelined step's collectives per program and stage, from one step run on these
        arguments: an ``autopar.runtime.pipeline_hlo.StepCollectives``."""
        compiled = self._compiled(args)
        return compiled.executable.collectives(compiled.flat_inputs(args))

    def get_traced(self, *args: Any) -> TracedStep:
        """The traced program and its OpGraph for these arguments."""
        return self._compiled(args).traced


def parallelize(
    fn: Callable | None = None,
    *,
    method: Method | None = None,
    batch_argnums: Sequence[int] = (1,),
    static_argnums: Sequence[int] = (),
    donate_argnums: Sequence[int] = (),
    devices: Sequence[Any] | None = None,
    plan: Plan | str | os.PathLike | None = None,
    cache: bool | str | os.PathLike = True,
) -> Any:
    """Parallelize a train step over the local devices.

    ``step = autopar.parallelize(train_step, method=autopar.DataParallel())``; usable bare
    (``@autopar.parallelize``), with arguments (``@autopar.parallelize(method=...)``) or as a
    function call.

    ``method``: without it the full automatic search runs (``AutoParallel()``: data
    parallelism, the intra-operator ILP, ZeRO-2/3 and the pipelined stage search, each planned
    on the same cost model, the fastest plan that fits kept; the plan records the method that
    made it and the candidates compared); a step that does not differentiate with
    ``autopar.value_and_grad`` / ``autopar.grad`` is not pipelined, with a note in the plan.
    ``batch_argnums``: the positional arguments that hold the batch (split by data
    parallelism and into microbatches); the rest is state.
    ``static_argnums``: arguments that are not arrays (flags, config): their values are part of
    the input signature, as with ``jax.jit``; they must be hashable.
    Non-array leaves of the other arguments (an Equinox module's activation functions, ints,
    bools, strings; Python scalars too) are static as with ``eqx.filter_jit``: their values are
    part of the input signature (a new value re-plans) and must be hashable; only array leaves
    are traced. Outputs may hold non-array leaves too (an updated ``eqx.Module``): they come
    back as the step returned them when traced. A batch argument must be arrays only.
    ``donate_argnums``: arguments whose buffers the step may reuse (typically the train state);
    after the call they are deleted, as with ``jax.jit``.
    ``devices``: restrict the step to these devices (default: all of this process's).
    ``plan``: a saved ``Plan`` (or the path of one, from ``Plan.save``) to run without
    planning; each new input signature is checked against it (a one-line ``PlanError`` when it
    does not match).
    ``cache``: the on-disk plan cache: ``True`` (default: the user cache directory, or
    ``$AUTOPAR_CACHE_DIR``), a directory, or ``False`` to plan every time.
    """
    from autopar.frontend.plan_cache import PlanCache, check_cache_dir

    saved = Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
    if saved is not None and not isinstance(saved, Plan):
        raise InvalidOptionError(f"plan= takes an autopar.Plan or a path to a saved plan, got "
                                 f"{type(saved).__name__}")
    if saved is not None and method is not None and not isinstance(method, AutoParallel) \
            and method.name != saved.method:
        raise InvalidOptionError(f"method={type(method).__name__}() but the plan was made by "
                                 f"method '{saved.method}'; pass one of them")
    if cache is True:
        plan_cache = PlanCache()
    elif cache is False or cache is None:
        plan_cache = None
    elif isinstance(cache, (str, os.PathLike)):
        plan_cache = PlanCache(check_cache_dir(cache))
    else:
        raise InvalidOptionError(f"cache= takes True, False or a directory, got "
                                 f"{type(cache).__name__}")
    chosen = method if method is not None else AutoParallel()

    def wrap(f: Callable) -> ParallelizedStep:
        step = ParallelizedStep(f, chosen, batch_argnums, devices, saved, static_argnums,
                                donate_argnums, plan_cache)
        step.method_defaulted = method is None
        return step

    return wrap if fn is None else wrap(fn)
