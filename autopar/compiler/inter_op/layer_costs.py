"""Stage costs by layer: ``LayerCostCache`` solves each structurally identical piece once per
logical mesh (``piece_cost``: a piece's small train step and its ILP), cuts a layer into the
forward's repeated blocks where it has them (``repeats``) and sums them, and splits the solves
over processes (``forked``) when the stage DP will read the whole table.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.opgraph import OpGraph
from autopar.compiler.inter_op.composed_cost import compose_costs
from autopar.compiler.inter_op.forked import run_pulled
from autopar.compiler.inter_op.piece_cost import (
    BuiltPiece,
    PieceCost,
    build_piece,
    meets_state_split,
    mesh_solve_key,
    optimizer_state_per_parameter,
    piece_signature,
    piece_span,
    piece_train_graph,
    solve_piece,
    solve_status,
    stopped_early,
)
from autopar.compiler.inter_op.recompute_parts import RecomputeParts, recompute_parts
from autopar.compiler.inter_op.remat import LayerSums, state_split_levels
from autopar.compiler.inter_op.seams import STAGE_GAP, price_seams, stitched_gap
from autopar.compiler.inter_op.step_parts import StepWork, step_work
from autopar.compiler.intra_op.dual_bound import WarmMessages
from autopar.compiler.intra_op.sharding_ilp import IntraOpOptions, MeshCaches
from autopar.ir.pieces import Piece, PieceSlicer
from autopar.ir.pipeline_pieces import PieceRoles, piece_roles
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.repeats import RepeatGrid, find_repeats

# Fewer layer ILPs than this are solved here, one by one, when the stage search asks: forking
# costs tens of milliseconds, about what small searches (the zoo at tiny sizes) take.
PARALLEL_MIN_SOLVES = 24
# Built ILPs kept for a memory-lean variant to restrict rather than build again (asked for right
# after the fastest plans of the same stage's layers; a prefetch keeps all of one mesh's).
BUILT_PROBLEMS_KEPT = 8


class SolveObserver(Protocol):
    """What a progress display is told: a batch of ``count`` ILPs begins; one was solved."""

    def expect(self, count: int) -> None: ...

    def solved(self, count: int = 1) -> None: ...


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
    # memory-lean variants whose plan was a less-split one's (``meets_state_split``)
    derived_levels: int = 0
    # strategy lists, resharding costs and matrices per mesh, shared by every piece on it
    mesh_caches: dict[tuple, MeshCaches] = field(default_factory=dict)
    # each piece's structure hash and its input and output roles, by its first, last equation
    signatures: dict[tuple[int, int], str] = field(default_factory=dict)
    roles: dict[tuple[int, int], PieceRoles] = field(default_factory=dict)
    # per structure: what recomputation keeps and rebuilds (``recompute_parts``)
    recompute: dict[str, RecomputeParts] = field(default_factory=dict)
    # bytes of optimizer state per byte of parameters, read off the step once
    state_per_parameter: float | None = None
    # each structure's train graph, traced once, and the piece it was traced from (its ids)
    graphs: dict[str, tuple[OpGraph, dict[str, int], Piece]] = field(default_factory=dict)
    # the step's work outside the loss function, read off the step once
    work: StepWork | None = None
    statuses: Counter = field(default_factory=Counter)
    # a cache hit renamed for the piece that asked, by solve key and the piece's span
    renamed: dict[tuple, PieceCost] = field(default_factory=dict)
    # the latest built ILPs by (structure, mesh): a piece's memory-lean variant is its
    # fastest's problem restricted, asked for soon after it (``BUILT_PROBLEMS_KEPT``)
    built: dict[tuple, BuiltPiece] = field(default_factory=dict)
    # the forward's repeated block, once looked for (``use_layers``); each layer's blocks
    grid: RepeatGrid | None = None
    grid_found: bool = False
    units_of: dict[tuple[int, int], list[Piece]] = field(default_factory=dict)
    slicer: PieceSlicer | None = None
    # each layer's cost as its blocks' sum, by (its span, mesh, split)
    composed: dict[tuple, PieceCost] = field(default_factory=dict)
    # told of every ILP solved, for a progress display (``planners.status.PlanningStatus``)
    status: SolveObserver | None = None
    # each layer range's costs summed, by (layer cuts, mesh, split) then (start, end), for
    # every stage cost table on these cuts (GPT 1T: 16 tables of ~20,000 ranges and meshes)
    summed: dict[tuple, dict[tuple[int, int], LayerSums]] = field(default_factory=dict)
    # what the stage cost tables read alike (``shared``)
    table_memo: dict[tuple, tuple[Any, Any]] = field(default_factory=dict)
    # this process's own work while the first forked solves run (``prefetch``): the full
    # search traces its one-stage candidates' rematerialised step there
    meanwhile: Callable[[], Any] | None = None

    def shared(self, pp: PipelineProgram, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()`` once per ``key`` and ``pp``'s forward (what the stage tables share)."""
        found = self.table_memo.get(key)
        if found is None or found[0] is not pp.forward:
            found = self.table_memo[key] = (pp.forward, make())
        return found[1]

    def use_layers(self, pp: PipelineProgram, positions: Sequence[int]) -> None:
        """Look for the forward's repeated block once, its boundaries placed as ``positions``
        (the stage search's layer cuts) fall in it. Layer scans already run their layers as
        one body: their pieces are not cut further."""
        if not self.grid_found:
            self.grid = None if pp.layer_scans else find_repeats(pp.forward, positions)
            self.grid_found = True

    def range_sums(self, positions: Sequence[int], mesh: LogicalMesh,
                   split: int) -> dict[tuple[int, int], LayerSums]:
        """The sums of layer ranges' costs on ``mesh`` at ``split``, by (start, end), for the
        layers cut at ``positions``: filled by the stage cost tables that read them."""
        return self.summed.setdefault((tuple(positions), *mesh_solve_key(mesh), split), {})

    def units(self, pp: PipelineProgram, piece: Piece) -> list[Piece]:
        """``piece`` cut at the repeated block's boundaries inside it (``[piece]`` if none)."""
        span = piece_span(piece)
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
                   time_limit_s: float | None = None, *, split: int = 1,
                   specs: bool = True) -> PieceCost:
        """``piece``'s cost and plan on ``mesh`` as the sum of its blocks' (``cost`` of each
        of ``units``; the arguments as there)."""
        units = self.units(pp, piece)
        if len(units) == 1:
            return self.cost(pp, units[0], mesh, time_limit_s, split=split, specs=specs)
        key = (piece_span(piece), *mesh_solve_key(mesh), split, specs)
        longer = time_limit_s is not None and time_limit_s > self.options.time_limit_s
        if longer or key not in self.composed:
            costs = [self.cost(pp, u, mesh, time_limit_s, split=split, specs=specs)
                     for u in units]
            self.composed[key] = compose_costs(pp, piece, units, costs,
                                               partial(self._roles, pp), specs=specs)
        return self.composed[key]

    def stitched_cost(self, pp: PipelineProgram, piece: Piece, mesh: LogicalMesh,
                      split: int = 1) -> PieceCost | None:
        """``piece``'s cost and plan as its blocks' (``layer_cost``), the plan the stage
        search priced it by, with the reshards at its seams priced (``seams``: where one
        block makes a value in another layout than the next reads it in), where every block's
        ILP ended proven or within its gap and the seams and those gaps leave the plan within
        ``seams.STAGE_GAP`` of the piece's own ILP's optimum (its ``ilp_gap``, reported).
        None where the piece is one block, or its own ILP (``cost``, which the chosen stages
        are otherwise solved as) may be cheaper by more than that."""
        units = self.units(pp, piece)
        if len(units) < 2:
            return None
        composed = self.layer_cost(pp, piece, mesh, split=split)
        if stopped_early(composed):
            return None
        costs = [self.cost(pp, unit, mesh, split=split) for unit in units]
        seams = price_seams(pp, units, [c.input_specs for c in costs], composed.value_specs,
                            mesh)
        if seams is None:
            return None
        m = self.num_microbatches
        gap = stitched_gap([c.planned_s(m) for c in costs],
                           [c.ilp_gap for c in costs], seams.time_s)
        if gap > STAGE_GAP:
            return None
        if not seams.disagreeing:
            return composed
        return replace(composed, time_s=composed.time_s + seams.time_s, ilp_gap=gap,
                       collectives=composed.collectives + seams.collectives)

    def _signature(self, pp: PipelineProgram, piece: Piece) -> str:
        span = piece_span(piece)
        if span not in self.signatures:
            self.signatures[span] = piece_signature(pp, piece)
        return self.signatures[span]

    def _roles(self, pp: PipelineProgram, piece: Piece) -> PieceRoles:
        span = piece_span(piece)
        if span not in self.roles:
            self.roles[span] = piece_roles(pp, piece)
        return self.roles[span]

    def _prepare(self, pp: PipelineProgram, piece: Piece, signature: str) -> None:
        """What solving ``piece`` needs first: its train graph (traced once per structure:
        an identical piece met first solves as that piece, whose ids the graph's are, and is
        renamed like any cache hit), and the step's optimizer state and work, read once."""
        if signature not in self.graphs:
            self.graphs[signature] = (*piece_train_graph(pp, piece), piece)
            self.recompute[signature] = recompute_parts(pp, piece)
        if self.state_per_parameter is None:
            self.state_per_parameter = optimizer_state_per_parameter(pp)
        if self.work is None:
            self.work = step_work(pp)

    def _solve_new(self, pp: PipelineProgram, signature: str, mesh: LogicalMesh,
                   options: IntraOpOptions, split: int,
                   lower: Sequence[PieceCost] = (), keep: int | None = None) -> PieceCost:
        """The structure's plan on ``mesh`` at ``split``: a ``lower`` (less-split) variant's
        plan where it splits every parameter so many ways (``meets_state_split``: marked
        ``derived``), else its ILP solved, its dual ascent started from the last messages a
        ``lower`` one kept (wherever that was solved: the plan is the same). ``keep``: how
        many built problems stay after it (default ``BUILT_PROBLEMS_KEPT``)."""
        graph, paths, traced_from = self.graphs[signature]
        work, state_per_parameter = self.work, self.state_per_parameter
        assert work is not None and state_per_parameter is not None, "read by _prepare first"
        mesh_key = mesh_solve_key(mesh)
        built = self.built.pop((signature, mesh_key), None)
        if built is None:
            built = build_piece(graph, mesh, options, self.mesh_caches.setdefault(
                mesh_key, MeshCaches()), work, self.num_microbatches)
        self.built[(signature, mesh_key)] = built  # the most recently used last
        while len(self.built) > (BUILT_PROBLEMS_KEPT if keep is None else keep):
            del self.built[next(iter(self.built))]
        for prior in lower if split > 1 else ():
            if meets_state_split(built, options.batch_argnums, prior, split):
                return replace(prior, derived=True)
        warm = WarmMessages(next((c.dual_messages for c in reversed(lower)
                                  if c.dual_messages is not None), {}))
        cost = solve_piece(pp, traced_from, graph, paths, mesh, options, built,
                           state_per_parameter, self.num_microbatches, split,
                           recompute=self.recompute[signature], warm=warm)
        return replace(cost, dual_messages=warm.kept) if warm.made else cost

    def _lower(self, signature: str, mesh: LogicalMesh, split: int) -> list[PieceCost]:
        """The structure's less split plans on ``mesh`` solved so far, least split first."""
        keys = [(signature, *mesh_solve_key(mesh), s)
                for s in (1, *state_split_levels(mesh.shape)) if s < split]
        return [self.solved[k][0] for k in keys if k in self.solved]

    def _record(self, key: tuple, cost: PieceCost) -> None:
        if cost.dual_messages is not None:  # only the latest rung's are read again
            for s in (1, *state_split_levels(key[1])):
                if s < key[-1] and (below := (*key[:-1], s)) in self.solved:
                    was, first = self.solved[below]
                    self.solved[below] = (replace(was, dual_messages=None), first)
        self.solved[key] = (cost, self.graphs[key[0]][2])
        if cost.derived:
            self.derived_levels += 1
            return
        self.ilp_solves += 1
        self.statuses[solve_status(cost)] += 1
        if self.status is not None:
            self.status.solved()

    def prefetch(self, pp: PipelineProgram, pieces: Sequence[Piece],
                 meshes: Sequence[LogicalMesh],
                 overfilled: Callable[[LogicalMesh, list[PieceCost]], bool],
                 workers: int) -> None:
        """Solve every piece's fastest plan on every mesh (per block: ``units``) and, where
        ``overfilled(mesh, the pieces' costs)``, their more split plans (``state_split_levels``
        upward until one is not), by mesh over ``workers`` processes (``forked``) when at
        least ``PARALLEL_MIN_SOLVES`` are missing (fewer are left to ``cost``)."""
        units = [self.units(pp, piece) for piece in pieces]
        firsts: dict[str, Piece] = {}
        for unit in (u for group in units for u in group):
            firsts.setdefault(self._signature(pp, unit), unit)
        missing = [mesh for mesh in meshes
                   if any((sig, *mesh_solve_key(mesh), 1) not in self.solved for sig in firsts)]
        if workers < 2 or len(missing) * len(firsts) < PARALLEL_MIN_SOLVES:
            return
        for sig, unit in firsts.items():
            self._prepare(pp, unit, sig)

        def layer_costs(found: dict[tuple, PieceCost], mesh: LogicalMesh,
                        split: int) -> list[PieceCost]:
            out = []
            for piece, group in zip(pieces, units, strict=True):
                costs = [found[(self.signatures[piece_span(u)], *mesh_solve_key(mesh), split)]
                         for u in group]
                out.append(costs[0] if len(group) == 1 else
                           compose_costs(pp, piece, group, costs, partial(self._roles, pp),
                                         specs=False))
            return out

        def solve(mesh: LogicalMesh) -> list[tuple[tuple, PieceCost]]:
            found = {}
            levels = (1, *state_split_levels(mesh.shape))
            for k, split in enumerate(levels):
                for sig in firsts:
                    key = (sig, *mesh_solve_key(mesh), split)
                    if key in self.solved:
                        found[key] = self.solved[key][0]
                    else:
                        lower = [found[(sig, *mesh_solve_key(mesh), s)] for s in levels[:k]]
                        found[key] = self._solve_new(pp, sig, mesh, self.options, split,
                                                     lower, max(BUILT_PROBLEMS_KEPT, len(firsts)))
                if not overfilled(mesh, layer_costs(found, mesh, split)):
                    break
            # each structure's latest dual messages travel back, not every rung's
            latest = {k[0]: k for k, c in found.items() if c.dual_messages is not None}
            return [(k, c if latest.get(k[0]) in (k, None) else replace(c, dual_messages=None))
                    for k, c in found.items() if k not in self.solved]

        # largest meshes first, each taken by the next free process: a larger mesh's ILPs
        # have more strategies (at GPT 76.1B on 1,024 GPUs the three largest took 130 of 153
        # seconds), and the last to start should be small
        order = sorted(missing, key=lambda mesh: -len(mesh.device_ids))
        if self.status is not None:  # the fastest plans' ILPs; the lean ones are not known yet
            self.status.expect(len(missing) * len(firsts))
        meanwhile, self.meanwhile = self.meanwhile, None
        for found in run_pulled(order, solve, workers, meanwhile):
            for key, cost in found:
                self._record(key, cost)

    def prefetch_whole(self, pp: PipelineProgram, jobs: Sequence[tuple[Piece, LogicalMesh, int]],
                       time_limit_s: float, workers: int) -> None:
        """Solve each ``(piece, mesh, split)`` whole (as ``cost`` with ``time_limit_s``
        would), the distinct ones missing split over ``workers`` processes: the chosen
        pipeline's stages, each one ILP of all its layers. Their train graphs are traced
        here first (JAX stays in this process)."""
        options = replace(self.options, time_limit_s=max(time_limit_s, self.options.time_limit_s))
        missing: dict[tuple, tuple[str, LogicalMesh, int]] = {}
        for piece, mesh, split in jobs:
            signature = self._signature(pp, piece)
            key = (signature, *mesh_solve_key(mesh), split)
            if key in missing or key in self.solved:
                continue  # (one the table's limit stopped, ``cost`` solves again)
            self._prepare(pp, piece, signature)
            missing[key] = (signature, mesh, split)
        if workers < 2 or len(missing) < 2:
            return  # ``cost`` solves them as it is asked
        tasks = sorted(missing.items(), key=lambda task: -len(task[1][1].device_ids))
        found = run_pulled(tasks, lambda task: (task[0], self._solve_new(
            pp, task[1][0], task[1][1], options, task[1][2], self._lower(*task[1]))), workers)
        for key, cost in found:
            self._record(key, cost)

    def cost(self, pp: PipelineProgram, piece: Piece, mesh: LogicalMesh,
             time_limit_s: float | None = None, *, split: int = 1,
             specs: bool = True) -> PieceCost:
        """``piece``'s cost and plan on ``mesh``. ``time_limit_s``: its ILP's limit when
        longer than the table's (``options.time_limit_s``): a piece that runs is solved
        again under it if the table's solve stopped at its limit. ``split`` > 1: the fastest
        plan among those splitting each of the piece's parameters at least that many ways, or
        as many as it can be (``state_split_at_least``). ``specs=False``: its times and bytes
        only, its specs naming the identical piece's values (the tables read every layer on
        every mesh: at GPT 1T renaming was 3 of 130 profiled seconds)."""
        mesh_key = mesh_solve_key(mesh)
        span = piece_span(piece)
        signature = self._signature(pp, piece)
        key = (signature, *mesh_key, split)
        options = self.options
        if time_limit_s is not None and time_limit_s > options.time_limit_s:
            options = replace(options, time_limit_s=time_limit_s)
            if key in self.solved and stopped_early(self.solved[key][0]):
                del self.solved[key]
                self.renamed = {k: v for k, v in self.renamed.items() if k[0] != key}
                self.summed.clear()  # sums that read the stopped solve
        if key not in self.solved:
            self._prepare(pp, piece, signature)
            self._record(key, self._solve_new(pp, signature, mesh, options, split,
                                              self._lower(signature, mesh, split)))
        cost, first = self.solved[key]
        if first is piece or not specs:
            return cost
        named = self.renamed.get((key, span))
        if named is not None:
            return named
        a, b = self._roles(pp, first), self._roles(pp, piece)  # the cached specs: renamed
        mapping = dict(zip(a.params + a.acts + a.fixed + a.micro,
                           b.params + b.acts + b.fixed + b.micro, strict=True))
        inputs = {mapping[v]: s for v, s in cost.input_specs.items() if v in mapping}
        # equal signatures: the pieces' equations correspond one to one, in order
        fwd, eqn_of = pp.forward, dict(zip(first.eqns, piece.eqns, strict=True))
        made = {a: b for i, j in eqn_of.items()
                for a, b in zip(fwd.eqns[i].outputs, fwd.eqns[j].outputs, strict=True)}
        named = replace(cost, input_specs=inputs,
                        value_specs={made[v]: s for v, s in cost.value_specs.items() if v in made},
                        cotangent_specs={made[v]: s for v, s in cost.cotangent_specs.items()
                                         if v in made},
                        contraction_specs={(eqn_of[i], k, r): s for (i, k, r), s
                                           in cost.contraction_specs.items()})
        self.renamed[(key, span)] = named
        return named
