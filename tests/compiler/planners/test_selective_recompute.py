"""Selective recomputation (``remat="selective"``) against full recomputation on Korthikanti et
al.'s GPT-3 175B row ("Reducing Activation Recomputation in Large Transformer Models", 2022:
tensor 8 x pipeline 8 on 64 A100s, batch 64, microbatch 1; 18.13 s a step with every layer
recomputed, 13.75 s with sequence parallelism and selective recomputation: 1.32x), on the
described DGX A100 cluster. Planned pinned both ways, abstract shapes only: the estimated ratio
is the paper's within 10 points, both plans fit the 80 GB, ``remat="auto"`` chooses selective
recomputation where keeping everything does not fit (the first six stages; the last two, with
fewer microbatches in flight, keep everything), and the stages' layer activations are split
eight ways over the tensor axis, as sequence parallelism splits them."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.bench.published import _megatron
from autopar.compiler.planners import dispatch
from autopar.method_builders import pinned
from autopar.method_options import RematMode

PAPER_RATIO = 18.13 / 13.75


def test_korthikantis_175b_row_selective_against_full_recomputation():
    run = _megatron("175B", 96, 12288, 96, 8, 8, 1, 64, 0)
    model = run.model().with_value_and_grad(autopar.value_and_grad)
    cluster = run.described_cluster()
    full = pinned(1, 8, 8, num_microbatches=64, remat=RematMode.LAYERS)
    step = dispatch.trace(model.train_step, model.abstract_inputs(), full, (1,))
    plans = {}
    for mode in (RematMode.LAYERS, RematMode.SELECTIVE, RematMode.AUTO):
        planned = dispatch.plan(dataclasses.replace(
            step, method=dataclasses.replace(full, remat=mode)), cluster)
        plans[mode] = planned
        assert planned.plan.peak_memory_bytes <= cluster.device.memory_bytes
    selective = plans[RematMode.SELECTIVE]
    assert selective.plan.pipeline.selective_stages == (True,) * 8
    ratio = plans[RematMode.LAYERS].plan.est_step_time_s / selective.plan.est_step_time_s
    assert ratio == pytest.approx(PAPER_RATIO, abs=0.10)
    # remat="auto" chooses per stage among none, selective and full: the first stage, with
    # the most microbatches in flight (220 GiB kept whole), selective; none recomputes every
    # layer, and the plan is no slower than selective everywhere
    chosen = plans[RematMode.AUTO].plan.pipeline
    assert chosen.selective_stages[0]
    assert all(s or not r for s, r in zip(chosen.selective_stages, chosen.remat_stages,
                                          strict=True)), chosen
    assert plans[RematMode.AUTO].plan.est_step_time_s <= selective.plan.est_step_time_s
    # the plan says what each choice saved and cost
    notes = plans[RematMode.AUTO].plan.notes
    chose = [n for n in notes if n.startswith("recomputation (selective) on stage(s) 0-")]
    assert len(chose) == 1 and "GiB less per device" in chose[0], notes
    kept = [s for s, r in enumerate(chosen.remat_stages) if not r]
    if kept:
        assert any(n.startswith(f"stage(s) {kept[0]}") and "keep every activation" in n
                   for n in notes), notes
    assert any(n.startswith("recomputation (every layer) on stage(s) 0-7") and
               "more time per microbatch" in n for n in plans[RematMode.LAYERS].plan.notes)
    # the residual stream ([1, 2048, 12288]) of a middle stage: split 8 ways over the tensor
    # axis (by the ILP's choice along the hidden dimension: the memory sequence parallelism
    # saves, with the layer norms' statistics reduced instead of the activations gathered)
    forward = selective.pipeline.forward
    stream = [spec for vid, spec in selective.plan.stages[1].tensor_shardings.items()
              if vid in forward.avals and tuple(forward.avals[vid].shape) == (1, 2048, 12288)]
    split = [s for s in stream if s.num_shards({"x": 8}) == 8]
    assert len(split) >= 0.9 * len(stream), (len(split), len(stream))
