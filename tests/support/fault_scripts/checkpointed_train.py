"""A user's training script with periodic Orbax checkpoints, run by ``autopar launch``
(tests/cli/test_launch_recovery.py).

    autopar launch --processes 2 --cpu-devices 2 -- \\
        python checkpointed_train.py CKPT OUT [--steps N] [--every K] [--die-at S --die-process P]

It trains the tiny tanh MLP of ``checkpointed_mlp`` (Adam) under DataParallel over every
process's devices for steps 1..N, each step's batch from its own seed, and saves the state to
``CKPT`` after every K-th step with Orbax's ``CheckpointManager`` (every process calls save:
Orbax writes each array's shards from the processes that hold them and syncs them at barriers;
a save returns once the checkpoint is complete on every process). When ``CKPT`` already holds a
checkpoint, it restores the latest one into its own plan's layout (``autopar.restore_target``:
the plan is made for the devices of this run, however many saved it) and goes on from there.

Process 0 appends each step's loss to ``OUT/losses.jsonl`` (with the number of processes that
ran it); at the end it writes the state to ``OUT/final.npz`` (leaves keyed by their pytree path)
and ``OUT/run.json`` (where the run started, on how many processes and devices). Every process
writes its pid to ``OUT/pids/<N>proc-<process id>.pid`` (N: the run's process count).
``--die-at S --die-process P``: process P kills itself with SIGKILL as step S begins, while its
peers are inside that step waiting for its part, as a host that is lost mid-step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

import autopar

# the run's step and data are shared with the test (tests/support), one directory up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checkpointed_mlp import abstract_state, batch, flat, initial_state, train_step  # noqa: E402

# before any JAX computation: joins the run the launcher's environment describes (generous
# timeouts for a loaded 2-core machine; a dead peer still ends the run: the launcher stops it)
autopar.runtime.distributed.initialize(initialization_timeout=60, heartbeat_timeout=60,
                                       shutdown_timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--die-process", type=int, default=1)
    args = parser.parse_args()
    me, processes = jax.process_index(), jax.process_count()
    (args.out_dir / "pids").mkdir(parents=True, exist_ok=True)
    (args.out_dir / "pids" / f"{processes}proc-{me}.pid").write_text(str(os.getpid()))

    step = autopar.parallelize(train_step(), method=autopar.DataParallel(), cache=False)
    manager = ocp.CheckpointManager(
        args.ckpt_dir.absolute(),
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
    state: object = initial_state()
    resumed_from = manager.latest_step()
    if resumed_from is not None:
        target = autopar.restore_target(step, abstract_state(), batch(resumed_from + 1))
        state = manager.restore(resumed_from, args=ocp.args.StandardRestore(target))
    first = (resumed_from or 0) + 1

    for s in range(first, args.steps + 1):
        if s == args.die_at and me == args.die_process:
            # before its part of the step: killed after dispatching it, the tiny step could
            # finish first (the gradient's all-reduce done), and process 0 logged its loss
            os.kill(os.getpid(), signal.SIGKILL)  # its peers are in the step, waiting for it
        state, loss = step(state, batch(s))
        loss = float(loss)  # on every process: the loss is on every device
        if me == 0:
            with open(args.out_dir / "losses.jsonl", "a") as fh:
                fh.write(json.dumps({"step": s, "loss": loss, "processes": processes}) + "\n")
        if s % args.every == 0:
            manager.save(s, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    manager.close()

    final = flat(autopar.runtime.distributed.to_host(state))  # every process takes part
    if me == 0:
        np.savez(args.out_dir / "final.npz", **final)
        plan = step.get_plan(state, batch(args.steps))
        (args.out_dir / "run.json").write_text(json.dumps({
            "resumed_from": resumed_from, "processes": processes,
            "devices": jax.device_count(), "method": plan.method,
            "plan_devices": sorted({d for st in plan.stages for d in st.device_ids}),
        }))


if __name__ == "__main__":
    main()
