"""What a pipeline stage costs: its forward, backward and update as one graph, solved by the
intra-operator ILP on a logical mesh.

A piece of the loss forward becomes a small train step: the forward, ``jax.vjp`` back to its
parameters and incoming activations, and a plain gradient step on the parameters (so the ILP
sees that a replicated parameter's gradient must be reduced, and ties the gradient's layout to
the parameter's). Traced at microbatch shapes, the ILP's objective is the stage's time per
microbatch; its choice for the piece's inputs is the stage's plan. Layers of the same structure
are costed once (``LayerCostCache``).

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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np

from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.opgraph import OpGraph
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.inter_op.forked import run_shares
from autopar.compiler.inter_op.piece_plan import forward_value_specs, piece_collectives
from autopar.compiler.inter_op.repeats import RepeatGrid, find_repeats
from autopar.compiler.inter_op.step_parts import StepWork, amortise, gradient_nodes, step_work
from autopar.compiler.intra_op.ilp import restrict, solve
from autopar.compiler.intra_op.sharding_ilp import (
    IntraOpOptions,
    MeshCaches,
    build_problem,
    most_split_state,
    read_solution,
)
from autopar.ir.flatten import flatten_step
from autopar.ir.pipeline_pieces import Piece, PieceRoles, PieceSlicer, piece_roles
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
    ``param_bytes``: per-device bytes of its parameters; ``fixed_bytes``: per-device bytes
    that stay (parameters, gradient accumulators, optimizer state); ``activation_bytes``: per
    in-flight microbatch (the forward's values kept for the backward); ``input_specs``: the
    spec of each piece input (forward value id -> spec); ``ilp_status``, ``ilp_gap``: how
    its ILP ended. ``collectives``: what the chosen plan communicates per microbatch (the
    forward's and backward's own and their resharding); ``sync_collectives``: per step (the
    gradients' reduction and their resharding into the update): together what the stage plan
    predicts, for the report to set beside the compiled programs' collectives.
    ``value_specs``: the spec of each value the piece's forward computes (forward value id ->
    spec; ``piece_plan``), which the runtime holds the forward's results to."""

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
    collectives: tuple[CollectiveEstimate, ...] = ()
    sync_collectives: tuple[CollectiveEstimate, ...] = ()
    value_specs: dict[int, ShardingSpec] = field(default_factory=dict)

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
            run_forward_eqns(fwd, piece.eqns, env, pp.layer_scans)
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


@dataclass
class LayerCostCache:
    """Piece costs by (structure, mesh): a repeated layer is solved once per mesh.

    A layer is costed per block of the forward's repeated structure (``repeats``; found from
    the first layer cuts given to ``use_layers``): ``layer_cost`` sums its blocks' costs, and
    identical blocks are one ILP per mesh. ``num_microbatches``: what the per-step parts
    (gradient reduction, update) are divided by in the ILP's objective. ``statuses``: how
    every ILP solved ended (``solve_status``)."""

    options: IntraOpOptions
    num_microbatches: int = 1
    solved: dict[tuple, tuple[PieceCost, Piece]] = field(default_factory=dict)
    ilp_solves: int = 0
    # strategy lists, resharding costs and matrices per mesh, shared by every piece on it
    mesh_caches: dict[tuple, MeshCaches] = field(default_factory=dict)
    # each piece's structure hash, by its first and last equation
    signatures: dict[tuple[int, int], str] = field(default_factory=dict)
    # each piece's input and output roles, by its first and last equation
    roles: dict[tuple[int, int], PieceRoles] = field(default_factory=dict)
    # bytes of optimizer state per byte of parameters, read off the step once
    state_per_parameter: float | None = None
    # each structure's train graph, traced once for all meshes, and the piece it was traced
    # from (its value ids are the ones the graph's paths name)
    graphs: dict[str, tuple[OpGraph, dict[str, int], Piece]] = field(default_factory=dict)
    # the step's work outside the loss function, read off the step once
    work: StepWork | None = None
    statuses: Counter = field(default_factory=Counter)
    # a cache hit renamed for the piece that asked (by solve key and the piece's span): the
    # stage search asks for every layer of every range on every mesh
    renamed: dict[tuple, PieceCost] = field(default_factory=dict)
    # the latest built ILPs by (structure, mesh): a piece's memory-lean variant is its
    # fastest's problem restricted, asked for soon after it (``BUILT_PROBLEMS_KEPT``)
    built: dict[tuple, BuiltPiece] = field(default_factory=dict)
    # the forward's repeated block, once looked for (``use_layers``)
    grid: RepeatGrid | None = None
    grid_found: bool = False
    # each layer's blocks, by its first and last equation, cut by ``slicer``
    units_of: dict[tuple[int, int], list[Piece]] = field(default_factory=dict)
    slicer: PieceSlicer | None = None
    # each layer's cost as its blocks' sum, by (its span, mesh, lean)
    composed: dict[tuple, PieceCost] = field(default_factory=dict)

    def use_layers(self, pp: PipelineProgram, positions: Sequence[int]) -> None:
        """Look for the forward's repeated block once, its boundaries placed as ``positions``
        (the stage search's layer cuts) fall in it. Layer scans already run their layers as
        one body: their pieces are not cut further."""
        if not self.grid_found:
            self.grid = None if pp.layer_scans else find_repeats(pp.forward, positions)
            self.grid_found = True

    def units(self, pp: PipelineProgram, piece: Piece) -> list[Piece]:
        """``piece`` cut at the repeated block's boundaries inside it (``[piece]`` if none)."""
        span = _span(piece)
        if span not in self.units_of:
            a, b = (piece.eqns[0], piece.eqns[-1] + 1) if piece.eqns else (0, 0)
            cuts = self.grid.cuts_within(a, b) if self.grid is not None and piece.eqns else []
            if not cuts:
                self.units_of[span] = [piece]
            else:
                if self.slicer is None or self.slicer.forward is not pp.forward:
                    self.slicer = PieceSlicer(pp.forward)
                bounds = [a, *cuts, b]
                self.units_of[span] = [self.slicer.piece(x, y, k) for k, (x, y) in
                                       enumerate(zip(bounds, bounds[1:], strict=False))]
        return self.units_of[span]

    def layer_cost(self, pp: PipelineProgram, piece: Piece, mesh: LogicalMesh,
                   time_limit_s: float | None = None, *, lean: bool = False) -> PieceCost:
        """``piece``'s cost and plan on ``mesh`` as the sum of its blocks' (``cost`` of each
        of ``units``; the arguments as there)."""
        units = self.units(pp, piece)
        if len(units) == 1:
            return self.cost(pp, units[0], mesh, time_limit_s, lean=lean)
        key = (_span(piece), *_mesh_key(mesh), lean)
        longer = time_limit_s is not None and time_limit_s > self.options.time_limit_s
        if longer or key not in self.composed:
            costs = [self.cost(pp, u, mesh, time_limit_s, lean=lean) for u in units]
            self.composed[key] = self._compose(pp, piece, units, costs)
        return self.composed[key]

    def _compose(self, pp: PipelineProgram, piece: Piece, units: Sequence[Piece],
                 costs: Sequence[PieceCost]) -> PieceCost:
        """One cost for ``piece`` from its ``units``' ``costs``: times and bytes added, plans
        merged (an inner boundary keeps its producer's layout: its consumer's is a
        resharding inside the layer), the worst ILP ending kept; rematerialised, only the
        piece's own inputs are kept, split as its blocks split their batch."""
        fwd = pp.forward
        inside = {v for i in piece.eqns for v in fwd.eqns[i].outputs}

        def input_bytes(p: Piece) -> float:
            roles = self._roles(pp, p)
            return sum(_nbytes(fwd.avals[v]) for v in (*roles.acts, *roles.micro))

        splits = [input_bytes(u) / c.boundary_bytes
                  for u, c in zip(units, costs, strict=True) if c.boundary_bytes > 0]
        stopped = [c for c in costs if _stopped_early(c)]
        gaps = [c.ilp_gap for c in costs if c.ilp_gap is not None]
        values: dict[int, ShardingSpec] = {}
        for c in costs:
            values.update(c.value_specs)
        return PieceCost(
            time_s=sum(c.time_s for c in costs),
            compute_s=sum(c.compute_s for c in costs),
            fixed_bytes=sum(c.fixed_bytes for c in costs),
            activation_bytes=sum(c.activation_bytes for c in costs),
            boundary_bytes=input_bytes(piece) / max(splits) if splits else 0.0,
            input_specs={v: s for c in costs for v, s in c.input_specs.items()
                         if v not in inside},
            ilp_status=(stopped[0] if stopped else max(
                costs, key=lambda c: c.ilp_status != "trivial")).ilp_status,
            sync_s=sum(c.sync_s for c in costs),
            update_s=sum(c.update_s for c in costs),
            param_bytes=sum(c.param_bytes for c in costs),
            ilp_gap=max(gaps) if gaps else None,
            collectives=tuple(x for c in costs for x in c.collectives),
            sync_collectives=tuple(x for c in costs for x in c.sync_collectives),
            value_specs=values,
        )

    def _roles(self, pp: PipelineProgram, piece: Piece) -> PieceRoles:
        span = _span(piece)
        if span not in self.roles:
            self.roles[span] = piece_roles(pp, piece)
        return self.roles[span]

    def _prepare(self, pp: PipelineProgram, piece: Piece, signature: str) -> None:
        """What solving ``piece`` needs first: its train graph (traced once per structure:
        an identical piece met first solves as that piece, whose ids the graph's are, and is
        renamed like any cache hit), and the step's optimizer state and work, read once."""
        if signature not in self.graphs:
            self.graphs[signature] = (*piece_train_graph(pp, piece), piece)
        if self.state_per_parameter is None:
            self.state_per_parameter = optimizer_state_per_parameter(pp)
        if self.work is None:
            self.work = step_work(pp)

    def _solve_new(self, pp: PipelineProgram, signature: str, mesh: LogicalMesh,
                   options: IntraOpOptions, lean: bool) -> PieceCost:
        graph, paths, traced_from = self.graphs[signature]
        mesh_key = _mesh_key(mesh)
        built = self.built.pop((signature, mesh_key), None)
        if built is None:
            built = _build_piece(graph, mesh, options, self.mesh_caches.setdefault(
                mesh_key, MeshCaches()), self.work, self.num_microbatches)
        self.built[(signature, mesh_key)] = built  # the most recently used last
        while len(self.built) > BUILT_PROBLEMS_KEPT:
            del self.built[next(iter(self.built))]
        return _solve_piece(pp, traced_from, graph, paths, mesh, options, built,
                            self.state_per_parameter, self.num_microbatches, lean)

    def _record(self, key: tuple, cost: PieceCost) -> None:
        self.solved[key] = (cost, self.graphs[key[0]][2])
        self.ilp_solves += 1
        self.statuses[solve_status(cost)] += 1

    def prefetch(self, pp: PipelineProgram, pieces: Sequence[Piece],
                 meshes: Sequence[LogicalMesh],
                 lean_on: Callable[[LogicalMesh, list[PieceCost]], bool],
                 workers: int) -> None:
        """Solve every piece's fastest plan on every mesh (per block: ``units``), and every
        piece's lean plan on the meshes where ``lean_on(mesh, fastest costs of the pieces in
        order)``, split by mesh over ``workers`` processes (``forked``), when at least
        ``PARALLEL_MIN_SOLVES`` are missing; fewer are left to ``cost``, which solves what it
        is asked for when asked."""
        units = [self.units(pp, piece) for piece in pieces]
        for unit in (u for group in units for u in group):
            span = _span(unit)
            if span not in self.signatures:
                self.signatures[span] = piece_signature(pp, unit)
        firsts: dict[str, Piece] = {}
        for unit in (u for group in units for u in group):
            firsts.setdefault(self.signatures[_span(unit)], unit)
        missing = [mesh for mesh in meshes
                   if any((sig, *_mesh_key(mesh), False) not in self.solved for sig in firsts)]
        if workers < 2 or len(missing) * len(firsts) < PARALLEL_MIN_SOLVES:
            return
        for sig, unit in firsts.items():
            self._prepare(pp, unit, sig)

        def layer_costs(found: dict[tuple, PieceCost], mesh: LogicalMesh) -> list[PieceCost]:
            out = []
            for piece, group in zip(pieces, units, strict=True):
                costs = [found[(self.signatures[_span(u)], *_mesh_key(mesh), False)]
                         for u in group]
                out.append(costs[0] if len(group) == 1 else
                           self._compose(pp, piece, group, costs))
            return out

        def solve(mesh: LogicalMesh) -> list[tuple[tuple, PieceCost]]:
            found = {}
            for lean in (False, True):
                for sig in firsts:
                    key = (sig, *_mesh_key(mesh), lean)
                    if key in self.solved:
                        found[key] = self.solved[key][0]
                    else:
                        found[key] = self._solve_new(pp, sig, mesh, self.options, lean)
                if lean or not lean_on(mesh, layer_costs(found, mesh)):
                    break
            return [(k, c) for k, c in found.items() if k not in self.solved]

        size = -(-len(missing) // workers)
        shares = [missing[k:k + size] for k in range(0, len(missing), size)]
        for share in run_shares(shares, solve):
            for found in share:
                for key, cost in found:
                    self._record(key, cost)

    def cost(self, pp: PipelineProgram, piece: Piece, mesh: LogicalMesh,
             time_limit_s: float | None = None, *, lean: bool = False) -> PieceCost:
        """``piece``'s cost and plan on ``mesh``. ``time_limit_s``: its ILP's limit when
        longer than the table's (``options.time_limit_s``): a piece that runs is solved
        again under it if the table's solve stopped at its limit. ``lean``: the fastest plan
        among those that split the piece's parameters the most ways (``most_split_state``)."""
        mesh_key = _mesh_key(mesh)
        span = _span(piece)
        if span not in self.signatures:
            self.signatures[span] = piece_signature(pp, piece)
        signature = self.signatures[span]
        key = (signature, *mesh_key, lean)
        options = self.options
        if time_limit_s is not None and time_limit_s > options.time_limit_s:
            options = replace(options, time_limit_s=time_limit_s)
            if key in self.solved and _stopped_early(self.solved[key][0]):
                del self.solved[key]
                self.renamed = {k: v for k, v in self.renamed.items() if k[0] != key}
        if key not in self.solved:
            self._prepare(pp, piece, signature)
            self._record(key, self._solve_new(pp, signature, mesh, options, lean))
        cost, first = self.solved[key]
        if first is piece:
            return cost
        named = self.renamed.get((key, span))
        if named is not None:
            return named
        # the cached specs name the first piece's values: rename them for this one
        a, b = self._roles(pp, first), self._roles(pp, piece)
        mapping = dict(zip(a.params + a.acts + a.fixed + a.micro,
                           b.params + b.acts + b.fixed + b.micro, strict=True))
        specs = {mapping[v]: s for v, s in cost.input_specs.items() if v in mapping}
        # equal signatures: the pieces' equations correspond one to one, in order
        fwd = pp.forward
        made = {a: b for i, j in zip(first.eqns, piece.eqns, strict=True)
                for a, b in zip(fwd.eqns[i].outputs, fwd.eqns[j].outputs, strict=True)}
        values = {made[v]: s for v, s in cost.value_specs.items() if v in made}
        named = replace(cost, input_specs=specs, value_specs=values)
        self.renamed[(key, span)] = named
        return named


def optimizer_state_per_parameter(pp: PipelineProgram) -> float:
    """Bytes of the step's other state (optimizer moments, counters) per byte of parameters:
    2 for Adam, 1 for momentum SGD, 0 for plain SGD. Parameters are the loss function's
    differentiated inputs; the batch is what the pipeline splits into microbatches."""
    outer = pp.outer
    params = set(pp.param_sources().values())
    batch = {pp.operand_of[f] for f in pp.split_inputs}
    param_bytes = sum(_nbytes(outer.avals[v]) for v in params)
    state_bytes = sum(_nbytes(outer.avals[v]) for v in outer.in_ids
                      if v not in params and v not in batch)
    return state_bytes / param_bytes if param_bytes else 0.0


def _mesh_key(mesh: LogicalMesh) -> tuple:
    return (tuple(mesh.shape), tuple(mesh.alpha), tuple(mesh.beta), mesh.peak_flops,
            mesh.compute_efficiency)


def _span(piece: Piece) -> tuple[int, int]:
    return (piece.eqns[0], piece.eqns[-1]) if piece.eqns else (piece.index, -1)


def _stopped_early(cost: PieceCost) -> bool:
    """Whether a piece's ILP ended at its time limit (or without a plan of its own)."""
    return cost.ilp_status in ("time_limit", "no_solution", "solver_error")


def solve_status(cost: PieceCost) -> str:
    """How a stage-cost ILP ended: ``proven`` (optimal up to solver tolerance, or decided
    without a MIP), ``within_gap`` (stopped within the relative gap it was given),
    ``time_limit`` (stopped at its time limit: the best plan so far), ``no_solution`` (the
    solver found none in time: the greedy plan), ``solver_error`` (the solver failed: the
    greedy plan)."""
    if _stopped_early(cost):
        return cost.ilp_status
    if cost.ilp_gap is not None and cost.ilp_gap > 1e-9:
        return "within_gap"
    return "proven"


# Fewer layer ILPs than this are solved here, one by one, when the stage search asks: forking
# costs tens of milliseconds, and small searches (the tests', the zoo at tiny sizes) finish
# in about that.
PARALLEL_MIN_SOLVES = 24
# Built ILPs kept for a memory-lean variant to restrict rather than build again: the stage
# search asks for it right after the fastest plans of the same stage's layers.
BUILT_PROBLEMS_KEPT = 8


@dataclass
class BuiltPiece:
    """A piece's sharding ILP on one mesh with its per-step parts amortised (``amortise``),
    what reads a solution back, and the function pricing a solution's per-step parts."""

    problem: Any
    parts: Any
    per_step: Any


def _build_piece(graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions,
                 caches: MeshCaches, work: StepWork, m: int) -> BuiltPiece:
    problem, parts = build_problem(graph, mesh, options, caches)
    return BuiltPiece(problem, parts, amortise(problem, parts, graph, mesh, work, m))


def _solve_piece(pp: PipelineProgram, piece: Piece, graph: OpGraph, paths: dict[str, int],
                 mesh: LogicalMesh, options: IntraOpOptions, built: BuiltPiece,
                 state_per_parameter: float, m: int, lean: bool) -> PieceCost:
    """``lean``: the fastest plan among those splitting every parameter the most ways."""
    problem, parts, per_step = built.problem, built.parts, built.per_step
    limits = dict(solver=options.solver, time_limit_s=options.time_limit_s,
                  relative_gap=options.relative_gap)
    if lean:
        restricted, originals = restrict(problem, {
            u: np.asarray(c) for u, c in most_split_state(parts, options.batch_argnums).items()})
        sub = solve(restricted, **limits)
        solution = replace(sub, choices=[int(originals[u][c])
                                         for u, c in enumerate(sub.choices)])
    else:
        solution = solve(problem, **limits)
    node_strategy, input_spec, _, tensor_spec, _ = read_solution(parts, solution.choices)
    per_microbatch_moves, per_step_moves = piece_collectives(
        parts, graph, node_strategy, tensor_spec, *gradient_nodes(graph))
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
    # the forward's own results are kept for the backward; split like the piece's batch
    fwd = pp.forward
    kept = sum(_nbytes(fwd.avals[v]) for i in piece.eqns for v in fwd.eqns[i].outputs)
    batch_split = max(
        [specs[v].num_shards(sizes) for v in (*roles.acts, *roles.micro) if v in specs] or [1]
    )
    keep = 1.0 / max(m, 1)
    # the ILP prices feeding the piece's batch inputs (microbatch data, activations and
    # cotangents) to choose their splits; the stage search prices the transfers between
    # stages itself, and a one-stage plan's estimate has no feed: left out here
    per_microbatch = float(solution.objective) - keep * (sync + update) - feed
    compute = sum(st.compute_time_s for st in node_strategy.values()) - placeholder
    return PieceCost(
        time_s=max(per_microbatch, 0.0),
        compute_s=max(compute, 0.0),
        # the parameters, their gradient accumulators and their optimizer state
        fixed_bytes=(2.0 + state_per_parameter) * param_bytes,
        activation_bytes=kept / batch_split,
        boundary_bytes=sum(_nbytes(fwd.avals[v]) for v in (*roles.acts, *roles.micro))
        / batch_split,
        input_specs=specs,
        ilp_status=solution.status,
        sync_s=sync,
        update_s=update,
        param_bytes=param_bytes,
        ilp_gap=solution.gap,
        collectives=tuple(per_microbatch_moves),
        sync_collectives=tuple(per_step_moves),
        value_specs=forward_value_specs(pp, piece, graph, paths, tensor_spec),
    )


def _nbytes(aval: Any) -> float:
    size = 1
    for d in aval.shape:
        size *= int(d)
    return float(size * aval.dtype.itemsize)
