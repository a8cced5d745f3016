"""The iterations of a scan over stacked layers, inlined into the pipeline's loss forward, and
how a stage runs them again as a loop.

``ir.scan_split`` inlines a *layer scan* (a scan over stacked layer parameters) into the loss
forward: one *unit* per iteration, a run of ordinary equations (its body's, renumbered), so
layer clustering sees every operation of every layer, as in the unrolled model, and may cut
inside an iteration (between a block's attention and its MLP) to balance stages. A unit is
described by what crosses its edges: the carries in and out, its ``[1, ...]`` slice of every
``xs`` operand and of every ``ys`` result.

The runtime does not run a stage's layers as unrolled code: every run of *whole* consecutive
units of one layer scan runs as one scan of as many iterations over their slices concatenated
(``run_forward_eqns``), the original body (``jax.checkpoint`` included) unchanged; only a unit
cut between two stages runs its equations one by one. The stage cost ILP traces its pieces the
same way (``piece_cost.piece_train_graph``), so it plans what runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax

from autopar.ir.program import FlatEqn, FlatProgram, bind_eqn


@dataclass(frozen=True)
class ScanUnit:
    """One iteration of a layer scan, inlined: forward equations ``start`` .. ``stop - 1``.
    ``carry_in``/``carry_out``: the loop carries before and after it; ``xs``: its ``[1, ...]``
    slice of each ``xs`` operand; ``ys``: its ``[1, ...]`` slice of each ``ys`` result."""

    start: int
    stop: int
    carry_in: tuple[int, ...]
    xs: tuple[int, ...]
    carry_out: tuple[int, ...]
    ys: tuple[int, ...]


@dataclass(frozen=True)
class LayerScan:
    """One layer scan of the loss forward, inlined: ``scan`` is its original equation (its
    consts are the first ``num_consts`` inputs; rebound with a shorter length to run whole
    units as a loop); ``units`` its iterations in the order they run (iteration
    ``length - 1`` first when ``reverse``); ``iterations[k]`` is the iteration unit ``k``
    runs."""

    scan: FlatEqn
    units: tuple[ScanUnit, ...]
    iterations: tuple[int, ...]
    reverse: bool

    @property
    def length(self) -> int:
        return len(self.units)


@dataclass(frozen=True)
class UnitRun:
    """Whole consecutive units ``units`` of layer scan ``scan``, found at position
    ``position`` of a list of equation indices and spanning ``span`` of them."""

    position: int
    span: int
    scan: int
    units: tuple[int, ...]


def whole_unit_runs(eqn_indices: Sequence[int], scans: Sequence[LayerScan]) -> list[UnitRun]:
    """The runs of whole consecutive units of one layer scan among ``eqn_indices`` (taken in
    that order): a unit counts when every one of its equations is there, in order."""
    unit_at = {u.start: (s, k) for s, scan in enumerate(scans)
               for k, u in enumerate(scan.units) if u.stop > u.start}
    indices = list(eqn_indices)
    runs = []
    i = 0
    while i < len(indices):
        s, k = unit_at.get(indices[i], (-1, -1))
        run: list[int] = []
        span = 0
        # a layer scan's units are inlined back to back, so the next one starts where the
        # last ended
        while s >= 0 and k < len(scans[s].units) and _whole(indices, i + span,
                                                             scans[s].units[k]):
            run.append(k)
            span += scans[s].units[k].stop - scans[s].units[k].start
            k += 1
        if run:
            runs.append(UnitRun(i, span, s, tuple(run)))
            i += span
        else:
            i += 1
    return runs


def _whole(indices: list[int], at: int, unit: ScanUnit) -> bool:
    return indices[at:at + unit.stop - unit.start] == list(range(unit.start, unit.stop))


def run_forward_eqns(forward: FlatProgram, eqn_indices: Sequence[int], env: dict[int, Any],
                     scans: Sequence[LayerScan],
                     on_value: Callable[[int, Any], Any] | None = None,
                     bind: Callable[[Any, Sequence[Any]], Sequence[Any]] = bind_eqn) -> None:
    """Apply the forward equations ``eqn_indices`` to ``env``, each run of whole consecutive
    units of one layer scan as one scan over their slices (the stage's shorter loop), every
    other equation as ``program.run_eqns`` would. ``on_value(id, value)``, when given, may
    replace each other equation's result as it is made (the runtime holds values to the stage
    plan's shardings there); ``bind(eqn, operands)`` applies each other equation (the runtime
    runs some per batch group there, ``runtime.param_copies``)."""
    indices = list(eqn_indices)
    runs = {run.position: run for run in whole_unit_runs(indices, scans)}
    i = 0
    while i < len(indices):
        run = runs.get(i)
        if run is not None:
            scan = scans[run.scan]
            _run_units(forward, scan, [scan.units[k] for k in run.units], env)
            i += run.span
            continue
        eqn = forward.eqns[indices[i]]
        operands = [env[v] if v in env else forward.values[v] for v in eqn.inputs]
        results = bind(eqn, operands)
        if on_value is not None:
            results = [on_value(v, x) for v, x in zip(eqn.outputs, results, strict=True)]
        env.update(zip(eqn.outputs, results, strict=True))
        i += 1


def _run_units(forward: FlatProgram, scan: LayerScan, units: Sequence[ScanUnit],
               env: dict[int, Any]) -> None:
    """Whole consecutive units as one scan of ``len(units)`` iterations: the scan's consts,
    the first unit's carries, each ``xs`` the units' slices concatenated in iteration order;
    the final carries under the last unit's ids and each unit's ``ys`` sliced back out."""
    p = scan.scan.params
    nc, nk, n = p["num_consts"], p["num_carry"], len(units)

    def read(v: int) -> Any:
        return env[v] if v in env else forward.values[v]

    in_order = list(units[::-1] if scan.reverse else units)  # iteration order, as xs stack
    xs = [jax.numpy.concatenate([read(u.xs[j]) for u in in_order]) if n > 1
          else read(in_order[0].xs[j]) for j in range(len(units[0].xs))]
    operands = [read(v) for v in scan.scan.inputs[:nc]] + [read(v) for v in units[0].carry_in]
    merged = replace(scan.scan, params=dict(p, length=n, unroll=1))
    results = bind_eqn(merged, operands + xs)
    env.update(zip(units[-1].carry_out, results[:nk], strict=True))
    for j, ys in enumerate(results[nk:]):
        for i, u in enumerate(in_order):
            env[u.ys[j]] = ys if n == 1 else jax.lax.slice_in_dim(ys, i, i + 1)
