"""The optimizer state kept in host memory between steps (ZeRO-Offload's memory saving, with the
update still on the device).

A plan may keep the step's optimizer state (the state leaves the forward and backward do not
read: Adam's moments; ``memory_model.parameter_inputs`` decides which) in its host's memory
between steps. The step then brings each leaf to the device when the update first reads it
and sends its new value back as soon as the update writes it, so the device holds a moment
only around its parameter's update, not through the forward and backward, where the
activations peak. The price is the host link, both ways, every step: the leaves' per-device
bytes in, their new values' out, at the device's ``host_link_bytes_per_s``, not overlapped
with compute (the transfers sit between the backward and the update).

Unlike ZeRO-Offload the update runs on the device, not on the host's CPU: the device needs a
moment's bytes while its update runs, which the memory model counts (``memory_model``:
an offloaded input lives from its first reader to its last, its new value from its writing to
the transfer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from autopar.compiler.cost.memory_model import parameter_inputs
from autopar.compiler.graph.opgraph import OpGraph


@dataclass(frozen=True)
class HostState:
    """Tensor ids of the step's inputs kept in host memory between steps (``inputs``) and of
    the outputs that are their new values (``outputs``), both with their leaf paths."""

    inputs: frozenset[int]
    outputs: frozenset[int]
    input_paths: tuple[str, ...]
    output_paths: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.inputs)


def host_state(graph: OpGraph, batch_argnums: Iterable[int]) -> HostState:
    """The optimizer state of ``graph``'s step: the state leaves (not in ``batch_argnums``)
    with at least one dimension that no parameter's path names (scalars, such as Adam's
    step count, stay: moving them costs a transfer and saves nothing), and the outputs
    carrying their new values (``out/0/<path>`` for ``state/<path>``, same shape)."""
    batch = set(batch_argnums)
    params = parameter_inputs(graph, batch)
    inputs = {io.path: io.tensor for io in graph.inputs
              if io.arg_index not in batch and io.tensor not in params
              and graph.tensors[io.tensor].ndim > 0}
    below = {path.split("/", 1)[1]: path for path in inputs if "/" in path}
    outputs: dict[str, int] = {}
    for io in graph.outputs:
        head, _, rest = io.path.partition("/")
        index, _, leaf = rest.partition("/")
        source = below.get(leaf) if index == "0" else None
        if source is not None and graph.tensors[io.tensor].shape == \
                graph.tensors[inputs[source]].shape:
            outputs[io.path] = io.tensor
    return HostState(frozenset(inputs.values()), frozenset(outputs.values()),
                     tuple(sorted(inputs)), tuple(sorted(outputs)))


def host_tensors(graph: OpGraph, batch_argnums: Iterable[int], offload: bool) -> frozenset[int]:
    """The tensors of ``graph`` kept in host memory between steps: its ``host_state``'s
    inputs and outputs where the plan ``offload``s the optimizer state, else none."""
    if not offload:
        return frozenset()
    state = host_state(graph, batch_argnums)
    return state.inputs | state.outputs


def host_transfer_s(graph: OpGraph, state: HostState, shards: Mapping[int, int],
                    host_link_bytes_per_s: float) -> float:
    """Seconds per step moving ``state`` over the host link: every input's per-device bytes
    in and every output's out (``shards[t]``: how many ways tensor ``t`` is split)."""
    if not state or host_link_bytes_per_s <= 0:
        return 0.0
    moved = sum(graph.tensors[t].nbytes / max(1, shards.get(t, 1))
                for t in (*state.inputs, *state.outputs))
    return moved / host_link_bytes_per_s
