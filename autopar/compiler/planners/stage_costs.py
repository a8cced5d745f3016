"""What a pipeline stage costs: per layer range, submesh and logical mesh, the sum of its
layers' ILP costs (``LayerCostCache``) with what the runtime adds per microbatch (gradient
accumulation, transfers in and out) and per step (gradient reduction, update, the replicas'
all-reduce, the driver's host time). ``stage_cost_table`` is what the stage DP reads;
``planners/pipeshard`` runs the search on it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from autopar.cluster import ClusterSpec
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.inter_op.forked import available_cores
from autopar.compiler.inter_op.layer_costs import LayerCostCache
from autopar.compiler.inter_op.piece_cost import PieceCost, nbytes
from autopar.compiler.inter_op.pipeline_cost import (
    replica_allreduce_time,
    runs_as_one_program,
    tasks_per_microbatch,
)
from autopar.compiler.inter_op.remat import LayerSums, remat_candidates, state_split_levels
from autopar.compiler.inter_op.stages import (
    StageCandidate,
    StageCostTable,
    StageDPOptions,
    SubmeshShape,
    submesh_shapes,
)
from autopar.compiler.intra_op.sharding_ilp import IntraOpOptions
from autopar.errors import InvalidOptionError, MeshError, PlanError
from autopar.ir.pipeline_pieces import LayerRanges, Piece, cut_pieces, piece_roles
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.schedules import ScheduleName
from autopar.methods import PipeshardParallel
from autopar.plan import CollectiveEstimate


def range_piece(pp: PipelineProgram, positions: Sequence[int], start: int, end: int) -> Piece:
    """Layers ``[start, end)`` as one piece."""
    return range_pieces(pp, positions, [(start, end)])[0]


def range_pieces(pp: PipelineProgram, positions: Sequence[int],
                 ranges: Sequence[tuple[int, int]]) -> list[Piece]:
    """The pieces of consecutive layer ranges ``ranges`` (``[start, end)`` each, in order),
    numbered as they come: the layers cut once (a piece per range cut the whole forward each
    time: 8 s of GPT 1T's search)."""
    layers = LayerRanges(pp.forward, cut_pieces(pp.forward, positions))
    return [replace(layers.piece(a, b), index=k) for k, (a, b) in enumerate(ranges)]


def logical_shapes(submesh: SubmeshShape) -> list[tuple[int, ...]]:
    """Logical meshes tried on a submesh: on one host, one axis over all its devices; then
    the 2-D ones ``(n / t, t)`` whose second axis (the one the ILP can give the model, as a
    data x tensor expert plan does) stays inside a host: ``t`` from 2 up to the devices per
    host, largest first, each a divisor of the submesh. A tensor degree beyond one host
    cannot win: its collectives would cross the slow links that the first axis's data
    parallelism crosses once per step. Nor can one axis over several hosts: every collective
    on it is priced at the links between hosts, while ``(hosts, devices per host)`` can lay
    out all it can (a dimension may be split over both axes) with the fast links inside a
    host (measured on GPT layers at 15B: 8-14x slower per microbatch)."""
    n = submesh.num_devices
    shapes: list[tuple[int, ...]] = [(n,)] if submesh.num_hosts == 1 else []
    t = min(submesh.devices_per_host, n // 2)
    while t >= 2:
        if n % t == 0 and submesh.devices_per_host % t == 0:
            shapes.append((n // t, t))
        t //= 2
    return shapes or [(n,)]


def stage_meshes(method: PipeshardParallel, submesh: SubmeshShape) -> list[tuple[int, ...]]:
    """The logical meshes a stage on ``submesh`` is costed on: the method's
    ``stage_mesh_shape`` where it covers the submesh (none elsewhere: no stage of that size),
    else ``logical_shapes``."""
    pinned = method.stage_mesh_shape
    if pinned is None:
        return logical_shapes(submesh)
    return [pinned] if math.prod(pinned) == submesh.num_devices else []


def check_stage_mesh(method: PipeshardParallel, cluster: ClusterSpec) -> None:
    """A pinned stage mesh must fill the cluster with the uniform stages' count (MeshError,
    one line, otherwise)."""
    shape = method.stage_mesh_shape
    if shape is None or method.stages != "uniform":
        return
    stages = method.num_stages or 2
    need = math.prod(shape) * stages
    if need != cluster.num_devices:
        mesh = "x".join(map(str, shape))
        raise MeshError(f"{stages} stage(s) of a {mesh} mesh need {need} devices but the "
                        f"cluster has {cluster.num_devices}; choose degrees whose product is "
                        f"{cluster.num_devices}")


def submesh_mesh(cluster: ClusterSpec, submesh: SubmeshShape, shape: tuple[int, ...],
                 device_ids: Sequence[int] | None = None) -> LogicalMesh:
    """The logical mesh ``shape`` over a submesh of ``cluster`` (its first devices, or
    ``device_ids``)."""
    ids = device_ids if device_ids is not None else range(submesh.num_devices)
    return LogicalMesh.from_cluster(cluster, shape, device_ids=tuple(ids))


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


def _range_facts(pp: PipelineProgram, positions: Sequence[int]):
    """``facts(start, end)`` of the piece of layers ``[start, end)`` (cached)."""
    found: dict[tuple[int, int], _RangeFacts] = {}
    fwd = pp.forward
    ranges = LayerRanges(fwd, cut_pieces(fwd, positions))

    def nbytes(v: int) -> float:
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
                bytes_per_microbatch=2 * sum(nbytes(v) for v in roles.acts))
        return found[(start, end)]

    return facts


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
    layers = cut_pieces(pp.forward, positions)
    cache.use_layers(pp, positions)
    m = num_microbatches or method.num_microbatches
    options = stage_dp_options(method, cluster, m)
    runtime = cluster.runtime
    facts = _range_facts(pp, positions)
    per_task = tasks_per_microbatch(method.schedule)
    whole = whole or cluster

    most_in_flight: dict[int, float] = {}
    meshes_made: dict[tuple[SubmeshShape, tuple[int, ...]], LogicalMesh] = {}

    def mesh_of(submesh: SubmeshShape, shape: tuple[int, ...]) -> LogicalMesh:
        # one per submesh and shape: made over every device, 16,384 at Llama-3 405B's size
        if (submesh, shape) not in meshes_made:
            meshes_made[(submesh, shape)] = submesh_mesh(cluster, submesh, shape)
        return meshes_made[(submesh, shape)]
    replica_times: dict[tuple[float, int], float] = {}

    def replica_time(whole_param_bytes: float, devices: int) -> float:
        # the stage DP reads each range on each mesh once per schedule and replica count
        key = (whole_param_bytes, devices)
        if key not in replica_times:
            replica_times[key] = replica_allreduce_time(whole_param_bytes, devices, replicas,
                                                        whole)
        return replica_times[key]

    # each range's layer costs summed, by (mesh, split) then (start, end) (kept in the cache
    # for every table on these cuts): the DP reads every range on every mesh, and a range's
    # sums are its one-shorter range's plus a layer (at GPT-3 175B on 1,024 GPUs the DP's
    # tables read about 100,000 ranges, each summed anew)
    summed: dict[tuple[int, int], dict[tuple[int, int], LayerSums]] = {}

    def range_sums(mesh: LogicalMesh, split: int, start: int, end: int) -> LayerSums:
        found = summed.get((id(mesh), split))
        if found is None:
            found = summed[(id(mesh), split)] = cache.range_sums(positions, mesh, split)
        if (start, end) not in found:
            shorter = LayerSums() if end - 1 == start else range_sums(mesh, split, start,
                                                                      end - 1)
            found[(start, end)] = shorter.plus(cache.layer_cost(pp, layers[end - 1], mesh,
                                                                split=split))
        return found[(start, end)]

    input_bytes: dict[int, float] = {}
    shares_of: dict[tuple[int, int, int], float] = {}

    def input_shares(mesh: LogicalMesh, split: int, start: int) -> float:
        """Into how many shares layer ``start``'s plan on ``mesh`` splits its inputs."""
        key = (id(mesh), split, start)
        if key in shares_of:  # read for every range starting there
            return shares_of[key]
        if start not in input_bytes:
            roles = piece_roles(pp, layers[start])
            input_bytes[start] = sum(nbytes(pp.forward.avals[v])
                                     for v in (*roles.acts, *roles.micro))
        held = cache.layer_cost(pp, layers[start], mesh, split=split).boundary_bytes
        shares_of[key] = max(input_bytes[start] / held, 1.0) if held > 0 else 1.0
        return shares_of[key]

    def overfills(candidates: Sequence[StageCandidate], devices: int) -> bool:
        """Whether none of a stage's candidates on ``devices`` devices fits with the most
        microbatches such a stage could hold."""
        if devices not in most_in_flight:
            most_in_flight[devices] = _most_in_flight(options, devices, cluster, len(layers))
        most = most_in_flight[devices]
        return not options.fits(min(c.memory(most) for c in candidates))

    def candidates(start: int, end: int, submesh: SubmeshShape) -> list[StageCandidate]:
        found = []
        start_s = time.perf_counter()
        f = facts(start, end)
        link = cluster.inter_host if submesh.num_hosts > 1 else cluster.intra_host
        # each device receives its own share of the activations (and sends back their
        # cotangents) over its own link, all at once: the bytes split as the range's first
        # layer splits its inputs on the mesh (Megatron-LM sends each tensor-parallel rank a
        # slice; a data-parallel rank only its sequences)
        transfer = f.bytes_per_microbatch * link.beta
        host = (m * (per_task * runtime.task_s + f.puts_per_microbatch * runtime.transfer_s)
                # each gradient sent to its home stage (the first backward's gradients are
                # the accumulators: no zeros made and placed)
                + f.params * runtime.transfer_s
                + f.fixed * runtime.transfer_s)
        if submesh.num_devices == cluster.num_devices and runs_as_one_program(method.schedule, 1):
            # the only stage: the runtime runs the step as one program (runtime.fused_step)
            host = runtime.call_s
        for shape in stage_meshes(method, submesh):
            mesh = mesh_of(submesh, shape)

            def variants(split: int, mesh=mesh, shape=shape) -> list[StageCandidate]:
                sums = range_sums(mesh, split, start, end)
                tail = sums.tail_s + replica_time(sums.whole_param_bytes,
                                                   submesh.num_devices)
                shares = input_shares(mesh, split, start)
                extra = transfer / shares + sums.param_bytes / runtime.accumulate_bytes_per_s
                return remat_candidates(sums, shape, method.remat, extra_time=extra,
                                        tail_time=tail, host_time=host,
                                        param_bytes=sums.param_bytes, split=split)

            chosen = variants(1)
            found.extend(chosen)
            # the layers' fastest plans may hold their parameters (and so their gradients and
            # optimizer state) on every device: where none of them fits with the most
            # microbatches this stage could hold, the plans splitting every parameter more
            # ways are candidates too, least split first (over a tensor axis, as Megatron-LM
            # splits, before over every device), until one fits (solved only for such
            # stages: most stages never need them)
            for split in state_split_levels(shape):
                if not overfills(chosen, submesh.num_devices):
                    break
                chosen = variants(split)
                found.extend(chosen)
        if clock is not None:
            clock.seconds += time.perf_counter() - start_s
        return found

    submeshes = submesh_shapes(cluster.num_hosts, cluster.devices_per_host)

    def overfilled(mesh: LogicalMesh, costs: list[PieceCost]) -> bool:
        # the whole model (or a stage's run of layers) on the mesh with its layers' plans
        # ``costs`` overfills it: the reader reads that entry, whose candidates then ask for
        # every layer's more split plans
        run = len(costs) if stage_layers is None else min(stage_layers, len(costs))
        return any(overfills(remat_candidates(LayerSums.of(costs[k:k + run]),
                                              tuple(mesh.shape), method.remat),
                             len(mesh.device_ids))
                   for k in range(len(costs) - run + 1))

    start_s = time.perf_counter()
    workers = method.planning_workers or available_cores()
    if prefetch_on is None:
        read_whole = method.stages == "auto" and \
            method.schedule != ScheduleName.INTERLEAVED_1F1B
        prefetch_on = submeshes if read_whole else ()
    meshes = [mesh_of(sub, shape) for sub in prefetch_on for shape in stage_meshes(method, sub)]
    if meshes:
        cache.prefetch(pp, layers, meshes, overfilled, workers)
    if clock is not None:
        clock.seconds += time.perf_counter() - start_s
    return StageCostTable(len(positions) + 1, submeshes, candidates)


def _most_in_flight(options: StageDPOptions, devices: int, cluster: ClusterSpec,
                    num_layers: int) -> float:
    """The most microbatches a stage on ``devices`` devices could hold in flight: stage 0
    of the longest pipeline such stages make (one stage per layer at most)."""
    longest = max(1, min(num_layers, cluster.num_devices // devices))
    try:
        return max(options.activation_counts(longest))
    except (InvalidOptionError, PlanError):  # the schedule does not run on that many stages
        return float(options.num_microbatches)


def stage_dp_options(method: PipeshardParallel, cluster: ClusterSpec,
                     num_microbatches: int | None = None) -> StageDPOptions:
    """The stage search's options: the method's real schedule and chunks, so that every stage
    is sized with the microbatches that schedule holds on it (``activation_counts``)."""
    budget = method.memory_budget_bytes or cluster.device.memory_bytes
    interleaved = method.schedule == ScheduleName.INTERLEAVED_1F1B
    if interleaved and method.num_chunks < 2:
        raise InvalidOptionError(
            f"interleaved-1f1b needs num_chunks >= 2, got {method.num_chunks}")
    return StageDPOptions(num_microbatches=num_microbatches or method.num_microbatches,
                          schedule=method.schedule, memory_budget_bytes=budget,
                          num_stages=method.num_stages,
                          num_chunks=method.num_chunks if interleaved else 1)


# Stage costs feed a DP whose inputs are estimates anyway: 0.1% of a layer's time is far below
# the cost model's own error, and proving the last 0.1% is most of HiGHS's time on big layers.
STAGE_COST_RELATIVE_GAP = 1e-3
# The stage search solves one ILP per distinct layer and mesh. Large ones are bounded by dual
# ascent first (intra_op/dual_bound), which proves most of them within the gap in about a
# second; the limit is there so that none is decided by it (at 1 s, 30 of the Alpa 15B row's
# ILPs stopped on it under load), the chosen stages' own solves included. At 10 s, two of
# Megatron 76.1B's block ILPs on its largest meshes (6-10 s each alone) stopped on it once
# both processes took those meshes at the same time: the method's own 30 s is the limit.
STAGE_COST_TIME_LIMIT_S = 30.0


def _intra_options(method: PipeshardParallel) -> IntraOpOptions:
    return IntraOpOptions(solver=method.solver,
                          time_limit_s=min(method.time_limit_s, STAGE_COST_TIME_LIMIT_S),
                          batch_argnums=(1,), relative_gap=STAGE_COST_RELATIVE_GAP)


def layer_cost_cache(method: PipeshardParallel) -> LayerCostCache:
    """An empty cache of layer costs with the ILP options ``method`` plans with: pass the same
    one to ``plan_pipeshard`` and ``stage_baselines`` to solve each layer and mesh once."""
    return LayerCostCache(_intra_options(method), num_microbatches=method.num_microbatches)


def stage_collectives(costs: Sequence[PieceCost], num_microbatches: int
                      ) -> list[CollectiveEstimate]:
    """What a stage's plan predicts it communicates in one step: each of its pieces' per
    microbatch collectives ``num_microbatches`` times and their per-step ones (the gradients'
    reduction) once, one estimate per (kind, mesh axes). Not counted: a rematerialised
    stage's recomputed forward, and the transfers between stages (no collectives)."""
    totals: dict[tuple, list[float]] = {}
    for cost in costs:
        for c, times in [(c, num_microbatches) for c in cost.collectives] + \
                [(c, 1) for c in cost.sync_collectives]:
            entry = totals.setdefault((c.kind.value, c.axes), [0, 0.0, 0.0])
            entry[0] += c.count * times
            entry[1] += c.nbytes * times
            entry[2] += c.time_s * times
    return [CollectiveEstimate(kind=kind, count=int(n), nbytes=b, axes=axes, time_s=t)
            for (kind, axes), (n, b, t) in sorted(totals.items())]
