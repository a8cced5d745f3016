"""Trace a train step into an OpGraph.

``trace_step(fn, args)`` takes the step and example arguments (real arrays or
``jax.ShapeDtypeStruct``), builds the flat program (nested calls inlined; scans expanded into
regions whose body is numbered once, see ``ir.program``; while/cond kept whole) and wraps every
equation as an ``OpNode`` with flop and byte estimates. Nothing is executed: a 39B-parameter
GPT is traced from abstract shapes alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.compiler.graph.op_costs import primitive_flops
from autopar.compiler.graph.opgraph import GraphIO, OpGraph, OpNode, ScanLoop, TensorInfo
from autopar.ir.flatten import StepJaxpr, flatten_step
from autopar.ir.program import FlatProgram
from autopar.ir.remat_loss import flatten_step_rematerialised


@dataclass
class TracedStep:
    """The result of tracing: the flat program (for the runtime) and its graph (for planning)."""

    program: FlatProgram
    graph: OpGraph


@functools.cache
def _dtype_name(dtype: Any) -> str:
    # str() of a numpy dtype looks its name up anew each time: a 48-layer GPT step has about
    # 34,000 values of a handful of dtypes (a quarter of building its graph went here)
    return str(dtype)


def _tensor_info(vid: int, aval: Any, kind: str) -> TensorInfo:
    shape = tuple(int(d) for d in getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", None)
    return TensorInfo(id=vid, shape=shape, dtype="token" if dtype is None else _dtype_name(dtype),
                      kind=kind)


def build_graph(program: FlatProgram) -> OpGraph:
    """Wrap a flat program's equations as OpNodes with flop and byte estimates (per step: an
    equation of a scan body counts its flops and bytes once per iteration)."""
    tensors = {
        vid: _tensor_info(vid, aval, program.kinds[vid]) for vid, aval in program.avals.items()
    }
    nodes: list[OpNode] = []
    for eqn in program.eqns:
        in_shapes = [tensors[t].shape for t in eqn.inputs]
        out_shapes = [tensors[t].shape for t in eqn.outputs]
        flops = primitive_flops(eqn.name, eqn.params, in_shapes, out_shapes)
        nbytes = sum(tensors[t].nbytes for t in (*eqn.inputs, *eqn.outputs))
        nodes.append(
            OpNode(
                id=eqn.index,
                primitive=eqn.name,
                inputs=eqn.inputs,
                outputs=eqn.outputs,
                flops=flops * eqn.repeat,
                bytes_accessed=float(nbytes) * eqn.repeat,
                params=eqn.params,
                repeat=eqn.repeat,
            )
        )
    return OpGraph(
        nodes=nodes,
        tensors=tensors,
        inputs=[
            GraphIO(t, p, arg)
            for t, p, arg in zip(
                program.in_ids, program.in_paths, program.leaf_arg_indices(), strict=True
            )
        ],
        outputs=[GraphIO(t, p) for t, p in zip(program.out_ids, program.out_paths, strict=True)],
        loops=[
            ScanLoop(enters=r.enters, exits=r.exits, body_start=r.body_start,
                     body_stop=r.body_stop, length=r.length, num_consts=r.num_consts,
                     num_carry=r.num_carry)
            for _, r in sorted(program.regions.items())
        ],
        cotangents=dict(program.cotangents),
    )


def trace_step(fn: Callable, args: Sequence[Any],
               remat_positions: Sequence[int] | None = None,
               jaxpr: StepJaxpr | None = None, remat_selective: bool = False) -> TracedStep:
    """Trace ``fn(*args)`` into a flat program and its OpGraph (raises ``TraceError``).
    ``remat_positions``: inline ``autopar.value_and_grad`` with the loss forward's layers (cut
    before these equations) under ``jax.checkpoint`` (``remat_loss.flatten_step_rematerialised``;
    ``remat_selective``: keeping their matmuls' outputs). ``jaxpr``: the step already traced
    at these shapes (``flatten.trace_jaxpr``): walked, not traced again.
    """
    if remat_positions is None:
        program = flatten_step(fn, tuple(args), expand_scans=True, jaxpr=jaxpr)
    else:
        program = flatten_step_rematerialised(fn, tuple(args), remat_positions, jaxpr=jaxpr,
                                              selective=remat_selective)
    return TracedStep(program=program, graph=build_graph(program))
