"""``autopar.pinned``: a hand configuration (data x tensor x pipeline, microbatches, schedule,
recomputation) planned as given, on a described cluster and run on the local devices; and
the CLI's ``--degrees``."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import numpy as np
import pytest
from serial_reference import serial_run

import autopar
from autopar.cli.main import main as cli_main
from autopar.cluster import load_cluster
from autopar.compiler.planners import dispatch
from autopar.models import get_model

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


def plan_on(model, method, cluster):
    marked = model.with_value_and_grad(autopar.value_and_grad)
    step = dispatch.trace(marked.train_step, marked.abstract_inputs(), method, (1,))
    return dispatch.plan(step, cluster).plan


@pytest.fixture(scope="module")
def two_dgx():
    return dataclasses.replace(load_cluster("a100-80gb-x8"), num_hosts=2)


def small_gpt():
    return get_model("gpt", "tiny", num_layers=4, batch_size=32)


def test_pinned_chooses_the_method_the_degrees_describe():
    assert autopar.pinned(8) == autopar.DataParallel(mesh_shape=(8,), remat="layers")
    shard = autopar.pinned(4, 2, remat="none")
    assert isinstance(shard, autopar.ShardParallel) and shard.mesh_shape == (4, 2)
    pipe = autopar.pinned(2, 2, 2, num_microbatches=4, schedule="interleaved-1f1b",
                          num_chunks=2)
    assert isinstance(pipe, autopar.PipeshardParallel)
    assert (pipe.stages, pipe.num_stages, pipe.layers, pipe.stage_mesh_shape, pipe.replicas) \
        == ("uniform", 2, 4, (2, 2), "none")
    accumulate = autopar.pinned(1, 8, 1, num_microbatches=4)  # one stage, four microbatches
    assert isinstance(accumulate, autopar.PipeshardParallel)
    assert accumulate.num_stages == 1 and accumulate.stage_mesh_shape == (8,)
    for bad in ((0, 1, 1), (2, "2", 1), (2, 2, True)):
        with pytest.raises(autopar.InvalidOptionError, match="pinned degrees"):
            autopar.pinned(*bad)
    with pytest.raises(autopar.InvalidOptionError, match="stage_mesh_shape"):
        autopar.PipeshardParallel(stage_mesh_shape=(2, 0))


def test_a_pinned_configuration_is_planned_as_given(two_dgx):
    model = small_gpt()
    shard = plan_on(model, autopar.pinned(8, 2, remat="none"), two_dgx)
    assert shard.method == "shard" and shard.stages[0].logical_mesh_shape == (8, 2)
    pipe = plan_on(model, autopar.pinned(4, 2, 2, num_microbatches=4,
                                         schedule="interleaved-1f1b"), two_dgx)
    assert pipe.method == "pipeshard" and len(pipe.stages) == 2
    assert pipe.pipeline.schedule == "interleaved-1f1b" and pipe.num_microbatches == 4
    for stage in pipe.stages:
        assert stage.logical_mesh_shape == (4, 2) and len(stage.device_ids) == 8
    # the degrees must fill the cluster
    with pytest.raises(autopar.MeshError, match="need 8 devices but the cluster has 16"):
        plan_on(model, autopar.pinned(2, 2, 2, num_microbatches=2), two_dgx)


def test_a_pinned_pipeline_runs_with_the_serial_numbers():
    model = get_model("mlp", "tiny", num_layers=4).with_value_and_grad(autopar.value_and_grad)
    method = autopar.pinned(2, 2, 2, num_microbatches=2, remat="none")
    step = autopar.parallelize(model.train_step, method=method)
    ref_losses, ref_leaves = serial_run(model, 2)
    state = model.init_state(jax.random.key(0))
    for i in range(2):
        state, loss = step(state, model.make_batch(jax.random.key(10 + i)))
        assert float(loss) == pytest.approx(ref_losses[i], rel=1e-5, abs=1e-6)
    atol = 2e-3 * model.config.learning_rate
    for want, got in zip(ref_leaves, jax.tree_util.tree_leaves(state), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol)
    plan = step.get_plan(state, model.make_batch(jax.random.key(0)))
    assert [s.logical_mesh_shape for s in plan.stages] == [(2, 2), (2, 2)]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True,
                          text=True, timeout=300)


def test_cli_degrees(capsys):
    done = cli("compile", "--model", "gpt", "--size", "tiny", "--cluster", "a100-80gb-x8",
               "--hosts", "2", "--degrees", "4x2x2", "--microbatches", "4", "--remat", "none")
    assert done.returncode == 0, done.stderr
    assert "2 stage(s) on 16 devices" in done.stdout and " 4x2 " in done.stdout
    # the refusals, from the CLI's entry point in this process (the console script is the
    # run above; a process each only repeated importing JAX)
    for bad, message in ((["--degrees", "4xx2"], "--degrees '4xx2': expected data x tensor"),
                         (["--degrees", "2x2x2", "--method", "shard"], "leave --method out"),
                         (["--degrees", "2x2x2", "--mesh", "2x4"], "--mesh: not an option")):
        code = cli_main(["compile", "--model", "mlp", "--size", "tiny", *bad])
        out, err = capsys.readouterr()
        assert code == 2 and "Traceback" not in out + err
        assert message in err and len(err.strip().splitlines()) == 1, err
