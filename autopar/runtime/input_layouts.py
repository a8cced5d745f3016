"""Where a plan wants a step's inputs: the sharding of every flat input of an executable, the
layout a checkpoint is restored into (``autopar.checkpoints``).

A one-stage plan says it exactly (``ShardedProgram.in_shardings``). A pipelined plan has no
one layout for a leaf: each stage places what it reads. A leaf goes where it is first read:
a parameter on the stage of the first piece reading it, in that stage plan's layout; a leaf
only the step's other equations read (an optimizer's moments, a step counter) replicated on
the stage of the first segment reading it; the batch split over that stage; anything else
replicated on every device of the plan. Every executable accepts its inputs in any layout on
any devices and moves them itself: these layouts are where that move costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from autopar.runtime.shard import ShardedProgram

__all__ = ["input_shardings"]


def input_shardings(executable: Any, avals: Sequence[Any]) -> list[jax.sharding.Sharding]:
    """The sharding ``executable`` (a ``ShardedProgram`` or a pipeline runner, as
    ``runtime.executables.build_executable`` makes them) wants for each of its flat inputs
    (``avals``: arrays or ``jax.ShapeDtypeStruct`` s, in the flat inputs' order)."""
    if isinstance(executable, ShardedProgram):
        return list(executable.in_shardings)
    return _pipeline_input_shardings(executable, avals)


def _pipeline_input_shardings(runner: Any, avals: Sequence[Any]) -> list[Any]:
    """Per flat input of a ``PipelineRunner``: where it is first read (see the module)."""
    pp = runner.pp
    read_by_piece: dict[int, tuple[int, int]] = {}  # step input -> (stage, loss input)
    for fid, vid in pp.operand_of.items():
        readers = runner.consumers.get(fid)
        if not readers:
            continue
        stage = runner.stage_of_piece[readers[0]]
        if vid not in read_by_piece or stage < read_by_piece[vid][0]:
            read_by_piece[vid] = (stage, fid)
    read_by_segment: dict[int, int] = {}  # step input -> the stage of its first segment
    for segment in runner.segments:  # in run order
        for vid in segment.inputs:
            read_by_segment.setdefault(vid, segment.stage)
    shardings = []
    for vid, aval in zip(pp.outer.in_ids, avals, strict=True):
        if vid in read_by_piece:
            stage, fid = read_by_piece[vid]
            if fid in pp.split_inputs:  # the batch, cut into microbatches on its stage
                shardings.append(runner.sharding(stage, aval, batched=True))
            else:
                shardings.append(runner.sharding(stage, aval, fid))
        elif vid in read_by_segment:
            shardings.append(runner.sharding(read_by_segment[vid], aval))
        else:
            shardings.append(runner.everywhere)
    return shardings
