"""What a pipeline stage costs: its forward, backward and update as one graph, solved by the
intra-operator ILP on a logical mesh.

A piece of the loss forward becomes a small train step: the forward, ``jax.vjp`` back to its
parameters and incoming activations, and a plain gradient step on the parameters (so the ILP
sees that a replicated parameter's gradient must be reduced, and ties the gradient's layout to
the parameter's). Traced at microbatch shapes, the ILP's objective is the stage's time per
microbatch; its choice for the piece's inputs is the stage's plan. Layers of the same structure
are costed once (``layer_costs.LayerCostCache``).

Two parts of that step run once per step, not once per microbatch, and are priced so before the
ILP chooses (``step_parts.amortise``): the gradients' reduction (the collectives of the nodes
that make each parameter's gradient, and the resharding of the gradient into the update) runs
after the last microbatch's backward, on the accumulated gradient (the model's assumption, as
Alpa's; the runtime reduces every microbatch's gradient today: docs/pipeline.md, "Where a
one-stage pipeline's time goes"); and the update is the step's
own optimizer (its equations after the gradients, ``step_update_work``: Adam's about a dozen
flops per parameter, not the placeholder ``p - g``), on the parameter as the plan lays it out.
Both enter the objective divided by the microbatch count (Alpa's
``grad_acc_num_micro_batches``), and ``PieceCost`` keeps them apart (``sync_s``, ``update_s``:
per step).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import jax
import numpy as np

from autopar.compiler.cost.estimate import launch_time_s
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.opgraph import OpGraph
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.inter_op.piece_plan import (
    contraction_specs,
    cotangent_specs,
    forward_value_specs,
    partial_sum_specs,
    piece_collectives,
)
from autopar.compiler.inter_op.recompute_parts import RecomputeParts, recompute_parts
from autopar.compiler.inter_op.remat import FORWARD_SHARE
from autopar.compiler.inter_op.step_parts import StepWork, amortise, gradient_nodes
from autopar.compiler.intra_op.dual_bound import WarmMessages
from autopar.compiler.intra_op.ilp import restrict, solve
from autopar.compiler.intra_op.problem import STOPPED_STATUSES
from autopar.compiler.intra_op.sharding_ilp import (
    IntraOpOptions,
    MeshCaches,
    build_problem,
    read_solution,
    state_split_at_least,
)
from autopar.ir.cotangent_marks import mark_cotangent, traced_bind
from autopar.ir.flatten import flatten_step
from autopar.ir.pieces import Piece
from autopar.ir.pipeline_pieces import piece_roles
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.scan_units import run_forward_eqns, whole_unit_runs
from autopar.plan import CollectiveEstimate, ShardingSpec


@dataclass(frozen=True)
class PieceCost:
    """One piece on one logical mesh.

    ``time_s``: seconds per microbatch, forward + backward (``compute_s`` of it computing, the
    rest communicating inside the mesh; feeding its inputs is the stage search's to price);
    ``sync_s``: seconds per step of its gradients' reduction over the mesh; ``update_s``:
    seconds per step of the step's optimizer update of its parameters (as laid out);
    ``param_bytes``: per-device bytes of its parameters (``whole_param_bytes``: unsplit);
    ``fixed_bytes``: per-device bytes
    that stay (parameters, gradient accumulators, optimizer state); ``activation_bytes``: per
    in-flight microbatch (the forward's values kept for the backward); ``input_specs``: the
    spec of each piece input (forward value id -> spec); ``ilp_status``, ``ilp_gap``: how
    its ILP ended. ``collectives``: what the chosen plan communicates per microbatch (the
    forward's and backward's own and their resharding); ``sync_collectives``: per step (the
    gradients' reduction and their resharding into the update): together what the stage plan
    predicts, for the report to set beside the compiled programs' collectives.
    ``value_specs``: the spec of each value the piece's forward computes (forward value id ->
    spec; ``piece_plan``), which the runtime holds the forward's results to. ``choices``:
    the ILP's solution, a strategy per node of its problem (empty where the cost is not one
    ILP's); ``derived``: no ILP was solved for it, its plan is a less-split variant's
    (``meets_state_split``)."""

    time_s: float
    compute_s: float
    fixed_bytes: float
    activation_bytes: float
    # per microbatch when the piece is rematerialised: only its activation inputs are kept
    boundary_bytes: float
    input_specs: dict[int, ShardingSpec]
    ilp_status: str
    sync_s: float = 0.0
    update_s: float = 0.0
    param_bytes: float = 0.0
    ilp_gap: float | None = None
    whole_param_bytes: float = 0.0
    collectives: tuple[CollectiveEstimate, ...] = ()
    sync_collectives: tuple[CollectiveEstimate, ...] = ()
    value_specs: dict[int, ShardingSpec] = field(default_factory=dict)
    # the spec of a forward value's cotangent in the backward where it is not the value's
    # own (forward value id -> spec; ``ir.cotangent_marks``): the runtime holds it there
    cotangent_specs: dict[int, ShardingSpec] = field(default_factory=dict)
    # where the plan reads a contraction's operands (forward and transposes) otherwise than
    # they come, by (forward equation, operand, role) (``piece_plan.contraction_specs``)
    contraction_specs: dict[tuple[int, int, str], ShardingSpec] = field(default_factory=dict)
    choices: tuple[int, ...] = ()
    derived: bool = False
    # selective recomputation (``remat="selective"``): the forward's matmul outputs kept per
    # microbatch (split like the batch), and the seconds per microbatch recomputing the rest
    matmul_output_bytes: float = 0.0
    selective_recompute_s: float = 0.0
    # recomputed (``jax.checkpoint`` per block of the forward's repeated structure, as
    # ``checkpoint_positions`` cuts): the checkpoints' inputs kept per microbatch (the piece's
    # own inputs where it is one block; every block's where it is several), and the largest
    # block's activations, which its backward rebuilds at once (per device, split like the
    # batch)
    checkpoint_bytes: float = 0.0
    recompute_bytes: float = 0.0
    # of ``time_s`` and ``update_s``, the kernels' launches (the same under every plan)
    launch_s: float = 0.0
    update_launch_s: float = 0.0
    # the dual messages its ILP's ascent ended with (``WarmMessages.kept``), where it ran
    # one: the next memory-lean rung's start (``LayerCostCache``)
    dual_messages: dict | None = field(default=None, compare=False, repr=False)

    def planned_s(self, num_microbatches: int) -> float:
        """``per_microbatch_s`` without the kernels' launches: what plans differ in."""
        return self.per_microbatch_s(num_microbatches) - self.launch_s - \
            self.update_launch_s / max(num_microbatches, 1)

    def per_microbatch_s(self, num_microbatches: int) -> float:
        """Forward and backward, with the per-step parts spread over the microbatches."""
        return self.time_s + (self.sync_s + self.update_s) / max(num_microbatches, 1)


def piece_train_graph(pp: PipelineProgram, piece: Piece) -> tuple[OpGraph, dict[str, int]]:
    """The piece's train step as an OpGraph, and the forward value id of each graph input path
    (``state/p/k`` parameters, ``state/c/k`` fixed inputs, ``batch/a/k`` activations,
    ``batch/d/k`` microbatch data, ``batch/g/k`` cotangents arriving from later stages)."""
    fwd = pp.forward
    roles = piece_roles(pp, piece)
    n_params = len(roles.params)

    def sds(v: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(fwd.avals[v].shape, fwd.avals[v].dtype)

    def piece_step(state: dict, batch: dict) -> Any:
        def run(diff_vals: list[Any]) -> tuple[list[Any], list[Any]]:
            env = dict(zip(roles.diff, diff_vals, strict=True))
            env.update(zip(roles.fixed, state["c"], strict=True))
            env.update(zip(roles.micro, batch["d"], strict=True))
            # what the runtime holds the backward to, marked (``cotangent_marks``)
            run_forward_eqns(fwd, piece.eqns, env, pp.layer_scans, mark_cotangent, traced_bind)
            return [env[v] for v in roles.float_outputs], [env[v] for v in roles.other_outputs]

        outs, vjp_fn, others = jax.vjp(run, [*state["p"], *batch["a"]], has_aux=True)
        (grads,) = vjp_fn(list(batch["g"]))
        new_params = [p - g for p, g in zip(state["p"], grads[:n_params], strict=True)]
        return {"p": new_params}, grads[n_params:], outs, others

    state = {"p": [sds(v) for v in roles.params], "c": [sds(v) for v in roles.fixed]}
    batch = {
        "a": [sds(v) for v in roles.acts],
        "d": [sds(v) for v in roles.micro],
        "g": [sds(v) for v in roles.float_outputs],
    }
    # scans as regions (the scan its whole units of a layer scan run as, as at run time, and
    # any scan in the piece): the ILP plans the body once, as one-stage planning does, rather
    # than a scan replicated whole
    program = flatten_step(piece_step, (state, batch), expand_scans=True)
    paths = {}
    for prefix, ids in (("state/p", roles.params), ("state/c", roles.fixed),
                        ("batch/a", roles.acts), ("batch/d", roles.micro),
                        ("batch/g", roles.float_outputs)):
        for k, v in enumerate(ids):
            paths[f"{prefix}/{k}"] = v
    return build_graph(program), paths


def piece_signature(pp: PipelineProgram, piece: Piece) -> str:
    """Equal for pieces of the same structure (operations, parameters, shapes, wiring)."""
    fwd = pp.forward
    local: dict[int, int] = {}

    def name(v: int) -> str:
        aval = fwd.avals[v]
        kind = f"{tuple(aval.shape)}{aval.dtype}"
        if v in fwd.values:
            return f"k{kind}"
        local.setdefault(v, len(local))
        return f"v{local[v]}:{kind}"

    roles = piece_roles(pp, piece)
    parts = [",".join(name(v) for v in group) for group in
             (roles.params, roles.acts, roles.fixed, roles.micro)]
    for i in piece.eqns:
        e = fwd.eqns[i]
        params = sorted((k, repr(p)) for k, p in e.params.items())
        parts.append(f"{e.name}{params}({','.join(name(v) for v in e.inputs)})->"
                     f"{','.join(name(v) for v in e.outputs)}")
    parts.append(",".join(name(v) for v in piece.outputs))
    # where whole units of a layer scan lie: those run (and are costed) as a scan
    parts.append(repr([(r.position, r.span) for r in whole_unit_runs(piece.eqns,
                                                                       pp.layer_scans)]))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def optimizer_state_per_parameter(pp: PipelineProgram) -> float:
    """Bytes of the step's other state (optimizer moments, counters) per byte of parameters:
    2 for Adam, 1 for momentum SGD, 0 for plain SGD. Parameters are the loss function's
    differentiated inputs; the batch is what the pipeline splits into microbatches."""
    outer = pp.outer
    params = set(pp.param_sources().values())
    batch = {pp.operand_of[f] for f in pp.split_inputs}
    param_bytes = sum(nbytes(outer.avals[v]) for v in params)
    state_bytes = sum(nbytes(outer.avals[v]) for v in outer.in_ids
                      if v not in params and v not in batch)
    return state_bytes / param_bytes if param_bytes else 0.0


def stopped_early(cost: PieceCost) -> bool:
    """Whether a piece's ILP ended at its time limit (or without a plan of its own)."""
    return cost.ilp_status in STOPPED_STATUSES


def solve_status(cost: PieceCost) -> str:
    """How a stage-cost ILP ended: ``proven`` (optimal up to solver tolerance, or decided
    without a MIP), ``within_gap`` (stopped within the relative gap it was given),
    ``time_limit`` (stopped at its time limit: the best plan so far), ``no_solution`` (the
    solver found none in time: the greedy plan), ``solver_error`` (the solver failed: the
    greedy plan)."""
    if stopped_early(cost):
        return cost.ilp_status
    if cost.ilp_gap is not None and cost.ilp_gap > 1e-9:
        return "within_gap"
    return "proven"


@dataclass
class BuiltPiece:
    """A piece's sharding ILP on one mesh with its per-step parts amortised (``amortise``),
    what reads a solution back, and the function pricing a solution's per-step parts."""

    problem: Any
    parts: Any
    per_step: Any
    update_launch_s: float = 0.0  # one parameter's update kernels' launches


def build_piece(graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions,
                caches: MeshCaches, work: StepWork, m: int) -> BuiltPiece:
    """``graph``'s sharding ILP on ``mesh``, its per-step parts divided by ``m``."""
    problem, parts = build_problem(graph, mesh, options, caches)
    return BuiltPiece(problem, parts, amortise(problem, parts, graph, mesh, work, m),
                      work.update_launch_s(mesh))


def solve_piece(pp: PipelineProgram, piece: Piece, graph: OpGraph, paths: dict[str, int],
                mesh: LogicalMesh, options: IntraOpOptions, built: BuiltPiece,
                 state_per_parameter: float, m: int, split: int = 1,
                recompute: RecomputeParts | None = None,
                warm: WarmMessages | None = None) -> PieceCost:
    """``split`` > 1: the fastest plan among those splitting every parameter at least that
    many ways (``state_split_at_least``). ``recompute``: the piece's ``recompute_parts``, where
    the caller has them. ``warm``: the dual messages of this piece's solve at a lower split
    on this mesh, to start from (and to keep this solve's in)."""
    problem, parts, per_step = built.problem, built.parts, built.per_step
    solve_limited = partial(solve, solver=options.solver, time_limit_s=options.time_limit_s,
                            relative_gap=options.relative_gap, warm=warm)
    if split > 1:
        restricted, originals = restrict(problem, {
            u: np.asarray(c)
            for u, c in state_split_at_least(parts, options.batch_argnums, split).items()})
        if warm is not None:
            warm.strategies = originals
        sub = solve_limited(restricted)
        solution = replace(sub, choices=[int(originals[u][c])
                                         for u, c in enumerate(sub.choices)])
    else:
        if warm is not None:
            warm.strategies = None
        solution = solve_limited(problem)
    node_strategy, input_spec, operand_specs, tensor_spec, _ = read_solution(parts,
                                                                           solution.choices)
    values = forward_value_specs(pp, piece, graph, paths, tensor_spec)
    updates, makers = gradient_nodes(graph)
    per_microbatch_moves, per_step_moves = piece_collectives(
        parts, graph, node_strategy, tensor_spec, updates, makers)
    sync, update, placeholder, feed = per_step(solution.choices)
    sizes = {a: mesh.axis_size(a) for a in mesh.axis_names}
    by_path = {io.path: io.tensor for io in graph.inputs}
    specs = {fid: input_spec[by_path[path]] for path, fid in paths.items()
             if not path.startswith("batch/g")}
    roles = piece_roles(pp, piece)
    param_bytes = sum(
        graph.tensors[by_path[f"state/p/{k}"]].nbytes / specs[v].num_shards(sizes)
        for k, v in enumerate(roles.params)
    )
    whole_param_bytes = sum(graph.tensors[by_path[f"state/p/{k}"]].nbytes
                            for k in range(len(roles.params)))
    # the forward's own results are kept for the backward; split like the piece's batch
    fwd = pp.forward
    kept = sum(nbytes(fwd.avals[v]) for i in piece.eqns for v in fwd.eqns[i].outputs)
    batch_split = max(
        [specs[v].num_shards(sizes) for v in (*roles.acts, *roles.micro) if v in specs] or [1]
    )
    recompute = recompute or recompute_parts(pp, piece)
    boundary = sum(nbytes(fwd.avals[v]) for v in (*roles.acts, *roles.micro)) / batch_split
    keep = 1.0 / max(m, 1)
    # the ILP prices feeding the piece's batch inputs (microbatch data, activations and
    # cotangents) to choose their splits; the stage search prices the transfers between
    # stages itself, and a one-stage plan's estimate has no feed: left out here
    per_microbatch = float(solution.objective) - keep * (sync + update) - feed
    compute = sum(st.compute_time_s for st in node_strategy.values()) - placeholder
    # the kernels' launches, left out of the ILP (the same under every plan): the piece's
    # forward and backward per microbatch, its parameters' updates per step
    launched = launch_time_s(graph, mesh, skip=updates)
    update_launch = len(updates) * built.update_launch_s
    update += update_launch
    return PieceCost(
        time_s=max(per_microbatch, 0.0) + launched,
        compute_s=max(compute, 0.0) + launched,
        # the parameters, their gradient accumulators and their optimizer state
        fixed_bytes=(2.0 + state_per_parameter) * param_bytes,
        activation_bytes=kept / batch_split,
        boundary_bytes=boundary,
        checkpoint_bytes=boundary,
        recompute_bytes=kept / batch_split,
        input_specs=specs,
        ilp_status=solution.status,
        sync_s=sync,
        update_s=update,
        param_bytes=param_bytes,
        whole_param_bytes=whole_param_bytes,
        ilp_gap=solution.gap,
        collectives=tuple(per_microbatch_moves),
        sync_collectives=tuple(per_step_moves),
        value_specs=values,
        cotangent_specs=cotangent_specs(graph, tensor_spec, values),
        contraction_specs=contraction_specs(pp, piece, graph, paths, operand_specs)
        | partial_sum_specs(pp, piece, graph, node_strategy, makers),
        choices=tuple(int(c) for c in solution.choices),
        launch_s=launched,
        update_launch_s=update_launch,
        matmul_output_bytes=recompute.matmul_output_bytes / batch_split,
        # the forward is a third of the compute (``remat.FORWARD_SHARE``)
        selective_recompute_s=FORWARD_SHARE * max(compute, 0.0) * recompute.recomputed_share,
    )


def meets_state_split(built: BuiltPiece, batch_argnums: Sequence[int], cost: PieceCost,
                      split: int) -> bool:
    """Whether ``cost``'s plan (solved on ``built``, with a lower ``split`` or none) already
    splits every parameter at least ``split`` ways (``state_split_at_least``). The variants'
    problems are nested, each a restriction of the less-split one's, so such a plan, optimal
    there, is optimal here too (within the same gap): its ILP need not be solved. A plan that
    stopped at a time limit is not: the restricted ILP may find a better one."""
    if not cost.choices or stopped_early(cost):
        return False
    keep = state_split_at_least(built.parts, batch_argnums, split)
    return all(cost.choices[u] in allowed for u, allowed in keep.items())


def nbytes(aval: Any) -> float:
    """Bytes of a value of abstract value ``aval``."""
    size = 1
    for d in aval.shape:
        size *= int(d)
    return float(size * aval.dtype.itemsize)


def mesh_solve_key(mesh: LogicalMesh) -> tuple:
    """What a piece's ILP on ``mesh`` depends on of the mesh (``LayerCostCache``'s keys)."""
    return (tuple(mesh.shape), tuple(mesh.alpha), tuple(mesh.beta), mesh.peak_flops,
            mesh.compute_efficiency)


def piece_span(piece: Piece) -> tuple[int, int]:
    """A piece of the forward by its first and last equation."""
    return (piece.eqns[0], piece.eqns[-1]) if piece.eqns else (piece.index, -1)
