"""Per-device memory of a one-stage plan: what each device holds at the step's peak.

The peak is the step's inputs (parameters, optimizer and other state, the batch), its outputs
that do not reuse an input's buffer (the updated state, unless the caller donates it), and the
largest set of temporaries alive at once. Each tensor counts its per-device share under the
plan's sharding.

Temporaries follow XLA rather than the jaxpr (``written_values``: which values XLA writes to
memory at all); liveness then runs in a memory-greedy order (XLA's scheduler keeps memory
low). The step's outputs hold buffers of their own for the whole step, but XLA lends an
output's buffer to temporaries that die before the output is written (one at a time, each no
bigger than the buffer); only the temporaries that find no such buffer add to the peak.

A scan region (``ir.program``) is counted as its body's values at one iteration's size: the
loop reuses them from iteration to iteration. What outlives the loop is its exits' results:
the stacked ``ys`` (a scanned model's activations kept for the backward) and the final carry.

Which state leaves are parameters: the ones the forward and backward read. Pushing the batch
split through the graph ends at the reduction points (where the batch dimension is summed
away: the gradients, the loss mean); the nodes those depend on are the batch region, and a
state leaf it reads is a parameter. Optimizer moments, counters and running statistics are
only read after the reductions. The ZeRO planner shards by the same rule.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from autopar.compiler.cost.written_values import FUSED_OPS, materialized_temporaries
from autopar.compiler.graph.batch_split import BatchSplitResult, propagate_batch_split
from autopar.compiler.graph.opgraph import OpGraph

BREAKDOWN_KEYS: tuple[str, ...] = (
    "parameters", "optimizer_state", "batch", "updated_state", "activations",
)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device at the step's peak, by what holds them.

    ``parameters`` / ``optimizer_state``: the state leaves the forward reads, and the rest of the
    state (optimizer moments, counters, running statistics). ``batch``: the batch leaves.
    ``updated_state``: outputs written to fresh buffers (0 when the state is donated).
    ``activations``: the most temporaries alive at once (forward activations kept for the
    backward, gradients, optimizer temporaries), less those that borrow an output's buffer
    before the output is written.
    """

    parameters: int
    optimizer_state: int
    batch: int
    updated_state: int
    activations: int

    @property
    def total(self) -> int:
        return sum(self.breakdown().values())

    def breakdown(self) -> dict[str, int]:
        """The parts as a dict (the plan's ``memory_breakdown``)."""
        return {k: int(getattr(self, k)) for k in BREAKDOWN_KEYS}

    def dominant(self) -> str:
        """The part holding the most bytes, in words."""
        name = max(BREAKDOWN_KEYS, key=lambda k: getattr(self, k))
        return name.replace("_", " ")


def batch_region(graph: OpGraph, split: BatchSplitResult) -> set[int]:
    """Ids of the nodes the batch split's reduction points depend on (the points included):
    the loss forward and the backward, up to the summed gradients."""
    region = {c.node for c in split.collectives}
    for node in reversed(graph.nodes):
        if node.id in region:
            continue
        if any(c in region for t in node.outputs for c in graph.consumers.get(t, ())):
            region.add(node.id)
    return region


def classify_state(graph: OpGraph, state_ids: Iterable[int], region: set[int]) -> set[int]:
    """Input tensor ids of the parameters: state leaves some batch-region node reads."""
    return {t for t in state_ids if any(c in region for c in graph.consumers.get(t, ()))}


def parameter_inputs(graph: OpGraph, batch_argnums: Iterable[int]) -> frozenset[int]:
    """Tensor ids of the state leaves the forward and backward read (see the module
    docstring): the batch split, pushed through the graph, ends at the gradient reductions;
    the nodes those depend on are the batch region; a state leaf it reads is a parameter.
    Computed once per graph and batch arguments (``OpGraph.derived``)."""
    batch_args = frozenset(batch_argnums)
    key = ("parameter_inputs", batch_args)
    if key not in graph.derived:
        graph.derived[key] = frozenset(_parameter_inputs(graph, batch_args))
    return graph.derived[key]


def _parameter_inputs(graph: OpGraph, batch_args: frozenset[int]) -> set[int]:
    batch = [io.tensor for io in graph.inputs if io.arg_index in batch_args
             and graph.tensors[io.tensor].ndim > 0]
    split = propagate_batch_split(graph, dict.fromkeys(batch, 0), 1)
    state = [io.tensor for io in graph.inputs if io.arg_index not in batch_args]
    return classify_state(graph, state, batch_region(graph, split))


def estimate_memory(
    graph: OpGraph,
    *,
    batch_argnums: Iterable[int],
    shards: Mapping[int, int] | None = None,
    resharded: Mapping[int, float] | None = None,
    donated_state: bool = False,
    host: Collection[int] = frozenset(),
) -> MemoryEstimate:
    """Per-device memory of ``graph`` when tensor ``t`` is split ``shards[t]`` ways (default:
    whole). ``resharded[n]``: bytes of operand copies node ``n`` reads in another layout than
    their producer's (XLA writes the resharded copy, alive while ``n`` runs).
    ``donated_state``: the state's outputs reuse its input buffers. ``host``: inputs and
    outputs kept in host memory between steps (``cost.host_state``): on the device an input
    lives from its first reader to its last and an output from its writing to its transfer,
    as temporaries (under ``activations``)."""
    shards = dict(shards or {})
    batch_args = set(batch_argnums)

    def share(t: int) -> int:
        return graph.tensors[t].nbytes // max(1, shards.get(t, 1))

    params = parameter_inputs(graph, batch_args)
    hosted = frozenset(host)
    inputs = {io.tensor for io in graph.inputs}
    batch = {io.tensor for io in graph.inputs if io.arg_index in batch_args}
    state = inputs - batch - hosted
    # an output that is an input passed through needs no buffer of its own
    fresh_outputs = {io.tensor for io in graph.outputs} - inputs - hosted
    temporaries = materialized_temporaries(graph, shards) - fresh_outputs - inputs
    temporaries |= hosted
    # XLA gives the outputs buffers of their own (lent to temporaries until they are written:
    # not when they are the donated inputs' buffers) and the other temporaries an arena
    updated = 0 if donated_state else sum(share(t) for t in fresh_outputs)
    lenders = set() if donated_state else fresh_outputs
    peak = updated + _peak_live(graph, temporaries, share, resharded or {}, lenders,
                                hosted & inputs, hosted - inputs)
    return MemoryEstimate(
        parameters=sum(share(t) for t in params),
        optimizer_state=sum(share(t) for t in state - params),
        batch=sum(share(t) for t in batch),
        updated_state=updated,
        activations=peak - updated,
    )


def resharded_operand_bytes(
    graph: OpGraph,
    operand_shards: Mapping[tuple[int, int], int],
    shards: Mapping[int, int],
) -> dict[int, float]:
    """Per node, bytes of the operand copies it reads in a layout other than the producer's:
    ``operand_shards[(n, k)]`` is how many ways node ``n`` needs operand ``k`` split,
    ``shards[t]`` how many ways tensor ``t`` is."""
    out: dict[int, float] = {}
    for (n, k), ways in operand_shards.items():
        t = graph.nodes[n].inputs[k]
        if graph.tensors[t].kind == "literal" or ways == shards.get(t, 1):
            continue
        out[n] = out.get(n, 0.0) + graph.tensors[t].nbytes / max(1, ways)
    return out


@dataclass(frozen=True)
class _ScheduleStructure:
    """What the memory-greedy schedule reads of the graph alone, computed once per graph
    (``OpGraph.derived``): a whole model's step is estimated many times, with other shards
    each time, over the same program (GPT-3 175B's rematerialised step: 60,000 nodes)."""

    distinct_inputs: tuple[tuple[int, ...], ...]  # by node id
    readers: dict[int, int]  # tensor -> how many nodes read it
    dependents: tuple[tuple[int, ...], ...]  # by node id: the nodes reading its outputs
    waiting: tuple[int, ...]  # by node id: how many nodes make its inputs
    barrier: tuple[int, ...]  # by node id: 1 for an optimization barrier
    # consumers before producers: each fused op's outputs and inputs (``last_reads``)
    fused_reversed: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


def _schedule_structure(graph: OpGraph) -> _ScheduleStructure:
    key = ("schedule_structure",)
    if key in graph.derived:
        return graph.derived[key]
    assert all(node.id == k for k, node in enumerate(graph.nodes)), "nodes by id, in order"
    producer = graph.producer
    distinct = tuple(tuple(set(node.inputs)) for node in graph.nodes)
    readers: dict[int, int] = {}
    for ins in distinct:
        for t in ins:
            readers[t] = readers.get(t, 0) + 1
    dependents: list[set[int]] = [set() for _ in graph.nodes]
    waiting = []
    for node in graph.nodes:
        before = {producer[t] for t in node.inputs if t in producer}
        waiting.append(len(before))
        for p in before:
            dependents[p].add(node.id)
    found = _ScheduleStructure(
        distinct, readers, tuple(tuple(d) for d in dependents), tuple(waiting),
        tuple(int(node.primitive == "optimization_barrier") for node in graph.nodes),
        tuple((node.outputs, node.inputs) for node in reversed(graph.nodes)
              if node.primitive in FUSED_OPS))
    graph.derived[key] = found
    return found


def memory_greedy_order(graph: OpGraph, counted: set[int], share=None) -> list[int]:
    """Node ids in a memory-greedy list schedule of the ``counted`` tensors.

    XLA's scheduler reorders the program to keep memory low (an optimizer update runs as soon
    as its gradient is ready, not after the whole backward as in the jaxpr), so among the ready
    ops this runs the one that frees the most bytes of ``counted`` (ties: program order).
    An ``optimization_barrier`` (it starts a rematerialised layer's recompute) waits until
    nothing else is ready, as the recompute is meant to run only when the backward needs it.
    """
    share = share or (lambda t: graph.tensors[t].nbytes)
    structure = _schedule_structure(graph)
    distinct_inputs, dependents = structure.distinct_inputs, structure.dependents
    readers = dict(structure.readers)
    waiting = list(structure.waiting)
    barrier = structure.barrier
    # what each node's outputs add never changes (a tensor with readers keeps them), what its
    # inputs free does (their other readers run first): both read from here, as ``delta`` is
    # asked twice for each of a whole model's tens of thousands of nodes
    grown = [sum(share(t) for t in node.outputs if t in counted and t in readers)
             for node in graph.nodes]
    counted_inputs = [[(t, share(t)) for t in ins if t in counted] for ins in distinct_inputs]

    def delta(n: int) -> tuple[int, int]:
        freed = 0
        for t, size in counted_inputs[n]:
            if readers[t] == 1:
                freed += size
        return (barrier[n], grown[n] - freed)

    ready = [(delta(n), n) for n, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    pop, push = heapq.heappop, heapq.heappush
    while ready:
        d, n = pop(ready)
        now = delta(n)
        if now != d and ready and (now, n) > ready[0]:
            push(ready, (now, n))  # others' reads changed what it frees
            continue
        order.append(n)
        for t in distinct_inputs[n]:
            readers[t] -= 1
        for m in dependents[n]:
            waiting[m] -= 1
            if waiting[m] == 0:
                push(ready, (delta(m), m))
    return order


def last_reads(graph: OpGraph, order: Sequence[int], counted: set[int]) -> dict[int, int]:
    """Per tensor, the position in ``order`` of its last reader, where a value XLA fuses away
    (not ``counted``, made by a fused op) is read through: its readers recompute it from the
    producer's operands, which must stay alive until then (a ReLU's mask, say, is recomputed in
    the backward from the pre-activation, so the pre-activation lives until the backward)."""
    structure = _schedule_structure(graph)
    distinct_inputs = structure.distinct_inputs
    last: dict[int, int] = {}
    for i, n in enumerate(order):  # positions rise: the last write is the latest reader
        for t in distinct_inputs[n]:
            last[t] = i
    for outputs, inputs in structure.fused_reversed:  # consumers before producers
        fused = [last[t] for t in outputs if t not in counted and t in last]
        if fused:
            latest = max(fused)
            for u in inputs:
                if last.get(u, -1) < latest:
                    last[u] = latest
    return last


def _peak_live(
    graph: OpGraph,
    counted: set[int],
    share,
    transient: Mapping[int, float],
    lenders: Collection[int] = frozenset(),
    arriving: Collection[int] = frozenset(),
    leaving: Collection[int] = frozenset(),
) -> int:
    """Peak bytes of ``counted`` tensors alive at once in the memory-greedy order, with each
    node's ``transient`` bytes alive while it runs, less the temporaries that borrow the
    buffer of a ``lenders`` tensor (an output, alive from its writing to the step's end).
    ``arriving``: inputs brought to the device when first read, ``leaving``: outputs sent
    away when written (both among ``counted``)."""
    # every size read below, looked up once (the order alone asks for each several times)
    sizes = {t: share(t) for t in counted}
    sizes.update((t, share(t)) for t in lenders if t not in sizes)
    size = sizes.__getitem__
    order = memory_greedy_order(graph, counted, size)
    last_use = last_reads(graph, order, counted)
    nodes = graph.nodes
    born: dict[int, int] = {}
    for i, n in enumerate(order):
        if arriving:
            for t in nodes[n].inputs:
                if t in arriving and t not in born:
                    born[t] = i
        for t in nodes[n].outputs:
            born[t] = i
    spans = {t: (born[t], last_use.get(t, born[t])) for t in counted if t in born
             and (t in last_use or t in leaving)}
    arrivals: dict[int, list[int]] = {}
    for t in arriving:
        if t in spans:
            arrivals.setdefault(spans[t][0], []).append(t)
    borrowed = _borrowers(spans, {t: born[t] for t in lenders if t in born}, size)
    frees: dict[int, list[int]] = {}
    for t, (_, end) in spans.items():
        if t not in borrowed:
            frees.setdefault(end, []).append(t)
    live = peak = 0
    for i, n in enumerate(order):
        dying = frees.pop(i, [])
        node = nodes[n]
        in_place = node.primitive in FUSED_OPS
        if i in arrivals:
            live += sum(sizes[t] for t in arrivals[i])
        for t in node.outputs:
            if t not in spans or t in borrowed:
                continue
            # a loop writes its result over an operand it reads for the last time
            same = next((u for u in dying if sizes[u] == sizes[t]), None) if in_place \
                else None
            if same is not None:
                dying.remove(same)
            else:
                live += sizes[t]
        now = live + int(transient.get(n, 0)) if transient else live
        if now > peak:
            peak = now
        for t in dying:
            live -= sizes[t]
    return peak


def _borrowers(spans: Mapping[int, tuple[int, int]], lenders: Mapping[int, int], share) -> set[int]:
    """Temporaries (``spans[t]``: first and last position alive) that XLA's buffer assignment
    puts into a lender's buffer (``lenders[t]``: the position it is written at): biggest
    temporaries first, each into the smallest buffer that holds it, is not yet written while
    the temporary lives, and holds no other borrower at the time."""
    # the buffers by size, and of one size by when they are written: a temporary looks at
    # the sizes that hold it, smallest first, and in each only at the buffers written after
    # it ends (at its end, one of its own size: written over it in place); a whole model has
    # thousands of buffers and temporaries, most of them alive until late in the step
    by_size: dict[int, list[int]] = {}
    for t in sorted(lenders, key=lambda t: (share(t), lenders[t])):
        by_size.setdefault(share(t), []).append(t)
    sizes = list(by_size)
    written = {size: [lenders[b] for b in group] for size, group in by_size.items()}
    # per buffer, the spans of its borrowers: disjoint, kept sorted by start (and so by end),
    # so a new span can only overlap its neighbours in that order
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    out: set[int] = set()
    for t in sorted(spans, key=lambda t: (-share(t), spans[t])):
        start, end = spans[t]
        size = share(t)
        placed = False
        for held in itertools.islice(sizes, bisect.bisect_left(sizes, size), None):
            group = by_size[held]
            after = bisect.bisect_left if held == size else bisect.bisect_right
            for b in itertools.islice(group, after(written[held], end), None):
                first, last = starts.setdefault(b, []), ends.setdefault(b, [])
                k = bisect.bisect_right(first, end)  # spans starting after this one ends
                if k and last[k - 1] >= start:  # the latest span starting within it lives
                    continue
                first.insert(k, start)
                last.insert(k, end)
                out.add(t)
                placed = True
                break
            if placed:
                break
    return out
