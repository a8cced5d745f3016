"""Which values of a step XLA writes to memory, as the memory model counts them.

Temporaries follow XLA rather than the jaxpr: XLA fuses chains of elementwise, shape and
slicing ops into loops, so their intermediates never exist in memory. A temporary is counted
only where XLA has to write it out: results of ops it does not fuse into a loop (dots,
convolutions, reductions, sorts, scatters, control flow), operands those ops read, values read
by more than one op, and the step's outputs. (The memory model's liveness lets a loop write
its result over an operand of the same size that it reads for the last time.)

A reduction reads its operand's loop in place (input fusion), unless it is big: XLA's CPU
backend hands a sum, max or min over a float operand of at least ``LIBRARY_MIN_ELEMENTS``
elements per device to its kernel library (YNNPACK), which reads its operands from memory. It
folds in the elementwise ops that feed only it (the square of a variance, the product of a
scale's gradient); the values those read are written out. (A layer norm over replicated
activations keeps its input, its centred input and its normalised output for the backward.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autopar.compiler.graph.batch_split import SHAPE_PRESERVING
from autopar.compiler.graph.opgraph import SCAN_ENTER, OpGraph

# Ops XLA folds into the loop of their consumer (or that are free views).
FUSED_OPS = SHAPE_PRESERVING | frozenset(
    """
    broadcast_in_dim reshape squeeze expand_dims transpose iota slice dynamic_slice
    concatenate pad select_n clamp rev gather
    """.split()
)
# Ops whose results are their operands' buffers (a barrier only orders the program; a scan
# region's enter hands the body its operand, or a slice of it the body reads in place).
ALIASING_OPS = frozenset({"optimization_barrier", SCAN_ENTER})
# Ops that read their operands in place from the producer's loop (input fusion): reductions.
READS_FUSED_OPERANDS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split()
)

# Reductions XLA's CPU backend gives its kernel library (YNNPACK) when the operand or the
# result has at least LIBRARY_MIN_ELEMENTS elements (per device); the library reads its
# operands from memory instead of fusing their loops.
LIBRARY_REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min".split())
LIBRARY_MIN_ELEMENTS = 4096

# Elementwise ops XLA will not duplicate into several consumers' loops (too costly to redo);
# a cheap one read by several consumers is recomputed in each instead of written out.
EXPENSIVE_OPS = frozenset(
    """
    exp exp2 expm1 log log1p tanh logistic div rem pow sqrt rsqrt cbrt erf erf_inv atan2 sin
    cos tan asin acos atan sinh cosh asinh acosh atanh lgamma digamma igamma
    """.split()
)


def _is_float(dtype: str) -> bool:
    return "float" in dtype


@dataclass(frozen=True)
class _LibraryWalk:
    """One reduction the kernel library may take: its operand, its results, and the values
    it reads from memory when it does (the walk up through what it folds in)."""

    operand: int
    outputs: tuple[int, ...]
    reads: frozenset[int]


@dataclass(frozen=True)
class _WrittenStructure:
    """What of ``materialized_temporaries`` depends on the graph alone, computed once per
    graph: a whole model's step is estimated many times (every floor, every ILP's chosen
    plan), each with other shards, and only which reductions the library takes changes."""

    always: frozenset[int]  # written whatever the shards
    if_library_read: frozenset[int]  # fused results written only where a library reads them
    walks: tuple[_LibraryWalk, ...]


def _structure(graph: OpGraph) -> _WrittenStructure:
    key = ("written_values",)
    if key in graph.derived:
        return graph.derived[key]
    consumers = graph.consumers
    producer = graph.producer
    outputs = graph.output_tensors
    walks = []
    for node in graph.nodes:
        if node.primitive not in LIBRARY_REDUCTIONS or not node.inputs:
            continue
        operand = node.inputs[0]
        if not _is_float(graph.tensors[operand].dtype):
            continue
        stack, seen, read = [operand], set(), set()
        while stack:
            t = stack.pop()
            if t in seen or graph.tensors[t].kind == "literal":
                continue
            seen.add(t)
            p = producer.get(t)
            # folded into the library call: made by an elementwise op that feeds only it
            if (
                p is not None
                and graph.nodes[p].primitive in FUSED_OPS
                and len(consumers.get(t, ())) == 1
                and t not in outputs
            ):
                stack.extend(graph.nodes[p].inputs)
            else:
                read.add(t)
        walks.append(_LibraryWalk(operand, tuple(node.outputs), frozenset(read)))
    always, maybe = set(), set()
    for node in graph.nodes:
        if node.primitive in ALIASING_OPS:
            continue
        fused_producer = node.primitive in FUSED_OPS
        for t in node.outputs:
            readers = [graph.nodes[u].primitive for u in consumers.get(t, ())]
            if (
                not fused_producer
                or t in outputs
                or (len(readers) > 1 and node.primitive in EXPENSIVE_OPS)
                or any(r not in FUSED_OPS and r not in READS_FUSED_OPERANDS for r in readers)
            ):
                always.add(t)
            else:
                maybe.add(t)
    found = _WrittenStructure(frozenset(always), frozenset(maybe), tuple(walks))
    graph.derived[key] = found
    return found


def library_read_operands(
    graph: OpGraph, shards: Mapping[int, int] | None = None
) -> set[int]:
    """Tensors a library reduction reads from memory (see the module docstring): walking up
    from each reduction big enough for the library (``shards[t]``: how many ways tensor ``t``
    is split, default whole), through the elementwise ops that feed only it (folded into the
    library call), to the values those read."""
    shards = shards or {}
    tensors = graph.tensors

    def elements(t: int) -> int:
        return tensors[t].size // max(1, shards.get(t, 1))

    read: set[int] = set()
    for walk in _structure(graph).walks:
        if max(elements(walk.operand), *(elements(t) for t in walk.outputs)) \
                >= LIBRARY_MIN_ELEMENTS:
            read |= walk.reads
    return read


def materialized_temporaries(
    graph: OpGraph, shards: Mapping[int, int] | None = None
) -> set[int]:
    """Intermediate tensors XLA writes to memory (see the module docstring) when tensor ``t``
    is split ``shards[t]`` ways (default: whole; it decides which reductions go to the
    kernel library)."""
    structure = _structure(graph)
    return set(structure.always) | (structure.if_library_read
                                    & library_read_operands(graph, shards))
