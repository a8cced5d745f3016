"""A run that survives a lost host: ``autopar launch`` runs a training script with periodic
Orbax checkpoints (``fault_scripts/checkpointed_train.py``: DataParallel, 6 steps, a checkpoint
every 2) as 2 processes x 2 simulated CPU devices on loopback; process 1 is killed with SIGKILL
in step 5. The launcher names it and ends process 0, which waits inside the step; relaunched
with ``--processes 1`` the same script plans for the 2 devices left, restores the last
checkpoint (step 4) and finishes. Its final state is bitwise that of an uninterrupted run from
that checkpoint on the same 2-device plan (here, in the test process), and every loss, before
and after the loss of the host, and the final state are the serial ``jax.jit`` run's within
fp32's tolerance (the 4-device plan sums the gradient in another order).

Subprocess timeouts are hang guards only; nothing is asserted about how long anything took."""

from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import repo_paths
from checkpointed_mlp import abstract_state, batch, flat, initial_state, train_step
from guarded_runs import run_guarded

import autopar

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

REPO = repo_paths.REPO
SCRIPT = repo_paths.FAULT_SCRIPTS / "checkpointed_train.py"
LAUNCH = "import sys; from autopar.cli.main import main; sys.exit(main(sys.argv[1:]))"
HANG_GUARD_S = 300  # per launched run; a passing one takes seconds (a minute when loaded)
STEPS, EVERY, DIE_AT = 6, 2, 5


def _launch(processes: int, *script_args: str) -> tuple[int, str]:
    """``autopar launch --processes N --cpu-devices 2`` of the script, in its own session;
    returns (exit status, stdout + stderr). One multi-process run at a time across the
    suite's workers (the lock test_distributed.py takes too)."""
    argv = [sys.executable, "-c", LAUNCH, "launch", "--processes", str(processes),
            "--cpu-devices", "2", "--timeout", "240", "--",
            sys.executable, str(SCRIPT), *script_args, "--steps", str(STEPS),
            "--every", str(EVERY)]
    with open(Path(tempfile.gettempdir()) / "autopar-test-launch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        code, out, _ = run_guarded(argv, HANG_GUARD_S, merge_stderr=True)
    return code, out


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has ended
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _losses(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]


def _saved_steps(ckpt: Path) -> list[int]:
    with ocp.CheckpointManager(ckpt) as manager:
        return list(manager.all_steps())


def _from_checkpoint(ckpt: Path, saved: int) -> tuple[list[float], dict]:
    """The uninterrupted run from checkpoint ``saved`` on the relaunch's plan (DataParallel on
    2 devices), in this process: (the losses of steps saved+1 .. STEPS, the final state)."""
    step = autopar.parallelize(train_step(), method=autopar.DataParallel(),
                               devices=jax.devices()[:2], cache=False)
    target = autopar.restore_target(step, abstract_state(), batch(saved + 1))
    with ocp.CheckpointManager(ckpt) as manager:
        state = manager.restore(saved, args=ocp.args.StandardRestore(target))
    losses = []
    for s in range(saved + 1, STEPS + 1):
        state, loss = step(state, batch(s))
        losses.append(float(loss))
    return losses, flat(jax.tree.map(np.asarray, state))


def _serial() -> tuple[list[float], dict]:
    """``jax.jit`` on one device from the start: (every step's loss, the final state)."""
    step, state, losses = jax.jit(train_step()), initial_state(), []
    for s in range(1, STEPS + 1):
        state, loss = step(state, batch(s))
        losses.append(float(loss))
    return losses, flat(jax.tree.map(np.asarray, state))


def test_a_run_that_loses_a_process_resumes_from_its_checkpoint_on_the_one_left(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"

    # 2 processes; process 1 dies in step 5, after the checkpoints of steps 2 and 4
    rc, log = _launch(2, str(ckpt), str(out), "--die-at", str(DIE_AT), "--die-process", "1")
    assert rc == 1, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("autopar: error: ")]
    assert errors == ["autopar: error: process 1 of 2 was killed by SIGKILL; stopped the other "
                      "processes"], log[-3000:]
    pids = {p.stem: int(p.read_text()) for p in (out / "pids").glob("*.pid")}
    assert sorted(pids) == ["2proc-0", "2proc-1"]
    assert [name for name, pid in pids.items() if _running(pid)] == []
    assert _saved_steps(ckpt) == [2, 4]
    assert [(r["step"], r["processes"]) for r in _losses(out)] == [(s, 2) for s in range(1, 5)]
    assert not (out / "final.npz").exists()

    # relaunched on the process left: re-planned for its 2 devices, resumed from step 4
    rc, log = _launch(1, str(ckpt), str(out))
    assert rc == 0, log[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert run == {"resumed_from": 4, "processes": 1, "devices": 2, "method": "data",
                   "plan_devices": [0, 1]}
    assert _saved_steps(ckpt) == [2, 4, 6]
    records = _losses(out)
    assert [(r["step"], r["processes"]) for r in records] == [(1, 2), (2, 2), (3, 2), (4, 2),
                                                             (5, 1), (6, 1)]
    with np.load(out / "final.npz") as saved:
        final = {name: saved[name] for name in saved.files}

    # the uninterrupted run from the same checkpoint, on the same plan: bit for bit
    want_losses, want_final = _from_checkpoint(ckpt, 4)
    assert [r["loss"] for r in records[4:]] == want_losses
    assert final.keys() == want_final.keys()
    for name, value in want_final.items():
        np.testing.assert_array_equal(final[name], value, err_msg=name)

    # and the serial run from the start, within fp32's tolerance
    serial_losses, serial_final = _serial()
    assert [r["loss"] for r in records] == pytest.approx(serial_losses, rel=1e-5)
    for name, value in serial_final.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
