"""Run an asynchronous pipeline (PipeDream with weight stashing, PipeDream-2BW) across calls.

The pipeline is not drained between calls of the step. Each call injects its batch's ``m``
microbatches into an endless stream (numbered from the pipeline's start) and runs, on every
stage, its 1F1B task stream as far as it goes without the next batch; the backwards of the
call's last microbatches on the earlier stages (``p - 1 - i`` on stage ``i``) stay in flight
and run during the next call. Which weight version each task reads and writes is the
schedule's data (``ir.async_schedules``); each stage applies its slice of the step's update
rule (``ir.async_update``) to its own copy of its state leaves.

What a call returns: the mean loss (and aux) of its ``m`` microbatches, each computed at the
weights its forward read, and the state as the stages hold it when the call ends: each leaf
from the stage that updates it (a leaf no gradient reaches, such as Adam's step count, from
stage 0's copy). Passing exactly the arrays a call returned back in continues the pipeline;
any other state starts a new pipeline from it (microbatches in flight are dropped).

Weight versions live in a per-stage store: version ``v`` of stage ``s``'s parameters is kept
while a microbatch in flight on any stage reading them uses it, or a later forward will, and
dropped as soon as neither holds. The store is the only place a version lives: a forward's
``jax.vjp`` residuals would hold the parameters it read (a copy per microbatch, since a jitted
function's outputs are new buffers), so the forward returns its residuals without them and the
backward takes them back from the store (the stashed version). An update donates the state
copy it replaces when the runtime made it in this call and no task reads it any more (what a
call was given, and gave back, stays the caller's). ``stash_weights=False`` (a test switch)
makes each backward rerun its forward at the newest weights, as PipeDream without stashing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import jax
import jax.numpy as jnp

from autopar.errors import PlanError
from autopar.ir.async_schedules import WeightVersions, weight_versions
from autopar.ir.async_update import AsyncStepProgram, async_step_program
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.schedules import Task, TaskKind
from autopar.plan import Plan
from autopar.runtime.async_programs import (
    AsyncPiecePrograms,
    result_function,
    split_reads,
    update_program,
)
from autopar.runtime.pipeline import PipelineRunner, TaskRecord
from autopar.runtime.pipeline_state import StepState, microbatch_mean
from autopar.runtime.program_calls import ProgramCall


@dataclass
class _Stream:
    """The pipeline in flight: what carries from one call to the next."""

    injected: int = 0  # microbatches injected so far (0 .. injected - 1)
    next_task: list[int] = field(default_factory=list)  # per stage, index in its task stream
    copies: list[dict[int, Any]] = field(default_factory=list)  # per stage: position -> value
    store: list[dict[int, list[Any]]] = field(default_factory=list)  # per stage: version ->
    # its parameters (in ``StageUpdate.params`` order)
    latest: list[int] = field(default_factory=list)
    in_flight: list[set[int]] = field(default_factory=list)  # per stage: F run, B not yet
    grads: dict[tuple[int, int], Any] = field(default_factory=dict)  # (param, group) -> sum
    acts: dict[tuple[int, int], Any] = field(default_factory=dict)
    cots: dict[tuple[int, int], Any] = field(default_factory=dict)
    # (piece, microbatch) -> the forward's residuals without the parameters (stashing), or
    # its inputs (without stashing: the backward runs the forward again)
    saved: dict[tuple[int, int], Any] = field(default_factory=dict)
    fresh: dict[int, Any] = field(default_factory=dict)  # id -> state copies made this call
    returned: tuple[Any, ...] = ()  # the state arrays the last call returned


class AsyncPipelineRunner(PipelineRunner):
    """Executes a ``PipelineProgram`` with an asynchronous schedule, carrying the pipeline
    from one call to the next (see the module docstring)."""

    stash_weights: bool = True
    #: per stage, the peak number of weight versions held (distinct buffers) since the start
    peak_live_versions: list[int]

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs["fuse"] = False  # its driver streams calls and updates: never one program
        # its gradients are applied per microbatch, from its own programs: no copies
        kwargs["param_copies"] = False
        super().__init__(*args, **kwargs)
        p = self.schedule.num_stages
        if self.schedule.num_chunks != 1 or self.stage_of_piece != list(range(p)):
            raise PlanError("asynchronous schedules run one model piece per stage, in order")
        self.versions: WeightVersions = weight_versions(self.schedule.name, p, self.m)
        self.program: AsyncStepProgram = async_step_program(self.pp, self.pieces,
                                                            self.stage_of_piece)
        self.readers = [sorted({t.stage for t in self.tasks for f in t.params
                                if self.program.owner[f] == s}) for s in range(p)]
        if any(self.remat_stages):
            raise PlanError("asynchronous schedules do not run rematerialised stages yet; "
                            "plan with remat='none'")
        self._update_fns: dict[tuple[int, bool, bool], Any] = {}
        self.programs = [AsyncPiecePrograms(self.pp, t) for t in self.tasks]
        self.result_fn = jax.jit(result_function(self.pp, self.program))
        outer = self.pp.outer
        read = {v for i in self.program.result_eqns for v in outer.eqns[i].inputs}
        read |= set(outer.out_ids[self.program.num_state:])
        self.result_inputs = [k for k, v in enumerate(outer.in_ids) if v in read]
        # of the step's equations before the loss, only those computing the loss function's
        # inputs other than its parameters run (the update rule is the stages' own)
        wanted = {self.pp.operand_of[f] for f in self.pp.forward.in_ids
                  if f not in set(self.pp.diff_inputs)}
        self.before: list[int] = []
        for k in reversed(range(len(self.segments))):
            seg = self.segments[k]
            if seg.phase == "before" and wanted & set(seg.outputs):
                self.before.insert(0, k)
                wanted |= set(seg.inputs)
        self.stream: _Stream | None = None
        self.peak_live_versions = [0] * p

    @classmethod
    def from_plan(cls, pp: PipelineProgram, plan: Plan, devices: Sequence[Any],
                  fuse: bool = False, param_copies: bool = False, *,
                  stash_weights: bool = True) -> Self:
        """The runner for an asynchronous pipeshard ``Plan``; ``stash_weights=False`` is the
        test switch described in the module docstring. ``fuse`` and ``param_copies`` are
        the base runner's, always off here (see ``__init__``)."""
        runner = super().from_plan(pp, plan, devices, fuse, param_copies)
        runner.stash_weights = stash_weights
        return runner

    # -- executables ---------------------------------------------------------------------------

    def update_program(self, stage: int, donate_params: bool, donate_state: bool) -> Any:
        """Stage ``stage``'s update, jitted: ``(params, other_state, grads) -> new values of
        its written state leaves`` (in ``async_programs.split_reads`` order); the gradients
        are always donated, the parameters and the other state leaves when asked (each variant
        compiled once)."""
        key = (stage, donate_params, donate_state)
        if key not in self._update_fns:
            self._update_fns[key] = update_program(self.pp, self.program, stage,
                                                   donate_params, donate_state)
        return self._update_fns[key]

    # -- the step ------------------------------------------------------------------------------

    def __call__(self, flat_args: Sequence[Any], record: bool = False,
                 calls: list[ProgramCall] | None = None) -> list[Any]:
        assert calls is None, "its programs are not run through _call: no log of them"
        outer, prog = self.pp.outer, self.program
        state = list(flat_args[: prog.num_state])
        stream = self.stream
        if stream is None or len(stream.returned) != len(state) or any(
                a is not b for a, b in zip(state, stream.returned, strict=True)):
            stream = self.stream = self._start(state)
        stream.fresh = {}  # what the last call returned is the caller's
        st = StepState(env=dict(zip(outer.in_ids, flat_args, strict=True)), acts=stream.acts,
                       cots=stream.cots)
        self.records = []
        start = time.perf_counter()
        for vid, outs, fn in self.input_split_fns:
            st.env.update(zip(outs, fn(st.env[vid]), strict=True))
        for k in self.before:
            self._run_segment(st, k, self.segments[k])
        base = stream.injected
        self._inject(st, base)
        stream.injected += self.m
        for task in self._runnable(stream):
            t0 = time.perf_counter() - start
            outs = self._run_task(st, stream, task)
            if record:
                jax.block_until_ready(outs)
                self.records.append(TaskRecord(task.kind.value, task.microbatch, task.stage,
                                               task.chunk, t0, time.perf_counter() - start))
        return self._results(st, stream, flat_args, base)

    def _start(self, state: list[Any]) -> _Stream:
        """A new pipeline from ``state``: every stage's copy of its leaves, version 0."""
        p, prog = self.schedule.num_stages, self.program
        stream = _Stream(next_task=[0] * p, latest=[0] * p, in_flight=[set() for _ in range(p)])
        param_at = {k: f for f, k in prog.param_position.items()}
        for u in prog.updates:
            # a parameter as the stage's plan places it, Adam's moments like their parameter
            stream.copies.append({
                k: self.place(state[k], u.stage, param_at.get(prog.follows.get(k, k)))
                for k in u.reads})
            params = [stream.copies[u.stage][prog.param_position[f]] for f in u.params]
            stream.store.append({0: params})
        self.peak_live_versions = [1] * p
        return stream

    def _inject(self, st: StepState, base: int) -> None:
        """The microbatches of this call's split loss inputs, numbered from ``base``."""
        mb = self.micro
        for fid in self.pp.split_inputs:
            full = st.env[self.pp.operand_of[fid]]
            for i in range(self.m):
                st.acts[(fid, base + i)] = full[i * mb : (i + 1) * mb]

    def _runnable(self, stream: _Stream):
        """Tasks in a dependency-respecting order, each stage's stream in its order, as far
        as the injected microbatches go (yields each before looking for the next)."""
        p = self.schedule.num_stages
        progress = True
        while progress:
            progress = False
            for stage in range(p):
                while True:
                    task = self.versions.stage_task(stage, stream.next_task[stage])
                    if task.kind is TaskKind.F and task.microbatch >= stream.injected:
                        break
                    if not all(self._done(stream, d) for d in self.schedule.dependencies(task)):
                        break
                    yield task
                    stream.next_task[stage] += 1
                    progress = True

    def _done(self, stream: _Stream, task: Task) -> bool:
        return self.versions.task_index(task) < stream.next_task[task.stage]

    def _param_values(self, stream: _Stream, t: Any, microbatch: int | None) -> list[Any]:
        """The parameters piece ``t`` reads: the version its owner's schedule gives
        ``microbatch`` (None: each owner's newest), placed on ``t``'s stage."""
        values = []
        for f in t.params:
            owner = self.program.owner[f]
            version = (stream.latest[owner] if microbatch is None
                       else self.versions.reads(microbatch, owner))
            if version not in stream.store[owner]:
                raise PlanError(f"weight version {version} of stage {owner} is not held when "
                                f"microbatch {microbatch} needs it on stage {t.stage}")
            arrays = stream.store[owner][version]
            index = self.program.updates[owner].params.index(f)
            values.append(self.place(arrays[index], t.stage, f))
        return values

    def _run_task(self, st: StepState, stream: _Stream, task: Task) -> Any:
        t, n = self.tasks[task.stage], task.microbatch
        programs, key = self.programs[t.piece.index], (t.piece.index, n)
        if task.kind is TaskKind.F:
            acts = [self._input(st, v, n, t.stage) for v in t.diff[len(t.params):]]
            nondiff = [self._input(st, v, n, t.stage) for v in t.nondiff]
            params = self._param_values(stream, t, n)
            outs, others, residuals = programs.forward(params, acts, nondiff)
            for v, x in zip(t.float_outputs + t.other_outputs, outs + others, strict=True):
                st.acts[(v, n)] = x
            stream.saved[key] = residuals if self.stash_weights else (acts, nondiff)
            stream.in_flight[task.stage].add(n)
            self._release(stream)
            return outs
        cots = [self._seeded_cotangent(st, v, n, t.stage) for v in t.float_outputs]
        if self.stash_weights:  # the version the forward read, from the store
            grads = programs.backward(self._param_values(stream, t, n), stream.saved.pop(key),
                                      cots)
        else:  # the newest weights, on the inputs the forward saw
            acts, nondiff = stream.saved.pop(key)
            grads = programs.replay(self._param_values(stream, t, None), acts, nondiff, cots)
        n_params = len(t.params)
        for v, g in zip(t.diff[n_params:], grads[n_params:], strict=True):
            self._add_cotangent(st, v, n, g)
        group = self.versions.update_group(n)
        for f, g in zip(t.params, grads[:n_params], strict=True):
            owner = self.program.owner[f]
            g = self.place(g, owner, f)
            key = (f, group)
            stream.grads[key] = g if key not in stream.grads else stream.grads[key] + g
        stream.in_flight[task.stage].discard(n)
        self._forget(st, t, n)
        written = self.versions.writes(task)
        if written is not None:
            self._update(stream, task.stage, group, written)
        self._release(stream)
        return grads

    def _forget(self, st: StepState, t: Any, n: int) -> None:
        """Drop microbatch ``n``'s values that no task reads after its backward on ``t``:
        every later piece's forward has run by then (the loss is kept for the results)."""
        keep = set(self.pp.loss_outputs)
        for v in t.float_outputs + t.other_outputs:
            if v not in keep:
                st.acts.pop((v, n), None)
        if t.stage == 0:
            for fid in self.pp.split_inputs:
                st.acts.pop((fid, n), None)

    def _seeded_cotangent(self, st: StepState, vid: int, n: int, stage: int) -> Any:
        """The output cotangent of microbatch ``n``; the loss is seeded with 1 (PipeDream: each
        microbatch is its own minibatch) or 1/m (2BW: the call's mean)."""
        aval = self.pp.forward.avals[vid]
        total = st.cots.pop((vid, n), None)
        if vid == self.pp.loss_outputs[0]:
            scale = 1.0 if self.versions.per_microbatch else 1.0 / self.m
            seed = jnp.full(aval.shape, scale, aval.dtype)
            total = seed if total is None else total + seed
        if total is None:
            total = jnp.zeros(aval.shape, aval.dtype)
        return self.place(total, stage, batched=True)

    def _update(self, stream: _Stream, stage: int, group: int, written: int) -> None:
        """Stage ``stage`` applies its update with the gradients of ``group``: version
        ``written`` of its state leaves."""
        u, prog = self.program.updates[stage], self.program
        grads = []
        for f in u.grads:
            g = stream.grads.pop((f, group), None)
            if g is None:  # no piece read it: a zero gradient, as jax.grad gives
                aval = self.pp.forward.avals[f]
                g = self.place(jnp.zeros(aval.shape, aval.dtype), stage, f)
            grads.append(g)
        copy, fresh = stream.copies[stage], stream.fresh
        params, others, written_at = split_reads(prog, u)
        param_vals, other_vals = [copy[k] for k in params], [copy[k] for k in others]
        previous = stream.latest[stage]
        # the parameters the update replaces can go when no task reads their version any more
        give_params = all(id(x) in fresh for x in param_vals) and \
            previous not in self._needed(stream, stage, written)
        give_state = all(id(x) in fresh for x in other_vals)
        if give_params:
            del stream.store[stage][previous]
        given = (param_vals if give_params else []) + (other_vals if give_state else [])
        for x in given:
            del fresh[id(x)]
        new = self.update_program(stage, give_params, give_state)(param_vals, other_vals, grads)
        for j, x in zip(written_at, new, strict=True):
            fresh.pop(id(copy.get(j)), None)
            copy[j] = x
            fresh[id(x)] = x
        stream.latest[stage] = written
        stream.store[stage][written] = [copy[prog.param_position[f]] for f in u.params]

    def _needed(self, stream: _Stream, owner: int, latest: int) -> set[int]:
        """The versions of ``owner``'s parameters some task will still read: the newest
        (``latest``), those of microbatches in flight, and the next forwards' ones."""
        needed = {latest}
        for stage in self.readers[owner]:
            needed |= {self.versions.reads(n, owner) for n in stream.in_flight[stage]}
            k = stream.next_task[stage]
            upcoming = self.versions.stage_task(stage, k)
            if upcoming.kind is not TaskKind.F:
                upcoming = self.versions.stage_task(stage, k + 1)
            needed.add(self.versions.reads(upcoming.microbatch, owner))
        return needed

    def _release(self, stream: _Stream) -> None:
        """Drop the versions no task will read; record how many each stage holds."""
        for owner, store in enumerate(stream.store):
            needed = self._needed(stream, owner, stream.latest[owner])
            for version in [v for v in store if v not in needed]:
                del store[version]
            buffers = {tuple(_buffer(x) for x in arrays) for arrays in store.values()}
            self.peak_live_versions[owner] = max(self.peak_live_versions[owner], len(buffers))

    def held_arrays(self) -> list[Any]:
        """The arrays the pipeline keeps for later calls: every stage's state copy and the
        weight versions in its store."""
        if self.stream is None:
            return []
        held = [x for copy in self.stream.copies for x in copy.values()]
        return held + [x for store in self.stream.store for arrays in store.values()
                       for x in arrays]

    def _results(self, st: StepState, stream: _Stream, flat_args: Sequence[Any],
                 base: int) -> list[Any]:
        """The call's outputs: its microbatches' mean loss and aux, the state as the stages
        hold it, and the step's other results."""
        prog, last = self.program, self.stage_of_piece[-1]
        losses = []
        for fid in self.pp.loss_outputs:
            parts = [self.place(st.acts.pop((fid, base + i)), last) for i in range(self.m)]
            losses.append(microbatch_mean(parts))
        state = [flat_args[j] if src < 0 else stream.copies[src][j]
                 for j, src in enumerate(prog.source)]
        stream.returned = tuple(state)
        inputs = {k: self.place(flat_args[k], last) for k in self.result_inputs}
        return state + list(self.result_fn(inputs, losses))


def _buffer(x: Any) -> int:
    """The address of the first shard's buffer: two versions that share it are one."""
    return x.addressable_shards[0].data.unsafe_buffer_pointer()
