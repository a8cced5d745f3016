"""Run a pipelined train step: stage executables, the schedule's driver, transfers.

Each piece (virtual stage) of the loss forward gets jitted tasks on its stage's devices
(``runtime.pipeline_tasks``: F, B, and for zero-bubble schedules B and W split). The driver
walks the schedule's global order; values cross stages with ``jax.device_put`` to the
receiving stage's sharding, straight from the producing stage to every consumer (a long skip
connection is not relayed through the stages between). The step's other equations run as
jitted segments on their home stages before and after the pipeline. A piece's first backward
in a step makes its gradient accumulators, later ones add into them, donated; parameters read
as copies (``runtime.param_copies``) have theirs reduced once, after the last. One stage: the
whole step traced into one program (``runtime.fused_step``; ``fuse=False`` runs it task by
task), since nothing there waits on another stage.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Self

import jax
import jax.numpy as jnp

from autopar.ir.pieces import Piece, cut_pieces
from autopar.ir.pipeline_pieces import input_consumers
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.pipeline_segments import Segment, plan_segments
from autopar.ir.program import run_eqns
from autopar.ir.random_draws import draw_function
from autopar.ir.schedule_orders import make_schedule
from autopar.ir.schedules import Schedule, TaskKind
from autopar.plan import Plan
from autopar.runtime.fused_step import FusedStep
from autopar.runtime.gradient_sinks import add_partial_sums, unsunk
from autopar.runtime.pipeline_placement import StagePlacement
from autopar.runtime.pipeline_state import StageDevices, StepState, microbatch_mean
from autopar.runtime.pipeline_tasks import PieceTasks, piece_tasks
from autopar.runtime.program_calls import ProgramCall, TaskRecord, abstract_args


class PipelineRunner(StagePlacement):
    """Executes a ``PipelineProgram`` cut into ``pieces`` with a schedule (its values placed
    on the stages as ``runtime.pipeline_placement`` lays them out)."""

    def __init__(
        self,
        pp: PipelineProgram,
        pieces: Sequence[Piece],
        stage_of_piece: Sequence[int],
        stages: Sequence[StageDevices],
        segments: Sequence[Segment],
        home: dict[int, int],
        schedule: Schedule,
        devices: Sequence[Any],
        specs: Sequence[dict[int, Any]] | None = None,
        remat_layers: Sequence[Piece] = (),
        remat_stages: Sequence[bool] = (),
        selective_stages: Sequence[bool] = (),
        fuse: bool = True,
        param_copies: bool = True,
        cotangent_specs: Sequence[dict[int, Any]] | None = None,
        contraction_specs: Sequence[dict[str, Any]] | None = None,
    ):
        super().__init__(pp, stages, devices, specs)
        self.pieces, self.schedule = list(pieces), schedule
        # per stage: the plan's layout of forward values' cotangents, where not their own
        self.cotangent_specs = list(cotangent_specs or [{} for _ in stages])
        # and where it reads contractions' operands otherwise than they come
        self.contraction_specs = list(contraction_specs or [{} for _ in stages])
        self.stage_of_piece = list(stage_of_piece)
        self.segments, self.home = list(segments), dict(home)
        self.m = schedule.num_microbatches
        self.micro = pp.batch_size // self.m
        self.consumers = input_consumers(self.pieces)
        # rematerialised stages run each layer (``remat_layers``: the forward cut at every
        # layer boundary) under jax.checkpoint: the backward keeps only layer inputs
        self.remat_layers = list(remat_layers)
        self.remat_stages = list(remat_stages) or [False] * len(stages)
        # of those, the stages whose checkpoints keep the layers' matmul outputs
        self.selective_stages = list(selective_stages) or [False] * len(stages)
        # the parameters the split batch meets read as copies made once per step, their
        # gradients reduced once, after the last microbatch (``runtime.param_copies``);
        # one microbatch reduces once anyway
        self._read_copies = param_copies and self.m > 1
        self.tasks = [self._piece_tasks(p) for p in self.pieces]
        self.segment_fns = [jax.jit(self._segment_fn(s)) for s in self.segments]
        self.draw_fns = [jax.jit(draw_function(d)) for d in pp.draws]
        self.input_split_fns = self._input_split_fns()
        self.records: list[TaskRecord] = []
        mb = self.micro
        self._microbatches = jax.jit(
            lambda x: [x[i * mb : (i + 1) * mb] for i in range(self.m)])
        # per (value, stage): the loss's cotangent seed (1 / m everywhere), placed once
        self._seeds: dict[tuple[int, int], Any] = {}
        # ``fuse``, one stage: the whole step as one program (its tasks' order is fixed,
        # nothing waits on another stage), traced from this driver. On by default: on 8
        # simulated CPU devices it measured 1.2x-5x faster than task by task for every local
        # zoo case (docs/pipeline.md); ``fuse=False`` keeps the tasks apart (their timings)
        self.fused = FusedStep(self) if fuse and len(self.meshes) == 1 else None

    @classmethod
    def from_plan(cls, pp: PipelineProgram, plan: Plan, devices: Sequence[Any],
                  fuse: bool = True, param_copies: bool = True) -> Self:
        """The runner for a pipeshard ``Plan`` of ``pp`` on ``devices`` (indexed by the plan's
        device ids); ``fuse``: a one-stage plan's step as one program (the default);
        ``param_copies``: data-parallel gradients reduced once per step (the default;
        ``runtime.param_copies``), not in each microbatch's backward."""
        layout = plan.pipeline
        assert layout is not None, "a pipeshard plan has its pipeline layout"
        pieces = cut_pieces(pp.forward, list(layout.piece_positions))
        owner = list(layout.stage_of_piece)
        segments, home = plan_segments(pp, pieces, owner)
        stages = [StageDevices(tuple(st.device_ids), tuple(st.logical_mesh_shape),
                               tuple(st.axis_names)) for st in plan.stages]
        schedule = make_schedule(layout.schedule, len(stages), plan.num_microbatches,
                                 layout.num_chunks)
        specs = [st.tensor_shardings for st in plan.stages]
        cotangents = [st.cotangent_shardings for st in plan.stages]
        contractions = [st.contraction_shardings for st in plan.stages]
        remat = list(layout.remat_stages)
        checkpoints = layout.checkpoint_positions or layout.layer_positions
        layers = cut_pieces(pp.forward, list(checkpoints)) if any(remat) else []
        return cls(pp, pieces, owner, stages, segments, home, schedule, devices, specs,
                   remat_layers=layers, remat_stages=remat,
                   selective_stages=layout.selective_stages, fuse=fuse,
                   param_copies=param_copies, cotangent_specs=cotangents,
                   contraction_specs=contractions)

    # -- executables ---------------------------------------------------------------------------

    def _piece_tasks(self, piece: Piece) -> PieceTasks:
        stage = self.stage_of_piece[piece.index]
        layers = self.remat_layers if self.remat_stages[stage] else ()
        return piece_tasks(self.pp, piece, stage, self.meshes[stage], self.specs[stage], layers,
                           read_copies=self._read_copies,
                           selective=self.selective_stages[stage],
                           cotangent_specs=self.cotangent_specs[stage],
                           contraction_specs=self.contraction_specs[stage])

    def _input_split_fns(self) -> list[tuple[int, list[int], Any]]:
        """Per stacked step input: (its id, its slices' ids, a jitted function making them).
        They run before the step where the caller's array lies, so each stage then receives
        only its slices, never the whole stacked leaf."""
        outer = self.pp.outer
        by_input: dict[int, list[int]] = {}
        for i in sorted(self.pp.input_splits):
            by_input.setdefault(outer.eqns[i].inputs[0], []).append(i)
        fns = []
        for vid, eqns in by_input.items():
            outs = [outer.eqns[i].outputs[0] for i in eqns]

            def run(x: Any, vid: int = vid, eqns: list[int] = eqns,
                    outs: list[int] = outs) -> list[Any]:
                env = {vid: x}
                run_eqns(outer, eqns, env)
                return [env[v] for v in outs]

            fns.append((vid, outs, jax.jit(run)))
        return fns

    def _segment_fn(self, segment: Segment):
        outer = self.pp.outer

        def run(*values: Any) -> list[Any]:
            env = dict(zip(segment.inputs, values, strict=True))
            run_eqns(outer, segment.eqns, env)
            return [env[v] for v in segment.outputs]

        return run

    # -- the step ------------------------------------------------------------------------------

    def __call__(self, flat_args: Sequence[Any], record: bool = False,
                 calls: list[ProgramCall] | None = None) -> list[Any]:
        """One step on the step's flat inputs; its flat outputs. ``record``: wait for and time
        every task (``records``); ``calls``: log every program run into this list. A fused
        one-stage pipeline runs as one program (``runtime.fused_step``): its record and logged
        call are that program's."""
        if self.fused is not None:
            return self.fused(flat_args, record, calls)
        st = self.new_state(flat_args, calls)
        self.records = []
        self.run_step(st, record)
        return [self.output(st, v) for v in self.pp.outer.out_ids]

    def new_state(self, flat_args: Sequence[Any],
                  calls: list[ProgramCall] | None = None) -> StepState:
        """A step's state holding its flat inputs (``calls``: the log of programs run)."""
        return StepState(env=dict(zip(self.pp.outer.in_ids, flat_args, strict=True)),
                          calls=calls)

    def run_step(self, st: StepState, record: bool = False) -> None:
        """Every program of one step in the schedule's order, the step's values in ``st.env``
        (``record``: each task waited for and timed into ``records``)."""
        start = time.perf_counter()
        self.begin_step(st)
        for task in self.schedule.global_order():
            t0 = time.perf_counter() - start
            outs = self.run_task(st, task)
            if record:
                jax.block_until_ready(outs)
                self.records.append(TaskRecord(task.kind.value, task.microbatch, task.stage,
                                               task.chunk, t0, time.perf_counter() - start))
        self.end_step(st)

    def begin_step(self, st: StepState) -> None:
        """What runs before the schedule's tasks: the stacked inputs' splits, the segments
        before the pipeline, the random draws and the microbatches of every split input."""
        for k, (vid, outs, fn) in enumerate(self.input_split_fns):
            st.env.update(zip(outs, self._call(st, f"split{k}", None, fn, st.env[vid]),
                              strict=True))
        for k, seg in enumerate(self.segments):
            if seg.phase == "before":
                self._run_segment(st, k, seg)
        self._draw(st)
        self._split_batch(st)

    def end_step(self, st: StepState, loss_means: Sequence[Any] | None = None) -> None:
        """What runs after the tasks: the loss results' means and the gradients at their
        homes (``loss_means``: each loss result already combined over the microbatches as
        ``microbatch_mean`` does, in its stage's layout), then the segments after the pipeline."""
        self._finish_pipeline(st, loss_means)
        for k, seg in enumerate(self.segments):
            if seg.phase == "after":
                self._run_segment(st, k, seg)

    def _call(self, st: StepState, label: str, stage: int | None, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, logged in ``st.calls`` when the step keeps a log."""
        if st.calls is not None:
            st.calls.append(ProgramCall(label, stage, fn, abstract_args(args)))
        return fn(*args)

    def _run_segment(self, st: StepState, k: int, seg: Segment) -> None:
        values = [self._fetch(st, v, seg.stage) for v in seg.inputs]
        outs = self._call(st, f"segment{k}", seg.stage, self.segment_fns[k], *values)
        st.env.update(zip(seg.outputs, outs, strict=True))

    def _draw(self, st: StepState) -> None:
        """The whole batch's bits of each per-example random draw (``ir.random_draws``), on
        the stage of the first piece reading them: the serial step's own draw, which
        ``_split_batch`` then cuts like the batch."""
        for k, (d, fn) in enumerate(zip(self.pp.draws, self.draw_fns, strict=True)):
            readers = self.consumers.get(d.bits, [len(self.pieces) - 1])
            stage = self.stage_of_piece[readers[0]]
            values = [self._fetch(st, self.pp.operand_of[v], stage, v) for v in d.inputs]
            st.env[d.source] = self._call(st, f"draw{k}", stage, fn, *values)

    def _split_batch(self, st: StepState) -> None:
        """Each microbatch of every split loss input (placed on the stages that read it when
        they read it), cut by one program per input where it lies: not a slice each."""
        for k, fid in enumerate(sorted(self.pp.split_inputs)):
            full = st.env[self.pp.operand_of[fid]]
            parts = self._call(st, f"microbatches{k}", None, self._microbatches, full)
            for i, part in enumerate(parts):
                st.acts[(fid, i)] = part

    def _input(self, st: StepState, vid: int, microbatch: int, stage: int) -> Any:
        if vid in self.pp.operand_of and vid not in self.pp.split_inputs:
            return self._fetch(st, self.pp.operand_of[vid], stage, vid)
        return self.place(st.acts[(vid, microbatch)], stage, vid, batched=True)

    def run_task(self, st: StepState, task: Any) -> Any:
        """Run one task of the schedule on the step's values ``st``; its outputs."""
        piece = task.piece(self.schedule.num_stages)
        t, i = self.tasks[piece], task.microbatch
        params = self._params(st, t, i)
        if task.kind == TaskKind.F:
            diff = params + [self._input(st, v, i, t.stage) for v in t.diff[len(t.params):]]
            nondiff = [self._input(st, v, i, t.stage) for v in t.nondiff]
            outs, others, res = self._call(st, f"F{piece}", t.stage, t.forward, diff, nondiff)
            for v, x in zip(t.float_outputs + t.other_outputs, outs + others, strict=True):
                st.acts[(v, i)] = x
            st.residuals[(piece, i)] = res
            return outs
        res = st.residuals[(piece, i)]
        acc = st.accum.get(piece)
        if task.kind == TaskKind.W:  # the output cotangents its B task used
            cots = st.saved_cots.pop((piece, i))
            if acc is None:
                st.accum[piece] = self._call(st, f"W{piece}", t.stage,
                                             t.backward_weight_first, params, res, cots)
            else:
                st.accum[piece] = self._call(st, f"W{piece}", t.stage, t.backward_weight,
                                             params, res, cots, acc)
            del st.residuals[(piece, i)]
            return st.accum[piece]
        cots = [self._cotangent(st, v, i, t.stage) for v in t.float_outputs]
        if self.schedule.splits_backward:
            act_grads = self._call(st, f"Bi{piece}", t.stage, t.backward_input, params, res,
                                   cots)
            st.saved_cots[(piece, i)] = cots
        elif acc is None:
            act_grads, st.accum[piece] = self._call(st, f"B{piece}", t.stage,
                                                    t.backward_first, params, res, cots)
            del st.residuals[(piece, i)]
        else:
            act_grads, st.accum[piece] = self._call(st, f"B{piece}", t.stage, t.backward,
                                                    params, res, cots, acc)
            del st.residuals[(piece, i)]
        for v, g in zip(t.diff[len(t.params) :], act_grads, strict=True):
            self._add_cotangent(st, v, i, g)
        return act_grads

    def _params(self, st: StepState, t: PieceTasks, i: int) -> list[Any]:
        """The parameters piece ``t`` reads, those it reads as copies replaced by them (made
        once per step, by one program per piece)."""
        values = [self._input(st, v, i, t.stage) for v in t.params]
        copied, p = [k for k, v in enumerate(t.params) if v in t.copies.params], t.piece.index
        if copied and p not in st.copies:
            st.copies[p] = self._call(st, f"copies{p}", t.stage, t.make_copies,
                                      [values[k] for k in copied])
        for k, c in zip(copied, st.copies.get(p, ()), strict=True):
            values[k] = c
        return values

    def _producer_stage(self, vid: int) -> int:
        for p in self.pieces:
            if vid in p.outputs:
                return self.stage_of_piece[p.index]
        return self.stage_of_piece[-1]

    def _add_cotangent(self, st: StepState, vid: int, i: int, g: Any) -> None:
        stage = self._producer_stage(vid)
        # laid out as the value is on its producer's stage: its backward reads it so
        g = self.place(g, stage, vid, batched=True)
        key = (vid, i)
        st.cots[key] = g if key not in st.cots else st.cots[key] + g

    def _cotangent(self, st: StepState, vid: int, i: int, stage: int) -> Any:
        aval = self.pp.forward.avals[vid]
        total = st.cots.pop((vid, i), None)
        outputs = self.pp.loss_outputs
        if vid == outputs[0]:  # the loss: the step's loss is the mean over microbatches
            if total is None and self.fused is None:
                # the same constant every microbatch and step: made and placed once (not
                # when the step is traced as one program: there it is a constant already)
                key = (vid, stage)
                if key not in self._seeds:
                    self._seeds[key] = self.place(
                        jnp.full(aval.shape, 1.0 / self.m, aval.dtype), stage, vid,
                        batched=True)
                return self._seeds[key]
            seed = jnp.full(aval.shape, 1.0 / self.m, aval.dtype)
            total = seed if total is None else total + seed
        if total is None:
            total = jnp.zeros(aval.shape, aval.dtype)
        return self.place(total, stage, vid, batched=True)

    def loss_stage(self, k: int) -> int:
        """The stage where the loss function's ``k``-th result is averaged."""
        return self.home.get(self.pp.vg.outputs[k], self.stage_of_piece[-1])

    def _finish_pipeline(self, st: StepState, loss_means: Sequence[Any] | None = None) -> None:
        """The loss function's results as the step sees them: means over microbatches, and each
        gradient summed over the pieces that read its parameter, at its home stage."""
        vg = self.pp.vg
        for k, fid in enumerate(self.pp.loss_outputs):
            out_id, stage = vg.outputs[k], self.loss_stage(k)
            if loss_means is not None:
                st.env[out_id] = loss_means[k]
                continue
            # each microbatch's in the layout its stage made it (batch norm's statistics
            # split by channel stay split): replicating each would gather it per microbatch
            parts = [self.place(st.acts[(fid, i)], stage, fid) for i in range(self.m)]
            st.env[out_id] = self._call(st, f"mean{k}", stage, microbatch_mean, parts)
        plain = {p: unsunk(t.params, t.sinks) for p, t in enumerate(self.tasks)}
        grads = {(p, v): g for p in st.accum
                 for v, g in zip(plain[p], st.accum[p][:len(plain[p])], strict=True)}
        for p, t in enumerate(self.tasks):  # the groups' partial sums: the step's reduction
            copied = [v for v in t.params if v in t.copies.params]
            if copied and p in st.accum:
                sums = self._call(st, f"reduce{p}", t.stage, add_partial_sums,
                                  [[grads[(p, v)]] for v in copied], ((1,),) * len(copied))
                grads.update(((p, v), g) for v, g in zip(copied, sums, strict=True))
            if t.sinks and p in st.accum:  # and the sinks' (``runtime.gradient_sinks``)
                sunk = list(dict.fromkeys(s.param for s in t.sinks))
                partials = st.accum[p][len(plain[p]):]
                mine = [[(s, x) for s, x in zip(t.sinks, partials, strict=True)
                         if s.param == v] for v in sunk]
                sums = self._call(st, f"sum{p}", t.stage, add_partial_sums,
                                  [[x for _, x in pairs] for pairs in mine],
                                  tuple(tuple(len(s.groups) for s, _ in pairs)
                                        for pairs in mine))
                grads.update(((p, v), g) for v, g in zip(sunk, sums, strict=True))
        for fid, gid in self.pp.grad_outputs().items():
            stage = self.home[gid]
            total = None
            for p in self.consumers.get(fid, []):
                g = self.place(grads[(p, fid)], stage, fid)
                total = g if total is None else total + g
            if total is None:
                aval = self.pp.forward.avals[fid]
                total = self.place(jnp.zeros(aval.shape, aval.dtype), stage)
            st.env[gid] = total
