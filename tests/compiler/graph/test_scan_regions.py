"""Scans traced as regions (``ir.program``, ``expand_scans``): the body's equations are in the
graph once, repeated ``length`` times per step; the expanded program computes what the step
computes, with or without hooks inside the body; the batch split follows the loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scan_steps import nested_and_odd_loss, odd_args

from autopar.compiler.graph.batch_split import group_collectives, propagate_batch_split
from autopar.compiler.graph.opgraph import SCAN_ENTER, SCAN_EXIT
from autopar.compiler.graph.trace import build_graph, trace_step
from autopar.ir.flatten import flatten_step
from autopar.ir.program import run_eqns
from autopar.models import get_model
from autopar.plan import CollectiveKind

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


def gpt(layers=2, scan=True, **overrides):
    return get_model("gpt", "tiny", num_layers=layers, scan_layers=scan, **overrides)


def test_scanned_gpt_is_two_regions_whose_bodies_are_in_the_graph_once():
    graph = trace_step(*(lambda m: (m.train_step, m.abstract_inputs()))(gpt())).graph
    assert "scan" not in {n.primitive for n in graph.nodes}
    forward, backward = graph.loops
    for loop in (forward, backward):
        assert loop.length == 2
        ids = [*loop.enters, *range(loop.body_start, loop.body_stop), *loop.exits]
        assert ids == list(range(min(ids), max(ids) + 1))  # consecutive: enters, body, exits
        assert {graph.nodes[i].primitive for i in loop.enters} == {SCAN_ENTER}
        assert {graph.nodes[i].primitive for i in loop.exits} == {SCAN_EXIT}
        assert all(graph.nodes[i].repeat == 2 for i in range(loop.body_start, loop.body_stop))
        assert all(graph.nodes[i].repeat == 1 for i in loop.enters)
        assert len(loop.carry_pairs()) == 1  # the residual stream
    # the forward reads the 15 stacked parameters as xs; the backward makes their gradients
    params = {io.tensor for io in graph.inputs if io.path.startswith("state/params/blocks")}
    assert len(params) == 15
    read = {graph.nodes[e].inputs[0] for e in forward.enters}
    assert params <= read
    for e in forward.enters:
        if graph.nodes[e].inputs[0] in params:
            assert graph.nodes[e].params["role"] == "xs"
            outer, body = (graph.tensors[t].shape for t in (*graph.nodes[e].inputs,
                                                               *graph.nodes[e].outputs))
            assert outer == (2, *body)
    assert sum(graph.nodes[x].params["role"] == "ys" for x in backward.exits) == 15


def test_the_graph_does_not_grow_with_the_layers_and_counts_every_layers_flops():
    def graph_of(layers, scan):
        m = gpt(layers, scan)
        return trace_step(m.train_step, m.abstract_inputs()).graph

    two, eight = graph_of(2, True), graph_of(8, True)
    assert two.num_nodes == eight.num_nodes
    unrolled = graph_of(8, False)
    assert eight.num_nodes < unrolled.num_nodes / 3
    # the same work, up to what JAX's scan differentiation does differently (< 0.2%)
    assert eight.total_flops == pytest.approx(unrolled.total_flops, rel=2e-3)


def test_nested_scans_multiply_their_lengths():
    def loss(w, x):
        def group(h, gw):
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, gw)
            return h, None
        h, _ = jax.lax.scan(group, x, w)
        return jnp.sum(h)

    w = jax.ShapeDtypeStruct((2, 3, 8, 8), jnp.float32)
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    graph = trace_step(jax.grad(loss), (w, x)).graph
    assert len(graph.loops) == 4  # two outer loops, each with an inner one
    dots = [n for n in graph.nodes if n.primitive == "dot_general"]
    assert {n.repeat for n in dots} == {6}
    forward = next(n for n in dots if n.inputs[0] != n.inputs[1])
    assert forward.flops == 6 * 2 * 4 * 8 * 8


@pytest.mark.parametrize("hooks", [False, True], ids=["bound-whole", "rebuilt-with-hooks"])
def test_the_expanded_program_computes_the_step(hooks):
    step = jax.value_and_grad(nested_and_odd_loss)
    args = odd_args()
    program = trace_step(step, args).program
    assert program.regions and not any(e.name == "scan" for e in program.eqns)
    seen = []

    def on_value(vid, value):
        seen.append(vid)
        return value

    def on_operand(eqn, k, value):
        return value

    flat = jax.tree_util.tree_leaves(args)
    got = jax.jit(lambda *a: program.evaluate(
        a, on_value=on_value if hooks else None, on_operand=on_operand if hooks else None))(*flat)
    want = jax.tree_util.tree_leaves(jax.jit(step)(*args))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    if hooks:  # the hook saw the values inside every body, nested ones included
        inside = {v for r in program.regions.values()
                  for e in range(r.body_start, r.body_stop) for v in program.eqns[e].outputs}
        assert inside <= set(seen)


def test_pipeline_programs_keep_scans_whole_and_run_eqns_runs_a_region_whole():
    step = jax.value_and_grad(nested_and_odd_loss)
    args = odd_args()
    whole = flatten_step(step, args)
    assert not whole.regions and any(e.name == "scan" for e in whole.eqns)
    expanded = flatten_step(step, args, expand_scans=True)
    flat = jax.tree_util.tree_leaves(args)
    env = dict(zip(expanded.in_ids, flat, strict=True))
    run_eqns(expanded, range(len(expanded.eqns)), env)
    want = jax.tree_util.tree_leaves(jax.jit(step)(*args))
    for vid, w in zip(expanded.out_ids, want, strict=True):
        got = env[vid] if vid in env else expanded.values[vid]
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-6, atol=1e-6)


def test_the_batch_split_goes_through_the_loop_like_through_unrolled_layers():
    def implied(scan):
        m = gpt(scan=scan)
        graph = trace_step(m.train_step, m.abstract_inputs()).graph
        batch = {io.tensor: 0 for io in graph.inputs if io.path.startswith("batch/")}
        return graph, propagate_batch_split(graph, batch, 8)

    graph, split = implied(True)
    forward = graph.loops[0]
    (enter, exit_), = forward.carry_pairs()
    assert split.split_dim[graph.nodes[enter].outputs[0]] == 0  # the activations, per device
    assert split.split_dim[graph.nodes[exit_].outputs[0]] == 0
    # the same gradient reductions as the unrolled model: per layer, every iteration
    _, unrolled = implied(False)
    assert group_collectives(split.collectives) == group_collectives(unrolled.collectives)
    assert set(group_collectives(split.collectives)) == {CollectiveKind.ALL_REDUCE}


def test_a_carry_made_split_in_the_loop_enters_split():
    def loss(x):
        acc, _ = jax.lax.scan(lambda c, _: (c + jnp.tanh(x), None), jnp.zeros_like(x), None,
                              length=3)
        return jnp.sum(acc)

    graph = build_graph(flatten_step(jax.grad(loss), (jax.ShapeDtypeStruct((8, 4),
                                                                           jnp.float32),),
                                     expand_scans=True))
    split = propagate_batch_split(graph, {graph.inputs[0].tensor: 0}, 4)
    layouts = [(split.split_dim[graph.nodes[enter].outputs[0]],
                split.split_dim[graph.nodes[exit_].inputs[0]])
               for loop in graph.loops for enter, exit_ in loop.carry_pairs()]
    # the forward's sum and the backward's gradient of x: the zeros are sliced, and the carry
    # keeps its split around the loop (the backward's cotangent of the sum stays whole)
    assert sorted(layouts, key=str) == [(0, 0), (0, 0), (None, None)]
    assert not [c for c in split.collectives if c.kind is CollectiveKind.ALL_GATHER]


def test_the_scanned_zoo_gpt_is_the_unrolled_one_stacked():
    unrolled, scanned = gpt(scan=False), gpt(scan=True)
    a, b = unrolled.init_state(jax.random.key(0)), scanned.init_state(jax.random.key(0))
    assert b["params"]["blocks"]["mlp"]["fc_in"]["kernel"].shape == (2, 64, 256)
    np.testing.assert_array_equal(b["params"]["blocks"]["mlp"]["fc_in"]["kernel"][1],
                                  a["params"]["blocks"][1]["mlp"]["fc_in"]["kernel"])
    batch = unrolled.make_batch(jax.random.key(1))
    want = jax.jit(jax.value_and_grad(unrolled.loss_fn))(a["params"], batch)
    got = jax.jit(jax.value_and_grad(scanned.loss_fn))(b["params"], batch)
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-6)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *want[1]["blocks"])
    for x, y in zip(jax.tree_util.tree_leaves(stacked),
                    jax.tree_util.tree_leaves(got[1]["blocks"]), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-7)


def test_the_command_line_names_the_scanned_variant_gpt_scan():
    from autopar.cli.sources import zoo_source
    from autopar.errors import InvalidOptionError

    source = zoo_source("gpt-scan", "tiny", None, 3)
    assert source.name == "gpt-scan tiny"
    state, _ = source.args
    assert state["params"]["blocks"]["attn"]["q"]["kernel"].shape == (3, 64, 64)
    assert len(trace_step(source.fn, source.args).graph.loops) == 2
    with pytest.raises(InvalidOptionError, match="no scanned variant of 'mlp'.*gpt-scan"):
        zoo_source("mlp-scan", "tiny", None, None)
    with pytest.raises(InvalidOptionError, match="scan_layers"):
        get_model("gpt", "tiny", scan_layers="yes")
