"""A stage cost table's candidates made as arrays for the whole table at once
(``table_arrays``), for the stage DP to read instead of one entry at a time.

``TableEntries.candidates`` prices one (layer range, submesh) entry in Python, a
``StageCandidate`` per logical mesh, split level and recomputation; the DP reads every entry
of every table, and the search makes one table per schedule and replica count (GPT-3 175B on
1,024 A100s: 14 tables of about 19,000 candidates, most of its stage DP's seconds). Here the
same candidates come from each mesh's layer costs summed over every range at once: the sums
in the same order as ``LayerSums.plus`` (layer by layer from the range's start, so each is
the same float), each entry's candidates in the same order as ``candidates`` gives them (so
the DP picks the same candidate on ties, and ``candidates`` gives it by its index). A split
level is asked for only where ``candidates`` would ask: where every less split level of the
entry overfills, and only its layers' costs, so no ILP is solved that it would not solve.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.inter_op.pipeline_cost import (
    one_program_call_s,
    replica_allreduce_time,
    stage_host_seconds,
)
from autopar.compiler.inter_op.remat import MAXED_FIELD, LayerSums, state_split_levels
from autopar.compiler.inter_op.stages import SubmeshShape
from autopar.compiler.inter_op.submesh import CandidateArrays
from autopar.compiler.planners.stage_costs import stage_meshes
from autopar.method_options import RematMode


class Entries(Protocol):
    """What is read of ``stage_table.TableEntries`` (the table's own entry-by-entry maker)."""

    pp: Any
    positions: Sequence[int]
    method: Any
    cluster: Any
    whole: Any
    cache: Any
    options: Any
    num_microbatches: int
    replicas: int
    layers: list[Any]

    def facts(self, start: int, end: int) -> Any: ...

    def layer_input_bytes(self, start: int) -> float: ...

    def most_in_flight_on(self, devices: int) -> float: ...

    def mesh_of(self, submesh: SubmeshShape, shape: tuple[int, ...]) -> LogicalMesh: ...

# ``LayerSums``' fields, in order: what each layer adds to them is ``LayerSums.layer_terms``
_FIELDS = tuple(f.name for f in dataclasses.fields(LayerSums))


def _modes(remat: str) -> tuple[str, ...]:
    """The recomputation variants ``remat_candidates`` makes for ``remat``, in its order."""
    out = []
    if remat in (RematMode.NONE, RematMode.AUTO):
        out.append("none")
    if remat in (RematMode.SELECTIVE, RematMode.AUTO):
        out.append("selective")
    if remat in (RematMode.LAYERS, RematMode.AUTO):
        out.append("layers")
    return tuple(out)


class _RangeArrays:
    """Per (start, end): what ``_range_facts`` gives each range, as arrays, and each layer's
    input bytes (read once per layer cuts and kept in the cost cache for every table)."""

    def __init__(self, entries: Entries) -> None:
        n = len(entries.layers)
        shape = (n, n + 1)
        self.params, self.fixed = np.zeros(shape), np.zeros(shape)
        self.puts, self.bytes = np.zeros(shape), np.zeros(shape)
        for k in range(n):
            for e in range(k + 1, n + 1):
                facts = entries.facts(k, e)
                self.params[k, e], self.fixed[k, e] = facts.params, facts.fixed
                self.puts[k, e] = facts.puts_per_microbatch
                self.bytes[k, e] = facts.bytes_per_microbatch
        self.input_bytes = np.zeros(n)
        for k in range(n):
            self.input_bytes[k] = entries.layer_input_bytes(k)


def _layer_terms(entries: Entries, mesh: LogicalMesh, split: int,
                 needed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each needed layer's terms (``LayerSums.layer_terms``, a row per field; nan for the
    layers no entry asked for) and its ``boundary_bytes``."""
    n = len(entries.layers)
    terms, boundary = np.full((len(_FIELDS), n), np.nan), np.full(n, np.nan)
    for k in np.flatnonzero(needed):
        c = entries.cache.layer_cost(entries.pp, entries.layers[k], mesh, split=split,
                                     specs=False)
        terms[:, k] = LayerSums.layer_terms(c)
        boundary[k] = c.boundary_bytes
    return terms, boundary


def _range_sums(terms: np.ndarray) -> dict[str, np.ndarray]:
    """Every range's ``LayerSums`` fields, ``[k, e]``, added layer by layer from ``k`` as
    ``LayerSums.plus`` adds them (to 0.0 first; ``MAXED_FIELD`` their running maximum)."""
    n = terms.shape[1]
    maxed = np.array([name == MAXED_FIELD for name in _FIELDS])
    out = np.full((len(_FIELDS), n, n + 1), np.nan)
    running = np.zeros((len(_FIELDS), n))
    for e in range(1, n + 1):
        added = running[:, :e] + terms[:, e - 1:e]
        running[:, :e] = np.where(maxed[:, None],
                                  np.maximum(running[:, :e], terms[:, e - 1:e]), added)
        out[:, :e, e] = running[:, :e]
    return {name: out[i] for i, name in enumerate(_FIELDS)}


def _needed_layers(wanted: np.ndarray) -> np.ndarray:
    """The layers some wanted range ``[k, e)`` holds."""
    n = wanted.shape[0]
    needed = np.zeros(n, dtype=bool)
    for k, e in zip(*np.nonzero(wanted), strict=True):
        needed[k:e] = True
    return needed


def table_arrays(entries: Entries, usable: Sequence[int], submeshes: Sequence[SubmeshShape],
                 num_microbatches: int) -> CandidateArrays | None:
    """``entries``' candidates on ``submeshes[i]`` for ``i`` in ``usable``, as the stage DP
    reads them with ``num_microbatches`` (``stage_dp.candidate_arrays`` of the same table, to
    the bit); None where a value is not a finite non-negative number (``candidates`` says
    which)."""
    ranges = entries.cache.shared(entries.pp, ("range arrays", tuple(entries.positions)),
                                  lambda: _RangeArrays(entries))
    per_sub = [_submesh_slots(entries, ranges, submeshes[index]) for index in usable]
    return _packed(per_sub, len(entries.layers), num_microbatches)


def _submesh_slots(entries: Entries, ranges: _RangeArrays,
                   sub: SubmeshShape) -> list[dict[str, np.ndarray]]:
    """The candidates of every range on ``sub``, one slot per (logical mesh, split level,
    recomputation) in ``candidates``' order, each with the ranges that list it
    (``wanted``: a split level where every less split one overfills)."""
    n = len(entries.layers)
    cluster, runtime = entries.cluster, entries.cluster.runtime
    link = cluster.inter_host if sub.num_hosts > 1 else cluster.intra_host
    transfer = ranges.bytes * link.beta
    host = np.broadcast_to(stage_host_seconds(
        runtime, entries.method.schedule, entries.num_microbatches,
        sub.num_devices == cluster.num_devices, ranges.puts, ranges.params, ranges.fixed,
        one_program_call_s(entries.pp, cluster)),
        (n, n + 1))
    most = entries.most_in_flight_on(sub.num_devices)
    budget = entries.options.memory_budget_bytes
    slots = []
    for shape in stage_meshes(entries.method, sub):
        mesh = entries.mesh_of(sub, shape)
        wanted = np.triu(np.ones((n, n + 1), dtype=bool), 1)
        for split in (1, *state_split_levels(shape)):
            if not wanted.any():
                break
            level = _level_slots(entries, ranges, mesh, split, wanted, transfer,
                                 sub.num_devices)
            memory = np.full((n, n + 1), np.inf)
            for slot in level:
                slot["host"] = host
                memory = np.minimum(memory, slot["fixed"] + most * slot["act"])
            slots += level
            wanted = wanted & (np.zeros_like(wanted) if budget is None else
                               ~(memory <= budget))
    return slots


def _level_slots(entries: Entries, ranges: _RangeArrays, mesh: LogicalMesh, split: int,
                 wanted: np.ndarray, transfer: np.ndarray,
                 devices: int) -> list[dict[str, np.ndarray]]:
    """One split level's slots on ``mesh`` (``remat_candidates``' variants, in its order)."""
    n = len(entries.layers)
    runtime = entries.cluster.runtime
    terms, held = _layer_terms(entries, mesh, split, _needed_layers(wanted))
    sums = _range_sums(terms)
    shares = np.ones(n)
    ok = held > 0
    shares[ok] = np.maximum(ranges.input_bytes[ok] / held[ok], 1.0)
    param = sums["param_bytes"]
    extra = transfer / shares[:, None] + param / runtime.accumulate_bytes_per_s
    tail = sums["tail_s"] + _replica_times(entries, sums["whole_param_bytes"], wanted,
                                           devices)
    fixed = sums["fixed_bytes"]
    rebuilt = fixed + sums["recompute_bytes"]
    made = {"none": (sums["time_s"] + extra, fixed, sums["activation_bytes"]),
            "selective": (sums["selective_time_s"] + extra, rebuilt, sums["selective_bytes"]),
            "layers": (sums["remat_time_s"] + extra, rebuilt, sums["checkpoint_bytes"])}
    return [{"time": made[mode][0], "fixed": made[mode][1], "act": made[mode][2],
             "param": param, "tail": tail, "wanted": wanted}
            for mode in _modes(entries.method.remat)]


def _replica_times(entries: Entries, whole: np.ndarray, wanted: np.ndarray,
                   devices: int) -> np.ndarray:
    out = np.zeros_like(whole)
    if entries.replicas <= 1:
        return out
    link = entries.whole.inter_host  # all that ``replica_allreduce_time`` reads of it
    memo = entries.cache.shared(entries.pp, ("replica times", entries.replicas, link.alpha,
                                             link.beta), dict)
    for k, e in zip(*np.nonzero(wanted), strict=True):
        value = float(whole[k, e])
        found = memo.get((value, devices))
        if found is None:
            found = memo[(value, devices)] = replica_allreduce_time(
                value, devices, entries.replicas, entries.whole)
        out[k, e] = found
    return out


def _packed(per_sub: list[list[dict[str, np.ndarray]]], n: int,
            num_microbatches: int) -> CandidateArrays | None:
    """Each entry's wanted slots moved to the front, in order (as ``candidates`` lists
    them), over (k, e, j, c)."""
    width = max([1] + [int(np.sum([s["wanted"] for s in slots], axis=0).max())
                       for slots in per_sub if slots])
    shape = (n, n + 1, len(per_sub), width)
    times, fixed, act = np.full(shape, np.inf), np.full(shape, np.inf), np.zeros(shape)
    param, sums = np.zeros(shape), np.full(shape, np.inf)
    divisor = max(num_microbatches, 1)
    for j, slots in enumerate(per_sub):
        taken = np.zeros((n, n + 1), dtype=int)
        for slot in slots:
            k, e = np.nonzero(slot["wanted"])
            if not len(k):
                continue
            values = [slot[name][k, e] for name in ("time", "fixed", "act", "param", "tail",
                                                    "host")]
            if not all(np.isfinite(v).all() and (v >= 0).all() for v in values):
                return None
            time, mem, activation, params, tail, host = values
            c = taken[k, e]
            max_part = time + tail / divisor
            times[k, e, j, c] = max_part
            sums[k, e, j, c] = max_part + host
            fixed[k, e, j, c], act[k, e, j, c], param[k, e, j, c] = mem, activation, params
            taken[k, e] += 1
    return CandidateArrays(times, sums, fixed, act, param)
