"""Scans over stacked layers, inlined so that a pipeline can cut them anywhere.

A model written with ``jax.lax.scan`` over stacked layers (MaxText, Levanter, Flax ``nn.scan``)
has one ``scan`` equation in its loss forward, reading every layer's parameters as one stacked
array (``xs``). Kept whole, that equation lands in one pipeline stage with every layer. Here
such a *layer scan* is inlined: each iteration becomes a *unit* (``ir.scan_units``), the
body's equations renumbered, reading its own ``[1, ...]`` slice of each stacked parameter as a
loss input of its own (squeezed where the body first reads it), the carry chained from one
unit to the next. The pipeline pass then sees the layers as the unrolled model's: clustering
counts their operations, so it may cut between iterations or inside one (between a block's
attention and its MLP, to balance the stages), and each stage holds only its slices. The
runtime runs a stage's whole consecutive units as one shorter scan over its slices
(``scan_units.run_forward_eqns``), so a stage's layers still run as a loop,
``jax.checkpoint`` in the body included.

The step around the loss is split to match (``split_step``): every equation of the step that
is elementwise on a stacked value (the optimizer update: Adam's moments and the parameter
update are elementwise in the gradient) runs once per slice, so each slice's update and
optimizer state live on the stage that owns the slice; a step input that is stacked is sliced
where the caller's array lies (``PipelineProgram.input_splits``: the runtime runs those
slices before the step, no stage receives the whole array), and what the step returns is
concatenated back into the caller's layout (stacked leaves whole). Anything else that reads a
stacked value reads it whole, concatenated from its slices (correct, only not split), except
a sum over the leading axis (a global gradient norm), which sums each slice where it lies.

Pure: program forms in, program forms out; compiler and runtime build the same split from the
same trace, so value ids agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.ir.program import FlatEqn, FlatProgram, TensorKind
from autopar.ir.program_builder import ProgramBuilder, one_eqn, slice_aval
from autopar.ir.scan_units import LayerScan, ScanUnit
from autopar.ir.walk import flatten_closed_jaxpr

# Primitives that act element by element on operands of one shape (rank-0 operands broadcast):
# slicing their leading axis commutes with them, so they can run once per layer slice.
ELEMENTWISE = frozenset({
    "abs", "add", "add_any", "and", "atan2", "cbrt", "ceil", "clamp", "convert_element_type",
    "copy", "copy_p", "cos", "div", "eq", "erf", "exp", "exp2", "expm1", "floor", "ge", "gt",
    "integer_pow", "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min", "mul",
    "ne", "neg", "nextafter", "not", "or", "pow", "reduce_precision", "rem", "round", "rsqrt",
    "select_n", "sign", "sin", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor",
})


@dataclass(frozen=True)
class SplitForward:
    """The loss forward with its layer scans split: ``slices`` maps each stacked parameter
    input of the original forward to its slices' input ids (in iteration order)."""

    forward: FlatProgram
    slices: dict[int, tuple[int, ...]]
    scans: tuple[LayerScan, ...]


def find_layer_scans(forward: FlatProgram, diff_inputs: Sequence[int]) -> dict[int, list[int]]:
    """Layer scans of ``forward`` (equation index -> their stacked parameter inputs): scans of
    more than one iteration reading, as ``xs``, differentiated loss inputs that nothing else
    reads (a stacked parameter read elsewhere too stays whole, and so does its scan)."""
    readers: dict[int, list[int]] = {}
    for e in forward.eqns:
        for v in e.inputs:
            readers.setdefault(v, []).append(e.index)
    diff = set(diff_inputs)
    found: dict[int, list[int]] = {}
    for e in forward.eqns:
        if e.name != "scan" or int(e.params["length"]) < 2:
            continue
        first_x = e.params["num_consts"] + e.params["num_carry"]
        stacked = [v for v in e.inputs[first_x:] if v in diff and readers[v] == [e.index]]
        if stacked:
            found[e.index] = list(dict.fromkeys(stacked))
    return found


def split_forward(forward: FlatProgram, diff_inputs: Sequence[int]) -> SplitForward | None:
    """``forward`` with every layer scan inlined as units (None when it has none).

    Each stacked parameter input becomes ``length`` inputs (its ``[1, ...]`` slices, in its
    place among the inputs); other ``xs`` are sliced by equations before the first unit; the
    ``ys`` are concatenated after the last, under their original ids, and the last unit makes
    the final carries under theirs, so everything after the scan is unchanged."""
    scans = find_layer_scans(forward, diff_inputs)
    if not scans:
        return None
    b = ProgramBuilder(forward)
    slices: dict[int, tuple[int, ...]] = {}
    for fids in scans.values():
        for fid in fids:
            aval = forward.avals[fid]
            slices[fid] = tuple(b.value(slice_aval(aval), TensorKind.INPUT)
                                for _ in range(aval.shape[0]))
    in_ids: list[int] = []
    in_paths: list[str] = []
    for vid, path in zip(forward.in_ids, forward.in_paths, strict=True):
        parts = slices.get(vid, (vid,))
        in_ids.extend(parts)
        in_paths.extend([path] if vid not in slices else
                        [f"{path}[{i}]" for i in range(len(parts))])
    split: list[LayerScan] = []
    for e in forward.eqns:
        if e.index not in scans:
            b.copy(e)
            continue
        split.append(_inline_scan(b, e, slices))
    return SplitForward(b.program_with(in_ids, in_paths), slices, tuple(split))


def _inline_scan(b: ProgramBuilder, e: FlatEqn, slices: dict[int, tuple[int, ...]]) -> LayerScan:
    p = e.params
    nc, nk, length = p["num_consts"], p["num_carry"], int(p["length"])
    consts, carry, xs = e.inputs[:nc], list(e.inputs[nc:nc + nk]), e.inputs[nc + nk:]
    xs_parts = [slices[v] if v in slices else tuple(b.slice(v, i)[1] for i in range(length))
                for v in xs]
    body = flatten_closed_jaxpr(p["jaxpr"])
    # the body's constants and literals: one value each, shared by every iteration
    shared = {v: b.value(body.avals[v], body.kinds[v], c) for v, c in body.values.items()}
    ys = e.outputs[nk:]
    ys_parts: list[list[int]] = [[0] * length for _ in ys]
    order = list(range(length))[::-1] if p["reverse"] else list(range(length))
    units = []
    for k, i in enumerate(order):
        last = k == length - 1
        outs = tuple(e.outputs[:nk]) if last else tuple(b.value(b.avals[c])
                                                         for c in e.outputs[:nk])
        y_ids = tuple(b.value(slice_aval(b.avals[y])) for y in ys)
        for j, y in enumerate(y_ids):
            ys_parts[j][i] = y
        x_ids = tuple(parts[i] for parts in xs_parts)
        start = len(b.eqns)
        _inline_iteration(b, body, (*consts, *carry), x_ids, outs, y_ids, shared)
        units.append(ScanUnit(start, len(b.eqns), tuple(carry), x_ids, outs, y_ids))
        carry = list(outs)
    for y, parts in zip(ys, ys_parts, strict=True):
        b.concat(parts, y)
    return LayerScan(e, tuple(units), tuple(order), bool(p["reverse"]))


def _inline_iteration(b: ProgramBuilder, body: FlatProgram, leading: Sequence[int],
                      x_ids: Sequence[int], carry_out: Sequence[int], y_ids: Sequence[int],
                      shared: dict[int, int]) -> None:
    """Emit one iteration of ``body``: its consts and carries read ``leading``, each ``xs``
    the slice in ``x_ids`` squeezed where the body first reads it (a slice squeezed early would
    be live, as an activation, across every cut up to its use, which the unrolled layer's
    parameter never is); its new carries made as ``carry_out`` and its ``ys`` stacked as
    ``y_ids``."""
    ids = dict(shared)
    ids.update(zip(body.in_ids, leading, strict=False))
    squeeze = dict(zip(body.in_ids[len(leading):], x_ids, strict=True))
    # a new carry that a body equation makes is made under its unit's id directly
    made = {v for eqn in body.eqns for v in eqn.outputs}
    direct: dict[int, int] = {}
    for v, target in zip(body.out_ids, carry_out, strict=False):
        if v in made and v not in direct:
            direct[v] = target

    def read(v: int) -> int:
        if v in squeeze:
            ids[v] = b.value(body.avals[v])
            b.reshape(squeeze.pop(v), ids[v])
        return ids[v]

    for eqn in body.eqns:
        inputs = tuple(read(v) for v in eqn.inputs)
        for v in eqn.outputs:
            ids[v] = direct[v] if v in direct else b.value(body.avals[v])
        b.copy(eqn, inputs=inputs, outputs=tuple(ids[v] for v in eqn.outputs))
    for v, target in zip(body.out_ids, carry_out, strict=False):
        if direct.get(v) != target:  # a carry passed through, a constant, a repeated result
            b.same(read(v), target)
    for v, y in zip(body.out_ids[len(carry_out):], y_ids, strict=True):
        b.reshape(read(v), y)


@dataclass(frozen=True)
class SplitStep:
    """The step with its stacked values split: ``program`` (same inputs and outputs as the
    step), the index of its loss equation, and the equations slicing step inputs."""

    program: FlatProgram
    vg_index: int
    input_splits: frozenset[int]


def split_step(outer: FlatProgram, vg_index: int, fwd_in_ids: Sequence[int],
               slices: dict[int, tuple[int, ...]], diff_inputs: Sequence[int],
               first_grad: int) -> SplitStep:
    """The step ``outer`` with its loss equation reading the stacked parameters' slices and
    making their gradients' slices, and every elementwise equation on a stacked value run once
    per slice (see the module docstring).

    ``fwd_in_ids``: the original forward's inputs (aligned with the loss equation's operands);
    ``slices``: the stacked ones' slices (``split_forward``); ``diff_inputs``: the original
    differentiated inputs (aligned with the gradients, which start at output ``first_grad``)."""
    vg = outer.eqns[vg_index]
    seeds = {vg.inputs[k] for k, fid in enumerate(fwd_in_ids) if fid in slices}
    grads = {vg.outputs[first_grad + k]: fid for k, fid in enumerate(diff_inputs)
             if fid in slices}
    stacked = _stacked_values(outer, vg_index, seeds | set(grads))
    b = ProgramBuilder(outer)
    parts: dict[int, list[int]] = {}
    whole = set(outer.in_ids) | set(outer.values)
    input_splits: set[int] = set()
    inputs = set(outer.in_ids)

    def need_slices(v: int) -> list[int]:
        if v not in parts:
            made = [b.slice(v, i) for i in range(outer.avals[v].shape[0])]
            if v in inputs:
                input_splits.update(index for index, _ in made)
            parts[v] = [out for _, out in made]
        return parts[v]

    def need_whole(v: int) -> None:
        if v not in whole:
            b.concat(parts[v], v)
            whole.add(v)

    new_vg = vg_index
    for e in outer.eqns:
        if e.index == vg_index:
            ins: list[int] = []
            for fid, v in zip(fwd_in_ids, e.inputs, strict=True):
                if fid in slices:
                    ins.extend(need_slices(v))
                else:
                    need_whole(v)
                    ins.append(v)
            outs: list[int] = []
            for v in e.outputs:
                if v in grads:
                    # one gradient per slice, shaped as the slices the loss reads (the
                    # slice ids name the forward's values, not this program's)
                    piece = slice_aval(outer.avals[v])
                    parts[v] = [b.value(piece) for _ in slices[grads[v]]]
                    outs.extend(parts[v])
                else:
                    outs.append(v)
                    whole.add(v)
            new_vg = b.copy(e, inputs=tuple(ins), outputs=tuple(outs))
        elif e.outputs and e.outputs[0] in stacked and _splittable(outer, e):
            count = outer.avals[e.outputs[0]].shape[0]
            for v in e.outputs:
                parts[v] = [b.value(slice_aval(outer.avals[v])) for _ in range(count)]
            for i in range(count):
                ins = [v if not outer.avals[v].shape else need_slices(v)[i] for v in e.inputs]
                b.copy(e, params=_slice_params(e), inputs=tuple(ins),
                       outputs=tuple(parts[v][i] for v in e.outputs))
        elif (e.name == "reduce_sum" and e.inputs[0] not in whole and e.inputs[0] in parts
              and 0 in e.params["axes"]):
            _split_sum(b, e, parts[e.inputs[0]])
            whole.update(e.outputs)
        else:
            for v in e.inputs:
                need_whole(v)
            b.copy(e)
            whole.update(e.outputs)
    for v in outer.out_ids:
        need_whole(v)
    program = b.program_with(outer.in_ids, outer.in_paths)
    return SplitStep(program, new_vg, frozenset(input_splits))


def _split_sum(b: ProgramBuilder, e: FlatEqn, slices: Sequence[int]) -> None:
    """A sum over the leading axis (a global gradient norm's) as one sum per slice, where the
    slice lives, then the partial sums added: no stage gathers the whole stacked value."""
    out = e.outputs[0]
    if len(slices) == 1:
        b.copy(e, inputs=(slices[0],))
        return
    aval = b.avals[out]
    partial = [b.value(aval) for _ in slices]
    for vid, p in zip(slices, partial, strict=True):
        b.copy(e, inputs=(vid,), outputs=(p,))
    prim, params = one_eqn(lambda x, y: x + y, aval, aval)
    total = partial[0]
    for k, p in enumerate(partial[1:], start=2):
        made = out if k == len(partial) else b.value(aval)
        b.emit(prim, params, [total, p], [made])
        total = made


def _splittable(program: FlatProgram, e: FlatEqn) -> bool:
    """Elementwise over one shape with a leading axis (rank-0 operands broadcast), or a
    broadcast that does not map an operand dimension onto the leading axis."""
    shape = tuple(program.avals[e.outputs[0]].shape)
    if not shape or any(tuple(program.avals[v].shape) != shape for v in e.outputs):
        return False
    if e.name == "broadcast_in_dim":
        return 0 not in e.params["broadcast_dimensions"]
    if e.name not in ELEMENTWISE:
        return False
    return all(tuple(program.avals[v].shape) in ((), shape) for v in e.inputs)


def _slice_params(e: FlatEqn) -> dict[str, Any]:
    if e.name == "broadcast_in_dim":
        return dict(e.params, shape=(1, *e.params["shape"][1:]))
    return e.params


def _stacked_values(outer: FlatProgram, vg_index: int, seeds: set[int]) -> set[int]:
    """Values tied to ``seeds`` through splittable equations (operands and results of one
    shape), found with a union-find over those equations."""
    parent: dict[int, int] = {}

    def find(v: int) -> int:
        parent.setdefault(v, v)
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for e in outer.eqns:
        if e.index == vg_index or not e.outputs or not _splittable(outer, e):
            continue
        shape = tuple(outer.avals[e.outputs[0]].shape)
        tied = [v for v in (*e.inputs, *e.outputs) if tuple(outer.avals[v].shape) == shape]
        for v in tied[1:]:
            parent[find(v)] = find(tied[0])
    roots = {find(s) for s in seeds}
    return {v for v in list(parent) if find(v) in roots} | seeds
