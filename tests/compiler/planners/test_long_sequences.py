"""Long sequences (issue 35): a GPT of one sequence, 2 heads and 2 layers on the 8 local
devices, under a memory budget that no plan of its own equations fits. The full search plans it
with the attention kernel, splitting the sequence over the mesh as ring attention, and the step
equals the serial one; its compiled program passes key and value blocks around the ring
(collective-permutes) and gathers no keys or values whole. And Llama 3 8B at 128K tokens on 64
described H100s: the full search plans it with context parallelism, within 80 GB."""

from __future__ import annotations

import os
import re

import jax
import numpy as np
import pytest

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.planners import dispatch
from autopar.errors import format_bytes
from autopar.models import get_model
from autopar.runtime.local_cluster import local_cluster

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


def parse_bytes(text: str) -> float:
    """``format_bytes``'s text back to bytes (to its two decimals)."""
    value, unit = text.split()
    return float(value) * 2 ** (10 * ["B", "KiB", "MiB", "GiB", "TiB"].index(unit))


def long_gpt(seq_len: int):
    return get_model("gpt", "tiny", batch_size=1, seq_len=seq_len, num_heads=2,
                     num_layers=2).with_value_and_grad(autopar.value_and_grad)


def one_device_peak(model) -> int:
    step = dispatch.trace(model.train_step, model.abstract_inputs(), autopar.DataParallel(),
                          (1,))
    return dispatch.plan(step, local_cluster(jax.devices()[:1])).plan.peak_memory_bytes


def planned_within(seq_len: int, fraction: int):
    """The model, its full search under ``1 / fraction`` of its one-device peak, the plan."""
    model = long_gpt(seq_len)
    budget = one_device_peak(model) / fraction
    step = autopar.parallelize(model.train_step, cache=False, method=autopar.AutoParallel(
        memory_budget_bytes=budget, measure_candidates=0))
    state, batch = model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(1))
    plan = step.get_plan(state, batch)
    assert plan.attention_kernel and plan.peak_memory_bytes <= budget
    assert any("ring attention" in note for note in plan.notes), plan.notes
    (note,) = [n for n in plan.notes if n.startswith("attention as one kernel")]
    least = re.search(r"need at least (\d+\.\d+ \w+)$", note).group(1)
    assert parse_bytes(least) > budget, note  # no plan of the step's own equations fits
    return model, step, state, batch, plan


def test_at_8k_tokens_under_a_24th_of_the_peak_the_full_search_plans_ring_attention():
    planned_within(8192, 24)


# Run with the step at 8K tokens too where AUTOPAR_SLOW_TESTS is set (2026-11-29: it equalled
# the serial step, no all-gather): its serial reference alone, the model's own attention over
# 8,192 x 8,192 scores, takes most of 20-30 s of the suite's 8 minutes on 2 cores; the 2,048
# case runs the same planner and kernel.
SLOW = pytest.mark.skipif(not os.environ.get("AUTOPAR_SLOW_TESTS"),
                          reason="the 8K step and its serial reference: AUTOPAR_SLOW_TESTS=1")


@pytest.mark.parametrize("seq_len, fraction", [(2048, 12), pytest.param(8192, 24, marks=SLOW)])
def test_a_long_sequence_under_a_small_budget_runs_as_ring_attention(seq_len, fraction):
    model, step, state, batch, plan = planned_within(seq_len, fraction)
    new_state, loss = step(state, batch)
    want_state, want_loss = jax.jit(model.train_step)(state, batch)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(new_state),
                         jax.tree_util.tree_leaves(want_state), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    emitted = step.get_hlo_collectives(state, batch)
    assert emitted["collective-permute"]["count"] > 0
    assert emitted["all-gather"]["count"] == 0
    if seq_len == 2048:
        # the saved plan alone tells the runtime to trace the step with the kernel again
        loaded = autopar.Plan.from_json(plan.to_json())
        assert loaded == plan
        again = autopar.parallelize(model.train_step, plan=loaded, cache=False)
        _, loss_again = again(state, batch)
        assert float(loss_again) == pytest.approx(float(want_loss), rel=1e-5)


def test_llama3_8b_at_128k_tokens_on_64_h100s_plans_with_context_parallelism():
    model = get_model("llama", "8B", batch_size=1, seq_len=131072,
                      dtype="bfloat16").with_value_and_grad(autopar.value_and_grad)
    cluster = load_cluster("h100-80gb-x8").with_hosts(8)
    step = dispatch.trace(model.train_step, model.abstract_inputs(),
                          autopar.AutoParallel(measure_candidates=0), (1,))
    plan = dispatch.plan(step, cluster).plan
    assert plan.attention_kernel and plan.peak_memory_bytes <= cluster.device.memory_bytes
    (note,) = [n for n in plan.notes if n.startswith("attention as one kernel")]
    assert "32 attention(s)" in note and "context parallel" in note, note
    # what the kernel saved: the step's own equations need more than the device holds
    mine, least = re.search(r"; (\d+\.\d+ \w+) per device, where the step's own equations "
                            r"need at least (\d+\.\d+ \w+)$", note).groups()
    assert mine == format_bytes(plan.peak_memory_bytes)
    assert parse_bytes(least) > cluster.device.memory_bytes, note
