"""Measured candidates: where the full search plans for the devices the step runs on, its few
best candidates are compiled and timed there, and the fastest measured is kept, unless it is
within ``CLOCK_MARGIN`` of the search's choice (then the clock cannot tell them apart and the
choice stays).

The cost model ranks plans; on the present devices the clock can check that ranking for the
price of a few compiles. The search's own choice is timed beside its ``DataParallel()`` and
``ShardParallel()`` plans (a step must never run slower than the simple plans autopar itself
would have given), then the next one-stage plans by estimate, up to
``AutoParallel.measure_candidates``. Each runs on zeros of the step's input shapes, placed in
its own layouts before every timed call (so donated buffers are fresh and the placement is not
timed): two calls each to compile and warm up, then rounds calling each in turn (a change in
the machine's load falls on all alike; as many as take about a second, 5 to 40), each one's
median kept. The planning
record gets each measured time beside its estimate, and a note says what was kept and why.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from autopar.ir.program import FlatProgram
from autopar.ir.schedules import is_async
from autopar.plan import MethodName, Plan
from autopar.runtime.executables import StepExecutable, build_executable

# Timed rounds after the warm-up calls of each candidate (the first compiles): each round calls
# every candidate once, in turn, so that a change in the machine's load falls on all of them
# alike; each one's median is kept. As many rounds as fit in ``MEASURED_SECONDS`` (by the
# warm-up calls' times), at least ``MIN_ROUNDS`` and at most ``MAX_ROUNDS``: on XLA:CPU's
# simulated devices two runs of the same step differ by 5-20%, and the zoo's tiny steps take
# milliseconds, so they get more rounds than a step of seconds.
WARMUP_CALLS = 2
MIN_ROUNDS, MAX_ROUNDS = 5, 40
MEASURED_SECONDS = 1.0
# Another candidate replaces the search's choice only when measured faster by more than this
# fraction: closer than that, the medians of the same plans swap places from run to run on
# XLA:CPU's simulated devices. On 2 devices (2026-12-07) GPT tiny's ZeRO-2 plan was measured
# 4% faster than the search's ShardParallel plan and kept; the benchmark then timed it 25%
# slower, and its own interleaved runs 20-40% slower.
CLOCK_MARGIN = 0.03
# The simple plans by their candidate names: ``DataParallel()`` and ``ShardParallel()``, the
# plans a user would try by hand. Both are always timed.
SIMPLE_CANDIDATES = (MethodName.DATA, MethodName.SHARD)


@dataclass(frozen=True)
class Candidate:
    """A plan the search made, with the program its ids name (and its pipeline cut)."""

    name: str
    plan: Plan
    program: FlatProgram
    pipeline: Any = None  # ir.pipeline_program.PipelineProgram of a pipelined plan


@dataclass(frozen=True)
class MeasuredChoice:
    """What timing the candidates decided: the plan kept (its planning record updated), the
    candidate it came from, its executable (already compiled) and each candidate's median
    seconds per step by name."""

    plan: Plan
    kept: Candidate
    executable: StepExecutable
    seconds: dict[str, float]


def to_measure(chosen: Candidate, others: Sequence[Candidate], count: int) -> list[Candidate]:
    """The candidates timed: ``chosen`` first, then the simple plans (``SIMPLE_CANDIDATES``),
    then the other one-stage plans by estimate, ``count`` in all; a plan under two
    names (the search's choice is also its own candidate's) once; never an asynchronous
    pipeline (its driver carries state from call to call)."""
    picked = [chosen]
    seen = {id(chosen.plan)}
    ranked = sorted((c for c in others if c.plan.pipeline is None),
                    key=lambda c: c.plan.est_step_time_s)
    simple = [next((c for c in ranked if c.name == name), None)
              for name in SIMPLE_CANDIDATES]
    for c in [*[c for c in simple if c is not None], *ranked]:
        if len(picked) >= count:
            break
        if id(c.plan) not in seen:
            picked.append(c)
            seen.add(id(c.plan))
    if chosen.plan.pipeline is not None and is_async(chosen.plan.pipeline.schedule):
        picked = picked[:1]  # not timed: kept as the search chose it
    return picked[:max(count, 1)]


def _zeros(template: Sequence[Any]) -> list[Any]:
    """Host zeros shaped as each flat input (an array or a ``jax.ShapeDtypeStruct``); a
    Python scalar stays as it is."""
    return [np.zeros(np.shape(a), a.dtype) if hasattr(a, "dtype") else a for a in template]


def time_executables(executables: Sequence[StepExecutable], template: Sequence[Any],
                     rounds: int | None = None) -> list[float]:
    """Median seconds of one call of each of ``executables`` on zeros shaped as
    ``template``: each called ``WARMUP_CALLS`` times first (the first compiles), then
    ``rounds`` rounds (default: by ``MEASURED_SECONDS``) calling each once in turn; the
    inputs are placed anew before every call, untimed."""

    def call(executable: StepExecutable) -> float:
        # a pipeline's driver places each stage's inputs itself (``place`` leaves them)
        placed = executable.place(_zeros(template))
        jax.block_until_ready(placed)
        start = time.perf_counter()
        jax.block_until_ready(executable(placed))
        return time.perf_counter() - start

    warm = [0.0] * len(executables)
    for _ in range(WARMUP_CALLS):
        warm = [call(e) for e in executables]
    if rounds is None:
        per_round = max(sum(warm), 1e-6)
        rounds = min(MAX_ROUNDS, max(MIN_ROUNDS, math.ceil(MEASURED_SECONDS / per_round)))
    times: list[list[float]] = [[] for _ in executables]
    for _ in range(rounds):
        for executable, own in zip(executables, times, strict=True):
            own.append(call(executable))
    return [statistics.median(own) for own in times]


def choose_by_clock(chosen: Candidate, others: Sequence[Candidate], template: Sequence[Any],
                    devices: Sequence[Any], donated: Sequence[bool], count: int
                    ) -> MeasuredChoice:
    """Time ``to_measure``'s candidates on ``devices`` and keep the fastest (see the module
    docstring); the kept plan carries the search's record, each timed row with its
    ``measured_step_time_s``."""
    timed = to_measure(chosen, others, count)
    executables = {c.name: build_executable(c.plan, c.program, c.pipeline, devices, donated)
                   for c in timed}
    seconds = dict(zip(executables, time_executables(list(executables.values()), template),
                       strict=True))
    kept = kept_by_clock(chosen, timed, seconds)
    return MeasuredChoice(_record(chosen, kept, seconds), kept, executables[kept.name],
                          seconds)


def kept_by_clock(chosen: Candidate, timed: Sequence[Candidate],
                  seconds: dict[str, float]) -> Candidate:
    """The fastest of ``timed`` by ``seconds`` (median per candidate name), or ``chosen``
    when that is not faster than it by more than ``CLOCK_MARGIN``."""
    fastest = min(timed, key=lambda c: seconds[c.name])
    if seconds[fastest.name] >= seconds[chosen.name] * (1.0 - CLOCK_MARGIN):
        return chosen
    return fastest


def _record(chosen: Candidate, kept: Candidate, seconds: dict[str, float]) -> Plan:
    """``kept``'s plan carrying the search's planning record (``chosen``'s), with the
    measured times in its candidate rows and a note on what the clock decided."""
    record = chosen.plan.planning
    chosen_row = next((r for r in record.candidates if r.get("chosen")), None)
    chosen_label = chosen_row["name"] if chosen_row is not None else chosen.plan.method.value
    label = {chosen.name: chosen_label}
    rows = []
    for row in record.candidates:
        row = dict(row)
        name = chosen.name if row.get("chosen") else row.get("name")
        if name in seconds and (name != chosen.name or row.get("chosen")):
            row["measured_step_time_s"] = seconds[name]
        if kept is not chosen:
            row["chosen"] = row.get("name") == kept.name
        rows.append(row)
    order = ", ".join(f"{label.get(n, n)} {s * 1e3:.3g} ms" for n, s in
                      sorted(seconds.items(), key=lambda item: item[1]))
    if kept is chosen:
        fastest = min(seconds, key=seconds.__getitem__)
        verdict = ("the search's choice is the fastest" if fastest == chosen.name else
                   f"kept the search's choice: {label.get(fastest, fastest)} is within "
                   f"{CLOCK_MARGIN:.0%} of it")
        note = f"measured on these devices (medians of steps run in turn): {order}; {verdict}"
        return chosen.plan.noted(note, first=True).with_planning(candidates=rows)
    estimated = kept.plan.est_step_time_s / chosen.plan.est_step_time_s
    note = (f"measured on these devices (medians of steps run in turn): "
            f"{order}; kept {kept.name}, estimated {estimated:.2f}x the search's choice "
            f"({chosen_label}) but measured "
            f"{seconds[chosen.name] / seconds[kept.name]:.2f}x faster")
    plan = kept.plan
    options = dict(record.method_options)
    options["chosen"] = plan.method.value
    options["chosen_options"] = plan.planning.method_options
    # the search's notes (what it compared, what it could not plan), then the kept plan's own
    notes = (note, *chosen.plan.notes, *[n for n in plan.notes if n not in chosen.plan.notes])
    return replace(plan, notes=notes).with_planning(
        candidates=rows, method_options=options, planning_time_s=record.planning_time_s,
        phases=record.phases)


def search_candidates(plan: Plan, program: FlatProgram, pipeline: Any,
                      found: dict[str, Any]) -> tuple[Candidate, list[Candidate]]:
    """The full search's choice (``plan`` of ``program``) and its other candidates that fit
    and may be kept, from ``found`` (``PlannedProgram``s by name, as the search returns
    them)."""
    rows = {r.get("name"): r for r in plan.planning.candidates}
    names = [n for n, p in found.items() if p.plan is plan]
    chosen = Candidate(names[0] if names else "chosen", plan, program, pipeline)
    others = [Candidate(name, p.plan, p.traced.program, p.pipeline)
              for name, p in found.items()
              if p.plan is not plan and rows.get(name, {}).get("fits")
              and rows.get(name, {}).get("eligible", True)]
    return chosen, others


def measured_chooser(method: Any, template: Sequence[Any], devices: Sequence[Any],
                     donated: Sequence[bool], timed: dict[int, Any]) -> Callable[[Any], Any]:
    """The ``choose`` hook of ``frontend.planning.plan_train_step`` for a step about to run
    on ``devices``: given a plan made afresh with its candidates (a ``PlannedStep``), the
    measured choice (``choose_by_clock``) as a ``PlannedStep``, its compiled executable in
    ``timed`` by its plan's id. It times nothing unless ``method`` asks for it
    (``AutoParallel.measure_candidates``), the run is one process (every process would have
    to time alike and agree) and there are candidates to compare. ``template``: the step's
    flat inputs (arrays or shapes)."""
    count = getattr(method, "measure_candidates", 0)

    def choose(found: Any) -> Any:
        if not count or jax.process_count() > 1 or not found.candidates:
            return found
        chosen, others = search_candidates(found.plan, found.traced.program, found.pipeline,
                                           found.candidates)
        choice = choose_by_clock(chosen, others, template, devices, donated, count)
        timed[id(choice.plan)] = choice.executable
        kept = found.candidates.get(choice.kept.name)
        if kept is None or choice.kept is chosen:
            return dataclasses.replace(found, plan=choice.plan)
        return dataclasses.replace(found, traced=kept.traced, plan=choice.plan,
                                   pipeline=kept.pipeline)

    return choose
