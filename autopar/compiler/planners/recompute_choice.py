"""Recomputation for one-stage plans: the step traced again with its loss function's layers
under ``jax.checkpoint``, recomputed whole or selectively (``plan_rematerialised``), and what
``remat="auto"`` takes between them (``plan_recomputed_auto``).

Selective recomputation keeps each layer's matmul outputs and recomputes the rest (the
attention core, the element-wise chains): it holds more than recomputing whole layers and
recomputes less. ``remat="auto"`` tries it only where the whole layers' plan fits: where that
does not, keeping more cannot fit either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from autopar.cluster import ClusterSpec
from autopar.compiler.intra_op.problem import InfeasibleMemoryError
from autopar.compiler.planners.step_program import IlpObserver, PlannedProgram, StepProgram
from autopar.errors import CannotWinError, InvalidOptionError, format_bytes
from autopar.method_options import RematMode
from autopar.plan import Plan

# ``dispatch._plan_one_stage``: (traced, method, cluster, batch_argnums, ilp_observer, memo,
# beat) -> Plan; passed in, as dispatch imports this module
OneStagePlanner = Callable[..., Plan]


def plan_rematerialised(step: StepProgram, cluster: ClusterSpec,
                        planned: PlannedProgram | None, ilp_observer: IlpObserver | None,
                        plan_one_stage: OneStagePlanner, beat: float | None = None, *,
                        selective: bool | None = None) -> PlannedProgram:
    """Trace again with the loss function's layers under ``jax.checkpoint`` (``selective``:
    keeping their matmuls' outputs; default: as the method's ``remat`` says) and plan that;
    with ``planned`` (remat="auto"'s plan without recomputation) keep it only if it needs
    less memory than ``planned``."""
    if step.fn is None:
        raise InvalidOptionError("remat needs the step itself to trace it again; this step "
                                 "was given as a traced program only")
    if selective is None:
        selective = getattr(step.method, "remat", None) == RematMode.SELECTIVE
    remat = step.rematerialised(selective)
    if isinstance(remat, Exception):
        if planned is None:
            mode = "selective" if selective else "layers"
            raise InvalidOptionError(f"remat='{mode}' needs the step's gradient from "
                                     f"autopar.value_and_grad or autopar.grad: "
                                     f"{remat}") from None
        return planned.with_plan(planned.plan.noted(
            "remat='auto' left off: the step has no autopar.value_and_grad"))
    traced, positions = remat
    plan = plan_one_stage(traced, step.method, cluster, step.batch_argnums, ilp_observer,
                          step.memo, beat)
    if planned is not None and plan.peak_memory_bytes >= planned.plan.peak_memory_bytes:
        return planned.with_plan(planned.plan.noted(
            "remat='auto' tried the layers under jax.checkpoint: no memory saved"))
    # what it saved and cost, against the fastest plan keeping every activation
    saved = "" if planned is None else \
        f": {_against(plan, planned.plan, 'keeping every activation')}"
    kept = "their matmuls' outputs kept, the rest" if selective else "the backward"
    plan = replace(plan, remat_positions=tuple(positions), remat_selective=selective).noted(
        f"rematerialised: the loss function's {len(positions) + 1} layers run under "
        f"jax.checkpoint ({kept} recomputes them){saved}")
    return PlannedProgram(traced, plan)


def plan_recomputed_auto(step: StepProgram, cluster: ClusterSpec,
                         planned: PlannedProgram | None, ilp_observer: IlpObserver | None,
                         plan_one_stage: OneStagePlanner, fits: Callable[[Plan], bool],
                         beat: float | None = None) -> PlannedProgram:
    """``remat="auto"`` where the plan without recomputation (``planned``; None: none fits
    at all) does not fit: the layers recomputed whole, and where that plan fits, recomputed
    selectively too, taken where it fits and is estimated faster (the step traced a third
    time, once for every candidate of the step: ``StepProgram.rematerialised``)."""
    whole = plan_rematerialised(step, cluster, planned, ilp_observer, plan_one_stage, beat,
                                selective=False)
    if whole.plan.remat_positions is None or not fits(whole.plan):
        return whole
    to_beat = whole.plan.est_step_time_s if beat is None else min(beat,
                                                                  whole.plan.est_step_time_s)
    try:
        chosen = plan_rematerialised(step, cluster, planned, ilp_observer, plan_one_stage,
                                     to_beat, selective=True)
    except (CannotWinError, InfeasibleMemoryError):  # no faster, or no plan within the budget
        return whole
    plan = chosen.plan
    if not plan.remat_selective or not fits(plan) or \
            plan.est_step_time_s >= whole.plan.est_step_time_s:
        return whole
    return chosen.with_plan(plan.noted(
        "remat='auto' recomputes selectively: "
        + _against(plan, whole.plan, "recomputing whole layers")))


def _against(plan: Plan, other: Plan, what: str) -> str:
    """``plan``'s memory and estimate beside ``other``'s (the plan that does ``what``)."""
    return (f"{format_bytes(plan.peak_memory_bytes)} per device against "
            f"{format_bytes(other.peak_memory_bytes)} {what}, est. step "
            f"{plan.est_step_time_s:.4g} s against {other.est_step_time_s:.4g} s")
