"""The flat program: a train step's jaxpr with nested calls inlined and every value numbered.

Both halves of autopar read this one representation: the compiler builds its ``OpGraph`` from
it, and the runtime evaluates it again with sharding constraints on the tensors a plan names.
Because both number values the same way (by the deterministic walk in ``flatten``), a tensor id
in a ``Plan`` means the same value to the compiler that chose its sharding and to the runtime
that applies it.

This module holds the program's data (equations, scan regions, the program) and its evaluation;
``flatten`` traces a step into it (which calls it inlines and which it keeps whole).

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.extend import core as jcore

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
    # the user's with_sharding_constraint calls numbered as copies (``flatten``)
    dropped_constraints: int = 0
    # the backward's cotangent of each forward value marked by ``ir.cotangent_marks``: the
    # marked value's id (in the program that marked it), or a contraction's ``(eqn, k,
    # role)`` -> this program's id
    cotangents: dict[Any, int] = field(default_factory=dict)

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
        bind: Callable[[FlatEqn, Sequence[Any]], Sequence[Any]] | None = None,
    ) -> list[Any]:
        """Run the program on ``flat_args`` (arrays or tracers); returns the flat results.

        ``on_value(id, value)`` is called for every input and equation result and may return a
        replacement; ``on_operand(eqn_index, position, value)`` likewise for every operand as an
        equation reads it. The runtime uses them to put ``with_sharding_constraint`` on the
        plan's chosen tensors (as produced, and as each consumer needs them). ``bind``: applies
        an equation (outside scan regions) in place of ``bind_eqn`` (the runtime runs an
        attention split over the sequence as its ring kernel).
        """
        env: dict[int, Any] = dict(self.values)
        for vid, arg in zip(self.in_ids, flat_args, strict=True):
            env[vid] = arg
            if on_value is not None:
                env[vid] = on_value(vid, arg)
        self.run_range(0, len(self.eqns), env, on_value, on_operand, bind)
        return [env[i] for i in self.out_ids]

    def run_range(
        self,
        start: int,
        stop: int,
        env: dict[int, Any],
        on_value: Callable[[int, Any], Any] | None = None,
        on_operand: Callable[[int, int, Any], Any] | None = None,
        bind: Callable[[FlatEqn, Sequence[Any]], Sequence[Any]] | None = None,
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
            results = bind_eqn(eqn, operands) if bind is None else bind(eqn, operands)
            for vid, value in zip(eqn.outputs, results, strict=True):
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


def carried_inputs(inputs: Sequence[tuple[str, int, Any]],
                   outputs: Sequence[tuple[str, Any]]) -> dict[int, int]:
    """Which step results are new values of which inputs (the next step's inputs): result
    position -> input position, from leaf paths and shapes.

    ``inputs``: (path, argument index, shape) of the inputs that may be carried (a state's);
    ``outputs``: (path, shape) of every result. A step ``(state, ..., batch) -> (new_state,
    ..., loss)`` returns argument ``i``'s new value as result ``i``: ``state/params/w``
    (argument 0) pairs with ``out/0/params/w``. A step that returns the state alone
    (``out/params/w``) pairs by the path below the top level when that is unambiguous.
    Shapes must agree."""
    by_position: dict[tuple[int, str], int] = {}
    by_rest: dict[str, list[int]] = {}
    for k, (path, arg, _) in enumerate(inputs):
        rest = path.partition("/")[2]
        by_position[(arg, rest)] = k
        by_rest.setdefault(rest, []).append(k)
    pairs: dict[int, int] = {}
    for j, (path, shape) in enumerate(outputs):
        below = path.partition("/")[2]  # without "out"
        head, _, rest = below.partition("/")
        i = by_position.get((int(head), rest)) if head.isdigit() else None
        if i is None and len(by_rest.get(below, ())) == 1:
            i = by_rest[below][0]
        if i is not None and tuple(inputs[i][2]) == tuple(shape):
            pairs[j] = i
    return pairs
