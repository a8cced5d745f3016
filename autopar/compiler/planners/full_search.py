"""The full search (``AutoParallel``) as one object: every one-stage candidate (each method,
ShardParallel also on a 2-D mesh) and the pipelined one planned on the same cost model, the
fastest plan fitting the memory budget kept, with a planning record of every candidate.

``FullSearch.run`` goes through it in order: the one-stage candidates screened and queued
(``queue_one_stage``), the ShardParallel ones planned in a forked child beside the pipelines
where that pays (``one_stage_beside``), the pipelines, the child's answers, the candidates put
off until a plan that fits is known (``plan_deferred``), then the choice and its record
(``choose``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from autopar.cluster import ClusterSpec
from autopar.compiler.graph.trace import TracedStep
from autopar.compiler.inter_op.forked import Beside
from autopar.compiler.planners import one_stage_beside
from autopar.compiler.planners.candidate_rows import (
    annotations_note,
    candidate_row,
    failed_row,
    fits_budget,
    no_candidate_text,
)
from autopar.compiler.planners.candidate_screens import (
    cut_one_stage,
    floor_without_recompute,
    one_stage_candidates,
    pipelines_cannot_win,
    replicated_state_bytes,
    within_deadline,
)
from autopar.compiler.planners.step_program import IlpObserver, PlannedProgram, StepProgram
from autopar.errors import AutoparError, CannotWinError, PlanError
from autopar.methods import (
    FULL_SEARCH,
    AutoParallel,
    OneStageMethod,
    PipeshardParallel,
    ShardParallel,
)
from autopar.plan import MethodName, Plan

PIPESHARD = MethodName.PIPESHARD  # the pipelined candidate's name among the found plans

OneStagePlanner = Callable[[StepProgram, ClusterSpec, IlpObserver | None, float,
                            float | None], PlannedProgram]


class PipelinePlanner(Protocol):
    """``dispatch._plan_pipelined``: ``meanwhile()`` is done while the stage search's first
    forked layer ILPs run."""

    def __call__(self, step: StepProgram, method: PipeshardParallel, traced: TracedStep,
                 cluster: ClusterSpec, *,
                 meanwhile: Callable[[], Any] | None = None) -> PlannedProgram: ...


# ``beat`` for a one-stage candidate's first planning: no plan fits yet, so one whose fastest
# plan is over the budget is put off (``CannotWinError``) until the pipelines are planned
DEFER = 0.0
Row = dict[str, Any]


@dataclass
class FullSearch:
    """One run of the full search over ``step`` (whose method is ``AutoParallel``) on
    ``cluster``. ``plan_one_stage(step, cluster, ilp_observer, budget, beat)`` and
    ``plan_pipelined(step, method, traced, cluster)`` plan one candidate: passed in, since
    they are ``dispatch``'s, the one place that dispatches on the method's type.

    What it fills as it goes: ``found`` (each planned candidate by row name), ``rows`` (the
    planning record, one per candidate, in order), ``phases`` (seconds by part),
    ``skipped`` (candidates the time budget left out)."""

    step: StepProgram
    cluster: ClusterSpec
    ilp_observer: IlpObserver | None
    plan_one_stage: OneStagePlanner
    plan_pipelined: PipelinePlanner
    start: float = field(default_factory=time.perf_counter)
    found: dict[str, PlannedProgram] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    # one-stage candidates whose fastest plan is over the budget, by their row: solved under
    # the budget (or rematerialised) only once the pipelines are planned, and only where that
    # fastest plan is estimated faster than every plan that fits (``CannotWinError``): at
    # published sizes those solves took most of the search (GPT 76.1B on 1,024 GPUs: 77 s)
    deferred: list[tuple[str, OneStageMethod, int]] = field(default_factory=list)
    # ShardParallel candidates planned in the forked child beside the pipelines, by row
    singles: list[tuple[str, OneStageMethod, int]] = field(default_factory=list)
    # the child planning ``singles`` (``start_beside``), once started; where its start failed,
    # why (raised once the pipelines are planned, not as their failure)
    child: Beside | None = None
    child_started: bool = False
    child_error: Exception | None = None
    # the pipelined candidate's notes on its stage-cost ILPs, kept when another plan wins
    ilp_notes: list[str] = field(default_factory=list)

    @property
    def method(self) -> AutoParallel:
        method = self.step.method
        assert isinstance(method, AutoParallel), "the full search plans AutoParallel steps"
        return method

    @property
    def budget(self) -> float:
        return self.method.memory_budget_bytes or self.cluster.device.memory_bytes

    @property
    def deadline(self) -> float | None:
        limit = self.method.time_budget_s
        return None if limit is None else self.start + limit

    def run(self) -> PlannedProgram:
        """Plan every candidate and keep the fastest that fits (PlanError, one line, when
        none does)."""
        step = self.step
        beside = one_stage_beside.plans_beside(step, self.method, self.cluster,
                                               self.ilp_observer, self.deadline)
        self.queue_one_stage(beside)
        pruned = step.pipeline is not None and self.method.prune and pipelines_cannot_win(
            self.found, self.budget, self.method, self.cluster, self.rows, step.pipeline)
        try:
            if step.pipeline is not None and not pruned and self.within_budget(PIPESHARD):
                self.plan_pipelines()
            self.begin_beside()
            if self.child_error is not None:
                raise self.child_error
            answer = self.child.join() if self.child is not None else None
        except BaseException:  # an error, or Ctrl-C: the child is ended, not left behind
            if self.child is not None:
                self.child.cancel()
            raise
        if self.child is not None:
            self.collect_beside(answer)
        self.plan_deferred()
        return self.choose()

    def within_budget(self, name: str) -> bool:
        """Whether the time budget leaves room to plan ``name`` (else it is recorded as
        skipped). Until one candidate has a plan the search goes on: a plan is what it is
        for."""
        deadline = self.deadline
        if deadline is None or time.perf_counter() < deadline or not self.found:
            return True
        self.skipped.append(name)
        self.rows.append(self.skipped_row(name))
        return False

    def skipped_row(self, name: str) -> Row:
        return {"name": name, "method": name.split(" ")[0], "est_step_time_s": None,
                "fits": False,
                "note": f"skipped: the time budget ({self.method.time_budget_s:g} s) was spent"}

    def plan_single(self, name: str, candidate: OneStageMethod, beat: float | None) -> Row | None:
        """Plan one one-stage candidate: its row, or None when it was put off (``beat`` is
        ``DEFER`` and its fastest plan is over the budget)."""
        step = self.step
        step.status.enter(name)
        single = StepProgram(step.traced, candidate, step.batch_argnums, fn=step.fn,
                             args=step.args, memo=step.memo)
        began = time.perf_counter()
        deferring = False
        try:
            planned = self.plan_one_stage(single, self.cluster, self.ilp_observer,
                                          self.budget, beat)
        except CannotWinError as err:
            deferring = beat == DEFER
            return None if deferring else failed_row(name, name, err)
        except AutoparError as err:
            return failed_row(name, name, err)
        finally:
            self.phases[f"{name}_s"] = (self.phases.get(f"{name}_s", 0.0)
                                        + time.perf_counter() - began)
            if isinstance(candidate, ShardParallel) and not deferring:  # its ILP, counted once
                step.status.solved()
        self.found[name] = planned
        return candidate_row(name, planned.plan, self.budget)

    def queue_one_stage(self, beside: bool) -> None:
        """Each one-stage candidate refused by its state or memory floor (no ILP), queued for
        the child (``beside``: the ShardParallel ones), put off, or planned now."""
        budget, deadline = self.budget, self.deadline
        for name, candidate in one_stage_candidates(self.method, self.cluster,
                                                    self.step.annotations):
            if not self.within_budget(name):
                continue
            replicated = replicated_state_bytes(self.step, candidate)
            floor = floor_without_recompute(self.step, candidate, self.cluster)
            if replicated > budget or floor > budget:
                self.rows.append(self._refused_row(name, replicated, floor))
                continue
            candidate = within_deadline(candidate, deadline)
            if beside and one_stage_beside.is_shard(candidate):
                self.singles.append((name, candidate, len(self.rows)))
                self.rows.append({"name": name, "method": name.split(" ")[0]})  # filled later
                continue
            row = self.plan_single(name, candidate, DEFER)
            if row is None:
                self.deferred.append((name, candidate, len(self.rows)))
                row = {"name": name, "method": name.split(" ")[0]}  # filled in later
            self.rows.append(row)

    def _refused_row(self, name: str, replicated: float, floor: float) -> Row:
        note = (f"not planned: the state it keeps whole on every device needs "
                f"{replicated / 2**30:.2f} GiB, over the budget"
                if replicated > self.budget else
                f"not planned: with every tensor split over all {self.cluster.num_devices} "
                f"devices the step still needs {floor / 2**30:.2f} GiB, over the budget")
        return {"name": name, "method": name.split(" ")[0], "est_step_time_s": None,
                "fits": False, "needs_bytes": max(replicated, floor), "note": note}

    def begin_beside(self) -> None:
        """Start the child (``start_beside``) once: from the pipelines' stage search, while
        its first forked layer ILPs run (its trace of the rematerialised step is one core's
        work: 2-4 s at GPT-39B and GPT-3 175B), or from ``run`` when that forked none."""
        if self.child_started:
            return
        self.child_started = True
        try:
            self.child = self.start_beside()
        except Exception as err:  # noqa: BLE001 - raised by ``run``, not as the pipelines'
            self.child_error = err

    def start_beside(self) -> Beside | None:
        """The child planning ``singles`` (after tracing here what they will need), or None
        when there are none."""
        if not self.singles:
            return None
        one_stage_beside.trace_first(self.step, [c for _, c, _ in self.singles], self.cluster,
                                     self.budget)

        def plan_one(name: str, candidate: OneStageMethod) -> one_stage_beside.Planned:
            row = self.plan_single(name, candidate, DEFER)
            return row, self.found.get(name), self.phases.get(f"{name}_s", 0.0)

        return one_stage_beside.start(self.step, [(n, c) for n, c, _ in self.singles],
                                      plan_one)

    def plan_pipelines(self) -> None:
        """The pipelined candidate, its inner candidates' rows (the stage partitions the
        stage search compared) among the search's."""
        pipelined = within_deadline(self.method.pipeline_method(), self.deadline)
        traced = self.step.pipeline_traced
        assert traced is not None, "trace_auto traces the pipeline's outer program with its cut"
        began = time.perf_counter()
        try:
            self.found[PIPESHARD] = self.plan_pipelined(self.step, pipelined, traced,
                                                          self.cluster,
                                                          meanwhile=self.begin_beside)
        except AutoparError as err:
            self.rows.append(failed_row(PIPESHARD, PIPESHARD, err))
        finally:
            self.phases["pipeshard_s"] = time.perf_counter() - began
        if PIPESHARD not in self.found:
            return
        planned = self.found[PIPESHARD]
        self.phases.update(planned.plan.planning.phases)
        self.phases.pop("total_s", None)
        inner = planned.plan.planning.candidates
        search = planned.plan.planning.stage_search or {}
        if inner and search:
            inner[0]["ilp_statuses"] = dict(search.get("ilp_statuses", {}))
            inner[0]["ilp_solves"] = int(search.get("ilp_solves", 0))
        self.ilp_notes.extend(n for n in planned.plan.notes if "stage-cost ILPs" in n)
        for row in inner:
            row = dict(row, name=f"pipeshard: {row['name']}")
            if row.pop("chosen", False):
                note = row.get("note", "")
                row.update(candidate_row(row["name"], planned.plan, self.budget))
                row["note"] = "; ".join(n for n in (note, row["note"]) if n)
            self.rows.append(row)

    def collect_beside(self, answer: Any) -> None:
        """The child's rows and plans in their places (a candidate it failed on, or had to
        trace for, planned here)."""
        step = self.step
        outcomes, fastest, floors = answer if answer is not None else ([], {}, {})
        step.memo.fastest.update(fastest)
        step.memo.memory_floors.update(floors)
        done = {o.name: o for o in outcomes}
        for name, candidate, index in self.singles:
            outcome = done.get(name)
            if outcome is None or outcome.in_parent:  # the child failed, or had to trace
                row = self.plan_single(name, candidate, DEFER)
            else:
                row = outcome.row
                self.phases[f"{name}_s"] = outcome.seconds
                planned = one_stage_beside.program_of(step, outcome)
                if planned is not None:
                    self.found[name] = planned
                if row is not None:
                    step.status.solved()
            if row is None:
                self.deferred.append((name, candidate, index))
            else:
                self.rows[index] = row

    def plan_deferred(self) -> None:
        """The candidates put off, each planned to beat the fastest plan that fits (or
        skipped once the time budget is spent and a plan fits)."""
        deadline = self.deadline
        for name, candidate, index in self.deferred:
            fits = [p.plan.est_step_time_s for p in self.found.values()
                    if fits_budget(p.plan, self.budget)]
            if fits and deadline is not None and time.perf_counter() >= deadline:
                self.skipped.append(name)
                self.rows[index] = self.skipped_row(name)
                continue
            row = self.plan_single(name, within_deadline(candidate, deadline),
                                   min(fits) if fits else None)
            assert row is not None, "put off only when beat is DEFER; here it is an estimate"
            self.rows[index] = row

    def choose(self) -> PlannedProgram:
        """The fastest plan that fits, with the search's record on it."""
        budget, found = self.budget, self.found
        fitting = [(n, p) for n, p in found.items() if fits_budget(p.plan, budget)]
        # A one-stage pipeline is the one-stage ShardParallel step cut into microbatches: what
        # it adds (each microbatch reduces its gradients, smaller programs) its stage costs do
        # not price (docs/pipeline.md), so it is kept only for its memory, when no one-stage
        # plan fits; replicated with one microbatch per replica it is not cut at all
        one_stage_fits = any(n != PIPESHARD for n, _ in fitting)
        if one_stage_fits and PIPESHARD in found and cut_one_stage(found[PIPESHARD].plan):
            fitting = [(n, p) for n, p in fitting if n != PIPESHARD]
            for row in self.rows:
                if row.get("chosen_plan") is found[PIPESHARD].plan:
                    row["eligible"] = False
                    row["note"] = "; ".join(x for x in (row.get("note", ""), (
                        "one stage: a one-stage plan fits, and the microbatch split's costs "
                        "are not in this estimate")) if x)
        if not fitting:
            least = min(found.values(), key=lambda p: p.plan.peak_memory_bytes, default=None)
            if least is None:
                raise PlanError(no_candidate_text(self.rows, budget))
            raise PlanError(
                f"no candidate of the full search fits in {budget / 2**30:.2f} GiB per device: "
                f"the least memory is {least.plan.peak_memory_bytes / 2**30:.2f} GiB "
                f"({least.plan.method.value}); raise memory_budget_bytes, or use a larger "
                "cluster")
        name, best = min(fitting, key=lambda item: item[1].plan.est_step_time_s)
        return PlannedProgram(best.traced, best.plan, best.pipeline, candidates=found).with_plan(
            self.record(best.plan, name))

    def record(self, plan: Plan, name: str) -> Plan:
        """``plan`` with the search's notes, options, candidate rows and phases."""
        rows, method = self.rows, self.method
        chosen_name = next((r["name"] for r in rows if r.get("chosen_plan") is plan), name)
        for row in rows:
            row["chosen"] = row.pop("chosen_plan", None) is plan
        ranked = sorted((r for r in rows if r.get("est_step_time_s") is not None and r["fits"]
                         and r.get("eligible", True)),
                        key=lambda r: r["est_step_time_s"])
        runner_up = next((r for r in ranked if not r["chosen"]), None)
        summary = (f"the full search compared {len(rows)} candidate plans and chose "
                   f"{chosen_name} (est. {plan.est_step_time_s:.4g} s/step)")
        if runner_up is not None:
            summary += (f"; next: {runner_up['name']} (est. "
                        f"{runner_up['est_step_time_s']:.4g} s, "
                        f"{runner_up['est_step_time_s'] / plan.est_step_time_s:.2f}x)")
        first = [summary]
        if self.skipped:
            first.append(f"the time budget ({method.time_budget_s:g} s) was spent before "
                         f"{', '.join(self.skipped)}: not planned")
        if self.step.annotations is not None:
            first.append(annotations_note(self.step.annotations, rows, plan))
        pipelined = self.found.get(PIPESHARD)
        last = []
        if self.step.pipeline is not None and pipelined is not None and \
                plan is not pipelined.plan:
            last = [f"pipelined candidates: {n}" for n in self.ilp_notes]
        options = {"method": FULL_SEARCH, "chosen": plan.method.value,
                   "candidates": list(method.candidates),
                   "num_microbatches": method.num_microbatches, "schedule": method.schedule,
                   "remat": method.remat, "time_budget_s": method.time_budget_s,
                   "skipped": self.skipped}
        seconds = time.perf_counter() - self.start
        return plan.noted(*first, first=True).noted(*last).with_planning(
            method_options=options | {"chosen_options": plan.planning.method_options},
            candidates=rows, planning_time_s=seconds,
            phases=self.phases | {"total_s": seconds})
