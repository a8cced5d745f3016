"""Memory rows of the intra-operator ILP: per-device bytes of each choice, and live sets.

A variable's memory under choice ``i`` is the per-device size of every tensor its members
produce (inputs: their own tensor) in the specs of choice ``i``. A live set is the variables
whose tensors are alive at one sampled program point; the ILP keeps each set's sum under the
budget.
"""

from __future__ import annotations

from autopar.compiler.intra_op_variables import DecisionVariables, input_key


def memory_vectors(table: DecisionVariables) -> list[list[float]]:
    """Per-device bytes of each variable's tensors, one entry per choice."""
    sizes = {a: table.mesh.axis_size(a) for a in table.mesh.axis_names}
    tensors = table.graph.tensors
    vectors = []
    for var in table.variables:
        vec = [0.0] * var.size
        for member, strategies in var.members.items():
            outs = table.member_outputs(member)
            for i, s in enumerate(strategies):
                for t, spec in zip(outs, s.output_specs, strict=True):
                    vec[i] += tensors[t].nbytes / spec.num_shards(sizes)
        vectors.append(vec)
    return vectors


def live_sets(table: DecisionVariables, max_live_sets: int) -> list[list[int]]:
    """Variables whose tensors are alive at about ``max_live_sets`` evenly spaced program
    points (graph inputs are alive at all of them)."""
    graph = table.graph
    last_use: dict[int, int] = {}
    for node in graph.nodes:
        for t in node.inputs:
            last_use[t] = node.id
    always = sorted({table.var_of[input_key(p)] for p in range(len(graph.inputs))})
    step = max(1, len(graph.nodes) // max_live_sets)
    live: dict[int, int] = {}  # tensor -> id of its last user
    sets: list[list[int]] = []
    for node in graph.nodes:
        for t in node.outputs:
            if t in last_use:
                live[t] = last_use[t]
        if node.id % step == 0:
            current = {table.var_of[table.tensor_home[t][0]] for t in live}
            sets.append(sorted(current | set(always)))
        for t in [t for t, end in live.items() if end <= node.id]:
            del live[t]
    return sets
