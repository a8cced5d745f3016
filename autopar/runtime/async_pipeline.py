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
while a microbatch in flight on any stage reading them uses it, or a later forward will; it is
dropped (and its buffers freed with their last reference, the backward's residuals) as soon as
neither holds. ``stash_weights=False`` (a test switch) makes each backward recompute its
forward at the stage's newest weights instead of the stashed ones, as PipeDream without
stashing does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from autopar.errors import PlanError
from autopar.ir.async_schedules import WeightVersions, weight_versions
from autopar.ir.async_update import AsyncStepProgram, StageUpdate, async_step_program
from autopar.ir.program import run_eqns
from autopar.ir.schedules import Task, TaskKind
from autopar.plan import Plan
from autopar.runtime.pipeline import PipelineRunner, TaskRecord, _mean, _StepState


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
    vjps: dict[tuple[int, int], Any] = field(default_factory=dict)
    replay: dict[tuple[int, int], tuple[list[Any], list[Any]]] = field(default_factory=dict)
    returned: tuple[Any, ...] = ()  # the state arrays the last call returned


class AsyncPipelineRunner(PipelineRunner):
    """Executes a ``PipelineProgram`` with an asynchronous schedule, carrying the pipeline
    from one call to the next (see the module docstring)."""

    stash_weights: bool = True
    #: per stage, the peak number of weight versions held (distinct buffers), since the
    #: pipeline started
    peak_live_versions: list[int]

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        p = self.schedule.num_stages
        if self.schedule.num_chunks != 1 or self.stage_of_piece != list(range(p)):
            raise PlanError("asynchronous schedules run one model piece per stage, in order")
        self.versions: WeightVersions = weight_versions(self.schedule.name, p, self.m)
        self.program: AsyncStepProgram = async_step_program(self.pp, self.pieces,
                                                            self.stage_of_piece)
        self.readers = [sorted({t.stage for t in self.tasks for f in t.params
                                if self.program.owner[f] == s}) for s in range(p)]
        self.update_fns = [jax.jit(self._update_fn(u)) for u in self.program.updates]
        self.grad_fns = [jax.jit(_vjp_grads) for _ in self.tasks]
        self.replay_fns = [jax.jit(self._replay_fn(t)) for t in self.tasks]
        self.result_fn = jax.jit(self._result_fn())
        outer = self.pp.outer
        read = {v for i in self.program.result_eqns for v in outer.eqns[i].inputs}
        read |= set(outer.out_ids[self.program.num_state:])
        self.result_inputs = [k for k, v in enumerate(outer.in_ids) if v in read]
        self.stream: _Stream | None = None
        self.peak_live_versions = [0] * p

    @classmethod
    def from_plan(cls, pp: Any, plan: Plan, devices: Sequence[Any],
                  stash_weights: bool = True) -> AsyncPipelineRunner:
        """The runner for an asynchronous pipeshard ``Plan``; ``stash_weights=False`` is the
        test switch described in the module docstring."""
        runner = super().from_plan(pp, plan, devices)
        runner.stash_weights = stash_weights
        return runner  # type: ignore[return-value]

    # -- executables ---------------------------------------------------------------------------

    def _update_fn(self, u: StageUpdate):
        outer, prog = self.pp.outer, self.program
        grad_id = self.pp.grad_outputs()

        def run(reads: list[Any], grads: list[Any]) -> list[Any]:
            env = {prog.state_in[k]: x for k, x in zip(u.reads, reads, strict=True)}
            env.update({grad_id[f]: g for f, g in zip(u.grads, grads, strict=True)})
            run_eqns(outer, u.eqns, env)
            return [env[prog.state_out[j]] for j in u.writes]

        return run

    def _replay_fn(self, t: Any):
        # PipeDream without stashing: the backward runs the forward again at the weights it is
        # given (the newest) on the inputs the forward saw, then its vjp
        forward, n_params = t.forward, len(t.params)

        def run(params: list[Any], acts: list[Any], nondiff: list[Any], cots: list[Any]):
            _, _, vjp_fn = forward(list(params) + list(acts), nondiff)
            return vjp_fn(cots)[0]

        del n_params
        return run

    def _result_fn(self):
        outer, prog = self.pp.outer, self.program
        vg = self.pp.vg
        first = 1 + self.pp.loss.num_aux

        def run(inputs: dict[int, Any], losses: list[Any]) -> list[Any]:
            env = {outer.in_ids[k]: x for k, x in inputs.items()}
            env.update(zip(vg.outputs[:first], losses, strict=True))
            run_eqns(outer, prog.result_eqns, env)
            return [env[v] if v in env else outer.values[v]
                    for v in outer.out_ids[prog.num_state:]]

        return run

    # -- the step ------------------------------------------------------------------------------

    def __call__(self, flat_args: Sequence[Any], record: bool = False) -> list[Any]:
        outer, prog = self.pp.outer, self.program
        state = list(flat_args[: prog.num_state])
        stream = self.stream
        if stream is None or len(stream.returned) != len(state) or any(
                a is not b for a, b in zip(state, stream.returned, strict=True)):
            stream = self.stream = self._start(state)
        st = _StepState(env=dict(zip(outer.in_ids, flat_args, strict=True)), acts=stream.acts,
                        cots=stream.cots, vjps=stream.vjps)
        self.records = []
        start = time.perf_counter()
        for vid, outs, fn in self.input_split_fns:
            st.env.update(zip(outs, fn(st.env[vid]), strict=True))
        for k, seg in enumerate(self.segments):
            if seg.phase == "before":
                self._run_segment(st, k, seg)
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
        for u in prog.updates:
            where = {prog.param_position[f]: f for f in u.params}
            stream.copies.append({k: self._put(state[k], u.stage, where.get(k))
                                  for k in u.reads})
            params = [stream.copies[u.stage][prog.param_position[f]] for f in u.params]
            stream.store.append({0: params})
        self.peak_live_versions = [1] * p
        return stream

    def _inject(self, st: _StepState, base: int) -> None:
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
            values.append(self._put(arrays[index], t.stage, f))
        return values

    def _run_task(self, st: _StepState, stream: _Stream, task: Task) -> Any:
        t, n = self.tasks[task.stage], task.microbatch
        if task.kind is TaskKind.F:
            acts = [self._input(st, v, n, t.stage) for v in t.diff[len(t.params):]]
            nondiff = [self._input(st, v, n, t.stage) for v in t.nondiff]
            outs, others, vjp_fn = t.forward(self._param_values(stream, t, n) + acts, nondiff)
            for v, x in zip(t.float_outputs + t.other_outputs, outs + others, strict=True):
                st.acts[(v, n)] = x
            st.vjps[(t.piece.index, n)] = vjp_fn
            if not self.stash_weights:
                stream.replay[(t.piece.index, n)] = (acts, nondiff)
            stream.in_flight[task.stage].add(n)
            self._release(stream)
            return outs
        cots = [self._seeded_cotangent(st, v, n, t.stage) for v in t.float_outputs]
        vjp_fn = st.vjps.pop((t.piece.index, n))
        if self.stash_weights:
            grads = self.grad_fns[t.piece.index](vjp_fn, cots)
        else:
            acts, nondiff = stream.replay.pop((t.piece.index, n))
            newest = self._param_values(stream, t, None)
            grads = self.replay_fns[t.piece.index](newest, acts, nondiff, cots)
        del vjp_fn
        n_params = len(t.params)
        for v, g in zip(t.diff[n_params:], grads[n_params:], strict=True):
            self._add_cotangent(st, v, n, g)
        group = self.versions.update_group(n)
        for f, g in zip(t.params, grads[:n_params], strict=True):
            owner = self.program.owner[f]
            g = self._put(g, owner, f)
            key = (f, group)
            stream.grads[key] = g if key not in stream.grads else stream.grads[key] + g
        stream.in_flight[task.stage].discard(n)
        self._forget(st, t, n)
        written = self.versions.writes(task)
        if written is not None:
            self._update(stream, task.stage, group, written)
        self._release(stream)
        return grads

    def _forget(self, st: _StepState, t: Any, n: int) -> None:
        """Drop microbatch ``n``'s values that no task reads after its backward on ``t``:
        every later piece's forward has run by then (the loss is kept for the results)."""
        keep = set(self.pp.loss_outputs)
        for v in t.float_outputs + t.other_outputs:
            if v not in keep:
                st.acts.pop((v, n), None)
        if t.stage == 0:
            for fid in self.pp.split_inputs:
                st.acts.pop((fid, n), None)

    def _seeded_cotangent(self, st: _StepState, vid: int, n: int, stage: int) -> Any:
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
        return self._put(total, stage, batched=True)

    def _update(self, stream: _Stream, stage: int, group: int, written: int) -> None:
        """Stage ``stage`` applies its update with the gradients of ``group``: version
        ``written`` of its state leaves."""
        u, prog = self.program.updates[stage], self.program
        grads = []
        for f in u.grads:
            g = stream.grads.pop((f, group), None)
            if g is None:  # no piece read it: a zero gradient, as jax.grad gives
                aval = self.pp.forward.avals[f]
                g = self._put(jnp.zeros(aval.shape, aval.dtype), stage, f)
            grads.append(g)
        copy = stream.copies[stage]
        new = self.update_fns[stage]([copy[k] for k in u.reads], grads)
        copy.update(zip(u.writes, new, strict=True))
        stream.latest[stage] = written
        stream.store[stage][written] = [copy[prog.param_position[f]] for f in u.params]

    def _release(self, stream: _Stream) -> None:
        """Drop the versions no microbatch in flight and no later forward reads; record how
        many each stage holds."""
        for owner, store in enumerate(stream.store):
            needed = {stream.latest[owner]}
            for stage in self.readers[owner]:
                needed |= {self.versions.reads(n, owner) for n in stream.in_flight[stage]}
                k = stream.next_task[stage]
                upcoming = self.versions.stage_task(stage, k)
                if upcoming.kind is not TaskKind.F:
                    upcoming = self.versions.stage_task(stage, k + 1)
                needed.add(self.versions.reads(upcoming.microbatch, owner))
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

    def _results(self, st: _StepState, stream: _Stream, flat_args: Sequence[Any],
                 base: int) -> list[Any]:
        """The call's outputs: its microbatches' mean loss and aux, the state as the stages
        hold it, and the step's other results."""
        prog, last = self.program, self.stage_of_piece[-1]
        losses = []
        for fid in self.pp.loss_outputs:
            parts = [self._put(st.acts.pop((fid, base + i)), last) for i in range(self.m)]
            losses.append(_mean(parts))
        state = [flat_args[j] if src < 0 else stream.copies[src][j]
                 for j, src in enumerate(prog.source)]
        stream.returned = tuple(state)
        inputs = {k: self._put(flat_args[k], last) for k in self.result_inputs}
        return state + list(self.result_fn(inputs, losses))


def _vjp_grads(vjp_fn: Any, cots: list[Any]) -> list[Any]:
    (grads,) = vjp_fn(cots)
    return grads


def _buffer(x: Any) -> int:
    """The address of the first shard's buffer: two versions that share it are one."""
    return x.addressable_shards[0].data.unsafe_buffer_pointer()
