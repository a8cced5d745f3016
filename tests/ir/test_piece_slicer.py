"""``PieceSlicer.piece(a, b)`` is the piece ``[a, b)`` of any ``cut_pieces`` cutting at ``a``
and ``b``: the same equations, inputs and outputs, made without reading the whole forward."""

from __future__ import annotations

import random

import autopar
from autopar.ir.pieces import LayerRanges, PieceSlicer, cut_pieces
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.models import get_model


def test_sliced_pieces_are_the_cut_pieces():
    model = get_model("gpt", "tiny").with_value_and_grad(autopar.value_and_grad)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 2)
    forward = pp.forward
    n = len(forward.eqns)
    slicer = PieceSlicer(forward)
    draw = random.Random(0)
    for _ in range(100):
        cuts = sorted(draw.sample(range(1, n), draw.randint(1, 6)))
        bounds = [0, *cuts, n]
        for k, piece in enumerate(cut_pieces(forward, cuts)):
            assert slicer.piece(bounds[k], bounds[k + 1], k) == piece
    whole = slicer.piece(0, n)
    assert whole == cut_pieces(forward, [])[0]
    assert set(whole.outputs) == set(forward.out_ids) - set(forward.in_ids)


def test_runs_of_layers_joined_are_the_cut_pieces():
    """``LayerRanges.piece(start, end)`` (joined from the layers' inputs and outputs) is the
    piece ``cut_pieces`` makes for that run of layers."""
    model = get_model("gpt", "tiny").with_value_and_grad(autopar.value_and_grad)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 2)
    forward = pp.forward
    n = len(forward.eqns)
    draw = random.Random(1)
    for _ in range(10):
        cuts = sorted(draw.sample(range(1, n), draw.randint(2, 8)))
        bounds = [0, *cuts, n]
        ranges = LayerRanges(forward, cut_pieces(forward, cuts))
        for start in range(len(bounds) - 1):
            for end in range(start + 1, len(bounds)):
                a, b = bounds[start], bounds[end]
                (expected,) = [p for p in cut_pieces(forward, [c for c in (a, b) if 0 < c < n])
                               if p.eqns[0] == a]
                assert ranges.piece(start, end) == expected
