"""A scanned model is planned like the same model unrolled (issue 14), at abstract shapes.

- The runtime form: a layer scan is inlined as units; whole consecutive units run as one scan
  (``scan_units.run_forward_eqns``), a unit cut between pieces runs equation by equation, and
  either way the forward computes what the scanned model does.
- Stage costs: a piece holding whole units (a scan region in its cost graph) is priced like
  the unrolled layers, its gradients' reduction once per step, not per microbatch.
- The stage search on several hosts: where balancing the stages needs a cut inside a layer
  (the LM head is half a block here), the scanned plan's estimate is the unrolled plan's.
"""

import functools

import jax
import numpy as np
import pytest
from cluster_variants import flops_only

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.inter_op.stages import SubmeshShape
from autopar.compiler.planners.pipeshard import plan_pipeshard
from autopar.compiler.planners.stage_costs import layer_cost_cache, submesh_mesh
from autopar.ir.pieces import cut_pieces
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.ir.scan_units import run_forward_eqns, whole_unit_runs
from autopar.models import get_model

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

LAYERS = 4
# GPT's shapes at which layers are worth splitting over devices and hosts, with an LM head
# (hidden x vocab) of half a block's flops; planned at abstract shapes only
BIG = dict(hidden_size=2048, vocab_size=12288, seq_len=512, batch_size=64)


@functools.cache
def program(scanned: bool, microbatches: int = 2, **config):
    model = get_model("gpt", "tiny", num_layers=LAYERS, scan_layers=scanned,
                      **config).with_value_and_grad(autopar.value_and_grad)
    return build_pipeline_program(model.train_step, (model.abstract_state(),
                                                     model.abstract_batch()), (1,), microbatches)


def forward_values(pp, seed=0):
    """Random values for the loss forward's inputs (integer inputs: zeros)."""
    keys = jax.random.split(jax.random.key(seed), len(pp.forward.in_ids))
    out = []
    for k, v in zip(keys, pp.forward.in_ids, strict=True):
        aval = pp.forward.avals[v]
        if jax.numpy.issubdtype(aval.dtype, jax.numpy.floating):
            out.append(0.1 * jax.random.normal(k, aval.shape, aval.dtype))
        else:
            out.append(jax.numpy.zeros(aval.shape, aval.dtype))
    return out


def run(pp, cuts):
    """The forward's results, each piece (cut before ``cuts``) run as the runtime runs it,
    and the scans it bound with their lengths."""
    fwd = pp.forward

    def forward(*values):
        env = dict(zip(fwd.in_ids, values, strict=True))
        for piece in cut_pieces(fwd, cuts):
            run_forward_eqns(fwd, piece.eqns, env, pp.layer_scans)
        return [env[v] if v in env else fwd.values[v] for v in fwd.out_ids]

    values = forward_values(pp)
    lengths = [int(e.params["length"]) for e in jax.make_jaxpr(forward)(*values).jaxpr.eqns
               if e.primitive.name == "scan"]
    return [np.asarray(x) for x in jax.jit(forward)(*values)], lengths


def test_whole_units_run_as_one_scan_and_a_cut_unit_unrolled():
    pp = program(True)
    (scan,) = pp.layer_scans
    whole, lengths = run(pp, [])
    assert lengths == [LAYERS]  # one loop over every layer
    # cut inside the second unit: the first runs as a scan of one, the second's halves
    # unrolled, the last two as one scan of two
    unit = scan.units[1]
    middle = (unit.start + unit.stop) // 2
    cut, lengths = run(pp, [middle])
    assert sorted(lengths) == [1, LAYERS - 2]
    runs = whole_unit_runs(range(middle, len(pp.forward.eqns)), pp.layer_scans)
    assert [r.units for r in runs] == [tuple(range(2, LAYERS))]
    for a, b in zip(whole, cut, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_piece_of_whole_units_costs_what_the_unrolled_layers_cost():
    """The whole forward as one piece on 2 devices: the scanned piece's cost graph holds the
    layers as one scan region, the unrolled one every layer; each layer's gradient is
    reduced once per step in both (the reduction's maker lies inside the region's body,
    behind its exit and the split of the stacked gradient into the layers' slices). Flops
    only: the roofline's bytes of a scan and of its unrolled layers are compared in
    tests/compiler/graph/test_fusion.py."""
    cluster = flops_only(load_cluster("aws-p3.16xlarge"))
    mesh = submesh_mesh(cluster, SubmeshShape(1, 2), (2,))
    method = autopar.PipeshardParallel(num_microbatches=8)
    costs = {}
    for scanned in (False, True):
        pp = program(scanned, 8, **BIG)
        (piece,) = cut_pieces(pp.forward, [])
        costs[scanned] = layer_cost_cache(method).cost(pp, piece, mesh)
    unrolled, scanned = costs[False], costs[True]
    assert unrolled.sync_s > 0  # data parallel: the gradients are all-reduced
    assert scanned.sync_s == pytest.approx(unrolled.sync_s, rel=1e-6)
    assert scanned.time_s == pytest.approx(unrolled.time_s, rel=1e-3)
    assert scanned.param_bytes == pytest.approx(unrolled.param_bytes)


def test_the_stage_search_cuts_inside_a_scanned_layer_to_balance_hosts():
    """Two hosts of one GPU: four blocks and an LM head of half a block balance only with a
    cut inside a block. The scanned GPT's plan is estimated as the unrolled GPT's (the
    driver's extra work for the stacked leaves, slicing them and joining them back, is a few
    milliseconds of the step)."""
    cluster = load_cluster("aws-p3.16xlarge-8nodes").with_devices(2, 1)
    method = autopar.PipeshardParallel(num_microbatches=8, layers=8, memory_budget_bytes=1e18)
    plans = {s: plan_pipeshard(program(s, 8, **BIG), method, cluster) for s in (False, True)}
    unrolled, scanned = plans[False], plans[True]
    assert len(scanned.stages) == len(unrolled.stages) == 2
    assert scanned.est_step_time_s == pytest.approx(unrolled.est_step_time_s, rel=0.01)
    # the slowest stage is as fast: the cut between the stages lies inside a block
    slowest = {s: max(st.est_time_s for st in p.stages) for s, p in plans.items()}
    assert slowest[True] == pytest.approx(slowest[False], rel=0.01)
    pp = program(True, 8, **BIG)
    cut = scanned.pipeline.piece_positions[scanned.pipeline.stage_of_piece.index(1) - 1]
    assert any(u.start < cut < u.stop for u in pp.layer_scans[0].units)
