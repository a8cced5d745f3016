"""Methods built from a short description: :func:`pinned` (a hand configuration at given
degrees: data x tensor x pipeline) and :func:`method_from_name` (the names the CLI takes).

Both only assemble the option dataclasses of ``autopar.methods``; what each method means is
there.
"""

from __future__ import annotations

from autopar.errors import InvalidOptionError, choices_text
from autopar.ir.schedules import ScheduleName
from autopar.method_options import RematMode, ReplicaMode, Solver, StageMode
from autopar.methods import (
    AUTO_CANDIDATES,
    FULL_SEARCH,
    AutoParallel,
    DataParallel,
    Method,
    PipeshardParallel,
    ShardParallel,
    Zero2Parallel,
    Zero3Parallel,
)
from autopar.plan import MethodName

__all__ = ["METHOD_NAMES", "method_from_name", "pinned"]


def pinned(data: int, tensor: int = 1, pipeline: int = 1, *, num_microbatches: int = 1,
           schedule: str = ScheduleName.ONE_F_ONE_B, num_chunks: int = 2,
           remat: str = RematMode.LAYERS, memory_budget_bytes: float | None = None,
           solver: str = Solver.AUTO,
           time_limit_s: float = 30.0) -> Method:
    """A hand configuration at given degrees, planned as given: what a Megatron-LM-style run
    (tensor x pipeline x data) costs before the search improves on it.

    ``pipeline`` stages of equal layers (the loss forward clustered into ``pipeline`` layers,
    ``pipeline x num_chunks`` for ``schedule="interleaved-1f1b"``) on equal submeshes, each a
    ``data x tensor`` logical mesh; ``num_microbatches`` per step under ``schedule``; ``remat``
    ("layers" by default: Megatron's full recomputation). The degrees, the microbatches, the
    schedule and the recomputation are the caller's; the layouts inside a stage's mesh are the
    ILP's (on a ``data x tensor`` mesh the best of them is at least Megatron's own split).
    With one stage and one microbatch this is ``DataParallel`` (``tensor=1``) or
    ``ShardParallel`` on ``(data, tensor)``; otherwise ``PipeshardParallel`` with uniform
    stages (one stage with several microbatches: gradient accumulation)."""
    for name, value in dict(data=data, tensor=tensor, pipeline=pipeline).items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidOptionError(f"pinned degrees: {name} must be a positive integer, "
                                     f"got {value!r}")
    mesh = (data, tensor) if data > 1 and tensor > 1 else (data * tensor,)
    if pipeline == 1 and num_microbatches == 1:
        if tensor == 1:
            return DataParallel(mesh_shape=mesh, remat=remat)
        return ShardParallel(mesh_shape=mesh, memory_budget_bytes=memory_budget_bytes,
                             solver=solver, time_limit_s=time_limit_s, remat=remat)
    chunks = num_chunks if schedule == ScheduleName.INTERLEAVED_1F1B else 1
    return PipeshardParallel(num_microbatches=num_microbatches, layers=pipeline * chunks,
                             stages=StageMode.UNIFORM, num_stages=pipeline, schedule=schedule,
                             num_chunks=num_chunks, memory_budget_bytes=memory_budget_bytes,
                             solver=solver, time_limit_s=time_limit_s, remat=remat,
                             replicas=ReplicaMode.NONE, stage_mesh_shape=mesh)


# what the CLI and ``method_from_name`` accept: every plan method, and the full search
METHOD_NAMES: tuple[str, ...] = (*AUTO_CANDIDATES, FULL_SEARCH)


def method_from_name(name: str, mesh_shape: tuple[int, ...] | None = None, **options) -> Method:
    """The method for a CLI name (``auto``, ``data``, ``shard``, ``pipeshard``, ``zero2``,
    ``zero3``); raises ``InvalidOptionError`` for others."""
    if name == FULL_SEARCH:
        return AutoParallel(**options)
    if name == MethodName.DATA:
        return DataParallel(mesh_shape=mesh_shape)
    if name == MethodName.ZERO2:
        return Zero2Parallel(mesh_shape=mesh_shape)
    if name == MethodName.ZERO3:
        return Zero3Parallel(mesh_shape=mesh_shape)
    if name == MethodName.SHARD:
        return ShardParallel(mesh_shape=mesh_shape, **options)
    if name == MethodName.PIPESHARD:
        return PipeshardParallel(**options)
    raise InvalidOptionError(
        f"unknown method '{name}'; valid methods: {choices_text(METHOD_NAMES)}"
    )
