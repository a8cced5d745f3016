"""Memory floors: what no plan of a step holds less than, checked before a sharding ILP is
built (docs/memory.md, "The floor"). ``memory_floor``: every tensor split over all the
devices. ``mesh_memory_floor``: the state split only as far as a mesh's axes divide its
dimensions (``most_shards``, ``held_floor``), with the first floor's activations.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Collection, Iterable, Sequence

from autopar.compiler.cost.memory_model import (
    MemoryEstimate,
    estimate_memory,
    parameter_inputs,
)
from autopar.compiler.graph.opgraph import OpGraph


def memory_floor(graph: OpGraph, *, batch_argnums: Iterable[int], num_devices: int,
                 host: Collection[int] = frozenset()) -> MemoryEstimate:
    """The memory of ``graph`` with every tensor split ``num_devices`` ways: no plan on that
    many devices holds less of any tensor, so (up to the memory-greedy order, which the
    shares set) none peaks below this. What a planner checks before building an ILP that
    cannot fit; the plan's own figure is ``estimate_memory`` of its layouts. ``host``: the
    tensors kept in host memory between steps (``estimate_memory``)."""
    shards = dict.fromkeys(graph.tensors, max(1, int(num_devices)))
    return estimate_memory(graph, batch_argnums=batch_argnums, shards=shards, host=host)


def mesh_memory_floor(graph: OpGraph, *, batch_argnums: Iterable[int],
                      mesh_shape: Sequence[int],
                      everywhere: MemoryEstimate | None = None,
                      host: Collection[int] = frozenset()) -> MemoryEstimate:
    """A floor on a mesh of ``mesh_shape``, at or above ``memory_floor`` on as many devices
    (``everywhere``, computed if not given): what every plan holds besides activations as far
    as the mesh splits it (``held_floor``: on a 315 x 8 mesh a dimension of 20,480 takes the
    8-way axis only), and the activations of every tensor split over all the devices."""
    if everywhere is None:
        everywhere = memory_floor(graph, batch_argnums=batch_argnums,
                                  num_devices=math.prod(mesh_shape), host=host)
    held = held_floor(graph, batch_argnums=batch_argnums, mesh_shape=mesh_shape, host=host)
    return dataclasses.replace(held, activations=everywhere.activations)


def held_floor(graph: OpGraph, *, batch_argnums: Iterable[int],
               mesh_shape: Sequence[int], host: Collection[int] = frozenset()) -> MemoryEstimate:
    """What every plan on a mesh of ``mesh_shape`` holds besides activations, at least: the
    step's inputs (state and batch) and its updated state, each split as far as a layout on
    that mesh can split it (``most_shards``); ``activations`` 0. A sum over the inputs and
    outputs, without ``memory_floor``'s walk of the program: added to an all-device floor's
    activations it is a floor on the mesh at a fraction of the cost. ``host``: tensors kept
    in host memory between steps, left out (they are among the activations)."""
    batch_args = set(batch_argnums)

    def share(t: int) -> int:
        info = graph.tensors[t]
        return info.nbytes // most_shards(tuple(info.shape), mesh_shape)

    params = parameter_inputs(graph, batch_args)
    inputs = {io.tensor for io in graph.inputs} - set(host)
    batch = {io.tensor for io in graph.inputs if io.arg_index in batch_args}
    fresh_outputs = {io.tensor for io in graph.outputs} - inputs - set(host)
    return MemoryEstimate(
        parameters=sum(share(t) for t in params),
        optimizer_state=sum(share(t) for t in inputs - batch - params),
        batch=sum(share(t) for t in batch),
        updated_state=sum(share(t) for t in fresh_outputs),
        activations=0,
    )


def most_shards(shape: Sequence[int], mesh_shape: Sequence[int]) -> int:
    """The most ways a layout on a mesh of ``mesh_shape`` splits a tensor of ``shape``: each
    mesh axis on at most one dimension, every dimension divisible by the product of its
    axes (the layouts the sharding ILP's strategies take). On a 315 x 8 mesh a dimension
    of 20,480 takes only the 8-way axis, so GPT 529.6B's parameters split at most 8 ways."""
    axes = [a for a in mesh_shape if a > 1]
    best = 1
    for assignment in itertools.product(range(-1, len(shape)), repeat=len(axes)):
        per_dim = [1] * len(shape)
        for size, dim in zip(axes, assignment, strict=True):
            if dim >= 0:
                per_dim[dim] *= size
        if all(d % k == 0 for d, k in zip(shape, per_dim, strict=True)):
            best = max(best, math.prod(per_dim))
    return best
