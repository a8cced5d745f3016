"""Plan: the complete, plain-data result of compilation for one train step, where compiler and
runtime meet.

A plan names the method, the mesh, and its stages (:class:`StagePlan`). What the runtime and
the re-trace read has a field of its own: the pipeline layout (:class:`PipelineLayout`: where
the loss forward is cut into pieces, which stage owns each, the schedule, the rematerialised
stages) and the rematerialised layer cuts of a one-stage plan (``remat_positions``). What only
reports read (planning times, the stage search's statistics) is a :class:`PlanningRecord`.
Run statistics (compile time, measured idle time) belong to the step that ran the plan, not to
the plan.

The JSON round trip is lossless and strict: a missing, unknown or mistyped field is a one-line
``PlanError`` naming it. Format version 2; version-1 files (``options`` dict) are upgraded on
load (:mod:`autopar.plan.v1`). Plans are never pickled.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from autopar.errors import PlanError
from autopar.ir.schedules import ScheduleName
from autopar.plan.fields import (
    JsonField,
    boolean,
    dump_fields,
    field_of,
    is_int,
    listed,
    load_fields,
    object_of,
    optional,
    string,
)
from autopar.plan.planning_record import PlanningRecord
from autopar.plan.stage import StagePlan

FORMAT_VERSION = 2


class MethodName(StrEnum):
    """The method a plan was made by (``autopar.DataParallel`` plans ``DATA``, ...)."""

    DATA = "data"
    SHARD = "shard"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    PIPESHARD = "pipeshard"


@dataclass(frozen=True)
class InputSignature:
    """Path, shape and dtype of one input leaf: what a plan was made for."""

    path: str
    shape: tuple[int, ...]
    dtype: str


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(is_int(v) for v in value):
        raise TypeError(f"a list of integers, got {value!r}")
    return tuple(int(v) for v in value)


def _positive_int(value: Any) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"a positive integer, got {value!r}")
    return int(value)


def _bools(value: Any) -> tuple[bool, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, bool) for v in value):
        raise TypeError(f"a list of true/false, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class PipelineLayout:
    """How the runtime cuts and runs a pipelined step.

    ``layer_positions``: forward-equation indices of the loss forward where layers begin (the
    cuts the stage search chose among). ``piece_positions``: where the model pieces begin (one
    piece per stage, or ``num_chunks`` per stage for interleaved 1F1B). ``stage_of_piece``:
    the stage that runs each piece; every equation outside the loss forward goes to the stage
    that owns what it reads (the segments, derived from this by ``ir.pipeline_program``).
    ``remat_stages``: per stage, whether its layers run under ``jax.checkpoint``;
    ``selective_stages``: per stage (empty: none), whether that checkpoint keeps the layers'
    matmul outputs (selective recomputation: ``dots_with_no_batch_dims_saveable``).
    ``checkpoint_positions``: where those stages' checkpoints begin, every layer cut and the
    boundaries of the forward's repeated blocks inside the layers (a transformer's blocks, as
    Megatron-LM checkpoints them), so that a backward rebuilds one block at a time; empty:
    at ``layer_positions``.
    ``replicas``: data-parallel copies of the whole pipeline, each on its own group of hosts
    (the stages' devices are the first group's; the microbatches are shared out between the
    groups and each stage's gradients all-reduced between them). The runtime runs one (1).
    """

    schedule: ScheduleName
    num_chunks: int
    layer_positions: tuple[int, ...]
    piece_positions: tuple[int, ...]
    stage_of_piece: tuple[int, ...]
    remat_stages: tuple[bool, ...]
    replicas: int = 1
    selective_stages: tuple[bool, ...] = ()
    checkpoint_positions: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dump_fields(self, LAYOUT_JSON)

    @classmethod
    def from_dict(cls, d: Any, where: str = "pipeline") -> PipelineLayout:
        d = field_of({"v": d}, "v", lambda v: object_of(v, "a pipeline layout"), where)
        return cls(**load_fields(d, LAYOUT_JSON, where))

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "schedule", ScheduleName(self.schedule))
        except ValueError:
            raise PlanError(f"plan field pipeline.schedule {self.schedule!r} names no schedule; "
                            f"valid: {', '.join(s.value for s in ScheduleName)}") from None

    def check(self, num_stages: int) -> None:
        """PlanError (one line naming the field) unless the layout fits ``num_stages`` stages:
        one owner per piece, each a stage, every stage owning ``num_chunks`` pieces, cut
        positions increasing and among the layer cuts, one remat flag per stage."""
        where = "pipeline"
        if not is_int(self.num_chunks) or self.num_chunks < 1:
            raise PlanError(f"plan field {where}.num_chunks={self.num_chunks!r} must be a "
                            "positive integer")
        pieces = len(self.piece_positions) + 1
        if len(self.stage_of_piece) != pieces:
            raise PlanError(f"plan field {where}.stage_of_piece has {len(self.stage_of_piece)} "
                            f"owner(s) for the {pieces} piece(s) that piece_positions cuts")
        bad = [s for s in self.stage_of_piece if not 0 <= s < num_stages]
        if bad:
            raise PlanError(f"plan field {where}.stage_of_piece names stage {bad[0]}; the plan "
                            f"has stages 0 to {num_stages - 1}")
        for s in range(num_stages):
            owned = self.stage_of_piece.count(s)
            if owned != self.num_chunks:
                raise PlanError(f"plan field {where}.stage_of_piece gives stage {s} {owned} "
                                f"piece(s); every stage runs num_chunks={self.num_chunks}")
        for name in ("layer_positions", "piece_positions", "checkpoint_positions"):
            cuts = getattr(self, name)
            if any(b <= a for a, b in zip(cuts, cuts[1:], strict=False)) or any(
                    c <= 0 for c in cuts):
                raise PlanError(f"plan field {where}.{name} {list(cuts)} must be positive and "
                                "increasing")
        stray = sorted(set(self.piece_positions) - set(self.layer_positions))
        if stray:
            raise PlanError(f"plan field {where}.piece_positions cuts at {stray[0]}, which is "
                            "not one of layer_positions")
        stray = sorted(set(self.piece_positions) - set(self.checkpoint_positions or
                                                        self.piece_positions))
        if stray:
            raise PlanError(f"plan field {where}.piece_positions cuts at {stray[0]}, which is "
                            "not one of checkpoint_positions")
        if not is_int(self.replicas) or self.replicas < 1:
            raise PlanError(f"plan field {where}.replicas={self.replicas!r} must be a positive "
                            "integer")
        if len(self.remat_stages) != num_stages:
            raise PlanError(f"plan field {where}.remat_stages has {len(self.remat_stages)} "
                            f"flag(s) for {num_stages} stage(s)")
        if self.selective_stages and len(self.selective_stages) != num_stages:
            raise PlanError(f"plan field {where}.selective_stages has "
                            f"{len(self.selective_stages)} flag(s) for {num_stages} stage(s)")
        if any(s and not r for s, r in zip(self.selective_stages, self.remat_stages,
                                           strict=False)):
            raise PlanError(f"plan field {where}.selective_stages marks a stage whose "
                            "remat_stages flag is false; selective recomputation recomputes")


# PipelineLayout's JSON form, field by field (``fields.JsonField``)
LAYOUT_JSON = (
    JsonField("schedule", string, str),
    JsonField("num_chunks", int),
    JsonField("layer_positions", _ints, listed),
    JsonField("piece_positions", _ints, listed),
    JsonField("stage_of_piece", _ints, listed),
    JsonField("remat_stages", _bools, listed),
    JsonField("replicas", _positive_int, default=1),
    JsonField("selective_stages", _bools, listed, default=()),
    JsonField("checkpoint_positions", _ints, listed, default=()),
)


@dataclass(frozen=True)
class Plan:
    """A complete parallelization plan for one train step and one input signature.

    Frozen: a planner builds it whole, and what comes later (a note, the search's record)
    makes a new plan (``noted``, ``with_planning``, ``dataclasses.replace``), so a plan held
    by a cache or by the search's candidates never changes under its holder. ``stages`` and
    ``notes`` are kept as tuples."""

    method: MethodName
    mesh_shape: tuple[int, ...]
    cluster: str
    stages: Sequence[StagePlan]
    est_step_time_s: float
    total_flops: float
    signature: list[InputSignature] = field(default_factory=list)
    batch_argnums: tuple[int, ...] = (1,)
    num_microbatches: int = 1
    pipeline: PipelineLayout | None = None
    remat_positions: tuple[int, ...] | None = None
    # the rematerialised layers keep their matmuls' outputs (selective recomputation,
    # ``ir.remat_loss.SELECTIVE_POLICY``)
    remat_selective: bool = False
    # the step's attentions run by autopar's kernel (``ir.attention_rewrite``): its tensor ids
    # are that trace's
    attention_kernel: bool = False
    planning: PlanningRecord = field(default_factory=PlanningRecord)
    solver: dict[str, Any] | None = None
    notes: Sequence[str] = ()
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", MethodName(self.method))
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "notes", tuple(self.notes))

    def noted(self, *notes: str, first: bool = False) -> Plan:
        """This plan with ``notes`` added after its own (``first``: before them)."""
        return replace(self, notes=(*notes, *self.notes) if first else (*self.notes, *notes))

    def with_planning(self, **changes: Any) -> Plan:
        """This plan with these fields of its planning record changed."""
        return replace(self, planning=replace(self.planning, **changes))

    @property
    def is_pipelined(self) -> bool:
        """Whether the runtime runs this plan as a pipeline (stage programs and a schedule)."""
        return self.pipeline is not None

    @property
    def peak_memory_bytes(self) -> int:
        """Per-device peak memory: the largest over stages."""
        return max((s.peak_memory_bytes for s in self.stages), default=0)

    def shardings(self) -> dict[str, str]:
        """Every input leaf's path -> spec string (parameters, optimizer state, batch)."""
        out: dict[str, str] = {}
        for stage in self.stages:
            for path, spec in stage.input_shardings.items():
                out.setdefault(path, spec.to_string())
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": self.format_version, **dump_fields(self, PLAN_JSON)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """The plan of ``d`` (``Plan.to_dict``'s form, or a version-1 file's), checked
        (:meth:`check`): a missing, unknown, mistyped or inconsistent field is a one-line
        ``PlanError`` naming it."""
        if not isinstance(d, dict):
            raise PlanError(f"a plan is a JSON object, got {type(d).__name__}")
        version = d.get("format_version")
        if version == 1:
            from autopar.plan.v1 import upgrade

            d = upgrade(d)
        elif version != FORMAT_VERSION:
            raise PlanError(f"plan format version {version!r} is not supported; this autopar "
                            f"reads versions 1 and {FORMAT_VERSION}")
        plan = cls(**load_fields(d, PLAN_JSON, "", also=("format_version",)),
                   format_version=FORMAT_VERSION)
        plan.check()
        return plan

    def check(self) -> None:
        """``PlanError`` (one line naming the field) unless the plan is consistent in itself:
        every stage (:meth:`StagePlan.check`), at least one stage, a positive number of
        microbatches, a pipeline layout exactly when the method pipelines (and fitting the
        stages), and every input spec fitting the shape the plan's signature gives that input
        (as many dimensions, each split into pieces that divide it)."""
        if not self.stages:
            raise PlanError("plan field stages is empty; a plan has at least one stage")
        if not is_int(self.num_microbatches) or self.num_microbatches < 1:
            raise PlanError(f"plan field num_microbatches={self.num_microbatches!r} must be a "
                            "positive integer")
        pipelined = self.method is MethodName.PIPESHARD
        if pipelined and self.pipeline is None:
            raise PlanError("plan field pipeline is missing; a pipeshard plan needs its layout")
        if not pipelined and self.pipeline is not None:
            raise PlanError(f"plan field pipeline is set, but a {self.method.value} plan runs "
                            "one program; it takes no pipeline layout")
        if self.pipeline is not None:
            self.pipeline.check(len(self.stages))
        shapes = {s.path: tuple(s.shape) for s in self.signature}
        for i, stage in enumerate(self.stages):
            stage.check(f"stages[{i}]")
            sizes = stage.axis_sizes
            for path, spec in stage.input_shardings.items():
                shape = shapes.get(path)
                if shape is None:
                    continue
                field_name = f"stages[{i}].input_shardings[{path!r}]"
                if spec.ndim != len(shape):
                    raise PlanError(f"plan field {field_name} has {spec.ndim} dimension(s) but "
                                    f"the signature gives {path!r} the shape {list(shape)}")
                for dim, (size, axes) in enumerate(zip(shape, spec.dims, strict=True)):
                    pieces = math.prod(sizes[a] for a in axes)
                    if is_int(size) and size % pieces:
                        raise PlanError(
                            f"plan field {field_name} splits dimension {dim} (size {size}) into "
                            f"{pieces} pieces over mesh axes {', '.join(axes)}; they must "
                            "divide it")

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, atomically (a reader never sees half a file)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            fh.write(self.to_json())
        os.replace(tmp, target)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise PlanError(f"cannot read plan file {str(path)!r}: {exc.strerror}") from exc
        return cls.from_json(text)


def _stages(value: Any) -> list[StagePlan]:
    if not isinstance(value, list):
        raise TypeError(f"a list of stages, got {type(value).__name__}")
    return [StagePlan.from_dict(s, f"stages[{i}]") for i, s in enumerate(value)]


def _signature(value: Any) -> list[InputSignature]:
    return [InputSignature(string(s["path"]), _ints(s["shape"]), string(s["dtype"]))
            for s in value]


# Plan's JSON form, field by field (``fields.JsonField``), after its ``format_version``
PLAN_JSON = (
    JsonField("method", MethodName, lambda m: m.value),
    JsonField("mesh_shape", _ints, listed),
    JsonField("cluster", string),
    JsonField("stages", _stages, lambda stages: [s.to_dict() for s in stages]),
    JsonField("est_step_time_s", float),
    JsonField("total_flops", float),
    JsonField("signature", _signature,
              lambda sig: [asdict(s) | {"shape": list(s.shape)} for s in sig]),
    JsonField("batch_argnums", _ints, listed),
    JsonField("num_microbatches", int),
    JsonField("pipeline", optional(PipelineLayout.from_dict), optional(PipelineLayout.to_dict)),
    JsonField("remat_positions", optional(_ints), optional(listed)),
    JsonField("remat_selective", boolean, default=False),
    JsonField("attention_kernel", boolean, default=False),
    JsonField("planning", PlanningRecord.from_dict, PlanningRecord.to_dict),
    JsonField("solver", optional(lambda v: dict(object_of(v, "solver")))),
    JsonField("notes", lambda v: [string(n) for n in v], listed),
)
