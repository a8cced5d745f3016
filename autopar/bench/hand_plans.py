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
``megatron-sp``    Megatron's sequence parallelism (Korthikanti et al. 2022): ``megatron`` with
                   every batch leaf split on its sequence dimension (the second) over the same
                   devices, so the layer norms and element-wise ops outside the tensor-parallel
                   matmuls run on a slice of the sequence; transformer blocks only.
``data-megatron-sp``  2-D meshes: ``data-megatron`` with the batch's sequence split over the
                   last axis too.
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

What a hand plan costs, against XLA's own propagation and autopar's pinned ILP, is measured by
:mod:`autopar.bench.hand_oracle`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from autopar.bench.step_leaves import Leaf, graph_leaves, tree_leaves
from autopar.compiler.planners.zero import state_shard_spec
from autopar.plan import MethodName, ShardingSpec

__all__ = [
    "COLUMN_PARALLEL",
    "HAND_PLANS",
    "ROW_PARALLEL",
    "HandPlan",
    "Leaf",
    "graph_leaves",
    "hand_plan",
    "megatron_role",
    "megatron_specs",
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
    params = {s: x for x in leaves if not x.is_batch and (s := param_suffix(x.path))}
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


def _sequence_parallel(rule: SpecRule) -> SpecRule:
    """``rule`` (a Megatron plan) with every batch leaf's sequence dimension (its second) split
    over the tensor axis (the last active one), minor to the batch's split; None where the
    model has no transformer block or no batch leaf with a sequence the axis divides."""

    def rule_sp(leaves: Sequence[Leaf], axes: Axes) -> dict[str, ShardingSpec] | None:
        specs = rule(leaves, axes)
        if specs is None or not any(_BLOCK_LEAF.search(x.path) for x in leaves):
            return None
        tensor = _active(axes)[-1]
        split = False
        for leaf in leaves:
            if leaf.is_batch and leaf.ndim >= 2 and leaf.shape[1] % axes[tensor] == 0:
                dims = list(specs[leaf.path].dims)
                dims[1] = (*dims[1], tensor)
                specs[leaf.path] = ShardingSpec(tuple(dims))
                split = True
        return specs if split else None

    return rule_sp


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
    HandPlan(MethodName.DATA, "batch split over every device, state replicated", _data),
    HandPlan("megatron", "Megatron tensor parallelism over every device, batch replicated",
             _megatron),
    HandPlan("data-megatron", "batch over the first mesh axis, Megatron over the last",
             _data_megatron),
    HandPlan("megatron-sp", "Megatron over every device, the batch's sequence split over them "
             "(sequence parallelism)", _sequence_parallel(_megatron)),
    HandPlan("data-megatron-sp", "batch over the first mesh axis, Megatron and the sequence "
             "over the last", _sequence_parallel(_data_megatron)),
    HandPlan(MethodName.ZERO2, "data parallel, optimizer state sharded over every device",
             _zero(2)),
    HandPlan(MethodName.ZERO3, "data parallel, optimizer state and parameters sharded", _zero(3)),
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
