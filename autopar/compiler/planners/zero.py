"""ZeRO-style data parallelism (ZeRO-2 and ZeRO-3): the batch split of ``DataParallel`` plus
state sharded over the data-parallel devices.

Both presets split every batch leaf on its first dimension over all mesh axes, exactly as
:mod:`autopar.compiler.planners.data` does. On top of that:

* **ZeRO-2** shards the *optimizer state* (every state leaf the loss computation does not read:
  Adam's ``mu``/``nu``, batch-norm running statistics) on one dimension over all devices. The
  gradients are constrained to the same sharding where the optimizer update reads them, so each
  device receives only its slice of the summed gradient (a reduce-scatter), updates its slice of
  the parameters, and the updated parameters are gathered back to whole (an all-gather) because
  their output layout is replicated.
* **ZeRO-3** shards the *parameters* as well, in and out: the forward and backward read each
  parameter through a replicated constraint (XLA all-gathers it at its use), and the update
  works on slices only.

Which state leaf is a parameter is read off the graph, not off pytree names: the batch split
(:func:`propagate_batch_split`) ends at *reduction points* (the gradient contractions, the loss
mean, any forced gather); the nodes those points depend on form the *batch region* (forward and
backward). A state leaf is a **parameter** when a batch-region node reads it, and
**optimizer state** otherwise. Everything outside the batch region is the *update region*; the
state shardings are pushed through its elementwise, transpose and reshape nodes, and where that
reaches a tensor the batch region produced (a summed gradient), that tensor is constrained to
the sharded layout. An embedding gradient (a scatter-add of the batch into a sharded table) is
either reduce-scattered or made by gathering the batch's ids and updates, whichever moves fewer
bytes. See docs/zero.md.
"""

from __future__ import annotations

import math
from collections import deque

from autopar.cluster import format_mesh_shape
from autopar.compiler.cost.estimate import (
    split_compute_time_s,
    summarize_collectives,
    touched_by,
)
from autopar.compiler.cost.memory_model import (
    batch_region,
    classify_state,
    estimate_memory,
    parameter_inputs,
    resharded_operand_bytes,
)
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.batch_split import (
    SHAPE_PRESERVING,
    BatchSplitResult,
    batch_split_inputs,
    propagate_batch_split,
)
from autopar.compiler.graph.opgraph import OpGraph
from autopar.compiler.graph.trace import TracedStep
from autopar.compiler.planners.common import whole_mesh_plan
from autopar.errors import InvalidOptionError
from autopar.ir.program import carried_inputs
from autopar.plan import CollectiveKind, MethodName, Plan, ShardingSpec

ZERO_STAGES = (2, 3)

RESHAPE_LIKE = frozenset(
    "reshape squeeze expand_dims broadcast_in_dim reduce_sum reduce_max reduce_min".split()
)


def state_shard_spec(shape: tuple[int, ...], n: int, axes: tuple[str, ...]) -> ShardingSpec | None:
    """The ZeRO layout of a state leaf: its first dimension divisible by ``n`` split over
    ``axes`` (all mesh axes); None (stays replicated) when no dimension divides, or ``n`` is 1."""
    if n <= 1:
        return None
    for d, size in enumerate(shape):
        if size >= n and size % n == 0:
            return ShardingSpec.split(len(shape), d, axes)
    return None


def optimizer_state_pins(graph: OpGraph, mesh: LogicalMesh,
                         batch_argnums: tuple[int, ...]) -> dict[str, ShardingSpec]:
    """The ZeRO-2 layouts of the optimizer-state leaves, by path: what
    ``ShardParallel(prefer_reduce_scatter=True)`` pins before the ILP chooses the rest."""
    params = parameter_inputs(graph, batch_argnums)
    axes = tuple(mesh.axis_names)
    pins = {}
    for io in graph.inputs:
        if io.arg_index in batch_argnums or io.tensor in params:
            continue
        spec = state_shard_spec(graph.tensors[io.tensor].shape, mesh.num_devices, axes)
        if spec is not None:
            pins[io.path] = spec
    return pins


def _reshaped(
    src: tuple[int, ...], dst: tuple[int, ...], spec: ShardingSpec
) -> ShardingSpec | None:
    """``spec`` of a ``src``-shaped tensor carried to its ``dst``-shaped reshape, when the split
    dimension survives whole (same size, same elements before it); else None."""
    split = [d for d, axes in enumerate(spec.dims) if axes]
    if len(split) != 1:
        return None
    d = split[0]
    before = math.prod(src[:d])
    for j, size in enumerate(dst):
        if size == src[d] and math.prod(dst[:j]) == before:
            return ShardingSpec.split(len(dst), j, spec.dims[d])
    return None


def _tied(
    graph: OpGraph, node_id: int, t: int, spec: ShardingSpec
) -> list[tuple[int, ShardingSpec]]:
    """Tensors of node ``node_id`` that must share ``t``'s layout (``spec``), with their specs:
    same-shape operands and results of elementwise ops; a transpose's or reshape's other side,
    permuted or carried over."""
    node = graph.nodes[node_id]
    shape = graph.tensors[t].shape
    if node.primitive in RESHAPE_LIKE and math.prod(shape) == math.prod(
        graph.tensors[node.outputs[0]].shape
    ):
        # a reshape, or a squeeze/broadcast/reduction that only drops or adds size-1 dimensions
        # (the bias gradient is reduce_sum -> reshape (1, n) -> reduce_sum over that 1)
        src, out = node.inputs[0], node.outputs[0]
        other = out if t == src else src
        carried = _reshaped(shape, graph.tensors[other].shape, spec)
        return [] if carried is None else [(other, carried)]
    if node.primitive == "transpose":
        perm = list(node.params["permutation"])
        src, out = node.inputs[0], node.outputs[0]
        if t == src:
            return [(out, ShardingSpec(tuple(spec.dims[p] for p in perm)))]
        inverse = [perm.index(d) for d in range(len(perm))]
        return [(src, ShardingSpec(tuple(spec.dims[i] for i in inverse)))]
    if node.primitive in SHAPE_PRESERVING:
        return [(u, spec) for u in (*node.inputs, *node.outputs)
                if u != t and graph.tensors[u].shape == shape]
    return []


def propagate_state_layout(
    graph: OpGraph, seeds: dict[int, ShardingSpec], region: set[int], split: BatchSplitResult
) -> dict[int, ShardingSpec]:
    """Push the sharded state layouts through the update region (first layout reached wins).

    Returns tensor id -> spec for every tensor reached, seeds included. Batch-split tensors and
    graph inputs other than the seeds are never given a layout; tensors the batch region
    produces are reached (they are the gradients) but not walked through.
    """
    inputs = {io.tensor for io in graph.inputs}
    specs = dict(seeds)
    queue = deque(seeds)
    while queue:
        t = queue.popleft()
        nodes = [c for c in graph.consumers.get(t, ()) if c not in region]
        producer = graph.producer.get(t)
        if producer is not None and producer not in region:
            nodes.append(producer)
        for node_id in nodes:
            for u, spec in _tied(graph, node_id, t, specs[t]):
                if u in specs or u in inputs or split.split_dim.get(u) is not None:
                    continue
                specs[u] = spec
                if graph.producer.get(u) not in region:
                    queue.append(u)
    return specs


def carried_state(graph: OpGraph, state_ids: set[int]) -> dict[str, int]:
    """Output path -> the state input tensor whose new value it is (the next step's input),
    paired as ``ir.program.carried_inputs`` pairs them."""
    state = [io for io in graph.inputs if io.tensor in state_ids]
    pairs = carried_inputs(
        [(io.path, io.arg_index, graph.tensors[io.tensor].shape) for io in state],
        [(io.path, graph.tensors[io.tensor].shape) for io in graph.outputs])
    return {graph.outputs[j].path: state[k].tensor for j, k in pairs.items()}


def plan_zero(
    traced: TracedStep,
    mesh: LogicalMesh,
    *,
    stage: int,
    batch_argnums: tuple[int, ...],
    cluster_name: str,
    devices_per_host: int,
) -> Plan:
    """The ZeRO-``stage`` plan (2 or 3) of a traced step on ``mesh`` (raises
    ``BatchSizeError`` when a batch leaf does not divide over the devices)."""
    if stage not in ZERO_STAGES:
        raise InvalidOptionError(f"ZeRO stage must be 2 or 3, got {stage!r}")
    graph = traced.graph
    n = mesh.num_devices
    axes = tuple(mesh.axis_names)
    axis_sizes = dict(zip(axes, mesh.shape, strict=True))

    # 1. the batch split, as in data parallelism
    batch_ids = {io.tensor for io in graph.inputs if io.arg_index in batch_argnums}
    split_inputs = batch_split_inputs(graph, tuple(batch_argnums), n,
                                      format_mesh_shape(mesh.shape))
    split = propagate_batch_split(graph, split_inputs, n)

    # 2. parameters vs optimizer state, then the sharded layouts of the state inputs
    region = batch_region(graph, split)
    state_ids = [io.tensor for io in graph.inputs if io.tensor not in batch_ids]
    params = classify_state(graph, state_ids, region)
    opt_state = set(state_ids) - params
    sharded_kinds = opt_state | (params if stage == 3 else set())
    seeds = {
        t: spec for t in sorted(sharded_kinds)
        if (spec := state_shard_spec(graph.tensors[t].shape, n, axes)) is not None
    }
    layouts = propagate_state_layout(graph, seeds, region, split)

    # 3. input and output layouts; a state leaf's new value keeps that leaf's layout (it is
    # the next step's input): whole parameters leave whole in ZeRO-2, so they are gathered
    input_specs: dict[str, ShardingSpec] = {}
    for io in graph.inputs:
        info = graph.tensors[io.tensor]
        if io.tensor in split_inputs:
            input_specs[io.path] = ShardingSpec.split(info.ndim, 0, axes)
        else:
            input_specs[io.path] = seeds.get(io.tensor, ShardingSpec.replicated(info.ndim))
    carried = carried_state(graph, set(state_ids))
    output_specs: dict[str, ShardingSpec] = {}
    for io in graph.outputs:
        info = graph.tensors[io.tensor]
        d = split.split_dim.get(io.tensor)
        if d is not None:
            output_specs[io.path] = ShardingSpec.split(info.ndim, d, axes)
        elif io.path in carried:
            output_specs[io.path] = seeds.get(carried[io.path], ShardingSpec.replicated(info.ndim))
        else:
            output_specs[io.path] = ShardingSpec.replicated(info.ndim)

    # 4. constraints: every update-region tensor reached gets its layout; a summed value the
    # batch region still reads (a batch-norm mean) is constrained whole where it is made and
    # sharded only where the update reads it: with the sharded constraint alone, XLA
    # propagates that layout back into the forward and gathers there (85 small all-gathers in
    # Wide-ResNet's batch norms)
    tensor_specs: dict[int, ShardingSpec] = {}
    operand_specs: dict[tuple[int, int], ShardingSpec] = {}

    def constrain_uses(t: int, spec: ShardingSpec, in_region: bool) -> None:
        for c in graph.consumers.get(t, ()):
            if (c in region) == in_region:
                for k, u in enumerate(graph.nodes[c].inputs):
                    if u == t:
                        operand_specs[(c, k)] = spec

    for t, spec in layouts.items():
        if t in seeds:
            continue  # an input: in_shardings place it
        if graph.producer.get(t) in region and any(
            c in region for c in graph.consumers.get(t, ())
        ):
            tensor_specs[t] = ShardingSpec.replicated(spec.ndim)
            constrain_uses(t, spec, in_region=False)
        else:
            tensor_specs[t] = spec
    param_gathers = sorted(params & set(seeds)) if stage == 3 else []
    for t in param_gathers:
        # the forward and backward read each sharded parameter whole: XLA gathers it there
        constrain_uses(t, ShardingSpec.replicated(graph.tensors[t].ndim), in_region=True)

    # 5. predicted communication: a reduction whose result is constrained to a sharded layout
    # is a reduce-scatter; each sharded tensor leaving as a whole output is all-gathered
    implied: list[tuple[CollectiveKind, int]] = []
    scattered: set[int] = set()  # the summed gradients a device keeps a slice of
    for c in split.collectives:
        node = graph.nodes[c.node]
        out = node.outputs[0]
        result_spec = tensor_specs.get(out)
        if c.kind is not CollectiveKind.ALL_REDUCE or result_spec is None \
                or result_spec.is_replicated:
            implied.append((c.kind, c.nbytes))
            continue
        if node.primitive.startswith("scatter"):
            # an embedding gradient scattered into a sharded table: either gather the batch's
            # ids and updates and scatter into this device's rows, or scatter the local batch
            # into a whole table and reduce-scatter it (the same formula per byte). Left free,
            # XLA (CPU, jax 0.10.2) gathered for GPT tiny and reduce-scattered with a 32-token
            # table; the cheaper way is pinned with constraints so the prediction does not rest
            # on XLA's heuristic
            batch_operands = [(k, t, dim) for k, t in enumerate(node.inputs)
                              if (dim := split.split_dim.get(t)) is not None]
            gathered = dict.fromkeys(t for _, t, _ in batch_operands)
            if graph.bytes_of(gathered) < c.nbytes:
                for k, t, dim in batch_operands:
                    # split where made, whole where the scatter reads it: with the second
                    # constraint alone, XLA replicates the backward that computes the updates
                    ndim = graph.tensors[t].ndim
                    tensor_specs[t] = ShardingSpec.split(ndim, dim, axes)
                    operand_specs[(node.id, k)] = ShardingSpec.replicated(ndim)
                implied += [(CollectiveKind.ALL_GATHER, graph.tensors[t].nbytes)
                            for t in gathered]
                continue
            tensor_specs[out] = ShardingSpec.replicated(result_spec.ndim)
            constrain_uses(out, result_spec, in_region=False)
        scattered.add(out)
        implied.append((CollectiveKind.REDUCE_SCATTER, c.nbytes))
    for io in graph.outputs:
        spec = layouts.get(io.tensor)
        if spec is not None and output_specs[io.path].is_replicated:
            implied.append((CollectiveKind.ALL_GATHER, graph.tensors[io.tensor].nbytes))
    implied += [(CollectiveKind.ALL_GATHER, graph.tensors[t].nbytes) for t in param_gathers]
    collectives = summarize_collectives(implied, mesh, tuple(range(mesh.ndim)))
    # split work (the batch's, the sharded state's update) over the devices, the rest whole
    sharded = touched_by(graph, {t for t, d in split.split_dim.items() if d is not None}
                         | {t for t, s in layouts.items() if not s.is_replicated})
    compute_s = split_compute_time_s(graph, mesh, lambda node: n if sharded(node) else 1)
    comm_s = sum(c.time_s for c in collectives)

    intermediate_shards = {t: n for t, d in split.split_dim.items() if d is not None}
    intermediate_shards.update({t: s.num_shards(axis_sizes) for t, s in tensor_specs.items()
                                if not s.is_replicated})
    shards = dict(intermediate_shards)
    shards.update({t: s.num_shards(axis_sizes) for t, s in seeds.items()})
    memory = estimate_memory(
        graph, batch_argnums=batch_argnums, shards=shards,
        resharded=resharded_operand_bytes(
            graph, {use: s.num_shards(axis_sizes) for use, s in operand_specs.items()}, shards),
    ).breakdown()
    name = MethodName.ZERO2 if stage == 2 else MethodName.ZERO3
    notes = [
        f"{len(params)} state leaves read by the loss computation are parameters, "
        f"{len(opt_state)} are optimizer state; {len(seeds)} leaves sharded over "
        f"{n} devices, {len(sharded_kinds) - len(seeds)} replicated (no dimension divisible "
        f"by {n})"
    ]
    return whole_mesh_plan(
        name, mesh, graph, cluster_name=cluster_name, devices_per_host=devices_per_host,
        batch_argnums=tuple(batch_argnums), compute_s=compute_s, comm_s=comm_s, memory=memory,
        axis_names=axes, notes=notes, input_shardings=input_specs,
        output_shardings=output_specs, tensor_shardings=tensor_specs,
        operand_shardings=operand_specs, collectives=collectives,
    )
