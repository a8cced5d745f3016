"""The train step's update rule, split per stage for asynchronous pipelines.

Under an asynchronous schedule (``async_schedules``) each stage applies the step's update rule
to its own parameters on its own timetable: after each of its backwards (PipeDream) or after
its last backward of a call (2BW). The update rule is the traced step's equations outside the
loss function; this module slices them, from the step's new state back to the state and the
gradients, into one update per stage:

- a state leaf whose new value reads the gradients of one stage's parameters belongs to that
  stage (for Adam: the parameter and its two moments);
- a leaf that reads no gradient (Adam's step count) is kept by every stage whose update reads
  it, each advancing its own copy once per update; the step returns stage 0's copy;
- the update must not read the batch, the loss, or the gradients of two stages (global-norm
  clipping does): such steps have no per-stage update, and are refused with a PlanError.

Each stage's update reads its state leaves and its gradients and writes its state leaves;
applied repeatedly it advances that stage's part of the state one version at a time. The
step's other results (the loss) are computed once per call from the mean loss and aux.

Pure: equation indices and value ids of the traced program, no devices.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from autopar.errors import PlanError
from autopar.ir.pieces import Piece
from autopar.ir.pipeline_pieces import input_consumers
from autopar.ir.pipeline_program import PipelineProgram

_LOSS = -1  # tag of values computed from the loss function's loss and aux
_OTHER = -2  # tag of values computed from step inputs outside the state (the batch)


@dataclass(frozen=True)
class StageUpdate:
    """One stage's update: run ``eqns`` (outer step equations, in order) on the state leaves at
    positions ``reads`` and the gradients of the forward parameters ``grads``; the results are
    the new values of the state leaves at positions ``writes``. ``params``: the forward
    parameters this stage owns (their versions are what its tasks read)."""

    stage: int
    eqns: tuple[int, ...]
    reads: tuple[int, ...]
    grads: tuple[int, ...]
    writes: tuple[int, ...]
    params: tuple[int, ...]


@dataclass(frozen=True)
class AsyncStepProgram:
    """The step as an asynchronous pipeline runs it.

    ``state_in`` / ``state_out``: outer value ids of the state leaves (the step's first
    argument) and of the new state (the first element of its result), by position.
    ``param_position``: the state position each differentiated forward parameter is.
    ``owner``: the stage that owns each forward parameter (the first stage reading it).
    ``source``: per state position, the stage whose copy the step returns (-1: no update
    writes it; the step returns it as given). ``result_eqns``: the equations computing the
    step's other results from the loss, the aux, the batch and the state as given.
    ``follows``: state positions that go with one parameter (their new value reads that
    parameter's gradient alone and has its shape: Adam's moments), by position: the runtime
    places them as it places the parameter.
    """

    num_state: int
    state_in: tuple[int, ...]
    state_out: tuple[int, ...]
    param_position: dict[int, int]
    owner: dict[int, int]
    updates: tuple[StageUpdate, ...]
    source: tuple[int, ...]
    result_eqns: tuple[int, ...]
    follows: dict[int, int]


def async_step_program(
    pp: PipelineProgram, pieces: Sequence[Piece], stage_of_piece: Sequence[int]
) -> AsyncStepProgram:
    """Slice ``pp``'s step into per-stage updates (PlanError, one line, when it has none)."""
    outer = pp.outer
    if pp.input_splits:
        raise PlanError("asynchronous schedules do not run steps whose loss function scans "
                        "over stacked layers yet; use a synchronous schedule (1f1b)")
    in_tree, out_tree = outer.in_tree.children(), outer.out_tree.children()
    start, stop = outer.arg_leaf_ranges[0] if outer.arg_leaf_ranges else (0, 0)
    num_state = stop - start
    if not out_tree or out_tree[0] != in_tree[0] or start != 0:
        raise PlanError("asynchronous schedules need a step(state, batch) -> (new_state, ...) "
                        "whose new state has the state's structure")
    state_in = tuple(outer.in_ids[:num_state])
    state_out = tuple(outer.out_ids[:num_state])
    position = {vid: k for k, vid in enumerate(state_in)}
    param_position = {}
    for fid in pp.diff_inputs:
        operand = pp.operand_of[fid]
        if operand not in position:
            raise PlanError("asynchronous schedules need the loss function to differentiate "
                            "state leaves as the state holds them; a differentiated operand is "
                            "computed in the step")
        param_position[fid] = position[operand]
    consumers = input_consumers(pieces)
    owner = {fid: stage_of_piece[consumers[fid][0]] if fid in consumers else 0
             for fid in pp.diff_inputs}

    tags = _tags(pp, owner, set(state_in))
    path_of = dict(zip(outer.out_ids, outer.out_paths, strict=True))
    writer: dict[int, int | None] = {}
    for j, vid in enumerate(state_out):
        found = tags.get(vid, frozenset())
        if _LOSS in found or _OTHER in found:
            raise PlanError(f"asynchronous schedules need an update that reads only the state "
                            f"and the gradients; '{path_of[vid]}' reads the batch or the loss")
        stages = sorted(found)
        if len(stages) > 1:
            raise PlanError(f"asynchronous schedules update each stage on its own; "
                            f"'{path_of[vid]}' reads the gradients of stages {stages}")
        writer[j] = stages[0] if stages else None

    num_stages = max(stage_of_piece) + 1
    updates = tuple(
        _stage_update(pp, s, writer, state_in, state_out, param_position, owner, path_of)
        for s in range(num_stages)
    )
    source = [-1] * num_state
    for u in reversed(updates):  # the lowest stage writing a shared leaf is the one returned
        for j in u.writes:
            if writer[j] is None or writer[j] == u.stage:
                source[j] = u.stage
    results = list(outer.out_ids[num_state:])
    result_eqns = _slice(pp, results)
    bad = [v for v in results if any(t >= 0 for t in tags.get(v, ()))]
    if bad:
        raise PlanError(f"asynchronous schedules need the step's other results to read no "
                        f"gradient; '{path_of[bad[0]]}' does")
    return AsyncStepProgram(num_state, state_in, state_out, param_position, owner, updates,
                            tuple(source), tuple(result_eqns),
                            _followers(pp, state_out, param_position))


def _tags(pp: PipelineProgram, owner: dict[int, int], state: set[int]) -> dict[int, frozenset]:
    """For each value of the step: the stages whose gradients it reads, and _LOSS / _OTHER."""
    outer, vg = pp.outer, pp.vg
    tags: dict[int, frozenset] = {v: frozenset({_OTHER}) for v in outer.in_ids if v not in state}
    first = 1 + pp.loss.num_aux
    for v in vg.outputs[:first]:
        tags[v] = frozenset({_LOSS})
    for fid, gid in pp.grad_outputs().items():
        tags[gid] = frozenset({owner[fid]})
    for eqn in outer.eqns:
        if eqn.index == pp.vg_index:
            continue
        found = frozenset().union(*(tags.get(v, frozenset()) for v in eqn.inputs))
        if found:
            for v in eqn.outputs:
                tags[v] = found
    return tags


def _slice(pp: PipelineProgram, targets: Iterable[int]) -> list[int]:
    """The equations (not the loss's) that ``targets`` depend on, in program order."""
    outer = pp.outer
    needed, eqns = set(targets), set()
    for eqn in reversed(outer.eqns):
        if eqn.index == pp.vg_index or not any(v in needed for v in eqn.outputs):
            continue
        eqns.add(eqn.index)
        needed.update(eqn.inputs)
    return sorted(eqns)


def _stage_update(
    pp: PipelineProgram, stage: int, writer: dict[int, int | None], state_in: tuple[int, ...],
    state_out: tuple[int, ...], param_position: dict[int, int], owner: dict[int, int],
    path_of: dict[int, str],
) -> StageUpdate:
    """Stage ``stage``'s update, closed over the shared leaves it reads (it keeps their copies
    and so must advance them too); stage 0 also writes every shared leaf."""
    outer = pp.outer
    grad_of = {gid: fid for fid, gid in pp.grad_outputs().items()}
    position = {vid: k for k, vid in enumerate(state_in)}
    params = tuple(sorted(f for f, s in owner.items() if s == stage))
    writes = {j for j, w in writer.items()
              if w == stage or (stage == 0 and w is None and state_out[j] != state_in[j])}
    while True:
        eqns = _slice(pp, [state_out[j] for j in writes])
        read_ids = {v for i in eqns for v in outer.eqns[i].inputs} | {state_out[j] for j in writes}
        reads = {position[v] for v in read_ids if v in position}
        reads |= {param_position[f] for f in params}
        grown = set(writes)
        for k in reads:
            if state_out[k] == state_in[k] or k in writes:
                continue
            if writer[k] is not None and writer[k] != stage:
                raise PlanError(f"asynchronous schedules update each stage on its own; stage "
                                f"{stage}'s update reads '{path_of[state_out[k]]}', which "
                                f"stage {writer[k]} updates")
            grown.add(k)
        if grown == writes:
            break
        writes = grown
    grads = tuple(sorted(grad_of[v] for i in eqns for v in outer.eqns[i].inputs if v in grad_of))
    return StageUpdate(stage, tuple(eqns), tuple(sorted(reads)), tuple(dict.fromkeys(grads)),
                       tuple(sorted(writes)), params)


def _followers(pp: PipelineProgram, state_out: tuple[int, ...],
               param_position: dict[int, int]) -> dict[int, int]:
    """Each non-parameter state position whose new value reads exactly one parameter's
    gradient and has that parameter's shape, with the parameter's position."""
    outer = pp.outer
    grad_of = {gid: fid for fid, gid in pp.grad_outputs().items()}
    reads: dict[int, frozenset[int]] = {}  # value -> the parameters whose gradients it reads
    for gid, fid in grad_of.items():
        reads[gid] = frozenset({fid})
    for eqn in outer.eqns:
        if eqn.index == pp.vg_index:
            continue
        found = frozenset().union(*(reads.get(v, frozenset()) for v in eqn.inputs))
        if found:
            for v in eqn.outputs:
                reads[v] = found
    params = set(param_position.values())
    positions: dict[int, int] = {}
    for j, vid in enumerate(state_out):
        fids = reads.get(vid, frozenset())
        if j in params or len(fids) != 1:
            continue
        (fid,) = fids
        if tuple(outer.avals[vid].shape) == tuple(pp.forward.avals[fid].shape):
            positions[j] = param_position[fid]
    return positions
