"""What the stage search's recomputation choices saved in memory and cost in time, as the
plan's notes: per kind of recomputation (selective, every layer), the stages that took it, the
bytes a device holds less than with every activation kept (at each stage's microbatches in
flight, the rebuilt block counted) and the time per microbatch the recomputed forward adds.
Read off the same layer costs the search priced the stages with (``LayerSums``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.inter_op.remat import (
    LayerSums,
    is_remat_key,
    is_selective_key,
    state_split_of_key,
)
from autopar.compiler.inter_op.stages import StageDPOptions
from autopar.compiler.planners.pipeline_search import PipeshardSearch
from autopar.compiler.planners.stage_costs import range_pieces
from autopar.errors import format_bytes


def recompute_notes(search: PipeshardSearch, meshes: Sequence[LogicalMesh],
                    dp_options: StageDPOptions) -> list[str]:
    """One note per kind of recomputation the best pipeline's stages chose, and one naming
    the stages that keep every activation where others recompute."""
    best, cache, pp = search.best, search.cache, search.pp
    stages = best.partition.stages
    kinds: dict[str, list[tuple[int, float, float]]] = {}
    kept = []
    for s, assignment in enumerate(stages):
        key = assignment.candidate.key
        if not is_remat_key(key):
            kept.append(s)
            continue
        layers = range_pieces(pp, best.positions,
                              [(i, i + 1) for i in range(assignment.start, assignment.end)])
        sums = LayerSums.of([cache.layer_cost(pp, layer, meshes[s],
                                              split=state_split_of_key(key), specs=False)
                             for layer in layers])
        selective = is_selective_key(key)
        held = sums.selective_bytes if selective else sums.checkpoint_bytes
        took = sums.selective_time_s if selective else sums.remat_time_s
        in_flight = dp_options.in_flight(s, len(stages))
        saved = in_flight * (sums.activation_bytes - held) - sums.recompute_bytes
        added = (took - sums.time_s) / sums.time_s if sums.time_s > 0 else 0.0
        kinds.setdefault("selective" if selective else "every layer", []).append(
            (s, saved, added))
    if not kinds:
        return []
    notes = []
    for kind, rows in kinds.items():
        bytes_saved = [r[1] for r in rows]
        time_added = [r[2] for r in rows]
        notes.append(
            f"recomputation ({kind}) on stage(s) {_stages_text([r[0] for r in rows])}: "
            f"{_range(bytes_saved, format_bytes)} less per device than keeping every "
            "activation (at each stage's microbatches in flight, the block its backward "
            "rebuilds counted), "
            f"for {_range(time_added, lambda x: f'{100 * x:.1f}%')} more time per microbatch")
    if kept:
        notes.append(f"stage(s) {_stages_text(kept)} keep every activation (they fit)")
    return notes


def _range(values: Sequence[float], text: Callable[[float], str]) -> str:
    """``values`` as one figure, or their least and greatest: ``1.5 GiB-3.2 GiB``."""
    lo, hi = text(min(values)), text(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def _stages_text(stages: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for s in stages:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
