"""The stage DP's table (``StageCostTable``): for every layer range and submesh, per logical
mesh, the sum of the layers' ILP costs (``LayerCostCache``) with what the runtime adds per
microbatch (gradient accumulation, transfers in and out) and per step (gradient reduction,
update, the replicas' all-reduce, the driver's host time). ``stage_cost_table`` makes one;
``TableEntries`` is what it reads from, filled lazily.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from autopar.cluster import ClusterSpec
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.inter_op.forked import available_cores
from autopar.compiler.inter_op.layer_costs import LayerCostCache
from autopar.compiler.inter_op.piece_cost import PieceCost, nbytes
from autopar.compiler.inter_op.pipeline_cost import (
    one_program_call_s,
    replica_allreduce_time,
    stage_host_seconds,
)
from autopar.compiler.inter_op.remat import LayerSums, remat_candidates, state_split_levels
from autopar.compiler.inter_op.stages import (
    StageCandidate,
    StageCostTable,
    StageDPOptions,
    SubmeshShape,
    submesh_shapes,
)
from autopar.compiler.inter_op.submesh import CandidateArrays
from autopar.compiler.planners.stage_costs import stage_dp_options, stage_meshes, submesh_mesh
from autopar.compiler.planners.stage_table_arrays import table_arrays
from autopar.errors import InvalidOptionError, PlanError
from autopar.ir.pieces import LayerRanges, Piece, cut_pieces
from autopar.ir.pipeline_pieces import piece_roles
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.schedules import ScheduleName
from autopar.methods import PipeshardParallel, StageMode


@dataclass
class CostClock:
    """Seconds spent costing layers (tracing their train graphs and solving their ILPs) while
    the stage DP reads the table: the table is filled lazily, so the DP's own time is the
    search's total minus this."""

    seconds: float = 0.0


@dataclass(frozen=True)
class _RangeFacts:
    """What a layer range sends, receives and holds, for the driver's and links' costs."""

    params: int
    fixed: int
    puts_per_microbatch: int
    bytes_per_microbatch: float  # activations in, cotangents back


def _range_facts(pp: PipelineProgram,
                 positions: Sequence[int]) -> Callable[[int, int], _RangeFacts]:
    """``facts(start, end)`` of the piece of layers ``[start, end)`` (cached)."""
    found: dict[tuple[int, int], _RangeFacts] = {}
    fwd = pp.forward
    ranges = LayerRanges(fwd, cut_pieces(fwd, positions))

    def value_bytes(v: int) -> float:
        aval = fwd.avals[v]
        return float(math.prod(aval.shape)) * aval.dtype.itemsize

    def facts(start: int, end: int) -> _RangeFacts:
        if (start, end) not in found:
            roles = piece_roles(pp, ranges.piece(start, end))
            incoming = [*roles.acts, *roles.micro]
            found[(start, end)] = _RangeFacts(
                params=len(roles.params), fixed=len(roles.fixed),
                puts_per_microbatch=len(incoming) + len(roles.float_outputs) + len(roles.acts),
                # activations in from earlier stages, their cotangents back (the microbatch
                # data is the step's input, which a one-stage plan is not charged for either)
                bytes_per_microbatch=2 * sum(value_bytes(v) for v in roles.acts))
        return found[(start, end)]

    return facts


def _most_in_flight(options: StageDPOptions, devices: int, cluster: ClusterSpec,
                    num_layers: int) -> float:
    """The most microbatches a stage on ``devices`` devices could hold in flight: stage 0
    of the longest pipeline such stages make (one stage per layer at most)."""
    longest = max(1, min(num_layers, cluster.num_devices // devices))
    try:
        return max(options.activation_counts(longest))
    except (InvalidOptionError, PlanError):  # the schedule does not run on that many stages
        return float(options.num_microbatches)


@dataclass
class TableEntries:
    """What the stage DP reads for a layer range on a submesh (``candidates``), made from
    the layers' costs as it asks; each cache below is read many times (see its note)."""

    pp: PipelineProgram
    positions: Sequence[int]
    method: PipeshardParallel
    cluster: ClusterSpec
    cache: LayerCostCache
    clock: CostClock | None
    num_microbatches: int
    replicas: int
    whole: ClusterSpec
    layers: list[Piece] = field(init=False)
    options: StageDPOptions = field(init=False)
    facts: Callable[[int, int], _RangeFacts] = field(init=False)
    most_in_flight: dict[int, float] = field(default_factory=dict)
    # one mesh per submesh and shape: made over every device, 16,384 at Llama-3 405B's size
    meshes_made: dict[tuple[SubmeshShape, tuple[int, ...]], LogicalMesh] = field(
        default_factory=dict)
    # the stage DP reads each range on each mesh once per schedule and replica count
    replica_times: dict[tuple[float, int], float] = field(default_factory=dict)
    # each range's layer costs summed, by (mesh, split) then (start, end) (kept in the cache
    # for every table on these cuts): the DP reads every range on every mesh, and a range's
    # sums are its one-shorter range's plus a layer (at GPT-3 175B on 1,024 GPUs the DP's
    # tables read about 100,000 ranges, each summed anew)
    summed: dict[tuple[int, int], dict[tuple[int, int], LayerSums]] = field(
        default_factory=dict)
    input_bytes: dict[int, float] = field(default_factory=dict)
    shares_of: dict[tuple[int, int, int], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        cuts = tuple(self.positions)
        self.layers = self.cache.shared(self.pp, ("layers", cuts),
                                        lambda: cut_pieces(self.pp.forward, cuts))
        self.options = stage_dp_options(self.method, self.cluster, self.num_microbatches)
        self.facts = self.cache.shared(self.pp, ("range facts", cuts),
                                       lambda: _range_facts(self.pp, cuts))

    def mesh_of(self, submesh: SubmeshShape, shape: tuple[int, ...]) -> LogicalMesh:
        if (submesh, shape) not in self.meshes_made:
            self.meshes_made[(submesh, shape)] = submesh_mesh(self.cluster, submesh, shape)
        return self.meshes_made[(submesh, shape)]

    def replica_time(self, whole_param_bytes: float, devices: int) -> float:
        key = (whole_param_bytes, devices)
        if key not in self.replica_times:
            self.replica_times[key] = replica_allreduce_time(whole_param_bytes, devices,
                                                             self.replicas, self.whole)
        return self.replica_times[key]

    def range_sums(self, mesh: LogicalMesh, split: int, start: int, end: int) -> LayerSums:
        found = self.summed.get((id(mesh), split))
        if found is None:
            found = self.summed[(id(mesh), split)] = self.cache.range_sums(self.positions,
                                                                           mesh, split)
        if (start, end) not in found:
            shorter = LayerSums() if end - 1 == start else self.range_sums(mesh, split, start,
                                                                           end - 1)
            found[(start, end)] = shorter.plus(self.cache.layer_cost(
                self.pp, self.layers[end - 1], mesh, split=split, specs=False))
        return found[(start, end)]

    def input_shares(self, mesh: LogicalMesh, split: int, start: int) -> float:
        """Into how many shares layer ``start``'s plan on ``mesh`` splits its inputs."""
        key = (id(mesh), split, start)
        if key in self.shares_of:  # read for every range starting there
            return self.shares_of[key]
        held = self.cache.layer_cost(self.pp, self.layers[start], mesh, split=split,
                                     specs=False).boundary_bytes
        self.shares_of[key] = max(self.layer_input_bytes(start) / held, 1.0) \
            if held > 0 else 1.0
        return self.shares_of[key]

    def layer_input_bytes(self, start: int) -> float:
        """The bytes of layer ``start``'s activation and microbatch inputs."""
        if start not in self.input_bytes:
            roles = piece_roles(self.pp, self.layers[start])
            self.input_bytes[start] = sum(nbytes(self.pp.forward.avals[v])
                                          for v in (*roles.acts, *roles.micro))
        return self.input_bytes[start]

    def most_in_flight_on(self, devices: int) -> float:
        """The most microbatches a stage on ``devices`` devices could hold in flight."""
        if devices not in self.most_in_flight:
            self.most_in_flight[devices] = _most_in_flight(self.options, devices, self.cluster,
                                                           len(self.layers))
        return self.most_in_flight[devices]

    def overfills(self, candidates: Sequence[StageCandidate], devices: int) -> bool:
        """Whether none of a stage's candidates on ``devices`` devices fits with the most
        microbatches such a stage could hold."""
        most = self.most_in_flight_on(devices)
        return not self.options.fits(min(c.memory(most) for c in candidates))

    def _host_time(self, facts: _RangeFacts, submesh: SubmeshShape) -> float:
        """The driver's seconds per step for a stage of this range on ``submesh``."""
        return stage_host_seconds(self.cluster.runtime, self.method.schedule,
                                  self.num_microbatches,
                                  submesh.num_devices == self.cluster.num_devices,
                                  facts.puts_per_microbatch, facts.params, facts.fixed,
                                  one_program_call_s(self.pp, self.cluster))

    def _variants(self, start: int, end: int, submesh: SubmeshShape, shape: tuple[int, ...],
                  split: int, transfer: float, host: float) -> list[StageCandidate]:
        mesh = self.mesh_of(submesh, shape)
        sums = self.range_sums(mesh, split, start, end)
        tail = sums.tail_s + self.replica_time(sums.whole_param_bytes, submesh.num_devices)
        shares = self.input_shares(mesh, split, start)
        extra = transfer / shares + sums.param_bytes / self.cluster.runtime.accumulate_bytes_per_s
        return remat_candidates(sums, shape, self.method.remat, extra_time=extra,
                                tail_time=tail, host_time=host, param_bytes=sums.param_bytes,
                                split=split)

    def candidates(self, start: int, end: int, submesh: SubmeshShape) -> list[StageCandidate]:
        """Layers ``[start, end)`` on ``submesh``: per logical mesh, the fastest plans' and,
        where none of them fits, the plans splitting every parameter more ways."""
        found = []
        start_s = time.perf_counter()
        facts = self.facts(start, end)
        link = self.cluster.inter_host if submesh.num_hosts > 1 else self.cluster.intra_host
        # each device receives its own share of the activations (and sends back their
        # cotangents) over its own link, all at once: the bytes split as the range's first
        # layer splits its inputs on the mesh (Megatron-LM sends each tensor-parallel rank a
        # slice; a data-parallel rank only its sequences)
        transfer = facts.bytes_per_microbatch * link.beta
        host = self._host_time(facts, submesh)
        for shape in stage_meshes(self.method, submesh):
            chosen = self._variants(start, end, submesh, shape, 1, transfer, host)
            found.extend(chosen)
            # the layers' fastest plans may hold their parameters (and so their gradients and
            # optimizer state) on every device: where none of them fits with the most
            # microbatches this stage could hold, the plans splitting every parameter more
            # ways are candidates too, least split first (over a tensor axis, as Megatron-LM
            # splits, before over every device), until one fits (solved only for such
            # stages: most stages never need them)
            for split in state_split_levels(shape):
                if not self.overfills(chosen, submesh.num_devices):
                    break
                chosen = self._variants(start, end, submesh, shape, split, transfer, host)
                found.extend(chosen)
        if self.clock is not None:
            self.clock.seconds += time.perf_counter() - start_s
        return found

    def overfilled(self, mesh: LogicalMesh, costs: list[PieceCost],
                   stage_layers: int | None) -> bool:
        """Whether the whole model (or a stage's run of ``stage_layers`` layers) on ``mesh``
        with its layers' plans ``costs`` overfills it: the reader reads that entry, whose
        candidates then ask for every layer's more split plans."""
        run = len(costs) if stage_layers is None else min(stage_layers, len(costs))
        return any(self.overfills(remat_candidates(LayerSums.of(costs[k:k + run]),
                                                   tuple(mesh.shape), self.method.remat),
                                  len(mesh.device_ids))
                   for k in range(len(costs) - run + 1))


def stage_cost_table(pp: PipelineProgram, positions: Sequence[int], method: PipeshardParallel,
                     cluster: ClusterSpec, cache: LayerCostCache,
                     clock: CostClock | None = None, *, num_microbatches: int | None = None,
                     replicas: int = 1, whole: ClusterSpec | None = None,
                     prefetch_on: Sequence[SubmeshShape] | None = None,
                     stage_layers: int | None = None) -> StageCostTable:
    """Candidates for every layer range and submesh: per logical mesh shape, the sum of the
    layers' ILP costs (filled lazily: the DP reads every entry, baselines only a few), with
    what the runtime adds per microbatch (the accumulation of the gradients, the transfers in
    and out) and per step (the tail: gradient reduction, update, and with ``replicas`` > 1 the
    replicas' all-reduce over ``whole``'s links between hosts; the driver's host time).
    ``num_microbatches``: per pipeline (default the method's). ``clock``: accumulates the
    seconds spent in the layers' cost lookups and solves. ``prefetch_on``: the submeshes on
    whose meshes every layer is solved now, over the method's ``planning_workers`` (default:
    every submesh when the stage DP will read the table whole, i.e. stages="auto" and not
    interleaved; none for uniform or manual stages, which read their own entries, solved
    when read; ``()`` for a baseline reading a few). ``stage_layers``: the most layers one
    stage of the reader holds (a uniform split: its layers per stage), whose more split
    plans the prefetch solves only where such a run of layers overfills a device (default:
    where the whole model on the mesh does, as the stage DP may read any range)."""
    cache.use_layers(pp, positions)
    entries = TableEntries(pp, positions, method, cluster, cache, clock,
                           num_microbatches or method.num_microbatches, replicas,
                           whole or cluster)
    submeshes = submesh_shapes(cluster.num_hosts, cluster.devices_per_host)
    start_s = time.perf_counter()
    workers = method.planning_workers or available_cores()
    if prefetch_on is None:
        read_whole = method.stages == StageMode.AUTO and \
            method.schedule != ScheduleName.INTERLEAVED_1F1B
        prefetch_on = submeshes if read_whole else ()
    meshes = [entries.mesh_of(sub, shape) for sub in prefetch_on
              for shape in stage_meshes(method, sub)]
    if meshes:
        cache.prefetch(pp, entries.layers, meshes,
                       lambda mesh, costs: entries.overfilled(mesh, costs, stage_layers),
                       workers)
    if clock is not None:
        clock.seconds += time.perf_counter() - start_s

    def arrays(usable: Sequence[int], num_microbatches: int) -> CandidateArrays | None:
        began = time.perf_counter()
        try:
            return table_arrays(entries, usable, submeshes, num_microbatches)
        finally:
            if clock is not None:
                clock.seconds += time.perf_counter() - began

    return StageCostTable(len(positions) + 1, submeshes, entries.candidates, dense=arrays)
