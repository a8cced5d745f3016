"""What a piece's solved plan says beyond its inputs' specs: the specs of the values its
forward computes, and the collectives it predicts per microbatch and per step.

Which tensor of a piece's train graph is which forward value: the stage plan for the values a
piece computes, not only for those it reads.

A piece's cost is solved on its small train step (``piece_cost.piece_train_graph``: the
forward under ``jax.vjp``, the backward, a placeholder update), traced anew, so its tensors
have ids of their own. The runtime runs the piece's forward equations themselves (and lets
``jax.vjp`` derive the backward), so it can hold the forward's results to the plan only if
the plan names them by forward value id. Under ``jax.vjp`` every forward equation is bound
again on its primal operands (the JVP rules bind the primitive itself; the residuals they
compute are extra equations beside it), so each forward equation is found in the graph by
data flow: the first graph equation, not yet taken, of the same primitive whose operands are
the tensors already matched to the forward equation's operands, and whose results have the
same shapes and dtypes (constants and literals compared by position only; an equation of
constants alone, such as a mask's ``iota``, also by its parameters). What is computed from
constants alone counts as a constant on both sides: ``jax.vjp`` may fold such an equation
rather than bind it (a weak-typed literal's ``convert_element_type`` in
``jnp.where(m, x, -jnp.inf)``), and waiting on its match left every value computed after it,
through GPT's attention mask and MoE's routing, to XLA's choice. An equation not found
(a scan, expanded into a region in the graph; a JVP rule that computes its primal otherwise)
leaves its results, and whatever is computed from them, without a spec: the runtime then lets
XLA choose there, as before.
"""

from __future__ import annotations

from typing import Any

from autopar.compiler.graph.opgraph import OpGraph
from autopar.compiler.intra_op.sharding_ilp import ProblemParts, reshard_collectives
from autopar.ir.cotangent_marks import CT, GRAD, IN, OTHER, SUM, viewed_parameter
from autopar.ir.pieces import Piece
from autopar.ir.pipeline_pieces import piece_roles
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.program import TensorKind
from autopar.plan import CollectiveEstimate, ShardingSpec

_CONSTANT_KINDS = (TensorKind.CONST, TensorKind.LITERAL)


def forward_value_specs(pp: PipelineProgram, piece: Piece, graph: OpGraph,
                        paths: dict[str, int], tensor_spec: dict[int, ShardingSpec]
                        ) -> dict[int, ShardingSpec]:
    """The plan's spec of every result of ``piece``'s forward equations found in ``graph``
    (see the module), by forward value id; scalars are left out (every device holds them)."""
    return {v: tensor_spec[t] for v, t in forward_tensors(pp, piece, graph, paths).items()
            if t in tensor_spec}


def forward_tensors(pp: PipelineProgram, piece: Piece, graph: OpGraph,
                    paths: dict[str, int]) -> dict[int, int]:
    """The graph tensor of every non-scalar result of ``piece``'s forward equations found in
    ``graph`` (see the module), by forward value id: a fact of the graph, whatever the plan,
    kept on it (a structure's graph is solved on every mesh and split level: at GPT-39B the
    match made anew was 0.75 of the layer ILPs' 13 CPU seconds)."""
    return _matched(pp, piece, graph, paths)[0]


def forward_nodes(pp: PipelineProgram, piece: Piece, graph: OpGraph,
                  paths: dict[str, int]) -> dict[int, int]:
    """The graph node of each of ``piece``'s forward equations found in ``graph``, by
    equation index."""
    return _matched(pp, piece, graph, paths)[1]


def _matched(pp: PipelineProgram, piece: Piece, graph: OpGraph,
             paths: dict[str, int]) -> tuple[dict[int, int], dict[int, int]]:
    key = ("forward_tensors", tuple(piece.eqns), tuple(sorted(paths.items())))
    if key not in graph.derived:
        graph.derived[key] = _match_forward(pp, piece, graph, paths)
    return graph.derived[key]


def _match_forward(pp: PipelineProgram, piece: Piece, graph: OpGraph,
                   paths: dict[str, int]) -> tuple[dict[int, int], dict[int, int]]:
    fwd = pp.forward
    by_path = {io.path: io.tensor for io in graph.inputs}
    tensor_of: dict[int, int] = {fid: by_path[path] for path, fid in paths.items()
                                 if path in by_path}
    constant = {t for t, info in graph.tensors.items() if info.kind in _CONSTANT_KINDS}
    fwd_constant = {v for v, kind in fwd.kinds.items() if kind in _CONSTANT_KINDS}
    # graph equations by (primitive, operands with constants blanked), in graph order
    def results(ids: Any, avals: Any) -> tuple:
        return tuple((tuple(avals(v).shape), str(avals(v).dtype)) for v in ids)

    def key(name: str, operands: tuple, outs: tuple, params: Any) -> tuple:
        alone = all(o is None for o in operands)
        return (name, operands, outs, repr(sorted(params.items())) if alone else None)

    node_of: dict[int, int] = {}
    waiting: dict[tuple, list[Any]] = {}
    for node in graph.nodes:
        operands = tuple(None if t in constant else t for t in node.inputs)
        outs = results(node.outputs, lambda t: graph.tensors[t])
        waiting.setdefault(key(node.primitive, operands, outs, node.params), []).append(node)
        if all(o is None for o in operands):
            constant.update(node.outputs)
    for i in piece.eqns:
        eqn = fwd.eqns[i]
        if all(v in fwd_constant for v in eqn.inputs):
            # computed from constants alone, it is one too: under ``jax.vjp`` such an
            # equation may be folded into a constant rather than bound (a weak-typed
            # literal's ``convert_element_type``, as in ``jnp.where(m, x, -jnp.inf)``), and
            # a consumer must not wait on a match it may never get
            fwd_constant.update(eqn.outputs)
        matched: list[int | None] = []
        for v in eqn.inputs:
            if v in fwd_constant:
                matched.append(None)
            elif v in tensor_of:
                matched.append(tensor_of[v])
            else:
                break  # an operand not matched: neither is this equation
        else:
            outs = results(eqn.outputs, lambda v: fwd.avals[v])
            found = waiting.get(key(eqn.name, tuple(matched), outs, eqn.params))
            if found:
                node = found.pop(0)
                node_of[i] = node.id
                tensor_of.update(zip(eqn.outputs, node.outputs, strict=True))
    produced = {v for i in piece.eqns for v in fwd.eqns[i].outputs}
    return ({v: t for v, t in tensor_of.items() if v in produced and graph.tensors[t].ndim > 0},
            node_of)


def piece_collectives(parts: ProblemParts, graph: OpGraph, node_strategy: dict[int, Any],
                      tensor_spec: dict[int, ShardingSpec], updates: dict[int, int],
                      makers: set[int]
                      ) -> tuple[list[CollectiveEstimate], list[CollectiveEstimate]]:
    """The chosen plan's collectives, split as the stage cost prices them: per microbatch
    (the forward and backward) and per step (each gradient's ``makers``' own, its resharding
    into the placeholder update, and the new parameters' relayout to the parameters'). The
    placeholder ``updates``' own (node id -> operand position of the gradient) and their
    reading of the parameter are left out: the step's real update runs outside the pipeline's
    tasks."""
    uses, tied = reshard_collectives(parts, node_strategy, tensor_spec)
    per_microbatch: list[CollectiveEstimate] = []
    per_step: list[CollectiveEstimate] = list(tied)
    for node in graph.nodes:
        if node.id not in updates:
            moves = node_strategy[node.id].collectives
            (per_step if node.id in makers else per_microbatch).extend(moves)
    for (n, k), moves in uses.items():
        if updates.get(n) == k:
            per_step.extend(moves)
        elif n not in updates:
            per_microbatch.extend(moves)
    return per_microbatch, per_step


def cotangent_specs(graph: OpGraph, tensor_spec: dict[int, ShardingSpec],
                    values: dict[int, ShardingSpec]) -> dict[int, ShardingSpec]:
    """The plan's layout of each forward value's cotangent (marked in ``graph``:
    ``ir.cotangent_marks``) where it is not the value's own (``values``), by forward value
    id: the runtime holds a cotangent to its value's layout otherwise."""
    out = {}
    for v, t in graph.cotangents.items():
        spec = tensor_spec.get(t)
        if isinstance(v, int) and spec is not None and graph.tensors[t].ndim > 0 \
                and spec != values.get(v):
            out[v] = spec
    return out


def contraction_specs(pp: PipelineProgram, piece: Piece, graph: OpGraph,
                      paths: dict[str, int],
                      operand_specs: dict[tuple[int, int], ShardingSpec]
                      ) -> dict[tuple[int, int, str], ShardingSpec]:
    """Where the plan reads a contraction's operands otherwise than their producers lay them
    out, keyed as ``ir.cotangent_marks`` holds them: ``(eqn, k, IN)`` for the forward's
    operand ``k``; for the transpose making operand ``k``'s gradient, ``(eqn, k, CT)`` and
    ``(eqn, k, OTHER)`` (found from its marked result, through a ``transpose`` after it, and
    its marked operands), from ``operand_specs`` (``read_solution``'s: each use read otherwise
    than produced). XLA reshards there only when the runtime holds it there."""
    out: dict[tuple[int, int, str], ShardingSpec] = {}

    def add(key: tuple[int, int, str], node: int, position: int) -> None:
        if (node, position) in operand_specs:
            out[key] = operand_specs[(node, position)]

    fwd = pp.forward
    for i, node in forward_nodes(pp, piece, graph, paths).items():
        if fwd.eqns[i].name == "dot_general" and len(graph.nodes[node].inputs) == 2:
            add((i, 0, IN), node, 0)
            add((i, 1, IN), node, 1)
    marks = graph.cotangents
    for (i, k), node in _gradient_contractions(graph).items():
        for role in (CT, OTHER):
            read = marks.get((i, k, role))
            for position, operand in enumerate(graph.nodes[node].inputs):
                if operand == read:
                    add((i, k, role), node, position)
    return out


def _gradient_contractions(graph: OpGraph) -> dict[tuple[int, int], int]:
    """The graph node of each marked transpose (``(eqn, k)``: the one making operand ``k``'s
    gradient of forward contraction ``eqn``), found from its marked result through a
    ``transpose`` after it."""
    out: dict[tuple[int, int], int] = {}
    for key, t in graph.cotangents.items():
        if not (isinstance(key, tuple) and key[2] == GRAD):
            continue
        node = graph.producer.get(t)
        while node is not None and graph.nodes[node].primitive == "transpose":
            node = graph.producer.get(graph.nodes[node].inputs[0])
        if node is not None and graph.nodes[node].primitive == "dot_general":
            out[key[:2]] = node
    return out


def partial_sum_specs(pp: PipelineProgram, piece: Piece, graph: OpGraph,
                      node_strategy: dict[int, Any], makers: set[int]
                      ) -> dict[tuple[int, int, str], ShardingSpec]:
    """Where the transpose making a parameter's gradient contracts dimensions the plan
    splits, so that its partial sums are reduced once per step (the gradient's ``makers``'
    collectives are priced so: ``step_parts.amortise``), keyed ``(eqn, k, SUM)``: a spec over
    the result's cotangent naming, for each such dimension it contracts, the mesh axes that
    split it (in both operands alike). The runtime keeps those partial sums per group over
    the microbatches and reduces them once (``runtime.pipeline_tasks``)."""
    params = set(piece_roles(pp, piece).params)
    marks, fwd = graph.cotangents, pp.forward
    made = {v: fwd.eqns[i] for i in piece.eqns for v in fwd.eqns[i].outputs}
    out: dict[tuple[int, int, str], ShardingSpec] = {}
    for (i, k), node in _gradient_contractions(graph).items():
        n = graph.nodes[node]
        ct, other = marks.get((i, k, CT)), marks.get((i, k, OTHER))
        if viewed_parameter(made, fwd.eqns[i].inputs[k], params) is None \
                or node not in makers \
                or ct not in n.inputs or other not in n.inputs or ct == other:
            continue
        c = n.inputs.index(ct)
        specs = node_strategy[node].input_specs
        (contract, _) = n.params["dimension_numbers"]
        if specs[c] is None or specs[1 - c] is None:
            continue
        dims = [()] * graph.tensors[ct].ndim
        for dc, do in zip(contract[c], contract[1 - c], strict=True):
            if specs[c].dims[dc] and specs[c].dims[dc] == specs[1 - c].dims[do]:
                dims[dc] = tuple(specs[c].dims[dc])
        if any(dims):
            out[(i, k, SUM)] = ShardingSpec(tuple(dims))
    return out
