"""Tracer and OpGraph: node counts, flop estimates, inlining, pytree paths, networkx view."""

import jax
import jax.numpy as jnp
import networkx as nx
import pytest

from autopar.compiler.graph.opgraph import OpGraph
from autopar.compiler.graph.trace import trace_step
from autopar.errors import TraceError
from autopar.ir.program import TensorKind
from autopar.models import MODEL_NAMES, get_model

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


def sds(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def count_leaf_eqns(jaxpr) -> int:
    """Equations after inlining calls, counted independently of autopar's walker. A
    rematerialising call keeps JAX's CSE barrier: one ``optimization_barrier`` per operand
    that is not a literal. A scan is its region: an enter per operand, its body, an exit per
    result."""
    inlined = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
               "remat2", "checkpoint"}
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            body = eqn.params["jaxpr"].jaxpr
            total += len(eqn.invars) + count_leaf_eqns(body) + len(eqn.outvars)
        elif eqn.primitive.name in inlined:
            body = next(v for k, v in eqn.params.items() if k in ("jaxpr", "call_jaxpr"))
            total += count_leaf_eqns(getattr(body, "jaxpr", body))
            if eqn.params.get("prevent_cse", False):
                total += sum(not isinstance(v, jax.extend.core.Literal) for v in eqn.invars)
        else:
            total += 1
    return total


def test_matmul_flops_are_exact():
    def f(a, b):
        return a @ b

    traced = trace_step(f, (sds(32, 64), sds(64, 16)))
    (node,) = traced.graph.nodes
    assert node.primitive == "dot_general"
    assert node.flops == 2 * 32 * 64 * 16
    assert node.bytes_accessed == 4 * (32 * 64 + 64 * 16 + 32 * 16)


def test_batched_matmul_and_conv_flops():
    def bmm(a, b):
        return jnp.einsum("bij,bjk->bik", a, b)

    (node,) = trace_step(bmm, (sds(4, 8, 16), sds(4, 16, 32))).graph.nodes
    assert node.flops == 2 * 4 * 8 * 16 * 32

    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    (node,) = trace_step(conv, (sds(2, 8, 8, 3), sds(3, 3, 3, 16))).graph.nodes
    # every output element: 3x3 window over 3 input channels, one multiply-add each
    assert node.flops == 2 * (2 * 8 * 8 * 16) * (3 * 3 * 3)


def test_nested_calls_are_inlined_and_scans_expanded():
    @jax.jit
    def inner(x, w):
        return jax.nn.gelu(x @ w)

    @jax.custom_vjp
    def clipped(x):
        return jnp.clip(x, -1.0, 1.0)

    clipped.defvjp(lambda x: (clipped(x), None), lambda _, g: (g,))

    def loss(w, x):
        h = inner(x, w)
        h = jax.checkpoint(lambda v: jnp.tanh(v) * 2.0)(h)
        h = jax.nn.relu(clipped(h))
        h, _ = jax.lax.scan(lambda c, _: (c * 0.5, None), h, None, length=3)
        return jnp.sum(h)

    def step(w, x):
        return jax.grad(loss)(w, x)

    args = (sds(8, 8), sds(4, 8))
    traced = trace_step(step, args)
    prims = {n.primitive for n in traced.graph.nodes}
    assert not prims & {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "remat2", "scan"}
    closed = jax.make_jaxpr(step)(*args)
    assert traced.graph.num_nodes == count_leaf_eqns(closed.jaxpr)
    assert "optimization_barrier" in prims  # the checkpoint's recompute stays a recompute
    # two scan regions (the loop and its transpose), each body a multiply of 4x8 run 3 times:
    # the body's flops count every iteration
    assert len(traced.graph.loops) == 2
    body = [n for n in traced.graph.nodes if n.repeat == 3 and n.flops]
    assert sorted(n.flops for n in body) == [3 * 32, 3 * 32]


def test_inlined_program_computes_the_same_values():
    model = get_model("mlp", "tiny")
    state = model.init_state(jax.random.key(0))
    batch = model.make_batch(jax.random.key(1))
    traced = trace_step(model.train_step, (state, batch))
    flat = jax.jit(lambda *a: traced.program.evaluate(a))(
        *jax.tree_util.tree_leaves((state, batch))
    )
    expected = jax.tree_util.tree_leaves(model.train_step(state, batch))
    for got, want in zip(flat, expected, strict=True):
        assert jnp.allclose(got, want, atol=1e-6)


def test_pytree_paths_map_inputs_and_outputs():
    def step(state, batch):
        new = {"params": {"w": state["params"]["w"] + batch["x"].sum()}, "count": state["count"]}
        return new, batch["x"].mean()

    state = {"params": {"w": sds(3, 3)}, "count": sds(dtype=jnp.int32)}
    batch = {"x": sds(4, 3)}
    graph = trace_step(step, (state, batch)).graph
    assert [io.path for io in graph.inputs] == ["state/count", "state/params/w", "batch/x"]
    assert [io.arg_index for io in graph.inputs] == [0, 0, 1]
    assert [io.path for io in graph.outputs] == ["out/0/count", "out/0/params/w", "out/1"]
    shapes = {io.path: graph.tensors[io.tensor].shape for io in graph.inputs}
    assert shapes == {"state/count": (), "state/params/w": (3, 3), "batch/x": (4, 3)}
    # an output that is an input passed through keeps the input's tensor id
    assert graph.outputs[0].tensor == graph.inputs[0].tensor
    assert graph.tensors[graph.inputs[0].tensor].kind == TensorKind.INPUT


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_zoo_model_traces(name):
    model = get_model(name, "tiny")
    args = model.abstract_inputs()
    traced = trace_step(model.train_step, args)
    graph = traced.graph
    closed = jax.make_jaxpr(model.train_step)(*args)
    assert graph.num_nodes == count_leaf_eqns(closed.jaxpr)
    assert len(graph.inputs) == len(jax.tree_util.tree_leaves(args))
    assert len(graph.outputs) == len(jax.tree_util.tree_leaves(jax.eval_shape(
        model.train_step, *args)))
    matmul_flops = sum(n.flops for n in graph.nodes if n.primitive in (
        "dot_general", "conv_general_dilated"))
    assert matmul_flops > 0.5 * graph.total_flops
    # every node's tensors are known and every consumer edge points forward
    for node in graph.nodes:
        for t in node.inputs:
            producer = graph.producer.get(t)
            assert producer is None or producer < node.id


def test_networkx_round_trip_is_lossless():
    model = get_model("gpt", "tiny")
    graph = trace_step(model.train_step, model.abstract_inputs()).graph
    g = graph.to_networkx()
    assert isinstance(g, nx.DiGraph)
    assert nx.is_directed_acyclic_graph(g)
    assert g.number_of_nodes() == graph.num_nodes
    assert g.number_of_edges() == graph.num_edges
    back = OpGraph.from_networkx(g)
    assert back.nodes == graph.nodes
    assert back.tensors == graph.tensors
    assert back.inputs == graph.inputs and back.outputs == graph.outputs


def test_peak_live_bytes_of_a_chain():
    def chain(x):
        a = x * 2.0  # 400 B live
        b = a + 1.0  # a and b live together: 800 B
        return jnp.sum(b)

    graph = trace_step(chain, (sds(10, 10),)).graph
    assert graph.peak_live_bytes(exclude=[graph.inputs[0].tensor]) == 800


def test_untraceable_step_raises_trace_error():
    def bad(x):
        if x.sum() > 0:  # Python control flow on a traced value
            return x
        return -x

    with pytest.raises(TraceError, match="could not trace bad"):
        trace_step(bad, (sds(3),))


def test_non_array_argument_is_a_trace_error():
    with pytest.raises(TraceError, match="not an array"):
        trace_step(lambda s: s, ("a string",))


def test_a_node_fact_is_computed_once_per_node_and_name():
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    graph = trace_step(lambda x: jnp.tanh(x) * 2.0, (x,)).graph
    asked = []

    def fact(g, node):
        asked.append(node.id)
        return None if node.primitive == "tanh" else node.primitive  # None is kept too

    for _ in range(3):
        assert [graph.node_fact("kind", n, fact) for n in graph.nodes] == \
            [None if n.primitive == "tanh" else n.primitive for n in graph.nodes]
    assert asked == [n.id for n in graph.nodes]
    graph.node_fact("other", graph.nodes[0], fact)  # another name: its own table
    assert asked[-1] == graph.nodes[0].id and len(asked) == len(graph.nodes) + 1
