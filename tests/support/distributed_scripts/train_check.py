"""One process of a multi-process check, run by ``autopar launch`` (tests/test_distributed.py).

Every process trains the same tiny MLP for a few steps twice: the serial step (plain
``jax.jit`` on one local device) and the parallelized step over every process's devices, and
writes the losses and metrics (read with ``float()`` on every process, as a training loop's
``if jax.process_index() == 0: log(loss)`` would), the largest parameter difference and where
the plan's stages run to ``OUT/result-{process id}.json``.

    autopar launch --processes 2 --cpu-devices 4 -- python train_check.py shard|pipeshard OUT
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np
import optax

import autopar

# the step is shared with the tests (tests/support), one directory up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tanh_mlp import tanh_mlp_step  # noqa: E402

# before any JAX computation: joins the run described by the launcher's environment
# generous: on a loaded 2-core CI machine one process can lag the other by tens of seconds;
# a dead peer still ends the run quickly (the launcher stops the others)
autopar.runtime.distributed.initialize(initialization_timeout=60, heartbeat_timeout=60,
                               shutdown_timeout=120)


STEPS = 3
WIDTHS = (16, 128, 128, 16)
BATCH = 256  # big enough that the ShardParallel plan splits tensors across the processes


def make_step(metrics: bool):
    opt = optax.sgd(0.1)

    step = tanh_mlp_step(opt, metrics=metrics)

    # host data: the same on every process (fixed seeds), as multi-controller JAX expects
    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((a, b)) * a**-0.5).astype(np.float32)
              for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True)]
    batches = [{"x": rng.standard_normal((BATCH, WIDTHS[0])).astype(np.float32),
                "y": rng.standard_normal((BATCH, WIDTHS[-1])).astype(np.float32)}
               for _ in range(STEPS)]
    return step, {"params": params, "opt": opt.init(params)}, batches


def _cross_process_axes_used(plan, devices) -> set[str]:
    """Mesh axes whose device groups span processes and that some input is split over."""
    found = set()
    for st in plan.stages:
        grid = np.array([devices[d].process_index for d in st.device_ids]).reshape(
            st.logical_mesh_shape)
        for axis, name in enumerate(st.axis_names):
            spans = (np.moveaxis(grid, axis, -1) != np.moveaxis(grid, axis, -1)[..., :1]).any()
            used = any(name in dim for spec in st.input_shardings.values() for dim in spec.dims)
            if spans and used:
                found.add(name)
    return found


def _named(metrics):
    """The step's second result as a dict (the plain step returns the loss alone)."""
    return metrics if isinstance(metrics, dict) else {"loss": metrics}


def main(method_name: str, out_dir: str) -> None:
    start = time.perf_counter()
    # the pipelined step returns metrics too: an aux output of the loss function and the
    # gradients' norm, computed on other stages than the loss (the ShardParallel case keeps
    # the plain step, whose plan splits tensors across the processes)
    step, state, batches = make_step(metrics=method_name == "pipeshard")
    serial = jax.jit(step)  # uncommitted host inputs: runs on this process's first device
    ref_state, ref_metrics = state, []
    for batch in batches:
        ref_state, metrics = serial(ref_state, batch)
        ref_metrics.append({k: float(v) for k, v in _named(metrics).items()})

    if method_name == "shard":  # hosts on the first axis (device ids are host-major)
        method = autopar.ShardParallel(mesh_shape=(2, 4))
    else:  # two stages of one layer each: with one host per process, one stage per process
        method = autopar.PipeshardParallel(num_microbatches=2, num_stages=2, layers=2)
    par = autopar.parallelize(step, method=method, cache=False)
    plan = par.get_plan(state, batches[0])
    devices = autopar.runtime.distributed.global_devices()
    par_state, got_metrics = state, []
    for batch in batches:
        par_state, metrics = par(par_state, batch)
        # plain float() on every process: the step's small outputs are on every device
        got_metrics.append({k: float(v) for k, v in _named(metrics).items()})
    metric_devices = sorted({len(v.sharding.device_set) for v in _named(metrics).values()})
    got = autopar.runtime.distributed.to_host(par_state)  # the state: global arrays
    want = jax.tree.map(np.asarray, ref_state)
    diffs = [float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]
    result = {
        "process_id": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "method": plan.method,
        "stage_processes": [sorted({devices[d].process_index for d in st.device_ids})
                            for st in plan.stages],
        "cross_process_axes_used": sorted(_cross_process_axes_used(plan, devices)),
        "serial_metrics": ref_metrics,
        "metrics": got_metrics,
        "metric_devices": metric_devices,
        "max_param_rel_diff": max(diffs),
        "seconds": time.perf_counter() - start,
    }
    path = os.path.join(out_dir, f"result-{jax.process_index()}.json")
    with open(path, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
