"""The hand-plan oracle's measures: what a hand plan (:mod:`autopar.bench.hand_plans`) costs.

``jax.jit`` with the hand plan's input shardings (new state laid out as the old) is what XLA's
own propagation makes of the same inputs, counted in the compiled HLO (:func:`jit_collectives`);
autopar's ILP with the same inputs pinned (:func:`plan_pinned`) must do at least as well
(``tests/compiler/intra_op/test_hand_plan_oracle.py``). The rest counts what a plan moves, in
the bytes the busiest device sends, so that the two can be compared. Apart from the layouts
because it compiles and plans: the layouts are rules on paths and shapes only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autopar.bench.hand_plans import Axes, Leaf
from autopar.plan import ShardingSpec

__all__ = [
    "collective_traffic",
    "cpu_reduce_scatter_excess",
    "feed_bytes",
    "jit_collectives",
    "plan_pinned",
    "state_in_layout",
]


# -- the oracle ------------------------------------------------------------------------------


def jit_collectives(step: Callable, args: Sequence[Any], specs: Mapping[str, ShardingSpec],
                    devices: Sequence[Any], mesh_shape: Sequence[int],
                    axis_names: Sequence[str], names: Sequence[str] = ("state", "batch")):
    """What XLA's own sharding propagation emits for ``step`` from the hand plan's inputs:
    ``jax.jit(step, in_shardings=specs, out_shardings=(state as in, rest replicated))``
    compiled on ``devices`` laid out as ``mesh_shape``; a
    :class:`~autopar.runtime.hlo.CollectiveSummary` of its HLO (as one run executes them: a
    loop's body once per iteration), and the jitted function."""
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
    assert text is not None, "XLA's CPU and GPU backends give the compiled HLO's text"
    return count_collectives(text, per_run=True), jitted


def state_in_layout(jitted: Any, args: Sequence[Any]) -> Any:
    """The state (``args[0]``) put in the layout ``jitted`` takes it in, as a training loop
    holds it between steps (the previous step's new state, laid out as the old)."""
    import jax

    return jax.device_put(args[0], jitted.lower(*args).compile().input_shardings[0][0])


def plan_pinned(traced: Any, mesh: Any, pins: Mapping[str, ShardingSpec], *,
                cluster_name: str, devices_per_host: int, time_limit_s: float = 30.0,
                caches: Any = None):
    """autopar's one-stage ShardParallel plan of ``traced`` on ``mesh`` (a LogicalMesh) with
    the inputs in ``pins`` fixed (empty: the free ILP); the Plan. ``caches``: a
    ``MeshCaches`` the plans of ``traced`` on this same mesh share (pinned or free: pins key
    their own input lists), or None for a fresh one."""
    from autopar.compiler.intra_op.sharding_ilp import IntraOpOptions
    from autopar.compiler.planners.shard import plan_shard_parallel

    options = IntraOpOptions(time_limit_s=time_limit_s, batch_argnums=(1,),
                             pinned_inputs=dict(pins))
    return plan_shard_parallel(traced, mesh, options, batch_argnums=(1,),
                               cluster_name=cluster_name, devices_per_host=devices_per_host,
                               caches=caches)


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
