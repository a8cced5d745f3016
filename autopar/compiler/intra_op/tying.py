"""Identical-layer tying: the same op of structurally identical layers makes one decision.

Ops are labelled Weisfeiler-Lehman style: a node's label starts as its strategy signature
(primitive, params, types) and is refined ``rounds`` times with the labels of its operands and
users. Variables whose root and followers carry equal labels and whose strategy lists agree are
merged, so where the model repeats a layer the ILP solves it once. :func:`tie_in_alternation`
then lets the odd and the even occurrences decide apart (Megatron's alternation).

A layer written as a ``scan`` body needs no labels: its equations are in the graph once, for
every iteration. What the loop adds is :func:`tie_scan_carries`: a carry is one value around
the loop, so the enter that reads it and the exit that makes it share one decision.
"""

from __future__ import annotations

from autopar.compiler.graph.opgraph import OpGraph
from autopar.compiler.intra_op.variables import DecisionVariables, Variable, input_key


def tie_scan_carries(table: DecisionVariables) -> int:
    """Merge the variables of each scan carry's enter and exit (see the module docstring), in
    place; returns how many pairs were merged. Both ends list the specs of one shape in one
    order, so a choice index means the same spec at both; a pair whose lists disagree (or that
    already shares a variable) is left as it is."""
    pairs = []
    for loop in table.graph.loops:
        for enter, exit_ in loop.carry_pairs():
            a, b = table.var_of.get(enter), table.var_of.get(exit_)
            if a is None or b is None or a == b:
                continue
            ins = [s.output_specs[0] for s in table.variables[a].members[enter]]
            outs = [s.input_specs[0] for s in table.variables[b].members[exit_]]
            if ins == outs:
                pairs.append((a, b))
    if not pairs:
        return 0
    # union-find over variable indices: a carry passed through unchanged chains its pairs
    parent = list(range(len(table.variables)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in pairs:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    merged: list[Variable] = []
    remap: dict[int, int] = {}
    for var in table.variables:
        root = find(var.index)
        if root == var.index:
            remap[var.index] = len(merged)
            merged.append(Variable(len(merged), var.root, dict(var.members), list(var.costs)))
    for var in table.variables:
        root = find(var.index)
        if root != var.index:
            into = merged[remap[root]]
            into.members.update(var.members)
            into.costs = [x + y for x, y in zip(into.costs, var.costs, strict=True)]
            remap[var.index] = remap[root]
    table.variables = merged
    table.var_of = {m: remap[v] for m, v in table.var_of.items()}
    return len(pairs)


def structural_labels(
    graph: OpGraph, batch_argnums: tuple[int, ...], rounds: int, signatures: dict[int, tuple]
) -> dict[int, int]:
    """Weisfeiler-Lehman labels of ops (by id) and inputs (by -1 - position) after ``rounds``
    refinements over operand and user wiring. Equal labels: alike within ``rounds`` hops.

    ``signatures`` maps every op node id to its strategy signature (``node_signature``).
    The labels depend on nothing else, so the last ones are kept on the graph: the full
    search builds one whole-step problem per logical mesh (GPT-3 175B's 60,000 nodes: 1.8 s
    of labelling per build)."""
    key = (batch_argnums, rounds, tuple(signatures[node.id] for node in graph.nodes))
    kept = graph.derived.get(("structural_labels",))
    if kept is not None and kept[0] == key:
        return dict(kept[1])
    label = _refined_labels(graph, batch_argnums, rounds, signatures)
    graph.derived[("structural_labels",)] = (key, label)
    return dict(label)


def _refined_labels(graph: OpGraph, batch_argnums: tuple[int, ...], rounds: int,
                    signatures: dict[int, tuple]) -> dict[int, int]:
    producer: dict[int, int] = {io.tensor: input_key(p) for p, io in enumerate(graph.inputs)}
    producer.update(graph.producer)
    label: dict[int, int] = {}
    for p, io in enumerate(graph.inputs):
        info = graph.tensors[io.tensor]
        label[input_key(p)] = hash(
            ("input", info.shape, info.dtype, io.arg_index in batch_argnums)
        )
    for node in graph.nodes:
        label[node.id] = hash(signatures[node.id])
    operands: dict[int, list[tuple[int, int]]] = {k: [] for k in label}
    users: dict[int, list[tuple[int, int]]] = {k: [] for k in label}
    for node in graph.nodes:
        for k, t in enumerate(node.inputs):
            src = producer.get(t)
            if src is not None:
                operands[node.id].append((k, src))
                users[src].append((k, node.id))
    for _ in range(rounds):
        label = {
            key: hash(
                (
                    lab,
                    tuple((k, label[src]) for k, src in operands[key]),
                    tuple(sorted((k, label[dst]) for k, dst in users[key])),
                )
            )
            for key, lab in label.items()
        }
    return label


def tie_identical_variables(
    table: DecisionVariables, batch_argnums: tuple[int, ...], rounds: int
) -> None:
    """Merge the variables of ``table`` whose roots look alike within ``rounds`` hops (same
    ops, shapes and wiring), in place: merged variables make one choice together and their
    costs add up. Variable indices are renumbered in order of first appearance."""
    labels = structural_labels(table.graph, batch_argnums, rounds, table.signatures)
    classes: dict[tuple, int] = {}
    merged: list[Variable] = []
    remap: dict[int, int] = {}
    for var in table.variables:
        members = sorted(var.members)
        signature = (
            labels[var.root],
            tuple(labels[m] for m in members if m != var.root),
            tuple(s.name for s in var.members[var.root]),
        )
        target = classes.get(signature)
        if target is None:
            target = len(merged)
            classes[signature] = target
            merged.append(Variable(target, var.root, dict(var.members), list(var.costs)))
        else:
            into = merged[target]
            into.members.update(var.members)
            into.costs = [a + b for a, b in zip(into.costs, var.costs, strict=True)]
        remap[var.index] = target
    table.variables = merged
    table.var_of = {m: remap[v] for m, v in table.var_of.items()}


def tie_in_alternation(
    table: DecisionVariables, untied: list[Variable], untied_of: dict[int, int], period: int
) -> None:
    """Split every tied decision of ``table`` by occurrence: the k-th of the variables it
    merged (``untied``, in program order; ``untied_of``: member -> its index there) joins the
    decision of occurrence ``k mod period``. In place.

    Identical layers tied into one decision must all choose alike, which rules out the plans
    where consecutive layers differ: in a chain of identical dense layers Megatron's split
    alternates, column-parallel then row-parallel, so that one all-reduce per pair of layers
    is all it needs, while every layer splitting alike either gathers or all-reduces at every
    layer. Occurrences of one op in program order are its layers in order (forward, backward
    and update each run through the layers in one direction), so period 2 lets even and odd
    layers decide apart and keeps a deep model's decisions bounded."""
    groups: dict[int, list[Variable]] = {}
    for var in untied:
        groups.setdefault(table.var_of[var.root], []).append(var)
    merged: list[Variable] = []
    remap: dict[int, int] = {}
    for index in sorted(groups):
        occurrences = groups[index]
        for phase in range(min(period, len(occurrences))):
            part = occurrences[phase::period]
            into = Variable(len(merged), part[0].root, {}, [0.0] * part[0].size)
            for var in part:
                into.members.update(var.members)
                into.costs = [a + b for a, b in zip(into.costs, var.costs, strict=True)]
                remap[var.index] = into.index
            merged.append(into)
    table.variables = merged
    table.var_of = {m: remap[v] for m, v in untied_of.items()}
