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
from dataclasses import dataclass, field

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


@dataclass
class _ZeroLayout:
    """What a ZeRO plan decides, filled in order by the steps of :func:`plan_zero`."""

    split_inputs: dict[int, int]
    split: BatchSplitResult
    region: set[int]
    state_ids: list[int]
    params: set[int]
    opt_state: set[int]
    sharded_kinds: set[int]
    seeds: dict[int, ShardingSpec]  # the state inputs' sharded layouts
    layouts: dict[int, ShardingSpec]  # the update region's tensors reached from them
    tensor_specs: dict[int, ShardingSpec] = field(default_factory=dict)
    operand_specs: dict[tuple[int, int], ShardingSpec] = field(default_factory=dict)
    param_gathers: list[int] = field(default_factory=list)


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
    zero = _state_layouts(graph, mesh, stage, batch_argnums)
    input_specs, output_specs = _io_specs(graph, zero, axes)
    _constrain_update(graph, zero, stage)
    collectives = summarize_collectives(_predicted(graph, zero, output_specs, axes), mesh,
                                        tuple(range(mesh.ndim)))
    split, layouts, seeds = zero.split, zero.layouts, zero.seeds
    # split work (the batch's, the sharded state's update) over the devices, the rest whole
    sharded = touched_by(graph, {t for t, d in split.split_dim.items() if d is not None}
                         | {t for t, s in layouts.items() if not s.is_replicated})
    compute_s = split_compute_time_s(graph, mesh, lambda node: n if sharded(node) else 1)
    comm_s = sum(c.time_s for c in collectives)
    shards = {t: n for t, d in split.split_dim.items() if d is not None}
    shards.update({t: s.num_shards(axis_sizes) for t, s in zero.tensor_specs.items()
                   if not s.is_replicated})
    shards.update({t: s.num_shards(axis_sizes) for t, s in seeds.items()})
    memory = estimate_memory(
        graph, batch_argnums=batch_argnums, shards=shards,
        resharded=resharded_operand_bytes(
            graph, {use: s.num_shards(axis_sizes) for use, s in zero.operand_specs.items()},
            shards),
    ).breakdown()
    name = MethodName.ZERO2 if stage == 2 else MethodName.ZERO3
    notes = [
        f"{len(zero.params)} state leaves read by the loss computation are parameters, "
        f"{len(zero.opt_state)} are optimizer state; {len(seeds)} leaves sharded over "
        f"{n} devices, {len(zero.sharded_kinds) - len(seeds)} replicated (no dimension "
        f"divisible by {n})"
    ]
    return whole_mesh_plan(
        name, mesh, graph, cluster_name=cluster_name, devices_per_host=devices_per_host,
        batch_argnums=tuple(batch_argnums), compute_s=compute_s, comm_s=comm_s, memory=memory,
        axis_names=axes, notes=notes, input_shardings=input_specs,
        output_shardings=output_specs, tensor_shardings=zero.tensor_specs,
        operand_shardings=zero.operand_specs, collectives=collectives,
    )


def _state_layouts(graph: OpGraph, mesh: LogicalMesh, stage: int,
                   batch_argnums: tuple[int, ...]) -> _ZeroLayout:
    """The batch split, as in data parallelism; the state's parameters and optimizer state;
    the sharded layouts of the state inputs (the optimizer state's, and with ZeRO-3 the
    parameters'), pushed through the update region."""
    n = mesh.num_devices
    axes = tuple(mesh.axis_names)
    batch_ids = {io.tensor for io in graph.inputs if io.arg_index in batch_argnums}
    split_inputs = batch_split_inputs(graph, tuple(batch_argnums), n,
                                      format_mesh_shape(mesh.shape))
    split = propagate_batch_split(graph, split_inputs, n)
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
    return _ZeroLayout(split_inputs, split, region, state_ids, params, opt_state,
                       sharded_kinds, seeds, layouts)


def _io_specs(graph: OpGraph, zero: _ZeroLayout, axes: tuple[str, ...]
              ) -> tuple[dict[str, ShardingSpec], dict[str, ShardingSpec]]:
    """Input and output layouts by path. A state leaf's new value keeps that leaf's layout
    (it is the next step's input): whole parameters leave whole in ZeRO-2, so they are
    gathered."""
    input_specs: dict[str, ShardingSpec] = {}
    for io in graph.inputs:
        info = graph.tensors[io.tensor]
        if io.tensor in zero.split_inputs:
            input_specs[io.path] = ShardingSpec.split(info.ndim, 0, axes)
        else:
            input_specs[io.path] = zero.seeds.get(io.tensor, ShardingSpec.replicated(info.ndim))
    carried = carried_state(graph, set(zero.state_ids))
    output_specs: dict[str, ShardingSpec] = {}
    for io in graph.outputs:
        info = graph.tensors[io.tensor]
        d = zero.split.split_dim.get(io.tensor)
        if d is not None:
            output_specs[io.path] = ShardingSpec.split(info.ndim, d, axes)
        elif io.path in carried:
            output_specs[io.path] = zero.seeds.get(carried[io.path],
                                                   ShardingSpec.replicated(info.ndim))
        else:
            output_specs[io.path] = ShardingSpec.replicated(info.ndim)
    return input_specs, output_specs


def _constrain_uses(graph: OpGraph, zero: _ZeroLayout, t: int, spec: ShardingSpec,
                    in_region: bool) -> None:
    """``spec`` on every use of ``t`` by a node inside (or outside) the batch region."""
    for c in graph.consumers.get(t, ()):
        if (c in zero.region) == in_region:
            for k, u in enumerate(graph.nodes[c].inputs):
                if u == t:
                    zero.operand_specs[(c, k)] = spec


def _constrain_update(graph: OpGraph, zero: _ZeroLayout, stage: int) -> None:
    """Every update-region tensor reached gets its layout. A summed value the batch region
    still reads (a batch-norm mean) is constrained whole where it is made and sharded only
    where the update reads it: with the sharded constraint alone, XLA propagates that layout
    back into the forward and gathers there (85 small all-gathers in Wide-ResNet's batch
    norms). ZeRO-3's sharded parameters are read whole by the forward and backward."""
    for t, spec in zero.layouts.items():
        if t in zero.seeds:
            continue  # an input: in_shardings place it
        if graph.producer.get(t) in zero.region and any(
            c in zero.region for c in graph.consumers.get(t, ())
        ):
            zero.tensor_specs[t] = ShardingSpec.replicated(spec.ndim)
            _constrain_uses(graph, zero, t, spec, in_region=False)
        else:
            zero.tensor_specs[t] = spec
    zero.param_gathers = sorted(zero.params & set(zero.seeds)) if stage == 3 else []
    for t in zero.param_gathers:
        # the forward and backward read each sharded parameter whole: XLA gathers it there
        _constrain_uses(graph, zero, t, ShardingSpec.replicated(graph.tensors[t].ndim),
                        in_region=True)


def _predicted(graph: OpGraph, zero: _ZeroLayout, output_specs: dict[str, ShardingSpec],
               axes: tuple[str, ...]) -> list[tuple[CollectiveKind, int]]:
    """The collectives the plan implies: a reduction whose result is constrained to a
    sharded layout is a reduce-scatter; each sharded tensor leaving as a whole output is
    all-gathered (as are ZeRO-3's parameters where they are read)."""
    implied: list[tuple[CollectiveKind, int]] = []
    for c in zero.split.collectives:
        node = graph.nodes[c.node]
        out = node.outputs[0]
        result_spec = zero.tensor_specs.get(out)
        if c.kind is not CollectiveKind.ALL_REDUCE or result_spec is None \
                or result_spec.is_replicated:
            implied.append((c.kind, c.nbytes))
            continue
        if node.primitive.startswith("scatter"):
            gathered = _scattered_embedding(graph, zero, node.id, c.nbytes, axes)
            if gathered is not None:
                implied += gathered
                continue
            zero.tensor_specs[out] = ShardingSpec.replicated(result_spec.ndim)
            _constrain_uses(graph, zero, out, result_spec, in_region=False)
        implied.append((CollectiveKind.REDUCE_SCATTER, c.nbytes))
    for io in graph.outputs:
        spec = zero.layouts.get(io.tensor)
        if spec is not None and output_specs[io.path].is_replicated:
            implied.append((CollectiveKind.ALL_GATHER, graph.tensors[io.tensor].nbytes))
    implied += [(CollectiveKind.ALL_GATHER, graph.tensors[t].nbytes)
                for t in zero.param_gathers]
    return implied


def _scattered_embedding(graph: OpGraph, zero: _ZeroLayout, node_id: int, nbytes: int,
                         axes: tuple[str, ...]) -> list[tuple[CollectiveKind, int]] | None:
    """An embedding gradient scattered into a sharded table: either gather the batch's ids
    and updates and scatter into this device's rows (the gathers returned, constraints set),
    or scatter the local batch into a whole table and reduce-scatter it (None: the same
    formula per byte, the cheaper way chosen). Left free, XLA (CPU, jax 0.10.2) gathered for
    GPT tiny and reduce-scattered with a 32-token table; the cheaper way is pinned with
    constraints so the prediction does not rest on XLA's heuristic."""
    node = graph.nodes[node_id]
    batch_operands = [(k, t, dim) for k, t in enumerate(node.inputs)
                      if (dim := zero.split.split_dim.get(t)) is not None]
    gathered = dict.fromkeys(t for _, t, _ in batch_operands)
    if graph.bytes_of(gathered) >= nbytes:
        return None
    for k, t, dim in batch_operands:
        # split where made, whole where the scatter reads it: with the second constraint
        # alone, XLA replicates the backward that computes the updates
        ndim = graph.tensors[t].ndim
        zero.tensor_specs[t] = ShardingSpec.split(ndim, dim, axes)
        zero.operand_specs[(node.id, k)] = ShardingSpec.replicated(ndim)
    return [(CollectiveKind.ALL_GATHER, graph.tensors[t].nbytes) for t in gathered]
