"""Hand plans: the layouts an expert writes for a model family, given as input shardings.

A hand plan gives every input leaf of a train step ``(state, batch)`` a :class:`ShardingSpec`,
by rules on the leaf's pytree path and shape, so one plan applies to every model of a family
(any depth, any width) rather than to one test's model. The plans:

=================  ==========================================================================
``data``           every batch leaf split on its first dimension over every device; the state
                   replicated (gradients all-reduced).
``megatron``       Megatron-LM's tensor parallelism over every device (Shoeybi et al. 2019):
                   column-parallel kernels (split on their output features) followed by
                   row-parallel ones (split on their input features); the batch replicated.
``data-megatron``  2-D meshes: the batch split over the first mesh axis, Megatron over the
                   last.
``zero2``          ``data`` with the optimizer state (Adam's moments) sharded over every
                   device (Rajbhandari et al. 2020).
``zero3``          ``zero2`` with the parameters sharded too.
``experts``        GShard's expert parallelism: tokens split over every device, the expert
                   kernels split on their expert dimension over the same devices.
``conv-data-head-tensor``  convolution nets: data-parallel convolutions, a tensor-parallel
                   dense head.
=================  ==========================================================================

Which kernels are column- and which row-parallel (:func:`megatron_role`):

* a transformer block's ``attn/q``, ``attn/k``, ``attn/v`` and ``mlp/fc_in`` kernels are
  column-parallel, ``attn/out`` and ``mlp/fc_out`` row-parallel (``.../blocks/<i>/...``);
* a chain of dense layers (``.../layers/<i>/kernel``) alternates: even layers column, odd
  layers row, so every row-parallel layer reads its column-parallel predecessor's split
  features and only its partial sums are all-reduced;
* expert kernels ``moe/wi: [E, M, F]`` (column: split F) and ``moe/wo: [E, F, M]`` (row);
* any other rank-2 ``kernel`` (a network's dense head) is column-parallel.

A column-parallel kernel's bias is split with its output features; a row-parallel kernel's bias
stays whole (it is added after the all-reduce). An optimizer state leaf that mirrors a
parameter (``opt_state/0/mu/<parameter path>``, same shape) takes the parameter's layout (as
Megatron's distributed optimizer keeps it) unless the plan shards the optimizer state. A split
that does not divide its dimension is left out (that dimension stays whole).

The oracle half (:func:`jit_collectives`, :func:`plan_pinned`) measures what a hand plan costs:
``jax.jit`` with the hand plan's input shardings (new state laid out as the old) is what XLA's
own propagation makes of the same inputs, counted in the compiled HLO; autopar's ILP with the
same inputs pinned must do at least as well (``tests/compiler/intra_op/test_hand_plan_oracle.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.compiler.planners.zero import state_shard_spec
from autopar.plan import ShardingSpec

__all__ = [
    "COLUMN_PARALLEL",
    "HAND_PLANS",
    "ROW_PARALLEL",
    "HandPlan",
    "Leaf",
    "graph_leaves",
    "hand_plan",
    "jit_collectives",
    "megatron_role",
    "megatron_specs",
    "plan_pinned",
    "tree_leaves",
]

# Megatron-LM's split of a transformer block: the first matmul of each pair column-parallel,
# the second row-parallel.
COLUMN_PARALLEL: tuple[str, ...] = ("attn/q", "attn/k", "attn/v", "mlp/fc_in")
ROW_PARALLEL: tuple[str, ...] = ("attn/out", "mlp/fc_out")
_BLOCK_LEAF = re.compile(r"/blocks/\d+/(\w+/\w+)/(kernel|bias)$")
_CHAIN_LEAF = re.compile(r"/layers/(\d+)/(kernel|bias)$")
_EXPERT_LEAF = re.compile(r"/moe/(wi|wo)$")
_PARAMS = "/params/"

Role = tuple[str, str]  # ("column" | "row", "kernel" | "bias")


@dataclass(frozen=True)
class Leaf:
    """One input leaf of a train step: its path (``state/params/w``), shape, and whether it is
    a batch leaf (fed anew each step) rather than state."""

    path: str
    shape: tuple[int, ...]
    is_batch: bool = False
    itemsize: int = 4  # bytes per element

    @property
    def ndim(self) -> int:
        return len(self.shape)


Axes = Mapping[str, int]  # mesh axis name -> size, in mesh order
SpecRule = Callable[[Sequence[Leaf], Axes], "dict[str, ShardingSpec] | None"]


@dataclass(frozen=True)
class HandPlan:
    """A named hand plan: ``specs(leaves, axes)`` gives every leaf's spec, or None where the
    plan does not apply to the model or mesh (no kernel it would split, a 1-D mesh for a 2-D
    plan, a batch no split divides)."""

    name: str
    summary: str
    specs: SpecRule


# -- leaf roles ------------------------------------------------------------------------------


def megatron_role(path: str, ndim: int) -> str | None:
    """``"column"`` or ``"row"``: the role of a kernel under Megatron's rules (see the module
    docstring); None for a parameter Megatron keeps whole. Biases take their kernel's role
    (:func:`parameter_roles`)."""
    found = _BLOCK_LEAF.search(path)
    if found:
        layer, kind = found.groups()
        if kind != "kernel":
            return None
        return "column" if layer in COLUMN_PARALLEL else "row" if layer in ROW_PARALLEL else None
    found = _CHAIN_LEAF.search(path)
    if found:
        index, kind = found.groups()
        if kind != "kernel":
            return None
        return "column" if int(index) % 2 == 0 else "row"
    found = _EXPERT_LEAF.search(path)
    if found:
        return ("column" if found.group(1) == "wi" else "row") if ndim == 3 else None
    if path.endswith("/kernel") and ndim == 2:
        return "column"
    return None


def parameter_roles(
    params: Mapping[str, int], kernel_role: Callable[[str, int], str | None] = megatron_role
) -> dict[str, Role]:
    """Parameter path -> (role, "kernel" | "bias") for every parameter (path -> ndim) that a
    role splits: kernels by ``kernel_role``, a ``.../bias`` by its sibling ``.../kernel``."""
    roles: dict[str, Role] = {}
    for path, ndim in params.items():
        role = kernel_role(path, ndim)
        if role is not None:
            roles[path] = (role, "kernel")
    for path in params:
        if path.endswith("/bias"):
            kernel = roles.get(path[: -len("bias")] + "kernel")
            if kernel is not None:
                roles[path] = (kernel[0], "bias")
    return roles


def megatron_dim(role: Role, ndim: int) -> int | None:
    """The dimension a role splits: a column kernel its output features (last), a row kernel
    its input features (second to last), a column bias its only dimension; None: whole."""
    side, kind = role
    if kind == "bias":
        return ndim - 1 if side == "column" and ndim else None
    if ndim < 2:
        return None
    return ndim - 1 if side == "column" else ndim - 2


def _split(shape: Sequence[int], dim: int | None, axes: Sequence[str], sizes: Axes
           ) -> ShardingSpec:
    """``dim`` split over ``axes`` when that divides it evenly (and splits anything), else
    whole; sizes unknown (``sizes`` empty): split as asked."""
    ndim = len(shape)
    if dim is None or not axes:
        return ShardingSpec.replicated(ndim)
    if sizes:
        n = 1
        for a in axes:
            n *= sizes[a]
        if n <= 1 or shape[dim] % n:
            return ShardingSpec.replicated(ndim)
    return ShardingSpec.split(ndim, dim, tuple(axes))


def param_suffix(path: str) -> str | None:
    """The part of a parameter's path after ``params/`` (None for a leaf outside params)."""
    return path.split(_PARAMS, 1)[1] if _PARAMS in path else None


def mirrored_parameters(leaves: Sequence[Leaf]) -> dict[str, Leaf]:
    """Path of every state leaf -> the parameter it mirrors: a parameter itself, or an
    optimizer state leaf of the same shape whose path ends with the parameter's path after
    ``params/`` (``state/opt_state/0/mu/blocks/0/attn/q/kernel``). The longest suffix wins."""
    params = {param_suffix(x.path): x for x in leaves if not x.is_batch and param_suffix(x.path)}
    by_length = sorted(params, key=len, reverse=True)
    found: dict[str, Leaf] = {}
    for leaf in leaves:
        if leaf.is_batch:
            continue
        if param_suffix(leaf.path) is not None:
            found[leaf.path] = leaf
            continue
        for suffix in by_length:
            p = params[suffix]
            if leaf.path.endswith("/" + suffix) and p.shape == leaf.shape:
                found[leaf.path] = p
                break
    return found


def _batch_spec(leaf: Leaf, axes: Sequence[str], sizes: Axes) -> ShardingSpec:
    """A batch leaf split on its first dimension over ``axes``, whole if that does not divide."""
    return _split(leaf.shape, 0 if leaf.ndim else None, axes, sizes)


def _is_optimizer_state(leaf: Leaf, mirrors: Mapping[str, Leaf]) -> bool:
    return not leaf.is_batch and param_suffix(leaf.path) is None and leaf.path in mirrors


# -- the plans -------------------------------------------------------------------------------


def _active(axes: Axes) -> tuple[str, ...]:
    return tuple(a for a, n in axes.items() if n > 1)


def tensor_parallel_specs(
    leaves: Sequence[Leaf], axis: Sequence[str], sizes: Axes,
    roles: Callable[[str, int], str | None] = megatron_role,
) -> dict[str, ShardingSpec]:
    """Every state leaf's Megatron spec over mesh ``axis`` (one or several axes, split as one
    group); everything Megatron keeps whole, and every batch leaf, replicated."""
    mirrors = mirrored_parameters(leaves)
    by_param = parameter_roles({p.path: p.ndim for p in mirrors.values()}, roles)
    specs = {}
    for leaf in leaves:
        param = mirrors.get(leaf.path)
        role = by_param.get(param.path) if param is not None else None
        dim = megatron_dim(role, leaf.ndim) if role is not None else None
        specs[leaf.path] = _split(leaf.shape, dim, axis, sizes)
    return specs


def megatron_specs(leaves: Iterable[tuple[str, int]], axis: str) -> dict[str, ShardingSpec]:
    """The spec of every train-state leaf ``(path, ndim)`` under Megatron's tensor parallelism
    over mesh axis ``axis`` (the bench's Megatron baseline): only state leaves are listed (the
    ILP chooses the batch's split, over the other mesh axis: data parallelism). Shapes are not
    known here, so splits are not checked for divisibility."""
    state = [Leaf(path, (0,) * ndim) for path, ndim in leaves if path.startswith("state/")]
    return tensor_parallel_specs(state, (axis,), {})


def _megatron(leaves: Sequence[Leaf], axes: Axes) -> dict[str, ShardingSpec] | None:
    active = _active(axes)
    specs = tensor_parallel_specs(leaves, active, axes)
    if not any(not s.is_replicated for s in specs.values()):
        return None
    return specs


def _data_megatron(leaves: Sequence[Leaf], axes: Axes) -> dict[str, ShardingSpec] | None:
    if len(_active(axes)) != 2:
        return None
    data, tensor = tuple(axes)
    specs = tensor_parallel_specs(leaves, (tensor,), axes)
    if not any(not s.is_replicated for s in specs.values()):
        return None
    for leaf in leaves:
        if leaf.is_batch:
            specs[leaf.path] = _batch_spec(leaf, (data,), axes)
    return specs


def _data(leaves: Sequence[Leaf], axes: Axes) -> dict[str, ShardingSpec] | None:
    active = _active(axes)
    specs = {
        x.path: _batch_spec(x, active, axes) if x.is_batch else ShardingSpec.replicated(x.ndim)
        for x in leaves
    }
    if not any(not specs[x.path].is_replicated for x in leaves if x.is_batch):
        return None
    return specs


def _zero(stage: int) -> SpecRule:
    def rule(leaves: Sequence[Leaf], axes: Axes) -> dict[str, ShardingSpec] | None:
        specs = _data(leaves, axes)
        if specs is None:
            return None
        active = _active(axes)
        n = 1
        for a in active:
            n *= axes[a]
        mirrors = mirrored_parameters(leaves)
        for leaf in leaves:
            sharded = _is_optimizer_state(leaf, mirrors) or (
                stage == 3 and param_suffix(leaf.path) is not None and not leaf.is_batch)
            if sharded:
                spec = state_shard_spec(leaf.shape, n, active)
                specs[leaf.path] = spec or ShardingSpec.replicated(leaf.ndim)
        return specs

    return rule


def _is_expert_kernel(path: str, ndim: int) -> bool:
    return ndim == 3 and _EXPERT_LEAF.search(path) is not None


def _experts(leaves: Sequence[Leaf], axes: Axes) -> dict[str, ShardingSpec] | None:
    specs = _data(leaves, axes)
    if specs is None:
        return None
    active = _active(axes)
    mirrors = mirrored_parameters(leaves)
    split = False
    for leaf in leaves:
        param = mirrors.get(leaf.path)
        if param is not None and _is_expert_kernel(param.path, param.ndim):
            specs[leaf.path] = _split(leaf.shape, 0, active, axes)
            split = split or not specs[leaf.path].is_replicated
    return specs if split else None


def _dense_role(path: str, ndim: int) -> str | None:
    """Megatron's role of the dense (rank <= 2) parameters only: a conv net's head."""
    return megatron_role(path, ndim) if ndim <= 2 else None


def _conv_data_head_tensor(leaves: Sequence[Leaf], axes: Axes) -> dict[str, ShardingSpec] | None:
    if not any(x.ndim == 4 and not x.is_batch for x in leaves):
        return None  # no convolution kernel: not a conv net
    specs = _data(leaves, axes)
    if specs is None:
        return None
    head = tensor_parallel_specs(leaves, _active(axes), axes, roles=_dense_role)
    split = False
    for leaf in leaves:
        if not leaf.is_batch and not head[leaf.path].is_replicated:
            specs[leaf.path] = head[leaf.path]
            split = True
    return specs if split else None


HAND_PLANS: tuple[HandPlan, ...] = (
    HandPlan("data", "batch split over every device, state replicated", _data),
    HandPlan("megatron", "Megatron tensor parallelism over every device, batch replicated",
             _megatron),
    HandPlan("data-megatron", "batch over the first mesh axis, Megatron over the last",
             _data_megatron),
    HandPlan("zero2", "data parallel, optimizer state sharded over every device", _zero(2)),
    HandPlan("zero3", "data parallel, optimizer state and parameters sharded", _zero(3)),
    HandPlan("experts", "tokens and expert kernels split over every device (GShard)", _experts),
    HandPlan("conv-data-head-tensor", "data-parallel convolutions, tensor-parallel dense head",
             _conv_data_head_tensor),
)


def hand_plan(name: str) -> HandPlan:
    """The hand plan called ``name`` (KeyError naming the valid ones otherwise)."""
    for plan in HAND_PLANS:
        if plan.name == name:
            return plan
    raise KeyError(f"unknown hand plan {name!r}; valid: {', '.join(p.name for p in HAND_PLANS)}")


# -- leaves of a step ------------------------------------------------------------------------


def graph_leaves(graph: Any, batch_argnums: Sequence[int] = (1,)) -> list[Leaf]:
    """The input leaves of a traced step's graph (``TracedStep.graph``)."""
    return [Leaf(io.path, tuple(graph.tensors[io.tensor].shape), io.arg_index in batch_argnums,
                 graph.tensors[io.tensor].itemsize)
            for io in graph.inputs]


def tree_leaves(args: Sequence[Any], names: Sequence[str] = ("state", "batch"),
                batch_argnums: Sequence[int] = (1,)) -> list[Leaf]:
    """The leaves of a step's arguments, with the paths the tracer gives them."""
    import jax

    from autopar.ir.flatten import leaf_path

    found = []
    for i, (name, arg) in enumerate(zip(names, args, strict=True)):
        for keypath, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            found.append(Leaf(leaf_path(name, keypath), tuple(leaf.shape), i in batch_argnums,
                              jax.numpy.dtype(leaf.dtype).itemsize))
    return found


# -- the oracle ------------------------------------------------------------------------------


def jit_collectives(step: Callable, args: Sequence[Any], specs: Mapping[str, ShardingSpec],
                    devices: Sequence[Any], mesh_shape: Sequence[int],
                    axis_names: Sequence[str], names: Sequence[str] = ("state", "batch")):
    """What XLA's own sharding propagation emits for ``step`` from the hand plan's inputs:
    ``jax.jit(step, in_shardings=specs, out_shardings=(state as in, rest replicated))``
    compiled on ``devices`` laid out as ``mesh_shape``; a
    :class:`~autopar.runtime.hlo.CollectiveSummary` of its HLO, and the jitted function."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from autopar.ir.flatten import leaf_path
    from autopar.runtime.hlo import count_collectives
    from autopar.runtime.shard import partition_spec

    mesh = Mesh(np.array(list(devices)).reshape(tuple(mesh_shape)), tuple(axis_names))

    def shardings(i: int) -> Any:
        def one(keypath, _leaf):
            spec = specs.get(leaf_path(names[i], keypath))
            return NamedSharding(mesh, partition_spec(spec) if spec else PartitionSpec())
        return jax.tree_util.tree_map_with_path(one, args[i])

    in_shardings = tuple(shardings(i) for i in range(len(args)))
    out_shape = jax.eval_shape(step, *args)
    whole = NamedSharding(mesh, PartitionSpec())
    rest = jax.tree_util.tree_map(lambda _: whole, tuple(out_shape[1:]))
    jitted = jax.jit(step, in_shardings=in_shardings, out_shardings=(in_shardings[0], *rest))
    text = jitted.lower(*args).compile().as_text()
    return count_collectives(text), jitted


def plan_pinned(traced: Any, mesh: Any, pins: Mapping[str, ShardingSpec], *,
                cluster_name: str, devices_per_host: int, time_limit_s: float = 30.0):
    """autopar's one-stage ShardParallel plan of ``traced`` on ``mesh`` (a LogicalMesh) with
    the inputs in ``pins`` fixed (empty: the free ILP); the Plan."""
    from autopar.compiler.intra_op.sharding_ilp import IntraOpOptions
    from autopar.compiler.planners.shard import plan_shard_parallel

    options = IntraOpOptions(time_limit_s=time_limit_s, batch_argnums=(1,),
                             pinned_inputs=dict(pins))
    return plan_shard_parallel(traced, mesh, options, batch_argnums=(1,),
                               cluster_name=cluster_name, devices_per_host=devices_per_host)


# -- what a plan moves -----------------------------------------------------------------------


def collective_traffic(summary: Any) -> float:
    """Bytes the busiest device sends in the collectives of ``summary`` (a
    :class:`~autopar.runtime.hlo.CollectiveSummary`), each run as the cost model prices it:
    a ring all-reduce of ``M`` bytes over ``n`` devices sends ``2 (n-1)/n M``, an all-gather or
    a reduce-scatter ``(n-1)/n M``, an all-to-all of a tensor of ``M`` bytes ``(n-1)/n**2 M``, a
    collective-permute its buffer. The HLO's ``nbytes`` (full tensors) cannot be added across
    kinds: a reduce-scatter plus an all-gather move what one all-reduce moves, while their
    ``nbytes`` add up to twice its."""
    total = 0.0
    for c in summary.collectives:
        n = c.group_size
        if n <= 1:
            continue
        if c.kind == "all-reduce":
            total += 2 * (n - 1) / n * c.nbytes
        elif c.kind in ("all-gather", "reduce-scatter"):
            total += (n - 1) / n * c.nbytes
        elif c.kind == "all-to-all":
            total += (n - 1) / n**2 * c.nbytes
        else:
            total += c.nbytes
    return total


def feed_bytes(leaves: Sequence[Leaf], specs: Mapping[str, ShardingSpec], axes: Axes) -> float:
    """Bytes of the batch one device receives each step: every batch leaf over its shards
    (what the ILP charges a batch input)."""
    total = 0.0
    for leaf in leaves:
        if not leaf.is_batch:
            continue
        spec = specs.get(leaf.path)
        shards = spec.num_shards(dict(axes)) if spec is not None else 1
        size = leaf.itemsize
        for d in leaf.shape:
            size *= d
        total += size / shards
    return total


def cpu_reduce_scatter_excess(plan: Any) -> float:
    """What the reduce-scatters a one-stage plan predicts cost more on XLA:CPU, which has no
    reduce-scatter and runs each as an all-reduce whose result is sliced: ``(n-1)/n M`` more
    than the reduce-scatter of ``M`` bytes sends, per device. Subtracted from the compiled
    CPU program's traffic, the rest is what the plan moves where reduce-scatter exists."""
    stage = plan.stages[0]
    shape = stage.logical_mesh_shape
    excess = 0.0
    for c in stage.collectives:
        if c.kind.value != "reduce-scatter":
            continue
        n = 1
        for a in c.axes:
            n *= shape[a]
        excess += (n - 1) / n * c.nbytes  # nbytes: the estimate's total over its count
    return excess
