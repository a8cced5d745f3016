"""Rematerialisation in the stage search: a stage may keep only its blocks' inputs for the
backward and recompute the rest of each block's forward there (``jax.checkpoint`` per block of
the forward's repeated structure in the runtime, ``PipelineLayout.checkpoint_positions``; per
layer where it has none).

A rematerialised candidate pays one more forward per microbatch (a third of a layer's
forward-plus-backward compute, the usual 1:2 flop split) and holds, per in-flight microbatch,
only the bytes of its blocks' activation inputs instead of everything their forwards produce,
and once the largest block's activations, which its backward rebuilds.
A selectively recomputed one (``remat="selective"``: the checkpoint keeps the matmuls' outputs,
``recompute_parts.keeps_output``) holds those inputs and the layers' matmul outputs, and recomputes
the rest: that share of the forward's flops (the attention core and the element-wise chains,
a few percent of a large transformer layer's), ``recompute_parts``.

The same candidates come in memory-lean variants (``state_split_levels``): the layers' plans
splitting every parameter at least k ways. Both are read off the layers' costs summed
(``LayerSums``).
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.compiler.inter_op.submesh import StageCandidate
from autopar.method_options import RematMode

REMAT_SUFFIX = "+remat"
SELECTIVE_SUFFIX = "+selective"
# a candidate whose layers split every parameter at least k ways (or as many as it can be):
# "+split<k>" (the memory-lean variants, ``LayerCostCache.cost(split=k)``)
SPLIT_SUFFIX = "+split"
# forward flops / (forward + backward flops) of a layer
FORWARD_SHARE = 1.0 / 3.0


def is_remat_key(key: str) -> bool:
    """Whether a stage candidate's key names a rematerialised variant (whole layers or
    selective)."""
    return key.endswith((REMAT_SUFFIX, SELECTIVE_SUFFIX))


def is_selective_key(key: str) -> bool:
    """Whether a stage candidate's key names a selectively recomputed variant."""
    return key.endswith(SELECTIVE_SUFFIX)


def state_split_of_key(key: str) -> int:
    """The least number of ways a stage candidate's layers split each parameter (1: the
    fastest plans, no such floor), from its key."""
    found = re.search(re.escape(SPLIT_SUFFIX) + r"(\d+)", key)
    return int(found.group(1)) if found else 1


def state_split_levels(shape: Sequence[int]) -> list[int]:
    """The memory-lean variants a logical mesh of ``shape`` offers, least split first: every
    parameter split at least as many ways as one axis, or several together, has (on a data x
    tensor mesh: over the tensor axis, as Megatron-LM splits; over the data axis; over
    both)."""
    return list(_split_levels(tuple(map(int, shape))))


@functools.lru_cache(maxsize=256)
def _split_levels(shape: tuple[int, ...]) -> tuple[int, ...]:
    # asked for every range on every mesh by each stage table (GPT-3 175B: 140,000 times)
    sizes = [d for d in shape if d > 1]
    products = {math.prod(c) for r in range(1, len(sizes) + 1)
                for c in itertools.combinations(sizes, r)}
    return tuple(sorted(products))


# the one field of ``LayerSums`` that is a layer range's largest term, not its sum
MAXED_FIELD = "recompute_bytes"


@dataclass(frozen=True)
class LayerSums:
    """What a stage's candidates read of its layers' costs (``PieceCost``), summed in layer
    order: ``time_s`` and ``remat_time_s`` per microbatch (the latter with the recomputed
    forward), the bytes kept, ``tail_s`` (the per-step gradient reduction and update), and
    the parameters' bytes per device (``param_bytes``) and unsplit (``whole_param_bytes``).
    Recomputed, the stage keeps its checkpoints' inputs per microbatch
    (``checkpoint_bytes``) and, during one block's backward, that block's activations rebuilt
    (``recompute_bytes``: the largest block's, once)."""

    time_s: float = 0.0
    remat_time_s: float = 0.0
    # selective recomputation: the time with what it recomputes, the bytes it keeps
    selective_time_s: float = 0.0
    selective_bytes: float = 0.0
    fixed_bytes: float = 0.0
    activation_bytes: float = 0.0
    checkpoint_bytes: float = 0.0
    recompute_bytes: float = 0.0
    param_bytes: float = 0.0
    tail_s: float = 0.0
    whole_param_bytes: float = 0.0

    @staticmethod
    def layer_terms(c: Any) -> tuple[float, ...]:
        """What one layer's cost ``c`` adds to each field, in field order (``recompute_bytes``
        is the largest of them, ``MAXED_FIELD``; every other field their sum)."""
        return (c.time_s, c.time_s + FORWARD_SHARE * c.compute_s,
                c.time_s + c.selective_recompute_s,
                c.checkpoint_bytes + c.matmul_output_bytes, c.fixed_bytes, c.activation_bytes,
                c.checkpoint_bytes, c.recompute_bytes, c.param_bytes, c.sync_s + c.update_s,
                c.whole_param_bytes)

    def plus(self, c: Any) -> LayerSums:
        """These sums with one more layer's cost ``c`` added."""
        t = self.layer_terms(c)
        return LayerSums(self.time_s + t[0], self.remat_time_s + t[1],
                         self.selective_time_s + t[2], self.selective_bytes + t[3],
                         self.fixed_bytes + t[4], self.activation_bytes + t[5],
                         self.checkpoint_bytes + t[6], max(self.recompute_bytes, t[7]),
                         self.param_bytes + t[8], self.tail_s + t[9],
                         self.whole_param_bytes + t[10])

    @classmethod
    def of(cls, costs: Sequence[Any]) -> LayerSums:
        """The sums of ``costs``, in order."""
        sums = cls()
        for c in costs:
            sums = sums.plus(c)
        return sums


@functools.lru_cache(maxsize=1024)
def _candidate_key(shape: tuple[int, ...], split: int) -> str:
    """A candidate's key: its logical mesh shape, and its split where it has one."""
    return "x".join(map(str, shape)) + (f"{SPLIT_SUFFIX}{split}" if split > 1 else "")


def remat_candidates(sums: LayerSums, shape: tuple[int, ...], mode: str, *,
                     extra_time: float = 0.0, tail_time: float = 0.0, host_time: float = 0.0,
                     param_bytes: float = 0.0, split: int = 1) -> list[StageCandidate]:
    """The stage candidates of layers whose costs sum to ``sums`` on one logical mesh: as
    they are (``mode`` "none" or "auto"), selectively recomputed ("selective" or "auto"),
    rematerialised ("layers" or "auto").
    ``extra_time`` is added per microbatch; ``tail_time``, ``host_time`` and ``param_bytes``
    are the stage's (see ``StageCandidate``); ``split``: the costs are those of the plans
    splitting every parameter at least that many ways (named so in the key)."""
    key = _candidate_key(tuple(shape), split)
    # built field by field, not through a partial: the stage search makes hundreds of
    # thousands (GPT-3 175B: 150,000 calls), and merging a partial's keywords was a fifth of it
    fixed, tail, host, params = sums.fixed_bytes, tail_time, host_time, param_bytes
    found = []
    if mode in (RematMode.NONE, RematMode.AUTO):
        found.append(StageCandidate(sums.time_s + extra_time, fixed, sums.activation_bytes,
                                    shape, key, tail, host, params))
    # a recomputed block's backward holds its activations again, one block at a time: once
    # per stage, whatever the microbatches in flight (the matmul outputs selective
    # recomputation keeps are among them: counted twice there, a little over)
    rebuilt = fixed + sums.recompute_bytes
    if mode in (RematMode.SELECTIVE, RematMode.AUTO):
        found.append(StageCandidate(sums.selective_time_s + extra_time, rebuilt,
                                    sums.selective_bytes, shape, key + SELECTIVE_SUFFIX, tail,
                                    host, params))
    if mode in (RematMode.LAYERS, RematMode.AUTO):
        found.append(StageCandidate(sums.remat_time_s + extra_time, rebuilt,
                                    sums.checkpoint_bytes, shape, key + REMAT_SUFFIX, tail,
                                    host, params))
    return found
