"""Softmax attention is found in the traced step by its shape (``graph.attention``): once per
layer of the zoo's GPT, MoE and grouped-query Llama (causal) and of a BERT written with plain
``jnp`` (not causal), never in the backward, and nowhere in models without it."""

from __future__ import annotations

import pytest
from hand_plan_models import bert_layers

from autopar.compiler.graph.attention import find_attention
from autopar.compiler.graph.trace import trace_step
from autopar.models import get_model


def traced_zoo(name: str, **overrides):
    model = get_model(name, "tiny", **overrides)
    return model, trace_step(model.train_step, model.abstract_inputs()).graph


@pytest.mark.parametrize("name", ["gpt", "moe", "llama"])
def test_each_layer_of_a_causal_transformer_has_one_attention(name):
    model, graph = traced_zoo(name, num_layers=3)
    sites = find_attention(graph)
    assert len(sites) == 3
    seq = model.config.seq_len
    for site in sites:
        assert site.causal and (site.query_length, site.key_length) == (seq, seq)
        scores, output = graph.nodes[site.scores], graph.nodes[site.output]
        assert scores.primitive == output.primitive == "dot_general"
        assert {site.query, site.key} == set(scores.inputs) and site.value in output.inputs
        assert site.result in output.outputs
        assert site.scores in site.nodes and site.output in site.nodes
        assert {graph.nodes[n].primitive for n in site.nodes} >= {"exp", "reduce_max",
                                                                "reduce_sum", "div"}
    # the sites are the forward's: the loss (the step's second result) is made after them all
    loss = next(o.tensor for o in graph.outputs if o.path == "out/1")
    assert graph.tensors[loss].shape == ()
    assert all(max(s.nodes) < graph.producer[loss] for s in sites)


def test_attention_without_a_mask_is_found_and_not_causal():
    case = bert_layers(depth=2, seq=8)
    graph = trace_step(case.step, (case.state, case.batch)).graph
    sites = find_attention(graph)
    assert len(sites) == 2 and not any(s.causal for s in sites)
    assert all((s.query_length, s.key_length) == (8, 8) for s in sites)


@pytest.mark.parametrize("name", ["mlp", "wresnet"])
def test_models_without_attention_have_none(name):
    _, graph = traced_zoo(name)
    assert find_attention(graph) == []
