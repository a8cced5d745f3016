"""The walk that numbers a jaxpr into a ``FlatProgram``: nested calls inlined, every value
given an integer id, scans kept whole or numbered as regions (``flatten``'s docstring says
which calls are inlined). ``flatten`` traces the user's step and walks it with this.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

from autopar.ir.cotangent_marks import COTANGENT, COTANGENT_MARK
from autopar.ir.loss_markers import PIPELINE_BOUNDARY, VALUE_AND_GRAD, expand_value_and_grad
from autopar.ir.program import SCAN_ENTER, SCAN_EXIT, FlatEqn, FlatProgram, ScanRegion, TensorKind

# Layout requests in the user's code (``with_sharding_constraint``; ``reshard``, which JAX's
# autodiff also emits): each names a sharding over the user's own mesh
SHARDING_CONSTRAINTS = frozenset({"sharding_constraint", "reshard"})

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


class Numberer:
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
        self.dropped_constraints = 0
        self.cotangents: dict[int, int] = {}

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
                           regions=dict(self.regions),
                           dropped_constraints=self.dropped_constraints,
                           cotangents=dict(self.cotangents))

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
            elif name == COTANGENT_MARK:  # an identity: where the cotangent is, recorded
                results = operands
                if eqn.params["role"] == COTANGENT:
                    self.cotangents[eqn.params["value"]] = operands[0]
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
            elif name in SHARDING_CONSTRAINTS:
                # the user's layout request, over the user's mesh: the plan sets layouts (a
                # constraint it does not price made XLA reshard around it; inside a stage,
                # on other devices, XLA refuses it), so it is numbered as a plain copy
                results = [self.new_id(v.aval, TensorKind.INTERMEDIATE) for v in eqn.outvars]
                self.append(jax.lax.copy_p, {}, operands, results, getattr(eqn, "ctx", None),
                            str(eqn.source_info.name_stack))
                self.dropped_constraints += 1
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
            closed = _barrier_jaxpr(self.avals[vid])
            out.extend(self.walk(closed.jaxpr, closed.consts, [vid]))
        return out


@functools.lru_cache(maxsize=256)
def _barrier_jaxpr(aval: Any) -> Any:
    """``optimization_barrier`` of one value of ``aval``, traced once per aval (a
    rematerialised GPT-3 175B passes 1,400 operands through barriers, all of a few avals;
    tracing each was a second of its trace)."""
    return jax.make_jaxpr(jax.lax.optimization_barrier)(aval)


def flatten_closed_jaxpr(closed: Any, keep_markers: bool = True) -> FlatProgram:
    """A ``FlatProgram`` of a closed jaxpr (a scan's body): its invars are the inputs, its
    consts constants; calls inlined, scans kept whole, as everywhere."""
    numberer = Numberer(keep_markers)
    in_ids = [numberer.new_id(v.aval, TensorKind.INPUT) for v in closed.jaxpr.invars]
    out_ids = numberer.walk(closed.jaxpr, closed.consts, in_ids)
    return numberer.program(
        in_ids, out_ids, [f"in/{i}" for i in range(len(in_ids))],
        [f"out/{i}" for i in range(len(out_ids))], None, None, [(0, len(in_ids))]
    )


def flatten_jaxpr(jaxpr: Any, in_paths: Sequence[str], keep_markers: bool = True) -> FlatProgram:
    """A ``FlatProgram`` of an open jaxpr whose constvars, then invars, are its inputs (the loss
    function of ``autopar.value_and_grad``: closed-over values, then argument leaves)."""
    numberer = Numberer(keep_markers)
    const_ids = [numberer.new_id(v.aval, TensorKind.INPUT) for v in jaxpr.constvars]
    arg_ids = [numberer.new_id(v.aval, TensorKind.INPUT) for v in jaxpr.invars]
    out_ids = numberer.walk_ids(jaxpr, const_ids, arg_ids)
    in_ids = const_ids + arg_ids
    out_paths = [f"out/{i}" for i in range(len(out_ids))]
    return numberer.program(
        in_ids, out_ids, list(in_paths), out_paths, None, None, [(0, len(in_ids))]
    )
