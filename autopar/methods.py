"""Parallelization methods: the options a user passes as ``method=``.

Each method is a frozen dataclass of options; the planner for it lives in ``autopar.compiler``.
A method from a short description (degrees, a CLI name): ``autopar.method_builders``.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import InvalidOptionError, choices_text
from autopar.ir.schedules import ScheduleName, schedule_name
from autopar.method_options import (
    SCHEDULE_AUTO,
    LayerMode,
    RematMode,
    ReplicaMode,
    Solver,
    StageMode,
    check_choice,
    check_flag,
    check_positive,
    check_remat,
    check_replicas,
    check_solver,
    check_workers,
)
from autopar.plan import MethodName, ShardingSpec

__all__ = [
    "AUTO_CANDIDATES", "FULL_SEARCH", "METHOD_TYPES", "SCHEDULE_AUTO", "AutoParallel",
    "DataParallel", "LayerMode", "ManualStages", "Method", "OneStageMethod", "PipeshardParallel",
    "RematMode", "ReplicaMode", "ShardParallel", "Solver", "StageMode", "Zero2Parallel",
    "Zero3Parallel",
]


@dataclass(frozen=True)
class DataParallel:
    """Split every batch leaf along its first dimension over all devices; replicate the state.

    ``mesh_shape``: the logical mesh (default: all devices in one axis). The batch is split over
    every axis of it, so the shape only changes how the gradient all-reduce is costed.
    ``remat``: see ``ShardParallel`` (the budget is the device's memory).
    """

    mesh_shape: tuple[int, ...] | None = None
    remat: str = RematMode.NONE

    name = MethodName.DATA

    def __post_init__(self) -> None:
        check_remat(self.remat)


@dataclass(frozen=True)
class ShardParallel:
    """Choose every tensor's sharding on one logical mesh with an ILP (Alpa's intra-op pass).

    ``mesh_shape``: a 1-D or 2-D logical mesh over the devices (default: all in one axis).
    ``memory_budget_bytes``: per-device memory every plan must fit (default: unlimited).
    ``solver``: ``"auto"`` (HiGHS when available, else CBC), ``"highs"`` or ``"cbc"``.
    ``time_limit_s``: the solver's time limit; past it the best plan found so far is used and
    marked as not proven optimal.
    ``prefer_reduce_scatter``: shard the optimizer state over all devices as ``Zero2Parallel``
    does and let the ILP choose everything else; gradients then reach their update
    reduce-scattered rather than all-reduced.
    ``remat``: rematerialisation of the loss function's layers (it needs the step's gradient
    from ``autopar.value_and_grad``): ``"none"``, ``"layers"`` (each layer under
    ``jax.checkpoint``: the backward keeps only layer inputs and recomputes the rest),
    ``"selective"`` (the same, keeping each layer's matmul outputs too) or ``"auto"`` (whole
    layers, only when the plan without recomputation does not fit the memory budget).
    ``pinned_inputs``: (leaf path, spec on the logical mesh) pairs, e.g.
    ``(("state/params/w", ShardingSpec(((), ("y",)))),)``: those inputs keep that layout and
    the ILP chooses the rest (the full search pins the inputs committed to your own mesh so).
    ``offload_optimizer_state``: keep the optimizer state (the state the loss does not read,
    as Adam's moments) in host memory between steps, brought to the device for the update
    and sent back after it, over the device's host link (ZeRO-Offload's memory saving; the
    update stays on the device). The full search (``remat="auto"``) takes it where nothing
    else fits and the cluster describes the host link.
    """

    mesh_shape: tuple[int, ...] | None = None
    memory_budget_bytes: float | None = None
    solver: str = Solver.AUTO
    time_limit_s: float = 30.0
    prefer_reduce_scatter: bool = False
    remat: str = RematMode.NONE
    pinned_inputs: tuple[tuple[str, ShardingSpec], ...] = ()
    offload_optimizer_state: bool = False

    name = MethodName.SHARD

    def __post_init__(self) -> None:
        check_remat(self.remat)
        check_solver(self.solver)
        check_positive("time_limit_s", self.time_limit_s)
        check_positive("memory_budget_bytes", self.memory_budget_bytes, optional=True)


@dataclass(frozen=True)
class Zero2Parallel:
    """Data parallelism with ZeRO-2 state sharding: every batch leaf split on its first dimension
    over all devices; the optimizer state (state the loss does not read) sharded over them too,
    gradients reduce-scattered to match, parameters all-gathered whole after the update.

    ``mesh_shape``: the logical mesh (default: all devices in one axis); the batch and the
    sharded state are split over every axis of it.
    """

    mesh_shape: tuple[int, ...] | None = None

    name = MethodName.ZERO2


@dataclass(frozen=True)
class Zero3Parallel:
    """ZeRO-3: as :class:`Zero2Parallel`, and the parameters are sharded too (in and out);
    the forward and backward gather each one where they read it.

    ``mesh_shape``: the logical mesh (default: all devices in one axis).
    """

    mesh_shape: tuple[int, ...] | None = None

    name = MethodName.ZERO3




@dataclass(frozen=True)
class ManualStages:
    """Stages chosen by hand: ``layer_ranges[i] = (first, end)`` (end exclusive) and
    ``submesh_shapes[i] = (hosts, devices per host)`` for stage i."""

    layer_ranges: tuple[tuple[int, int], ...]
    submesh_shapes: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if len(self.layer_ranges) != len(self.submesh_shapes) or not self.layer_ranges:
            raise InvalidOptionError(
                f"ManualStages needs one submesh shape per layer range; got "
                f"{len(self.layer_ranges)} ranges and {len(self.submesh_shapes)} shapes"
            )


@dataclass(frozen=True)
class PipeshardParallel:
    """Pipeline stages on submeshes, each with its own intra-operator plan (Alpa's full search).

    ``num_microbatches``: microbatches per step (must divide the batch size).
    ``layers``: ``"auto"`` (the step's ``autopar.mark_pipeline_boundary`` calls when it has
    any, else automatic clustering), ``"marked"`` (only the marks) or a number of layers to
    cluster the loss forward into.
    ``stages``: ``"auto"`` (the stage DP), ``"uniform"`` (equal layers on equal submeshes;
    ``num_stages`` of them) or a ``ManualStages``.
    ``schedule``: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` (``num_chunks`` model pieces
    per stage, uniform stages), ``"zb-h1"`` (backward split into input and weight gradients),
    the asynchronous ``"pipedream"`` (weight stashing, an update per microbatch) or
    ``"pipedream-2bw"`` (double-buffered weights, an update per step), which change the
    training algorithm (docs/pipeline.md), or ``"auto"``: the planner plans 1f1b and zb-h1
    and keeps the faster; with ``allow_async=True`` also pipedream and pipedream-2bw (where
    their weight versions fit the memory).
    ``num_stages``: fixes the stage count (None: the DP chooses; uniform needs it or uses 2).
    ``memory_budget_bytes``: per-device memory every stage must fit (default: the cluster's).
    ``remat``: rematerialisation, ``"none"``, ``"layers"`` (every stage keeps only its layers'
    inputs for the backward and recomputes the rest, ``jax.checkpoint`` on each layer),
    ``"selective"`` (every stage keeps its layers' inputs and matmul outputs and recomputes
    the rest: the attention core and the element-wise chains, cheap to recompute and large
    to keep at long sequences; ``jax.checkpoint`` with the policy
    ``dots_with_no_batch_dims_saveable``) or ``"auto"`` (the stage search chooses per stage
    between none, selective and layers, paying the recompute only where memory is short).
    ``replicas``: ``"auto"`` (on several hosts the search also tries the pipeline replicated
    data-parallel over equal groups of hosts; such a plan is planned for a described cluster,
    the runtime does not run it yet) or ``"none"`` (one pipeline over every device).
    ``autopar.parallelize`` plans for the local devices with ``"none"``.
    ``stage_mesh_shape``: every stage's logical mesh (``(data, tensor)``, or one axis); None
    (default): the search tries one axis and every 2-D mesh whose second axis stays inside a
    host, per stage.
    ``per_microbatch_statistics``: a loss that mixes the examples of its batch (batch norm
    in training mode, a branch on a batch sum) is run on each microbatch with that
    microbatch's statistics (GPipe's and Alpa's semantics: another loss than the step's) when
    True; when False (default) such a step is refused in one line (``CoupledBatchError``).
    ``planning_workers``: processes the stage search's layer ILPs are split over (None:
    every core this process may use; 1: all in this process). The plan is the same.
    """

    num_microbatches: int = 4
    layers: int | str = LayerMode.AUTO
    stages: str | ManualStages = StageMode.AUTO
    schedule: str = ScheduleName.ONE_F_ONE_B
    num_stages: int | None = None
    num_chunks: int = 2
    memory_budget_bytes: float | None = None
    solver: str = Solver.AUTO
    time_limit_s: float = 30.0
    remat: str = RematMode.NONE
    replicas: str = ReplicaMode.AUTO
    allow_async: bool = False
    stage_mesh_shape: tuple[int, ...] | None = None
    planning_workers: int | None = None
    per_microbatch_statistics: bool = False

    name = MethodName.PIPESHARD

    def __post_init__(self) -> None:
        check_replicas(self.replicas)
        check_flag("allow_async", self.allow_async)
        check_flag("per_microbatch_statistics", self.per_microbatch_statistics)
        if not isinstance(self.num_microbatches, int) or self.num_microbatches < 1:
            raise InvalidOptionError(
                f"num_microbatches must be a positive integer, got {self.num_microbatches!r}"
            )
        check_remat(self.remat, pipelined=True)
        if schedule_name(self.schedule) is None and self.schedule != SCHEDULE_AUTO:
            raise InvalidOptionError(
                f"unknown schedule '{self.schedule}'; valid schedules: "
                f"{choices_text(ScheduleName)}, {SCHEDULE_AUTO}"
            )
        if not isinstance(self.stages, ManualStages):
            check_choice("stages", self.stages, StageMode, " or autopar.ManualStages(...)")
        if isinstance(self.layers, str):
            check_choice("layers", self.layers, LayerMode, ", or a number")
        elif not isinstance(self.layers, int) or self.layers < 1:
            raise InvalidOptionError(f"layers must be a positive number, got {self.layers!r}")
        if self.num_stages is not None and (
            not isinstance(self.num_stages, int) or self.num_stages < 1
        ):
            raise InvalidOptionError(
                f"num_stages must be a positive integer, got {self.num_stages!r}"
            )
        check_solver(self.solver)
        check_positive("time_limit_s", self.time_limit_s)
        check_positive("memory_budget_bytes", self.memory_budget_bytes, optional=True)
        if self.stage_mesh_shape is not None:
            shape = tuple(self.stage_mesh_shape)
            if not 1 <= len(shape) <= 2 or any(
                    not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in shape):
                raise InvalidOptionError(f"stage_mesh_shape must be one or two positive "
                                         f"integers, got {self.stage_mesh_shape!r}")
            object.__setattr__(self, "stage_mesh_shape", shape)
        check_workers(self.planning_workers)


# the full search's candidates are the plan's method names, in that order
AUTO_CANDIDATES: tuple[str, ...] = tuple(name.value for name in MethodName)
# the full search's name (``AutoParallel``): not a ``MethodName``, since each of its plans is
# made by one of the methods it compares
FULL_SEARCH = "auto"


@dataclass(frozen=True)
class AutoParallel:
    """The full search (what ``autopar.parallelize(step)`` does without ``method=``): every
    method below is planned on the same cost model and the fastest plan that fits the memory
    budget is kept; the plan records which method made it, and its planning record lists
    every candidate with its estimate.

    ``candidates``: the methods compared, among ``data`` (``DataParallel``), ``shard``
    (``ShardParallel`` on one mesh axis, and on the 2-D mesh a stage over every device gets:
    hosts x devices per host, or 2 x n/2 on one host), ``zero2``, ``zero3`` and ``pipeshard``
    (the stage search: ``PipeshardParallel`` with the options below; a step without
    ``autopar.value_and_grad``, or whose batch the microbatches do not divide, is not
    pipelined, with a note).
    ``num_microbatches``, ``layers``, ``schedule``, ``num_chunks``: the pipelined candidates'
    (see ``PipeshardParallel``). ``memory_budget_bytes``: per-device memory every plan must
    fit (default: the cluster's device memory). ``solver``, ``time_limit_s``: the ILPs'.
    ``remat``: ``"auto"`` (default: each candidate is rematerialised only where it would not
    fit otherwise; a pipeline's stages selectively or whole), ``"none"``, ``"layers"`` or
    ``"selective"``.
    ``replicas``: the pipelined candidates' (see ``PipeshardParallel``).
    ``time_budget_s``: planning seconds the search may spend (None: no limit). The candidates
    are planned in order (the one-stage methods, then the pipelines); each ILP's limit is cut
    to what is left, and once the budget is spent the rest are skipped: the best plan found
    is kept and its notes and planning record name what was skipped.
    ``planning_workers``: the pipelined candidates' (see ``PipeshardParallel``); at 2 or more
    (the default where there are two cores) a large step's ShardParallel candidates are also
    planned in a forked process beside the pipelines (``planners/one_stage_beside``).
    ``prune``: skip the pipelined candidates where a bound shows they cannot win (a one-stage
    plan fitting the budget is estimated below the least driver time of any pipeline of two
    or more stages; a one-stage pipeline is kept only for memory): the plan is the same;
    False plans them anyway, for the planning record.
    ``measure_candidates``: when the plan is for the devices the step runs on (not a
    described cluster), how many candidate plans are compiled and timed there before one is
    kept (the fastest measured): the search's own choice, its ``DataParallel()`` and
    ``ShardParallel()`` plans, then the next by estimate; 0 keeps the estimate's
    choice without timing any. A plan from the cache or a file is not timed again.
    ``per_microbatch_statistics``: the pipelined candidates' (see ``PipeshardParallel``);
    False leaves them out of the search for a step whose loss mixes its examples, with a
    note, so that the plan computes the step's own loss.
    """

    candidates: tuple[str, ...] = AUTO_CANDIDATES
    num_microbatches: int = 4
    layers: int | str = LayerMode.AUTO
    schedule: str = ScheduleName.ONE_F_ONE_B
    num_chunks: int = 2
    memory_budget_bytes: float | None = None
    solver: str = Solver.AUTO
    time_limit_s: float = 30.0
    remat: str = RematMode.AUTO
    replicas: str = ReplicaMode.AUTO
    time_budget_s: float | None = None
    planning_workers: int | None = None
    prune: bool = True
    measure_candidates: int = 3
    per_microbatch_statistics: bool = False

    name = FULL_SEARCH

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates", tuple(self.candidates))
        bad = [c for c in self.candidates if c not in AUTO_CANDIDATES]
        if bad or not self.candidates:
            raise InvalidOptionError(
                f"unknown candidate method(s) {bad or '(none)'}; valid: "
                f"{choices_text(AUTO_CANDIDATES)}")
        check_remat(self.remat)
        check_solver(self.solver)
        check_replicas(self.replicas)
        check_flag("per_microbatch_statistics", self.per_microbatch_statistics)
        check_positive("time_budget_s", self.time_budget_s, optional=True)
        check_positive("time_limit_s", self.time_limit_s)
        check_positive("memory_budget_bytes", self.memory_budget_bytes, optional=True)
        if (not isinstance(self.measure_candidates, int)
                or isinstance(self.measure_candidates, bool) or self.measure_candidates < 0):
            raise InvalidOptionError(f"measure_candidates must be a non-negative integer (0: "
                                     f"time none), got {self.measure_candidates!r}")
        self.pipeline_method()  # its options' errors now, not at planning time

    def pipeline_method(self) -> PipeshardParallel:
        """The pipelined candidate's method."""
        return PipeshardParallel(num_microbatches=self.num_microbatches, layers=self.layers,
                                 schedule=self.schedule, num_chunks=self.num_chunks,
                                 memory_budget_bytes=self.memory_budget_bytes,
                                 solver=self.solver, time_limit_s=self.time_limit_s,
                                 remat=self.remat, replicas=self.replicas,
                                 planning_workers=self.planning_workers)

    def one_stage_methods(self) -> list[OneStageMethod]:
        """The one-stage candidates' methods, in the order they are planned."""
        remat = self.remat
        found: list[OneStageMethod] = []
        for name in self.candidates:
            if name == MethodName.DATA:
                found.append(DataParallel(remat=remat))
            elif name == MethodName.SHARD:
                found.append(ShardParallel(memory_budget_bytes=self.memory_budget_bytes,
                                           solver=self.solver, time_limit_s=self.time_limit_s,
                                           remat=remat))
            elif name == MethodName.ZERO2:
                found.append(Zero2Parallel())
            elif name == MethodName.ZERO3:
                found.append(Zero3Parallel())
        return found


Method = (DataParallel | ShardParallel | PipeshardParallel | Zero2Parallel | Zero3Parallel
          | AutoParallel)
# the methods that plan one stage over the whole mesh (each has a ``mesh_shape``)
OneStageMethod = DataParallel | ShardParallel | Zero2Parallel | Zero3Parallel


METHOD_TYPES: tuple[type[Method], ...] = (
    DataParallel, ShardParallel, PipeshardParallel, Zero2Parallel, Zero3Parallel, AutoParallel
)
