"""The optimizer state kept in host memory between steps (issue 35; ``cost.host_state``):
ShardParallel with ``offload_optimizer_state`` runs its step with Adam's moments arriving from
and returning to pinned host memory (in the compiled program's entry layout), equal to the
serial step; the memory model counts them only around the update and the estimate pays the
host link; and ``remat="auto"`` takes it where nothing with the state on the devices fits."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

import autopar
from autopar.bench.step_leaves import tree_leaves
from autopar.cluster import load_cluster
from autopar.compiler.cost.host_state import host_state, host_transfer_s
from autopar.compiler.cost.memory_model import estimate_memory
from autopar.compiler.graph.trace import trace_step
from autopar.errors import AutoparError, format_bytes
from autopar.models import get_model

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


def model_and_data(name: str, **shape):
    model = get_model(name, "tiny", **shape).with_value_and_grad(autopar.value_and_grad)
    return model, model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(1))


def test_the_host_state_is_the_optimizer_moments_and_their_new_values():
    model, state, batch = model_and_data("gpt")
    graph = trace_step(model.train_step, (state, batch)).graph
    hosted = host_state(graph, (1,))
    params = [p for p in hosted.input_paths if "/params/" in p]
    assert not params and hosted.input_paths  # the moments, never the parameters
    assert all("/mu/" in p or "/nu/" in p for p in hosted.input_paths)
    assert "state/opt_state/0/count" not in hosted.input_paths  # a scalar stays
    assert [p.replace("out/0/", "state/", 1) for p in hosted.output_paths] == \
        list(hosted.input_paths)
    # on the device the moments live only around the update: less memory at the peak
    kept = estimate_memory(graph, batch_argnums=(1,))
    moved = estimate_memory(graph, batch_argnums=(1,), host=hosted.inputs | hosted.outputs)
    moments = sum(graph.tensors[t].nbytes for t in hosted.inputs)
    assert kept.optimizer_state - moved.optimizer_state == moments
    assert moved.total < kept.total
    # the host link, both ways, every step
    assert host_transfer_s(graph, hosted, {}, 1e9) == pytest.approx(2 * moments / 1e9)
    assert host_transfer_s(graph, hosted, {}, 0.0) == 0.0
    device = load_cluster("a100-80gb-x8").device
    assert device.host_link_bytes_per_s == 32e9
    assert type(device).from_dict(device.to_dict()) == device


def test_offloaded_state_runs_from_host_memory_and_equals_serial():
    model, state, batch = model_and_data("mlp")
    step = autopar.parallelize(model.train_step, cache=False, method=autopar.ShardParallel(
        offload_optimizer_state=True))
    plain = autopar.parallelize(model.train_step, cache=False, method=autopar.ShardParallel())
    plan, kept = step.get_plan(state, batch), plain.get_plan(state, batch)
    hosted = plan.stages[0].host_paths
    assert hosted and not kept.stages[0].host_paths
    assert plan.peak_memory_bytes < kept.peak_memory_bytes
    assert plan.stages[0].memory_breakdown["optimizer_state"] < \
        kept.stages[0].memory_breakdown["optimizer_state"]
    assert any("kept in host memory between steps" in n for n in plan.notes), plan.notes
    assert autopar.Plan.from_json(plan.to_json()).stages[0].host_paths == hosted

    new_state, loss = step(state, batch)
    new_state, loss = step(new_state, batch)
    serial = jax.jit(model.train_step)
    want_state, want_loss = serial(*serial(state, batch)[:1], batch)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(want_loss), rtol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(new_state),
                         jax.tree_util.tree_leaves(want_state), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    # the moments come back in pinned host memory; the parameters on the devices
    paths = [leaf.path for leaf in tree_leaves((new_state,), names=("state",),
                                               batch_argnums=())]
    kinds = {path: leaf.sharding.memory_kind
             for path, leaf in zip(paths, jax.tree_util.tree_leaves(new_state), strict=True)}
    assert {p for p, kind in kinds.items() if kind == "pinned_host"} == \
        {p for p in hosted if p.startswith("state/")}
    assert all(kinds[p] == "device" for p in kinds if "/params/" in p)
    # XLA's program takes and gives them in the host memory space (S(5) in its layout)
    entry = next(line for line in step.get_hlo_text(state, batch).splitlines()
                 if "entry_computation_layout" in line)
    assert entry.count("S(5)") == len(hosted)


def test_remat_auto_keeps_the_state_in_host_memory_where_nothing_else_fits():
    model, state, batch = model_and_data("mlp", batch_size=8)

    def plan(budget: float):
        step = autopar.parallelize(model.train_step, cache=False, method=autopar.ShardParallel(
            remat="auto", memory_budget_bytes=budget))
        return step.get_plan(state, batch)

    fastest = plan(1e12)
    assert not fastest.stages[0].host_paths  # nothing to save where everything fits
    # the least memory any plan with the state on the devices needs
    with pytest.raises(AutoparError) as refused:
        autopar.parallelize(model.train_step, cache=False, method=autopar.ShardParallel(
            memory_budget_bytes=1.0)).get_plan(state, batch)
    least = getattr(refused.value, "min_peak_bytes", None)
    assert least is not None, refused.value
    budget = 0.97 * least
    offloaded = plan(budget)
    assert offloaded.stages[0].host_paths and offloaded.peak_memory_bytes <= budget
    (note,) = [n for n in offloaded.notes
               if "no plan fitted with the optimizer state on the devices" in n]
    needed = re.search(r"the least needed (\d+\.\d+ \w+) per device", note).group(1)
    value, unit = needed.split()
    assert float(value) * 2 ** (10 * ["B", "KiB", "MiB", "GiB"].index(unit)) > budget, note
    assert note.endswith(f"the plan needs {format_bytes(offloaded.peak_memory_bytes)}")
    assert offloaded.est_step_time_s > fastest.est_step_time_s  # the host link's price
