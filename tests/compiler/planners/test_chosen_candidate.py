"""The full search's answer is one of its candidates: the plan it returns, notes and record
included, is the plan its candidates hold under the chosen name (the measured choice and the
benchmarks find the chosen candidate by its plan), and the candidates planned along the way
are not changed by being chosen (plans are frozen). Pure planning on a described cluster."""

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.planners import dispatch
from autopar.models import get_model


def test_the_chosen_plan_is_its_candidate_with_every_note():
    # jax.value_and_grad, not autopar's: no pipelined candidate, and a note of the step says so
    model = get_model("mlp", "tiny")
    step = dispatch.trace(model.train_step, model.abstract_inputs(), autopar.AutoParallel(),
                          (1,))
    planned = dispatch.plan(step, load_cluster("a100-80gb-x8").with_devices(1, 4))
    plan = planned.plan
    assert plan.notes[0].startswith("the full search compared")
    assert any(n.startswith("no pipelined candidate") for n in plan.notes)
    held = [name for name, c in planned.candidates.items() if c.plan is plan]
    (chosen,) = [r["name"] for r in plan.planning.candidates if r.get("chosen")]
    assert held == [chosen]
    # the others carry their own plans only: none has the search's notes
    for name, c in planned.candidates.items():
        if name != chosen:
            assert not any(n.startswith("the full search") for n in c.plan.notes)
