"""Checks shared by the memory and rematerialisation tests: XLA's own figure for a step's
per-device memory, and the serial comparison of a zoo model's steps."""

import jax
import numpy as np
import pytest
from serial_reference import serial_run


def xla_bytes(step, state, batch) -> int:
    compiled = step._compiled((state, batch))
    executable = compiled.executable.program().compiled(compiled.flat_inputs((state, batch)))
    m = executable.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def assert_serial_numbers(step, model, steps):
    """Run ``steps`` steps from seed 0 and compare every loss and the final state with the
    plain single-device jit step; returns the final state."""
    ref_losses, ref_leaves = serial_run(model, steps)
    state = model.init_state(jax.random.key(0))
    for i in range(steps):
        state, loss = step(state, model.make_batch(jax.random.key(10 + i)))
        assert float(loss) == pytest.approx(ref_losses[i], rel=1e-5, abs=1e-6)
    atol = 2e-3 * model.config.learning_rate
    for want, got in zip(ref_leaves, jax.tree_util.tree_leaves(state), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol)
    return state
