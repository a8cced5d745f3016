"""The flat program: a train step's jaxpr with nested calls inlined and every value numbered.

Both halves of autopar read this one representation: the compiler builds its ``OpGraph`` from
it, and the runtime evaluates it again with sharding constraints on the tensors a plan names.
Because both number values the same way (by the deterministic walk below), a tensor id in a
``Plan`` means the same value to the compiler that chose its sharding and to the runtime that
applies it.

Inlined: ``jit``/``pjit``, ``closed_call``/``core_call``, ``custom_jvp_call``,
``custom_vjp_call`` and ``checkpoint``/``remat``. Kept whole: ``while``, ``cond`` and every
other primitive (their bodies are not numbered), and ``scan`` unless the program is flattened
with ``expand_scans``.

**Scan regions** (``expand_scans=True``; what one-stage planning traces): a ``scan`` becomes a
*region* of consecutive equations: one ``autopar_scan_enter`` per scan operand (its result is
the body's input value: the same value for consts and carries, one slice of the stacked
operand for ``xs``), the body's own equations (numbered once, inlined calls and nested scans
expanded alike), and one ``autopar_scan_exit`` per scan result (it reads the body's output:
the final carry, or one slice of the stacked ``ys``). Body values are numbered like any other
value, with their per-iteration shapes; ``FlatEqn.repeat`` says how often an equation runs per
step (the product of the lengths of the scans around it). ``FlatProgram.evaluate`` runs a
region as one ``jax.lax.scan`` whose body evaluates the body's equations with the same hooks,
so a plan can constrain values inside the loop body.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from autopar.errors import TraceError
from autopar.ir.loss_markers import PIPELINE_BOUNDARY, VALUE_AND_GRAD, expand_value_and_grad

# How an autopar_value_and_grad equation's loss function becomes value and gradient code.
LossExpansion = Callable[[Any], Callable[..., list[Any]]]

# Call-like primitives whose body is inlined, and the parameter that holds the body. Bodies are
# traced with the call's operands in order (for custom_jvp/vjp the consts come first already).
INLINED_CALLS: dict[str, str] = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
}


# Calls that rematerialise their body in the backward (``jax.checkpoint``).
REMAT_CALLS = frozenset({"checkpoint", "remat", "remat2"})

# The two ends of a scan region (never bound: ``FlatProgram.evaluate`` runs the region as a
# scan). Their parameters: ``role`` (``const``, ``carry`` or ``xs`` for an enter: which operand
# group of the scan it reads; ``carry`` or ``ys`` for an exit) and the scan's ``length``.
SCAN_ENTER = jcore.Primitive("autopar_scan_enter")
SCAN_EXIT = jcore.Primitive("autopar_scan_exit")


class TensorKind:
    """Where a numbered value comes from (plain strings: they are stored in JSON)."""

    INPUT = "input"
    CONST = "const"
    LITERAL = "literal"
    INTERMEDIATE = "intermediate"


@dataclass(frozen=True)
class FlatEqn:
    """One primitive application of the flat program; operands and results are value ids."""

    index: int
    primitive: Any  # jax.extend.core.Primitive
    params: dict[str, Any]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    context: Any = None  # the equation's JaxprEqnContext (e.g. compute type), re-entered on bind
    name_stack: str = ""  # the source name stack (``jvp(f)``, ``transpose(...)``): provenance
    repeat: int = 1  # times it runs per step: the lengths of the scan regions around it

    @property
    def name(self) -> str:
        return self.primitive.name


@dataclass(frozen=True)
class ScanRegion:
    """A ``scan`` expanded into equations ``start`` .. ``stop - 1`` of a flat program.

    ``enters[k]`` is the equation that reads scan operand ``k`` (consts, then carries, then
    ``xs``); ``exits[j]`` the one that makes scan result ``j`` (carries, then ``ys``); the body's
    equations are ``body_start`` .. ``body_stop - 1``. ``params`` are the scan's own (to bind
    it whole when nothing inside is constrained), ``primitive`` and ``context`` its equation's.
    """

    start: int
    stop: int
    body_start: int
    body_stop: int
    enters: tuple[int, ...]
    exits: tuple[int, ...]
    params: dict[str, Any]
    primitive: Any = None
    context: Any = None

    @property
    def length(self) -> int:
        return int(self.params["length"])

    @property
    def num_consts(self) -> int:
        return int(self.params["num_consts"])

    @property
    def num_carry(self) -> int:
        return int(self.params["num_carry"])

    def carry_pairs(self) -> list[tuple[int, int]]:
        """(enter, exit) equation indices of each carry: one loop value, read and remade."""
        first = self.num_consts
        return [(self.enters[first + k], self.exits[k]) for k in range(self.num_carry)]


@dataclass
class FlatProgram:
    """A train step as a flat list of equations over numbered values.

    ``avals[i]`` is the abstract value (shape, dtype) of value ``i``; ``kinds[i]`` says whether it
    is a step input, a closed-over constant, a literal or an equation result. ``in_ids``/``out_ids``
    follow the flattened pytrees of the step's arguments and results, whose leaf paths are
    ``in_paths``/``out_paths`` (``state/params/w``: the argument name, then the pytree keys).
    """

    eqns: list[FlatEqn]
    avals: dict[int, Any]
    kinds: dict[int, str]
    values: dict[int, Any]  # constants and literals: their concrete values
    in_ids: list[int]
    out_ids: list[int]
    in_paths: list[str]
    out_paths: list[str]
    in_tree: Any
    out_tree: Any
    arg_leaf_ranges: list[tuple[int, int]] = field(default_factory=list)
    # scan regions by their first equation's index (empty unless flattened with expand_scans)
    regions: dict[int, ScanRegion] = field(default_factory=dict)

    @property
    def num_eqns(self) -> int:
        return len(self.eqns)

    def leaf_arg_indices(self) -> list[int]:
        """For each input leaf, the index of the positional argument it belongs to."""
        owner = [0] * len(self.in_ids)
        for arg, (start, stop) in enumerate(self.arg_leaf_ranges):
            owner[start:stop] = [arg] * (stop - start)
        return owner

    def evaluate(
        self,
        flat_args: Sequence[Any],
        on_value: Callable[[int, Any], Any] | None = None,
        on_operand: Callable[[int, int, Any], Any] | None = None,
    ) -> list[Any]:
        """Run the program on ``flat_args`` (arrays or tracers); returns the flat results.

        ``on_value(id, value)`` is called for every input and equation result and may return a
        replacement; ``on_operand(eqn_index, position, value)`` likewise for every operand as an
        equation reads it. The runtime uses them to put ``with_sharding_constraint`` on the
        plan's chosen tensors (as produced, and as each consumer needs them).
        """
        env: dict[int, Any] = dict(self.values)
        for vid, arg in zip(self.in_ids, flat_args, strict=True):
            env[vid] = arg
            if on_value is not None:
                env[vid] = on_value(vid, arg)
        self.run_range(0, len(self.eqns), env, on_value, on_operand)
        return [env[i] for i in self.out_ids]

    def run_range(
        self,
        start: int,
        stop: int,
        env: dict[int, Any],
        on_value: Callable[[int, Any], Any] | None = None,
        on_operand: Callable[[int, int, Any], Any] | None = None,
    ) -> None:
        """Apply equations ``start`` .. ``stop - 1`` to ``env`` (value id -> value), a scan
        region as one scan (see ``evaluate`` for the hooks)."""
        i = start
        while i < stop:
            region = self.regions.get(i)
            if region is not None:
                self.run_region(region, env, on_value, on_operand)
                i = region.stop
                continue
            eqn = self.eqns[i]
            operands = [env[v] if v in env else self.values[v] for v in eqn.inputs]
            if on_operand is not None:
                operands = [on_operand(eqn.index, k, v) for k, v in enumerate(operands)]
            for vid, value in zip(eqn.outputs, bind_eqn(eqn, operands), strict=True):
                env[vid] = value if on_value is None else on_value(vid, value)
            i += 1

    def run_region(
        self,
        region: ScanRegion,
        env: dict[int, Any],
        on_value: Callable[[int, Any], Any] | None = None,
        on_operand: Callable[[int, int, Any], Any] | None = None,
    ) -> None:
        """Run one scan region: the scan bound whole when there are no hooks, else rebuilt
        with ``jax.lax.scan`` around a body that evaluates the region's equations with them
        (the enters' operands are hooked as the scan reads them, the body's results as the
        body returns them, the exits' results after the loop)."""
        enters = [self.eqns[e] for e in region.enters]
        exits = [self.eqns[e] for e in region.exits]
        operands = [_read(env, self.values, e.inputs[0]) for e in enters]
        if on_operand is not None:
            operands = [on_operand(e.index, 0, v) for e, v in zip(enters, operands, strict=True)]
        if on_value is None and on_operand is None:
            results = _bind_scan(region, operands)
        else:
            nc, nk = region.num_consts, region.num_carry
            consts, init, xs = operands[:nc], operands[nc:nc + nk], operands[nc + nk:]

            def body(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
                inner = dict(env)
                for e, value in zip(enters, [*consts, *carry, *x], strict=True):
                    vid = e.outputs[0]
                    inner[vid] = value if on_value is None else on_value(vid, value)
                self.run_range(region.body_start, region.body_stop, inner, on_value, on_operand)
                outs = [_read(inner, self.values, e.inputs[0]) for e in exits]
                if on_operand is not None:
                    outs = [on_operand(e.index, 0, v) for e, v in zip(exits, outs, strict=True)]
                return outs[:nk], outs[nk:]

            p = region.params
            final, ys = jax.lax.scan(body, init, xs, length=region.length,
                                     reverse=bool(p.get("reverse", False)),
                                     unroll=p.get("unroll", 1))
            results = [*final, *ys]
        for e, value in zip(exits, results, strict=True):
            vid = e.outputs[0]
            env[vid] = value if on_value is None else on_value(vid, value)


def _read(env: dict[int, Any], values: dict[int, Any], vid: int) -> Any:
    return env[vid] if vid in env else values[vid]


def _bind_scan(region: ScanRegion, operands: Sequence[Any]) -> Sequence[Any]:
    """The region's scan applied whole, as traced."""
    bind_params = region.primitive.get_bind_params(region.params)
    if region.context is not None:
        with region.context.manager:
            return region.primitive.bind(*operands, **bind_params)
    return region.primitive.bind(*operands, **bind_params)


def bind_eqn(eqn: FlatEqn, operands: Sequence[Any]) -> Sequence[Any]:
    """Apply one equation to ``operands``; returns its results as a sequence."""
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    if eqn.context is not None:
        with eqn.context.manager:
            result = eqn.primitive.bind(*operands, **bind_params)
    else:
        result = eqn.primitive.bind(*operands, **bind_params)
    return result if eqn.primitive.multiple_results else (result,)


def run_eqns(program: FlatProgram, eqn_indices: Sequence[int], env: dict[int, Any]) -> None:
    """Apply the equations ``eqn_indices`` of ``program`` in order, reading and writing ``env``
    (value id -> value); constants and literals are read from the program. A scan region runs
    whole where its first equation is listed (its other equations are skipped)."""
    if not program.regions:
        for i in eqn_indices:
            eqn = program.eqns[i]
            operands = [env[v] if v in env else program.values[v] for v in eqn.inputs]
            env.update(zip(eqn.outputs, bind_eqn(eqn, operands), strict=True))
        return
    inside = -1  # equations before this index belong to a region already run
    for i in eqn_indices:
        if i < inside:
            continue
        region = program.regions.get(i)
        if region is not None:
            program.run_region(region, env)
            inside = region.stop
            continue
        eqn = program.eqns[i]
        operands = [env[v] if v in env else program.values[v] for v in eqn.inputs]
        env.update(zip(eqn.outputs, bind_eqn(eqn, operands), strict=True))


class _Numberer:
    """Walks a jaxpr, inlining calls and giving every value a fresh integer id.

    ``keep_markers``: keep ``autopar_value_and_grad`` as one equation and the pipeline-boundary
    markers as equations (the pipeline pass reads them); otherwise the first is inlined as the
    forward and backward it stands for and the markers vanish (they are identities).
    ``expand_scans``: number every ``scan``'s body as a region (see the module docstring)."""

    def __init__(self, keep_markers: bool = False,
                 expand_loss: LossExpansion | None = None, expand_scans: bool = False) -> None:
        self.keep_markers = keep_markers
        self.expand_loss = expand_loss or expand_value_and_grad
        self.expand_scans = expand_scans
        self.eqns: list[FlatEqn] = []
        self.avals: dict[int, Any] = {}
        self.kinds: dict[int, str] = {}
        self.values: dict[int, Any] = {}
        self.regions: dict[int, ScanRegion] = {}
        self.repeat = 1  # the lengths of the scan regions being walked, multiplied

    def new_id(self, aval: Any, kind: str, value: Any = None) -> int:
        vid = len(self.avals)
        self.avals[vid] = aval
        self.kinds[vid] = kind
        if kind in (TensorKind.CONST, TensorKind.LITERAL):
            self.values[vid] = value
        return vid

    def program(
        self,
        in_ids: list[int],
        out_ids: list[int],
        in_paths: list[str],
        out_paths: list[str],
        in_tree: Any,
        out_tree: Any,
        arg_leaf_ranges: list[tuple[int, int]],
    ) -> FlatProgram:
        """The program walked so far, with these inputs and outputs."""
        return FlatProgram(self.eqns, self.avals, self.kinds, self.values, in_ids, out_ids,
                           in_paths, out_paths, in_tree, out_tree, arg_leaf_ranges,
                           regions=dict(self.regions))

    def walk(self, jaxpr: Any, consts: Sequence[Any], operand_ids: Sequence[int]) -> list[int]:
        const_ids = [
            self.new_id(var.aval, TensorKind.CONST, const)
            for var, const in zip(jaxpr.constvars, consts, strict=True)
        ]
        return self.walk_ids(jaxpr, const_ids, operand_ids)

    def walk_ids(
        self, jaxpr: Any, const_ids: Sequence[int], operand_ids: Sequence[int]
    ) -> list[int]:
        """Like ``walk``, with the constvars bound to existing value ids."""
        env: dict[Any, int] = {}
        for var, vid in zip(jaxpr.constvars, const_ids, strict=True):
            env[var] = vid
        for var, vid in zip(jaxpr.invars, operand_ids, strict=True):
            env[var] = vid

        def read(atom: Any) -> int:
            if isinstance(atom, jcore.Literal):
                return self.new_id(atom.aval, TensorKind.LITERAL, atom.val)
            return env[atom]

        for eqn in jaxpr.eqns:
            operands = [read(a) for a in eqn.invars]
            body_param = INLINED_CALLS.get(eqn.primitive.name)
            name = eqn.primitive.name
            if name == PIPELINE_BOUNDARY and not self.keep_markers:
                results = operands
            elif name == VALUE_AND_GRAD and not self.keep_markers:
                expanded = jax.make_jaxpr(self.expansion(eqn.params["loss"]))(
                    *[v.aval for v in eqn.invars]
                )
                results = self.walk(expanded.jaxpr, expanded.consts, operands)
            elif body_param is not None and body_param in eqn.params:
                if name in REMAT_CALLS and eqn.params.get("prevent_cse", False):
                    operands = self.barrier(operands)
                body = eqn.params[body_param]
                inner, inner_consts = (
                    (body.jaxpr, body.consts) if hasattr(body, "consts") else (body, ())
                )
                results = self.walk(inner, inner_consts, operands)
            elif name == "scan" and self.expand_scans:
                results = self.scan_region(eqn, operands)
            else:
                results = [self.new_id(v.aval, TensorKind.INTERMEDIATE) for v in eqn.outvars]
                self.append(eqn.primitive, dict(eqn.params), operands, results,
                            getattr(eqn, "ctx", None), str(eqn.source_info.name_stack))
            for var, vid in zip(eqn.outvars, results, strict=True):
                env[var] = vid
        return [read(a) for a in jaxpr.outvars]

    def append(self, primitive: Any, params: dict[str, Any], inputs: Sequence[int],
               outputs: Sequence[int], context: Any = None, name_stack: str = "") -> int:
        """Add one equation, run as often as the scan regions being walked say."""
        index = len(self.eqns)
        self.eqns.append(FlatEqn(index=index, primitive=primitive, params=params,
                                 inputs=tuple(inputs), outputs=tuple(outputs), context=context,
                                 name_stack=name_stack, repeat=self.repeat))
        return index

    def scan_region(self, eqn: Any, operands: Sequence[int]) -> list[int]:
        """Number a ``scan`` as a region: an enter per operand, the body walked once with its
        equations repeated ``length`` times (nested scans multiply), an exit per result."""
        params = dict(eqn.params)
        closed = params["jaxpr"]
        body = closed.jaxpr
        nc, nk = params["num_consts"], params["num_carry"]
        length = int(params["length"])
        context, stack = getattr(eqn, "ctx", None), str(eqn.source_info.name_stack)
        start = len(self.eqns)
        body_in, enters = [], []
        for k, (var, vid) in enumerate(zip(body.invars, operands, strict=True)):
            role = "const" if k < nc else "carry" if k < nc + nk else "xs"
            out = self.new_id(var.aval, TensorKind.INTERMEDIATE)
            enters.append(self.append(SCAN_ENTER, {"role": role, "length": length}, [vid],
                                      [out], None, stack))
            body_in.append(out)
        outer_repeat = self.repeat
        self.repeat = outer_repeat * length
        try:
            body_start = len(self.eqns)
            body_out = self.walk(body, closed.consts, body_in)
            body_stop = len(self.eqns)
            results, exits = [], []
            for k, (var, vid) in enumerate(zip(eqn.outvars, body_out, strict=True)):
                out = self.new_id(var.aval, TensorKind.INTERMEDIATE)
                role = "carry" if k < nk else "ys"
                exits.append(self.append(SCAN_EXIT, {"role": role, "length": length}, [vid],
                                         [out], None, stack))
                results.append(out)
        finally:
            self.repeat = outer_repeat
        self.regions[start] = ScanRegion(
            start=start, stop=len(self.eqns), body_start=body_start, body_stop=body_stop,
            enters=tuple(enters), exits=tuple(exits), params=params, primitive=eqn.primitive,
            context=context)
        return results

    def expansion(self, loss: Any) -> Callable[..., list[Any]]:
        """What an ``autopar_value_and_grad`` equation is inlined as: the plain value and
        gradient, or what the ``expand_loss`` given makes of it (its rematerialised form,
        ``remat_loss.flatten_step_rematerialised``)."""
        return self.expand_loss(loss)

    def barrier(self, operands: Sequence[int]) -> list[int]:
        """Each array operand through its own ``optimization_barrier``: what JAX's lowering does
        for a ``checkpoint`` with ``prevent_cse``, so that XLA cannot merge the recomputed
        forward back into the original once the call is inlined (one barrier per operand, so
        the sharding pass need not give unrelated tensors one layout)."""
        out = []
        for vid in operands:
            if self.kinds[vid] == TensorKind.LITERAL:
                out.append(vid)
                continue
            closed = jax.make_jaxpr(jax.lax.optimization_barrier)(self.avals[vid])
            out.extend(self.walk(closed.jaxpr, closed.consts, [vid]))
        return out


def argument_names(fn: Callable, nargs: int) -> list[str]:
    """Names of the first ``nargs`` positional parameters of ``fn`` (``argN`` where unknown)."""
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:nargs]]
    return names + [f"arg{i}" for i in range(len(names), nargs)]


def leaf_path(prefix: str, keypath: Sequence[Any]) -> str:
    """``state/params/w`` for the leaf at ``keypath`` under the argument ``prefix``."""
    rest = jax.tree_util.keystr(tuple(keypath), simple=True, separator="/")
    return f"{prefix}/{rest}" if rest else prefix


def is_array_like(leaf: Any) -> bool:
    """Arrays, tracers, ShapeDtypeStructs and Python or NumPy scalars."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return True
    return isinstance(leaf, (bool, int, float, complex, np.number))


def _abstract_leaf(leaf: Any) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    if isinstance(leaf, (bool, int, float, complex, np.number)):
        return leaf
    raise TraceError(
        f"argument leaf of type {type(leaf).__name__} is not an array; "
        "train-step arguments must be pytrees of arrays or jax.ShapeDtypeStruct"
    )


def flatten_step(fn: Callable, args: Sequence[Any], keep_markers: bool = False,
                 expand_loss: LossExpansion | None = None,
                 expand_scans: bool = False) -> FlatProgram:
    """Trace ``fn(*args)`` (arrays or ``jax.ShapeDtypeStruct``) into a ``FlatProgram``.

    Nothing is computed and no device memory is touched: abstract shapes are enough.
    ``keep_markers``: see ``_Numberer`` (the pipeline pass sets it). ``expand_loss``: what an
    ``autopar.value_and_grad`` equation is inlined as (default: its plain value and gradient;
    ``remat_loss.flatten_step_rematerialised`` passes the rematerialised form).
    ``expand_scans``: number scan bodies as regions (see the module docstring).
    """
    names = argument_names(fn, len(args))
    in_paths: list[str] = []
    ranges: list[tuple[int, int]] = []
    leaves: list[Any] = []
    for name, arg in zip(names, args, strict=True):
        start = len(leaves)
        for keypath, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            in_paths.append(leaf_path(name, keypath))
            leaves.append(_abstract_leaf(leaf))
        ranges.append((start, len(leaves)))
    in_tree = jax.tree_util.tree_structure(tuple(args))
    out_tree_box: list[Any] = []

    def flat_fn(*flat_leaves: Any) -> list[Any]:
        out = fn(*jax.tree_util.tree_unflatten(in_tree, flat_leaves))
        for keypath, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
            if not is_array_like(leaf):  # None is an empty subtree, as in jax.jit
                shown = repr(leaf) if isinstance(leaf, str) and len(leaf) <= 40 else ""
                raise TraceError(
                    f"the step's output '{leaf_path('out', keypath)}' is a "
                    f"{type(leaf).__name__}{f' ({shown})' if shown else ''}; a train step must "
                    "return a pytree of arrays"
                )
        flat_out, out_tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(out_tree)
        return flat_out

    try:
        closed = jax.make_jaxpr(flat_fn)(*leaves)
    except TraceError:
        raise
    except Exception as exc:  # any failure inside user code is reported as one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        name = getattr(fn, "__name__", "train step")
        raise TraceError(
            f"could not trace {name}: {type(exc).__name__}: {first}"
        ) from exc
    out_tree = out_tree_box[-1]
    numberer = _Numberer(keep_markers, expand_loss, expand_scans)
    in_ids = [
        numberer.new_id(var.aval, TensorKind.INPUT) for var in closed.jaxpr.invars
    ]
    out_ids = numberer.walk(closed.jaxpr, closed.consts, in_ids)
    out_paths = [
        leaf_path("out", keypath)
        for keypath, _ in jax.tree_util.tree_flatten_with_path(
            jax.tree_util.tree_unflatten(out_tree, list(range(len(out_ids))))
        )[0]
    ]
    return numberer.program(in_ids, out_ids, in_paths, out_paths, in_tree, out_tree, ranges)


def flatten_closed_jaxpr(closed: Any, keep_markers: bool = True) -> FlatProgram:
    """A ``FlatProgram`` of a closed jaxpr (a scan's body): its invars are the inputs, its
    consts constants; calls inlined, scans kept whole, as everywhere."""
    numberer = _Numberer(keep_markers)
    in_ids = [numberer.new_id(v.aval, TensorKind.INPUT) for v in closed.jaxpr.invars]
    out_ids = numberer.walk(closed.jaxpr, closed.consts, in_ids)
    return numberer.program(
        in_ids, out_ids, [f"in/{i}" for i in range(len(in_ids))],
        [f"out/{i}" for i in range(len(out_ids))], None, None, [(0, len(in_ids))]
    )


def flatten_jaxpr(jaxpr: Any, in_paths: Sequence[str], keep_markers: bool = True) -> FlatProgram:
    """A ``FlatProgram`` of an open jaxpr whose constvars, then invars, are its inputs (the loss
    function of ``autopar.value_and_grad``: closed-over values, then argument leaves)."""
    numberer = _Numberer(keep_markers)
    const_ids = [numberer.new_id(v.aval, TensorKind.INPUT) for v in jaxpr.constvars]
    arg_ids = [numberer.new_id(v.aval, TensorKind.INPUT) for v in jaxpr.invars]
    out_ids = numberer.walk_ids(jaxpr, const_ids, arg_ids)
    in_ids = const_ids + arg_ids
    out_paths = [f"out/{i}" for i in range(len(out_ids))]
    return numberer.program(
        in_ids, out_ids, list(in_paths), out_paths, None, None, [(0, len(in_ids))]
    )
