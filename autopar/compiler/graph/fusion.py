"""The bytes each op's kernel reads and writes from device memory, as XLA fuses them.

XLA runs a matmul or a convolution as a library kernel that reads its operands from memory
and writes its result there, and fuses the element-wise ops, reductions, casts and
broadcasts between them into loop kernels: a value made and used inside one fused chain
stays on chip. So a chain of element-wise ops costs one kernel's bytes (what it reads from
outside the chain and writes out of it), not each op's operands and results.

The rule here approximates that from the graph alone: a value is in memory when a library
kernel made it, when it is an input of the graph (parameters, the batch, constants), when it
is an output of the graph, or when a library kernel reads it; any other value lives inside
fused kernels and costs nothing, however many fused ops read it (XLA duplicates a cheap
producer into each consumer's kernel, fuses siblings into one multi-output kernel, and runs a
softmax's reductions as one kernel). A reshape, a slice and a scan iteration's slice of its
``xs`` are views read in place; a broadcast or an iota is recomputed inside the kernel that
reads it; a gather reads only its rows; a scan's stacked results are written once. Counting
a value read by several fused ops as written and read again priced GPT-350M on a V100 at half
the throughput Alpa measured.
"""

from __future__ import annotations

from autopar.compiler.graph.op_costs import CONTROL_FLOW
from autopar.compiler.graph.opgraph import SCAN_ENTER, SCAN_EXIT, OpGraph, OpNode
from autopar.ir.loss_markers import VALUE_AND_GRAD

# Ops XLA runs as a kernel of their own (a library call or a loop it does not fuse into),
# and calls kept whole in a graph (the loss function's forward and backward in a step's outer
# program): their results are in memory.
LIBRARY_KERNELS = frozenset({
    "dot_general", "conv_general_dilated", "scatter", "scatter-add", "scatter_add",
    "scatter_mul", "scatter_min", "scatter_max", "sort", "fft", "cholesky", "triangular_solve",
    "lu", "eigh", "qr", "svd", "custom_jvp_call", "custom_vjp_call", "pjit", "closed_call",
    "remat", "checkpoint", VALUE_AND_GRAD, *CONTROL_FLOW,
})
# Views of their operand: no bytes of their own. A slice is read in place where it is used
# (a library kernel takes a layer's slice of stacked weights at its offset, a fused kernel
# reads only the slice), and so is a scan region's enter, an iteration's slice of the stacked
# ``xs`` (or the carry): the unrolled and the scanned stack move the same bytes.
_VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "slice", "dynamic_slice",
                    SCAN_ENTER})
# Recomputed inside the kernel that reads them, from an operand of a few bytes at most.
_RECOMPUTED = frozenset({"broadcast_in_dim", "iota"})
# Read only the part of their first operand they return (the rows a gather takes).
_PARTIAL_READS = frozenset({"gather"})


def _in_memory(graph: OpGraph, tensor: int) -> bool:
    """Whether ``tensor`` is in device memory when a fused kernel reads it."""
    maker = graph.producer.get(tensor)
    while maker is not None and graph.nodes[maker].primitive in _VIEWS:
        tensor = graph.nodes[maker].inputs[0]
        maker = graph.producer.get(tensor)
    if maker is None:
        return True
    primitive = graph.nodes[maker].primitive
    if primitive in LIBRARY_KERNELS:
        return True
    if primitive in _RECOMPUTED:
        return False
    return _materialised(graph, tensor)


def _materialised(graph: OpGraph, tensor: int) -> bool:
    """Whether a fused kernel's result ``tensor`` is written out to device memory."""
    users = graph.consumers.get(tensor, [])
    return tensor in graph.output_tensors or any(graph.nodes[u].primitive in LIBRARY_KERNELS
                                                 for u in users)


def kernel_bytes(graph: OpGraph, node: OpNode) -> float:
    """Bytes ``node`` reads and writes from device memory per step, fused as XLA fuses it
    (see the module docstring): a library kernel's operands and results; for a fused op,
    the operands that are in memory and the results written out. Computed once per node of
    a graph (``OpGraph.node_fact``)."""
    return graph.node_fact("kernel_bytes", node, _kernel_bytes)


def _kernel_bytes(graph: OpGraph, node: OpNode) -> float:
    if node.primitive in LIBRARY_KERNELS:
        return node.bytes_accessed
    if node.primitive in _VIEWS or node.primitive in _RECOMPUTED:
        # costs only where a library kernel reads it: a broadcast is then written out whole,
        # a view of a fused chain's result is where that result is written
        needed = node.primitive in _RECOMPUTED or not _in_memory(graph, node.inputs[0])
        writes = sum(graph.tensors[t].nbytes for t in node.outputs
                     if needed and any(graph.nodes[u].primitive in LIBRARY_KERNELS
                                       for u in graph.consumers.get(t, [])))
        return float(writes) * node.repeat
    if node.primitive == SCAN_EXIT:
        # the iterations' results stacked (or the last carry): written once, as an unrolled
        # stack's results are assembled once
        return float(sum(graph.tensors[t].nbytes for t in node.outputs
                         if _materialised(graph, t)))
    operands = dict.fromkeys(node.inputs)
    reads = 0
    if node.primitive in _PARTIAL_READS and node.inputs:
        sliced = node.inputs[0]
        del operands[sliced]
        if _in_memory(graph, sliced):
            reads = min(graph.tensors[sliced].nbytes,
                        sum(graph.tensors[t].nbytes for t in node.outputs))
    reads += sum(graph.tensors[t].nbytes for t in operands if _in_memory(graph, t))
    writes = sum(graph.tensors[t].nbytes for t in node.outputs if _materialised(graph, t))
    return float(reads + writes) * node.repeat


def kernel_launches(graph: OpGraph, node: OpNode) -> int:
    """Kernels ``node`` starts per step, fused as XLA fuses it (as ``kernel_bytes``): one
    for a library kernel, and for a fused op one where it ends its chain (writes a result
    out to memory); none for a view, a scan's entry or a value recomputed where it is read
    (but one for a broadcast a library kernel reads, which is written out); each time a
    scan's body runs."""
    if node.primitive in (SCAN_ENTER, SCAN_EXIT):
        return 0
    if node.primitive in LIBRARY_KERNELS:
        return node.repeat
    if node.primitive in _VIEWS or node.primitive in _RECOMPUTED:
        return node.repeat if kernel_bytes(graph, node) else 0
    return node.repeat if any(_materialised(graph, t) for t in node.outputs) else 0
