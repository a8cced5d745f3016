"""Memory rows of the intra-operator ILP: per-device bytes of each choice, and live sets.

The rows follow ``memory_model``: a variable's memory under choice ``i`` is the per-device size
of the tensors its members produce that XLA writes to memory (temporaries it does not fuse
away, and the step's outputs; inputs: their own tensor) in the specs of choice ``i``. A live
set is the variables whose tensors are alive at one sampled point of the memory-greedy order,
plus every input and output (they hold their buffers for the whole step); the ILP keeps each
set's sum under the budget.
"""

from __future__ import annotations

from autopar.compiler.cost.memory_model import last_reads, memory_greedy_order
from autopar.compiler.cost.written_values import materialized_temporaries
from autopar.compiler.intra_op.variables import DecisionVariables, input_key


def memory_vectors(table: DecisionVariables) -> list[list[float]]:
    """Per-device bytes of each variable's tensors, one entry per choice."""
    sizes = {a: table.mesh.axis_size(a) for a in table.mesh.axis_names}
    tensors = table.graph.tensors
    written = materialized_temporaries(table.graph) | {io.tensor for io in table.graph.outputs}
    # a member's bytes per choice depend on its strategy list and its outputs' sizes: the
    # same op of every repeated layer shares both, and is computed once
    per_member: dict[tuple, list[list[float]]] = {}
    vectors = []
    for var in table.variables:
        vec = [0.0] * var.size
        for member, strategies in var.members.items():
            outs = tuple(tensors[t].nbytes if member < 0 or t in written else None
                         for t in table.member_outputs(member))
            key = (id(strategies), outs)
            found = per_member.get(key)
            if found is None:
                found = per_member[key] = [
                    [nbytes / spec.num_shards(sizes)
                     for nbytes, spec in zip(outs, s.output_specs, strict=True)
                     if nbytes is not None] for s in strategies]
            for i, parts in enumerate(found):
                for part in parts:
                    vec[i] += part
        vectors.append(vec)
    return vectors


def live_sets(table: DecisionVariables, max_live_sets: int,
              host: frozenset[int] = frozenset()) -> list[list[int]]:
    """Variables whose tensors are alive at about ``max_live_sets`` evenly spaced program
    points (graph inputs are alive at all of them). ``host``: inputs and outputs kept in host
    memory between steps (``cost.host_state``): an input is alive from its first reader to
    its last, an output where it is written."""
    graph = table.graph
    outputs = {io.tensor for io in graph.outputs}
    counted = materialized_temporaries(graph) - outputs | (outputs & host)
    order = memory_greedy_order(graph, counted)
    last_use = last_reads(graph, order, counted)
    inputs = {io.tensor: table.var_of[input_key(p)] for p, io in enumerate(graph.inputs)}
    always = {var for t, var in inputs.items() if t not in host}
    always |= {table.var_of[table.tensor_home[t][0]] for t in outputs - host
               if t in table.tensor_home}
    arriving = {t: var for t, var in inputs.items() if t in host}
    step = max(1, len(order) // max_live_sets)
    live: dict[int, int] = {}  # tensor -> position of its last reader
    ending: dict[int, list[int]] = {}  # position -> the tensors whose last reader it is
    sets: list[list[int]] = []
    for i, n in enumerate(order):
        for t in graph.nodes[n].inputs:
            if t in arriving and t not in live and t in last_use:
                live[t] = last_use[t]
                ending.setdefault(max(live[t], i), []).append(t)
        for t in graph.nodes[n].outputs:
            if t in counted and (t in last_use or t in host):
                live[t] = last_use.get(t, i)
                ending.setdefault(max(live[t], i), []).append(t)
        if i % step == 0:
            current = {arriving[t] if t in arriving else table.var_of[table.tensor_home[t][0]]
                       for t in live}
            sets.append(sorted(current | always))
        for t in ending.pop(i, ()):
            del live[t]
            arriving.pop(t, None)
    return sets
