"""The quickstart examples in examples/ run as the docs show them and give the serial jax.jit
step's numbers: the loss printed on every line, and every leaf of the final state."""

import importlib.util
import re

import jax
import numpy as np
import pytest
import repo_paths

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

EXAMPLES = repo_paths.REPO / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_same_state(got, want, atol: float = 1e-5):
    """Every leaf (parameters, Adam's moments, the step count) to fp32 rounding.

    Both examples train with Adam at optax's eps 1e-8, which turns rounding in a near-zero
    gradient element into a visible part of a step: one weight in 65536 ends 0.55% of the
    learning rate (1e-3) away from the serial one. The bound is 1% of it. Adam's first moments
    (2e-3 to 4e-2 at most per leaf here) still show a gradient wrong by a constant factor,
    which its near-sign update hides in the weights. (The optax example clips the gradient's
    global norm to 1 first, which removes such a factor from every number it computes.)
    """
    leaves = jax.tree_util.tree_leaves_with_path(want)
    assert len(leaves) == len(jax.tree_util.tree_leaves(got))
    for (path, w), g in zip(leaves, jax.tree_util.tree_leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


def test_optax_quickstart_matches_serial_and_saves_its_plan(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    parallel, serial = load("quickstart_optax").main()
    out = capsys.readouterr().out
    pairs = re.findall(r"loss ([\d.]+) \(serial jax.jit ([\d.]+)\)", out)
    assert len(pairs) == 3
    for par, ser in pairs:
        assert float(par) == pytest.approx(float(ser), rel=1e-5)
    assert_same_state(parallel, serial)
    assert (tmp_path / "quickstart-plan.json").exists()


def test_flax_quickstart_trains_on_two_stages_as_the_serial_step_does(capsys):
    example = load("quickstart_flax")
    final = example.main()
    out = capsys.readouterr().out
    # the stage DP chooses the count: on simulated CPU devices, where every pipeline task costs
    # the driver hundreds of microseconds, one stage (issue 18's runtime costs), run as one
    # program
    assert re.search(r"plan: \d+ stage\(s\)", out)
    losses = [float(x) for x in re.findall(r"loss ([\d.]+)", out)]
    # the serial reference from the example's own start; main() donated its copy
    state, batch = example.setup()
    step = jax.jit(example.train_step)
    want = []
    for _ in range(3):
        state, loss = step(state, batch)
        want.append(float(loss))
    # printed with 6 decimals
    assert losses == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert losses[2] < losses[0]
    # four microbatches' gradients summed on one stage of 8 devices round differently from
    # the serial step's: seen here, one weight in 65536 ends 1.5% of the learning rate away
    assert_same_state(final, state, atol=2e-5)
