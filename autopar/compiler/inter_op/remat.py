"""Rematerialisation in the stage search: a stage may keep only its layers' inputs for the
backward and recompute the rest of each layer's forward there (``jax.checkpoint`` per layer in
the runtime).

A rematerialised candidate pays one more forward per microbatch (a third of a layer's
forward-plus-backward compute, the usual 1:2 flop split) and holds, per in-flight microbatch,
only the bytes of its layers' activation inputs instead of everything their forwards produce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autopar.compiler.inter_op.submesh import StageCandidate

REMAT_SUFFIX = "+remat"
# a candidate whose layers split their parameters the most ways (the memory-lean variant)
LEAN_SUFFIX = "+lean"
# forward flops / (forward + backward flops) of a layer
FORWARD_SHARE = 1.0 / 3.0


def is_remat_key(key: str) -> bool:
    """Whether a stage candidate's key names a rematerialised variant."""
    return key.endswith(REMAT_SUFFIX)


def is_lean_key(key: str) -> bool:
    """Whether a stage candidate's key names the memory-lean variant (its layers' plans
    split their parameters the most ways: ``LayerCostCache.cost(lean=True)``)."""
    return LEAN_SUFFIX in key


def remat_candidates(costs: Sequence[Any], shape: tuple[int, ...], mode: str, *,
                     extra_time: float = 0.0, tail_time: float = 0.0, host_time: float = 0.0,
                     param_bytes: float = 0.0, lean: bool = False) -> list[StageCandidate]:
    """The stage candidates of layers with ``costs`` (``PieceCost``) on one logical mesh:
    as they are (``mode`` "none" or "auto"), rematerialised ("layers" or "auto").
    ``extra_time`` is added per microbatch; ``tail_time``, ``host_time`` and ``param_bytes``
    are the stage's (see ``StageCandidate``); ``lean``: the costs are the memory-lean
    variant's (named so in the key)."""
    key = "x".join(map(str, shape)) + (LEAN_SUFFIX if lean else "")
    fixed = sum(c.fixed_bytes for c in costs)
    common = dict(fixed_memory=fixed, logical_mesh_shape=shape, tail_time=tail_time,
                  host_time=host_time, param_bytes=param_bytes)
    found = []
    if mode != "layers":
        found.append(StageCandidate(
            time=sum(c.time_s for c in costs) + extra_time,
            activation_memory_per_microbatch=sum(c.activation_bytes for c in costs),
            key=key,
            **common,
        ))
    if mode != "none":
        found.append(StageCandidate(
            time=sum(c.time_s + FORWARD_SHARE * c.compute_s for c in costs) + extra_time,
            activation_memory_per_microbatch=sum(c.boundary_bytes for c in costs),
            key=key + REMAT_SUFFIX,
            **common,
        ))
    return found
