"""The quickstart examples in examples/ run as the docs show them, and the raw-JAX one prints
the same loss as the serial jax.jit step on every line."""

import importlib.util
import re
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_optax_quickstart_matches_serial_and_saves_its_plan(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    load("quickstart_optax").main()
    out = capsys.readouterr().out
    pairs = re.findall(r"loss ([\d.]+) \(serial jax.jit ([\d.]+)\)", out)
    assert len(pairs) == 3
    for parallel, serial in pairs:
        assert float(parallel) == pytest.approx(float(serial), rel=1e-5)
    assert (tmp_path / "quickstart-plan.json").exists()


def test_flax_quickstart_trains_on_two_stages(capsys):
    load("quickstart_flax").main()
    out = capsys.readouterr().out
    losses = [float(x) for x in re.findall(r"loss ([\d.]+)", out)]
    assert len(losses) == 3 and losses[2] < losses[0]
    assert "plan: 2 stage(s)" in out
