"""Running plans on the local devices: the only part of the harness that touches devices.

Every plan runs through ``autopar.parallelize(step, plan=..., cache=False)`` on real arrays
(the plan is the one the harness made, so nothing is planned twice); the single-device
baseline is plain ``jax.jit`` on the first device. A step time is the median of several calls
after warm-up calls (the first compiles), each waited for with ``jax.block_until_ready``.
Steps are called as a training loop calls them (:class:`TrainingLoop`): the state a step
returned goes back into the next, already on the devices in the plan's layout, and the batch
comes from the host each time. Passing the initial host-side state to every call instead
would time moving the whole state onto the devices, which no training step pays.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autopar.bench.hand_accumulation import HandStep
from autopar.models import ZooModel
from autopar.plan import Plan, PlanningRecord


@dataclass(frozen=True)
class Timing:
    """Measured step times (seconds) and the collectives of the compiled program."""

    step_times_s: tuple[float, ...]
    warmup_steps: int
    first_call_s: float  # the first warm-up call: compilation included
    hlo_collectives: dict[str, dict[str, int]] | None = None
    hlo_note: str = ""
    # a pipelined plan's: the measured step over the sum of its tasks' measured times (each
    # task waited for, ``ParallelizedStep.timed_call``); 1 when the driver adds nothing
    task_compute_s: float | None = None

    @property
    def runtime_overhead(self) -> float | None:
        """The median step over its tasks' summed compute (None: not pipelined)."""
        if not self.task_compute_s:
            return None
        return self.median_s / self.task_compute_s

    @property
    def median_s(self) -> float:
        """The median of the timed steps."""
        return statistics.median(self.step_times_s)

    def to_dict(self) -> dict[str, Any]:
        """The row's ``measured`` entry."""
        return {
            "step_time_s": self.median_s,
            "step_times_s": list(self.step_times_s),
            "warmup_steps": self.warmup_steps,
            "first_call_s": self.first_call_s,
            "hlo_collectives": self.hlo_collectives,
            "hlo_note": self.hlo_note,
            "task_compute_s": self.task_compute_s,
            "runtime_overhead": self.runtime_overhead,
        }


@dataclass(frozen=True)
class LocalInputs:
    """Real arrays for one model: its initial state and a batch, on the default device."""

    state: Any
    batch: Any


def make_inputs(model: ZooModel, seed: int = 0) -> LocalInputs:
    """The model's initial state and a random batch."""
    import jax

    key_state, key_batch = jax.random.split(jax.random.key(seed))
    return LocalInputs(model.init_state(key_state), model.make_batch(key_batch))


class TrainingLoop:
    """A zero-argument call of ``step(state, batch)`` that keeps the state it returns (the
    first output) for the next call, as a training loop does."""

    def __init__(self, step: Callable, state: Any, batch: Any) -> None:
        self.step, self.state, self.batch = step, state, batch

    def __call__(self) -> Any:
        out = self.step(self.state, self.batch)
        self.state = out[0]
        return out


def time_calls(call: Callable[[], Any], warmup: int, repeats: int) -> tuple[float, list[float]]:
    """The first call's seconds and ``repeats`` timed calls after ``warmup`` calls (at least
    one: the first compiles), each waited for."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(call())
    first = time.perf_counter() - start
    for _ in range(max(0, warmup - 1)):
        jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return first, times


# Timed calls of a pipelined step whose tasks' times are summed (the median sum is kept).
TASK_TIMING_CALLS = 3


def task_compute_s(step: Any, plan: Plan, loop: TrainingLoop,
                   calls: int = TASK_TIMING_CALLS) -> float | None:
    """A pipelined plan's tasks' summed measured time per step, each task waited for (the
    median over ``calls`` timed steps of ``ParallelizedStep.timed_call``, the state carried
    on as the loop carries it); None for a one-stage plan, which has no tasks."""
    if plan.pipeline is None:
        return None
    sums = []
    for _ in range(calls):
        out, records = step.timed_call(loop.state, loop.batch)
        loop.state = out[0]
        sums.append(sum(r.end_s - r.start_s for r in records))
    return statistics.median(sums)


def measure_plan(step_fn: Callable, plan: Plan, inputs: LocalInputs, devices: Sequence[Any],
                 warmup: int, repeats: int) -> Timing:
    """Run ``plan`` for ``step_fn(state, batch)`` on ``devices``: the step times, and the
    collectives counted in its compiled HLO (a pipelined plan's: every program of one more
    step, each times its calls)."""
    import autopar

    step = autopar.parallelize(step_fn, plan=plan, devices=list(devices), cache=False)
    loop = TrainingLoop(step, inputs.state, inputs.batch)
    first, times = time_calls(loop, warmup, repeats)
    counted = step.get_hlo_collectives(inputs.state, inputs.batch)
    return Timing(tuple(times), warmup, first, counted, task_compute_s=task_compute_s(
        step, plan, loop))


# Interleaved timing: each plan gets this many times the case's timed steps, one step of each
# plan in turn.
MEASURE_ROUNDS = 4


def measure_plans(step_fn: Callable, plans: dict[str, Plan], inputs: LocalInputs,
                  devices: Sequence[Any], warmup: int, repeats: int,
                  rounds: int = MEASURE_ROUNDS,
                  hand_steps: Mapping[str, HandStep] | None = None) -> dict[str, Timing]:
    """Time several plans of one step together: each is built and warmed up first, then
    ``rounds * repeats`` rounds each time one step of every plan in turn, so that a change in
    the machine's load falls on all of them alike (a shared machine's load moves within
    seconds). Each plan's ``Timing`` holds all its timed steps and its HLO's collectives (a
    pipelined plan's: every program of one more step, after the timing) and, pipelined, its
    tasks' summed time (``task_compute_s``: a few more steps, every task waited for).
    ``hand_steps``: steps compiled outside autopar (``hand_accumulation.HandStep``), timed in
    the same rounds under their names."""
    import autopar

    # a plan given under several names (autopar's plan is one of the baselines' own, or a
    # copy of it with the clock's choice recorded) is one program: timed once, its timing
    # shared, so that noise cannot tell it from itself
    first_name: dict[str, str] = {}
    distinct: dict[str, Plan] = {}
    for name, plan in plans.items():
        twin = next((n for n, p in distinct.items() if same_program(p, plan)), None)
        first_name[name] = name if twin is None else twin
        if twin is None:
            distinct[name] = plan
    steps, loops, firsts = {}, {}, {}
    for name, plan in distinct.items():
        step = autopar.parallelize(step_fn, plan=plan, devices=list(devices), cache=False)
        loops[name] = TrainingLoop(step, inputs.state, inputs.batch)
        firsts[name], _ = time_calls(loops[name], warmup, 0)
        steps[name] = step
    hand = dict(hand_steps or {})
    for name, made in hand.items():
        loops[name] = TrainingLoop(made.jitted, made.state, inputs.batch)
        firsts[name], _ = time_calls(loops[name], warmup, 0)
    import jax

    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(rounds * repeats):
        for name, loop in loops.items():
            start = time.perf_counter()
            jax.block_until_ready(loop())
            times[name].append(time.perf_counter() - start)
    out = {}
    for name, plan in distinct.items():
        counted = steps[name].get_hlo_collectives(inputs.state, inputs.batch)
        out[name] = Timing(tuple(times[name]), warmup, firsts[name], counted,
                           task_compute_s=task_compute_s(steps[name], plan, loops[name]))
    timed = {name: out[first_name[name]] for name in plans}
    for name, made in hand.items():
        timed[name] = Timing(tuple(times[name]), warmup, firsts[name], made.hlo_collectives)
    return timed


def same_program(a: Plan, b: Plan) -> bool:
    """Whether two plans run as one program: equal but for what records how they were made
    (their planning records, solver records and notes), which the runtime does not read."""
    if a is b:
        return True

    def bare(plan: Plan) -> Plan:
        return replace(plan, planning=PlanningRecord(), solver=None, notes=())

    return bare(a) == bare(b)


def measure_single_device(step_fn: Callable, inputs: LocalInputs, device: Any, warmup: int,
                          repeats: int) -> Timing:
    """``jax.jit(step_fn)`` with its inputs on ``device``."""
    import jax

    state = jax.device_put(inputs.state, device)
    jitted = jax.jit(step_fn)
    first, times = time_calls(TrainingLoop(jitted, state, inputs.batch), warmup, repeats)
    return Timing(tuple(times), warmup, first, None, "one device: no collectives")


def measured_default(searched: Any, inputs: LocalInputs, devices: Sequence[Any]) -> Plan:
    """The plan ``autopar.parallelize`` keeps on these devices without ``method=``: the full
    search's (``searched``, a ``bench.planning.Searched``) candidates timed and the fastest
    measured kept (``AutoParallel.measure_candidates``'s default count)."""
    import jax

    import autopar
    from autopar.runtime.measured_choice import choose_by_clock, search_candidates

    own = next(p for p in searched.programs.values() if p.plan is searched.plan)
    chosen, others = search_candidates(searched.plan, own.traced.program, own.pipeline,
                                       searched.programs)
    template = jax.tree_util.tree_leaves((inputs.state, inputs.batch))
    return choose_by_clock(chosen, others, template, devices, (),
                           autopar.AutoParallel().measure_candidates).plan


def local_devices(count: int) -> list[Any]:
    """The first ``count`` devices of this process."""
    import jax

    return list(jax.devices()[:count])
