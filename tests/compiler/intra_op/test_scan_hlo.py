"""ShardParallel on a scanned GPT, judged on the compiled HLO's while loops: the plan is
applied inside the loop body, so the body carries exactly the communication the per-layer
plan needs.

Seen on 4 simulated CPU devices (jax 0.10.2): with the weights dominating (planned for V100s,
where the Megatron split of the MLP is the optimum and the 8-token attention is not worth
splitting), one activation all-reduce in each loop body (the forward's after the MLP, the
backward's for the MLP's input gradient) and nothing else in the step; with the batch
dominating, one (combined) gradient all-reduce in the backward body, as a hand ``jax.jit``
plan of the same step gets from XLA, with every iteration on a quarter of the batch."""

import jax
import numpy as np
import pytest
from cluster_variants import without_waves
from hlo_loops import program_while_lines, split_by_loop

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import trace_step
from autopar.compiler.intra_op.sharding_ilp import IntraOpOptions
from autopar.compiler.planners.shard import plan_shard_parallel
from autopar.models import get_model
from autopar.runtime.shard import ShardedProgram

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

STEPS = 3


def compiled(**overrides):
    model = get_model("gpt", "tiny", scan_layers=True, **overrides)
    step = autopar.parallelize(model.train_step, method=autopar.ShardParallel(mesh_shape=(1, 4)),
                               cache=False, devices=jax.devices()[:4])
    state = model.init_state(jax.random.key(0))
    batch = model.make_batch(jax.random.key(1))
    return step.get_plan(state, batch).shardings(), step.get_hlo_text(state, batch)


def while_shapes(hlo: str) -> list[str]:
    """The carried tuple shape of every while instruction of the program's own loops."""
    return [line.split(" while(", 1)[0] for line in program_while_lines(hlo)]


def test_weights_dominating_puts_the_megatron_all_reduces_in_the_loop_body():
    # planned for one V100 node's 1x4 mesh (a plan is data), run on the local devices
    model = get_model("gpt", "tiny", scan_layers=True, hidden_size=512, num_heads=8,
                      batch_size=4, seq_len=8)
    state = model.init_state(jax.random.key(0))
    batch = model.make_batch(jax.random.key(1))
    traced = trace_step(model.train_step, (state, batch))
    # 32 tokens: every GEMM fits in one wave of the V100's multiprocessors
    cluster = without_waves(load_cluster("aws-p3.16xlarge"))
    plan = plan_shard_parallel(traced, LogicalMesh.from_cluster(cluster, (1, 4)),
                               IntraOpOptions(), batch_argnums=(1,), cluster_name=cluster.name,
                               devices_per_host=cluster.devices_per_host)
    specs = plan.shardings()
    # the MLP's first kernel column-split, its second row-split, the layer axis whole
    assert specs["state/params/blocks/mlp/fc_in/kernel"] == "P(None, None, 'y')"
    assert specs["state/params/blocks/mlp/fc_out/kernel"] == "P(None, 'y', None)"
    executable = ShardedProgram(traced.program, plan)
    flat = jax.tree_util.tree_leaves((state, batch))
    hlo = executable.hlo_text(flat)
    inside, outside = split_by_loop(hlo)
    assert len(while_shapes(hlo)) == 2
    assert outside.total_count == 0
    assert inside.count("all-reduce") == inside.total_count
    assert len({c.computation for c in inside.collectives}) == 2  # both loop bodies
    activation = ("f32", (4, 8, 512))  # [batch, seq, hidden]: one layer's activations
    assert {shape for c in inside.collectives for shape in c.result_shapes} == {activation}
    # and the serial step's numbers
    serial = jax.jit(model.train_step)
    a = b = state
    for _ in range(STEPS):
        a, want = serial(a, batch)
        out = executable(jax.tree_util.tree_leaves((b, batch)))
        b, got = jax.tree_util.tree_unflatten(traced.program.out_tree, out)
        assert float(got) == pytest.approx(float(want), rel=1e-5)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=2e-5)


def test_batch_dominating_splits_the_batch_inside_the_loop():
    specs, hlo = compiled(hidden_size=16, num_heads=2, batch_size=512, seq_len=16,
                          vocab_size=64)
    assert specs["batch/tokens"] == "P('y', None)"
    assert all(spec.count("'y'") == 0 for path, spec in specs.items()
               if path.startswith("state/params/blocks/"))
    inside, outside = split_by_loop(hlo)
    # one gradient all-reduce per iteration (the layer's 15 parameter gradients, combined)
    (grads,) = inside.collectives
    assert grads.kind == "all-reduce" and len(grads.result_shapes) == 15
    assert all(512 not in dims and 128 not in dims for _, dims in grads.result_shapes)
    assert outside.count("all-reduce") == outside.total_count  # the other gradients, the loss
    # each iteration carries a quarter of the batch's activations
    for shape in while_shapes(hlo):
        assert "f32[128,16,16]" in shape and "f32[512," not in shape
