"""Strategies for ``gather`` and the ``scatter`` family, derived from their dimension numbers.

Each mesh axis is given one *role* (or none), and the specs of every tensor follow from the
roles. All mappings come from the dimension numbers (jax puts the index vector in the last
dimension of the indices), so the embedding lookup, ``take_along_axis`` and any other gather
are handled by the same code.

gather(operand, indices) -> output
    * ``batch i``: indices dim ``i`` (not the index vector) split, and the output dim it becomes
      split alike; the operand stays whole on that axis — unless ``i`` is an indices batching
      dim, whose paired operand batching dim is split too (each device gathers from its own
      rows). No communication.
    * ``pass d``: operand dim ``d`` taken whole by every slice (``slice_sizes[d]`` is the full
      size, ``d`` not indexed) split, with the output offset dim it becomes. No communication.
    * ``vocab d``: operand dim ``d`` indexed with slice size 1 split (vocabulary parallel):
      each device gathers the rows it holds, zeros elsewhere, and an all-reduce of the output
      (the per-device output buffer) over that axis completes it.

scatter*(operand, indices, updates) -> output (output spec = operand spec always)
    * ``batch i`` on an indices batching dim: indices dim, updates scatter dim and the paired
      operand/output batching dim split together. No communication; any scatter kind.
    * ``batch i`` on another indices dim: indices and updates split, operand and output whole;
      each device applies its share of the updates and an all-reduce of the output completes
      it. Only for ``scatter-add``: sums of partial sums are sums (XLA keeps the operand
      counted once, checked in the tests); an overwriting scatter has no such decomposition.
    * ``pass d``: operand dim ``d`` covered whole by every update window split with the
      updates' window dim and the output. No communication.
    * ``vocab d``: operand dim ``d`` indexed with window size 1 split, indices and updates
      whole: each device applies the updates that land in its rows. No communication; any
      kind (every index lands on exactly one device).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from autopar.compiler.intra_op.strategies.base import (
    Strategy,
    StrategyContext,
    divisible,
    shard_bytes,
)
from autopar.compiler.intra_op.strategies.data_common import (
    REPLICATED,
    active_axes,
    make_strategy,
    spec_from_axes,
)
from autopar.plan import CollectiveKind

__all__ = ["RULES", "gather_strategies", "scatter_strategies"]


@dataclass(frozen=True)
class _Role:
    """What one mesh axis does: ``kind`` is batch / pass / vocab; ``dim`` is an indices dim
    (batch) or an operand dim (pass, vocab). ``places`` lists (tensor slot, dim) pairs the
    axis splits; ``reduces`` marks roles that leave partial results (all-reduce)."""

    kind: str
    dim: int
    places: tuple[tuple[int, int], ...]
    reduces: bool = False

    @property
    def label(self) -> str:
        return f"{self.kind}{self.dim}"


# Tensor slots used in ``_Role.places``: operand, indices, updates (scatter), output.
_OPERAND, _INDICES, _UPDATES, _OUTPUT = 0, 1, 2, 3


def _window_map(ndim: int, excluded: set[int], window_dims: tuple[int, ...]) -> dict[int, int]:
    """Operand dims not in ``excluded``, ascending, paired with ``window_dims`` in order
    (gather: output offset dims; scatter: update window dims)."""
    kept = [d for d in range(ndim) if d not in excluded]
    return dict(zip(kept, window_dims, strict=True))


def _gather_roles(ctx: StrategyContext) -> list[_Role]:
    operand, out = ctx.inputs[0], ctx.outputs[0]
    dn = ctx.node.params["dimension_numbers"]
    slice_sizes = tuple(ctx.node.params["slice_sizes"])
    op_batch = tuple(dn.operand_batching_dims)
    idx_batch = tuple(dn.start_indices_batching_dims)
    offsets = _window_map(operand.ndim, set(dn.collapsed_slice_dims) | set(op_batch),
                          tuple(dn.offset_dims))
    out_batch = [d for d in range(out.ndim) if d not in set(dn.offset_dims)]
    roles: list[_Role] = []
    for i, o in enumerate(out_batch):  # indices dims but the last (index vector) one
        places = [(_INDICES, i), (_OUTPUT, o)]
        if i in idx_batch:
            places.append((_OPERAND, op_batch[idx_batch.index(i)]))
        roles.append(_Role("batch", i, tuple(places)))
    indexed = set(dn.start_index_map)
    for d in range(operand.ndim):
        if d in offsets and d not in indexed and slice_sizes[d] == operand.shape[d]:
            roles.append(_Role("pass", d, ((_OPERAND, d), (_OUTPUT, offsets[d]))))
        elif d in indexed and slice_sizes[d] == 1 and d not in op_batch:
            roles.append(_Role("vocab", d, ((_OPERAND, d),), reduces=True))
    return roles


def _scatter_roles(ctx: StrategyContext, additive: bool) -> list[_Role]:
    operand, updates = ctx.inputs[0], ctx.inputs[2]
    dn = ctx.node.params["dimension_numbers"]
    op_batch = tuple(dn.operand_batching_dims)
    idx_batch = tuple(dn.scatter_indices_batching_dims)
    windows = _window_map(operand.ndim, set(dn.inserted_window_dims) | set(op_batch),
                          tuple(dn.update_window_dims))
    upd_scatter = [d for d in range(updates.ndim) if d not in set(dn.update_window_dims)]
    roles: list[_Role] = []
    for i, u in enumerate(upd_scatter):  # indices dims but the last (index vector) one
        if i in idx_batch:
            d = op_batch[idx_batch.index(i)]
            places: tuple[tuple[int, int], ...] = (
                (_INDICES, i), (_UPDATES, u), (_OPERAND, d), (_OUTPUT, d))
            roles.append(_Role("batch", i, places))
        elif additive:
            roles.append(_Role("batch", i, ((_INDICES, i), (_UPDATES, u)), reduces=True))
    indexed = set(dn.scatter_dims_to_operand_dims)
    for d in range(operand.ndim):
        window = updates.shape[windows[d]] if d in windows else 1
        if d in windows and d not in indexed and window == operand.shape[d]:
            places = ((_OPERAND, d), (_UPDATES, windows[d]), (_OUTPUT, d))
            roles.append(_Role("pass", d, places))
        elif d in indexed and window == 1 and d not in op_batch:
            roles.append(_Role("vocab", d, ((_OPERAND, d), (_OUTPUT, d))))
    return roles


def _assignments(ctx: StrategyContext, roles: list[_Role]) -> list[dict[_Role, list[str]]]:
    """Every way to give each active mesh axis one role or none (axes in mesh order, so two
    axes on one dimension split it x-major, as ``enumerate_specs`` does)."""
    axes = active_axes(ctx)
    result = []
    for choice in itertools.product([None, *roles], repeat=len(axes)):
        by_role: dict[_Role, list[str]] = {}
        for axis, role in zip(axes, choice, strict=True):
            if role is not None:
                by_role.setdefault(role, []).append(axis)
        result.append(by_role)
    return result


def _build(
    ctx: StrategyContext, roles: list[_Role], slots: dict[int, int]
) -> list[Strategy]:
    """Turn role assignments into strategies. ``slots`` maps tensor slot -> operand index
    (output slot: -1). Assignments that split a dimension unevenly are dropped."""
    infos = {s: (ctx.outputs[0] if i < 0 else ctx.inputs[i]) for s, i in slots.items()}
    strategies: list[Strategy] = []
    for by_role in _assignments(ctx, roles):
        dims: dict[int, list[list[str]]] = {s: [[] for _ in range(infos[s].ndim)] for s in slots}
        for role, axes in by_role.items():
            for slot, d in role.places:
                dims[slot][d].extend(axes)
        if not all(divisible(infos[s].shape[d], ctx, axes)
                   for s in slots for d, axes in enumerate(dims[s])):
            continue
        specs = {s: spec_from_axes(dims[s]) for s in slots}
        work_axes = [a for r, axes in by_role.items() if not r.reduces for a in axes]
        # Partial results: an all-reduce of the per-device output buffer, one per reducing
        # role over that role's axes — XLA's partitioner handles one split dimension at a
        # time and emits exactly that (two roles on x and y: two all-reduces, not one over
        # both axes; one role on x+y: one).
        nbytes = shard_bytes(infos[_OUTPUT], specs[_OUTPUT], ctx)
        collectives = [ctx.collective(CollectiveKind.ALL_REDUCE, nbytes, axes)
                       for r, axes in by_role.items() if r.reduces]
        parts = sorted(by_role.items(), key=lambda kv: ctx.axis_names.index(kv[1][0]))
        name = " ".join(f"{r.label}:{'+'.join(a)}" for r, a in parts) or REPLICATED
        inputs = [specs[s] for s in sorted(slots, key=lambda s: slots[s]) if slots[s] >= 0]
        strategies.append(make_strategy(ctx, name, [specs[_OUTPUT]], inputs, work_axes,
                                        collectives))
    return strategies


def gather_strategies(ctx: StrategyContext) -> list[Strategy]:
    """Strategies of ``gather``: combinations of batch / pass / vocab roles over the axes."""
    return _build(ctx, _gather_roles(ctx), {_OPERAND: 0, _INDICES: 1, _OUTPUT: -1})


def scatter_strategies(ctx: StrategyContext, additive: bool) -> list[Strategy]:
    """Strategies of a scatter; ``additive`` (scatter-add) also splits the updates' scatter
    dims with an all-reduce of the output."""
    slots = {_OPERAND: 0, _INDICES: 1, _UPDATES: 2, _OUTPUT: -1}
    return _build(ctx, _scatter_roles(ctx, additive), slots)


def _scatter_rule(additive: bool) -> Callable[[StrategyContext], list[Strategy]]:
    def rule(ctx: StrategyContext) -> list[Strategy]:
        return scatter_strategies(ctx, additive)

    return rule


RULES: dict[str, Callable[[StrategyContext], list[Strategy]]] = {
    "gather": gather_strategies,
    "scatter-add": _scatter_rule(True),
    "scatter": _scatter_rule(False),
    "scatter-sub": _scatter_rule(False),
    "scatter-mul": _scatter_rule(False),
    "scatter-min": _scatter_rule(False),
    "scatter-max": _scatter_rule(False),
}
