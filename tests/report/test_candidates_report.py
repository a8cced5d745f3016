"""The report says which candidates the full search compared, with their estimates, the parts
of the chosen plan's estimate and how the stage-cost ILPs ended: text, HTML and --json."""

from __future__ import annotations

import json

import jax.numpy as jnp
import optax
import pytest
from tanh_mlp import tanh_mlp_step

import autopar
from autopar.compiler.graph.trace import trace_step
from autopar.compiler.planners import dispatch
from autopar.report.candidates import candidate_table
from autopar.report.html import render_html, section_ids
from autopar.report.text import CompileReport
from autopar.runtime.local_cluster import local_cluster


@pytest.fixture(scope="module")
def auto_report():
    opt = optax.adam(1e-3)
    step = tanh_mlp_step(opt)
    params = [jnp.ones((16, 32)), jnp.ones((32, 8))]
    args = ({"params": params, "opt": opt.init(params)},
            {"x": jnp.ones((16, 16)), "y": jnp.zeros((16, 8))})
    # every candidate planned, the pipelines too (the default skips them here by their bound)
    plan = dispatch.plan(dispatch.trace(step, args, autopar.AutoParallel(prune=False), (1,)),
                         local_cluster()).plan
    return CompileReport.build("tanh mlp", plan, trace_step(step, args).graph, None, 0.1)


def test_text_lists_every_candidate_fastest_first(auto_report):
    text = auto_report.to_text()
    plan = auto_report.plan
    assert "candidates compared" in text
    rows = candidate_table(plan)
    assert len(rows) == len(plan.planning.candidates) >= 5
    marked = [r for r in rows if r[0] == "*"]
    assert len(marked) == 1 and marked[0][4] == "1.00x"
    for _, name, *_ in rows:
        assert name in text
    assert "runtime call" in text  # the estimate's parts
    assert "stage-cost ILPs" not in text.split("candidates compared")[0]
    if not plan.is_pipelined:  # how the pipelined candidates' ILPs ended, counted
        assert "the pipelined candidates' stage-cost ILPs:" in text


def test_html_has_a_candidates_section(auto_report):
    page = render_html(auto_report)
    assert "candidates" in section_ids(auto_report)
    section = page.split('<section id="candidates">')[1].split("</section>")[0]
    for c in auto_report.plan.planning.candidates:
        assert c["name"].replace("&", "&amp;") in section
    assert "stage-cost ILPs" in page  # the pipelined candidates' solves, counted


def test_json_carries_candidates_estimate_and_ilp_statuses(auto_report):
    doc = json.loads(json.dumps(auto_report.to_dict()))
    assert doc["candidates"] == list(auto_report.plan.planning.candidates)
    assert doc["estimate"]["total_s"] == pytest.approx(auto_report.plan.est_step_time_s)
    statuses = doc["stage_cost_ilps"]
    assert statuses and sum(statuses.values()) >= 1
