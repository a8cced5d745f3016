"""Which values XLA writes to memory (``cost.written_values``): the part that depends on how
the tensors are split, asked of one graph again and again with other shards (every memory
estimate of a whole model reads the graph's structure, computed once)."""

import jax
import jax.numpy as jnp

from autopar.compiler.cost.memory_model import estimate_memory
from autopar.compiler.cost.written_values import LIBRARY_MIN_ELEMENTS, materialized_temporaries
from autopar.compiler.graph.trace import build_graph
from autopar.ir.flatten import flatten_step

# 64 x 128 = 8,192 elements: whole, the sum goes to the kernel library; split 8 ways (1,024
# a device) it stays below LIBRARY_MIN_ELEMENTS and reads its operand's loop in place
X = jax.ShapeDtypeStruct((64, 128), jnp.float32)


def _step(x, y):
    doubled = x * 2.0  # read by two fused consumers: written only for the library to read
    return jnp.sum(doubled * y) + jnp.sum(doubled)


def _graph():
    return build_graph(flatten_step(_step, (X, X)))


def test_a_big_reductions_folded_operands_are_written_only_while_the_library_takes_it():
    assert 64 * 128 >= LIBRARY_MIN_ELEMENTS > 64 * 128 // 8
    graph = _graph()
    doubled = next(n for n in graph.nodes if n.primitive == "mul").outputs[0]
    split = dict.fromkeys(graph.tensors, 8)
    # whole: the library folds the product in and reads the doubled values from memory
    assert doubled in materialized_temporaries(graph)
    # split: the sum fuses the chain, nothing in it is written
    assert doubled not in materialized_temporaries(graph, split)
    # the same graph asked again, whole: the answer follows the shards, not the first ask
    assert doubled in materialized_temporaries(graph)
    assert materialized_temporaries(graph) == materialized_temporaries(_graph())


def test_a_graphs_estimates_under_other_shards_equal_a_fresh_graphs():
    graph = _graph()
    for ways in (1, 8, 2, 8, 1):
        shards = dict.fromkeys(graph.tensors, ways)
        fresh = _graph()
        assert estimate_memory(graph, batch_argnums=(1,), shards=shards) == \
            estimate_memory(fresh, batch_argnums=(1,), shards=dict.fromkeys(fresh.tensors, ways))
