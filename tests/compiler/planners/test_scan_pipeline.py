"""A model whose layers run under ``jax.lax.scan`` pipelines (issue 14): the scan is inlined
as one unit per iteration (``ir.scan_split``), the stage DP cuts between iterations,
each stage holds and updates only its slices of the stacked parameters and optimizer state,
and the step's results come back in the caller's layout.

Numerics: the scanned zoo GPT under PipeshardParallel with every schedule, on 2 or 4 stages,
and a scanned step with ``jax.checkpoint`` around its body, a reversed scan and ``ys``: loss
of every step and every updated state leaf after 3 Adam steps against the serial ``jax.jit``
step, at test_pipeline_numerics.py's tolerances."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from serial_reference import serial_run

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.planners.pipeshard import plan_pipeshard
from autopar.ir.pieces import cut_pieces
from autopar.ir.pipeline_pieces import stage_scan_iterations
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.ir.scan_units import whole_unit_runs
from autopar.ir.schedules import ScheduleName, is_async
from autopar.models import get_model

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

STEPS = 3
LAYERS = 4
# The two schedules whose tasks cut a stage further (interleaved 1F1B's chunks, zero-bubble's
# weight-gradient tasks), one at each stage count: the unrolled model runs every schedule and
# stage count (tests/runtime/test_pipeline_numerics.py), and GPipe and 1F1B run a stage's scan
# iterations as they run its other layers (a suite-time decision, issue 34; async schedules
# do not take scans yet)
CASES = [(ScheduleName.INTERLEAVED_1F1B.value, 2), (ScheduleName.ZB_H1.value, 4)]
assert not any(is_async(s) for s, _ in CASES)


def scanned_gpt(layers=LAYERS):
    return get_model("gpt", "tiny", num_layers=layers, scan_layers=True).with_value_and_grad(
        autopar.value_and_grad)


@functools.cache
def reference():
    return serial_run(scanned_gpt(), STEPS)


def test_the_scan_becomes_one_unit_per_iteration_and_the_update_one_per_slice():
    model = scanned_gpt()
    pp = build_pipeline_program(model.train_step, (model.abstract_state(),
                                                   model.abstract_batch()), (1,), 2)
    (scan,) = pp.layer_scans
    assert scan.length == LAYERS and scan.iterations == tuple(range(LAYERS))
    # the scan is inlined: its units are the body's equations, back to back, no scan left
    fwd = pp.forward
    assert not any(e.name == "scan" for e in fwd.eqns)
    starts = [u.start for u in scan.units]
    assert all(u.stop > u.start for u in scan.units)
    assert [u.stop for u in scan.units[:-1]] == starts[1:]
    body = len(scan.scan.params["jaxpr"].jaxpr.eqns)
    assert all(u.stop - u.start >= body for u in scan.units)
    # every stacked parameter is a loss input per layer: [1, ...] slices, each read once, by
    # its own unit (squeezed there)
    stacked = [f for f in pp.diff_inputs if fwd.avals[f].shape[:1] == (1,)]
    assert len(stacked) == 15 * LAYERS
    readers: dict[int, list[int]] = {}
    for e in fwd.eqns:
        for v in e.inputs:
            readers.setdefault(v, []).append(e.index)
    for u in scan.units:
        assert all(u.start <= readers[f][0] < u.stop and len(readers[f]) == 1 for f in u.xs)
        assert set(u.xs) <= set(stacked) and len(u.xs) == 15
    # run whole, the forward's units make one loop of every iteration
    (run,) = whole_unit_runs(range(len(fwd.eqns)), pp.layer_scans)
    assert run.units == tuple(range(LAYERS))
    # the step's stacked inputs (parameters, Adam's two moments) are sliced by the driver;
    # no equation after the gradients reads a whole stacked leaf except to return it
    outer = pp.outer
    assert len(pp.input_splits) == 3 * 15 * LAYERS
    after = outer.eqns[pp.vg_index + 1:]
    joined = [e for e in after if e.name == "concatenate"]
    assert len(joined) == 3 * 15
    returned = set(outer.out_ids)
    assert all(e.outputs[0] in returned for e in joined)
    whole = {v for v in outer.in_ids if outer.avals[v].shape[:1] == (LAYERS,)}
    assert not any(set(e.inputs) & whole for e in after if e.index not in pp.input_splits)


@pytest.mark.parametrize("schedule, stages", CASES, ids=[f"{s}-{p}st" for s, p in CASES])
def test_scanned_gpt_pipeline_equals_serial(schedule, stages):
    model = scanned_gpt()
    chunks = 2 if schedule == "interleaved-1f1b" else 1
    method = autopar.PipeshardParallel(
        num_microbatches=4, schedule=schedule, stages="uniform", num_stages=stages,
        layers=stages * chunks, num_chunks=max(chunks, 2))
    step = autopar.parallelize(model.train_step, method=method, cache=False)
    want_losses, want_leaves = reference()
    state = model.init_state(jax.random.key(0))
    for i in range(STEPS):
        state, loss = step(state, model.make_batch(jax.random.key(10 + i)))
        assert float(loss) == pytest.approx(want_losses[i], rel=1e-5, abs=1e-6)
    atol = 2e-3 * model.config.learning_rate
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    for path, want, got in zip(paths, want_leaves, jax.tree_util.tree_leaves(state),
                               strict=True):
        assert got.shape == want.shape, path  # stacked leaves come back whole
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol, err_msg=path)
    plan = step.get_plan(state, model.make_batch(jax.random.key(0)))
    assert plan.method == "pipeshard" and len(plan.stages) == stages
    assert plan.pipeline.schedule == schedule


def test_full_search_pipelined_candidate_equals_serial():
    """The full search with only its pipelined candidates (the stage DP and the hand splits on
    clustered layers, auto layer count): whatever it keeps runs the scan split, a one-stage
    pipeline as one scan of every iteration, and gives the serial numbers. (Its choice is
    kept as estimated: the measured choice times one-stage plans beside it and this search
    has none, so timing would only run the choice a dozen times.)"""
    model = scanned_gpt()
    step = autopar.parallelize(model.train_step, cache=False, method=autopar.AutoParallel(
        candidates=("pipeshard",), measure_candidates=0))
    want_losses, want_leaves = reference()
    state = model.init_state(jax.random.key(0))
    for i in range(STEPS):
        state, loss = step(state, model.make_batch(jax.random.key(10 + i)))
        assert float(loss) == pytest.approx(want_losses[i], rel=1e-5, abs=1e-6)
    atol = 2e-3 * model.config.learning_rate
    for want, got in zip(want_leaves, jax.tree_util.tree_leaves(state), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol)
    plan = step.get_plan(state, model.make_batch(jax.random.key(0)))
    assert plan.method == "pipeshard"
    # clustering into as many layers as iterations (one per two of the 8 devices)
    assert len(plan.pipeline.layer_positions) == LAYERS - 1


def test_stage_dp_cuts_the_scan_between_iterations():
    model = scanned_gpt(layers=8)
    pp = build_pipeline_program(model.train_step, (model.abstract_state(),
                                                   model.abstract_batch()), (1,), 8)
    cluster = load_cluster("cpu-sim").with_devices(1, 4)
    method = autopar.PipeshardParallel(num_microbatches=8, layers=8, num_stages=4)
    plan = plan_pipeshard(pp, method, cluster)
    layout = plan.pipeline
    pieces = cut_pieces(pp.forward, list(layout.piece_positions))
    counts = stage_scan_iterations(pp, pieces, layout.stage_of_piece)
    # the eight iterations are shared out: more than one stage runs part of the scan
    assert sum(counts) == 8
    assert sum(1 for c in counts if c) >= 2, counts
    assert len(plan.stages) >= 2


def checkpointed_reverse_step():
    """A reversed scan over stacked tanh layers with ``jax.checkpoint`` around its body and a
    per-layer ``ys`` read by the loss; Adam with a global-norm clip (a reduction over every
    gradient, read whole)."""
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2, eps=1e-3))

    def loss_fn(p, b):
        @jax.checkpoint
        def body(h, layer):
            h = jnp.tanh(h @ layer["w"] + layer["b"])
            return h, jnp.mean(h, axis=1)  # per example: the loss stays a batch mean

        h, means = jax.lax.scan(body, b["x"] @ p["w_in"], p["layers"], reverse=True)
        return jnp.mean((h - b["y"]) ** 2) + 0.1 * jnp.mean(means ** 2)

    def train_step(state, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt": opt_state}, loss

    k = jax.random.split(jax.random.key(1), 5)
    params = {"w_in": jax.random.normal(k[0], (8, 16)) * 0.3,
              "layers": {"w": jax.random.normal(k[1], (6, 16, 16)) * 0.25,
                         "b": jax.random.normal(k[2], (6, 16)) * 0.1}}
    batch = {"x": jax.random.normal(k[3], (16, 8)), "y": jax.random.normal(k[4], (16, 16))}
    return train_step, {"params": params, "opt": opt.init(params)}, batch


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_checkpointed_reversed_scan_with_ys_equals_jit(schedule):
    train_step, state, batch = checkpointed_reverse_step()
    want_state, want = state, []
    serial = jax.jit(train_step)
    for _ in range(STEPS):
        want_state, loss = serial(want_state, batch)
        want.append(float(loss))
    method = autopar.PipeshardParallel(num_microbatches=4, schedule=schedule,
                                       stages="uniform", num_stages=2, layers=4)
    # the global norm sums each gradient slice where it lies: every stacked value is
    # concatenated only to be returned
    pp = build_pipeline_program(train_step, (state, batch), (1,), 4)
    outer = pp.outer
    joins = [e for e in outer.eqns if e.name == "concatenate" and e.index > pp.vg_index]
    assert len(joins) == 2 * 3  # layers/w and layers/b: parameters, Adam's two moments
    assert all(e.outputs[0] in set(outer.out_ids) for e in joins)
    step = autopar.parallelize(train_step, method=method, cache=False,
                               devices=jax.devices()[:4])
    got = []
    for _ in range(STEPS):
        state, loss = step(state, batch)
        got.append(float(loss))
    np.testing.assert_allclose(got, want, rtol=2e-5)
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(want_state),
                    strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
