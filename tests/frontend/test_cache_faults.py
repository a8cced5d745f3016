"""Faults around the on-disk plan cache lose nothing: a run interrupted while planning or while
storing the plan (Ctrl-C, SIGTERM) leaves no entry and, once the next run has opened the cache,
no temporary file; that next run plans and stores normally. A cache directory that cannot be
written (not a directory, no permission, a full disk) costs one warning line, never the step."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import repo_paths
from tanh_mlp import tanh_mlp_step

import autopar
from autopar.frontend.plan_cache import PlanCacheWarning
from autopar.plan import Plan

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

REPO = repo_paths.REPO
SCRIPT = repo_paths.FAULT_SCRIPTS / "plan_into_cache.py"
HANG_GUARD_S = 180  # a passing run takes seconds; this only keeps a broken one from hanging


def _env(cache_dir: Path) -> dict[str, str]:
    # two simulated devices; the session's other XLA flags (fast CPU compiles, conftest.py)
    # are kept, so the scripts compile as the tests' own processes do
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                   os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, AUTOPAR_CACHE_DIR=str(cache_dir), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=2".strip())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _interrupted_run(mode: str, sig: signal.Signals, cache_dir: Path, tmp_path: Path) -> str:
    """Start the script holding in ``mode``, wait until it says it holds, send ``sig``; returns
    its stderr once it has ended (killed by ``sig`` or by the exception it raises)."""
    marker = tmp_path / f"holding-{mode}-{sig.name}"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), mode, str(marker)],
                            env=_env(cache_dir), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not marker.exists():  # written from inside planning / the cache write
            if proc.poll() is not None:
                pytest.fail(f"the script ended before it held: {proc.communicate()[1][-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"the script did not reach the hold within {HANG_GUARD_S} s")
            time.sleep(0.02)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGINT:  # Ctrl-C: KeyboardInterrupt unwinds the planner or the write
        assert "KeyboardInterrupt" in err, err[-3000:]
    else:  # SIGTERM's default action: the process dies where it stands
        assert proc.returncode == -signal.SIGTERM, err[-3000:]
    return err


def _next_run(cache_dir: Path) -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPT), "plan"], env=_env(cache_dir), cwd=REPO,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
@pytest.mark.parametrize("mode", ["hold-in-planning", "hold-in-write"])
def test_an_interrupted_run_leaves_no_entry_and_the_next_run_plans_normally(
        mode, sig, tmp_path):
    cache_dir = tmp_path / "plans"
    cache_dir.mkdir()
    _interrupted_run(mode, sig, cache_dir, tmp_path)

    left = sorted(os.listdir(cache_dir))
    assert not [n for n in left if n.endswith(".json")], left  # no entry, whole or partial
    if mode == "hold-in-write" and sig == signal.SIGTERM:
        # killed between writing the temporary file and renaming it: no finally ran, so its
        # file is still there, named as the cache's own (the next run removes it)
        assert len(left) == 1 and left[0].startswith(".autopar-tmp."), left
    else:  # the exception unwound the write (or planning had not reached it)
        assert left == []

    result = _next_run(cache_dir)
    assert result["from_cache"] is False  # planned again, not served a half-written plan
    assert result["warnings"] == []  # an interrupted predecessor is not a cache problem
    assert np.isfinite(result["loss"])
    assert result["cached_again"] is True  # and what it stored serves the next step
    (entry,) = os.listdir(cache_dir)  # one entry, no temporary file of anyone's
    assert entry.endswith(".json")
    Plan.from_dict(json.loads((cache_dir / entry).read_text())["plan"])


def test_a_temporary_file_of_a_running_writer_is_left_alone(tmp_path):
    """Only dead writers' files are removed: another process's write in progress is not."""
    cache_dir = tmp_path / "plans"
    cache_dir.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        from autopar.frontend.plan_cache import _host

        live = cache_dir / f".autopar-tmp.{_host()}.{sleeper.pid}.0123456789abcdef.xyz.tmp"
        live.write_text("{")
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
        stale = cache_dir / f".autopar-tmp.{_host()}.{int(dead.stdout)}.0123456789abcdef.x.tmp"
        stale.write_text("{")
        other_host = cache_dir / f".autopar-tmp.elsewhere-{_host()}.1.0123456789abcdef.x.tmp"
        other_host.write_text("{")
        result = _next_run(cache_dir)
        assert result["from_cache"] is False and result["warnings"] == []
        names = set(os.listdir(cache_dir))
        assert live.name in names and other_host.name in names
        assert stale.name not in names
    finally:
        sleeper.kill()
        sleeper.wait()


# -- a cache directory that cannot take the plan --------------------------------------------------


OPT = optax.sgd(0.1)
STEP = tanh_mlp_step(OPT)


def _inputs(batch_size: int = 16) -> tuple[dict, dict]:
    k = jax.random.split(jax.random.key(1), 4)
    params = [jax.random.normal(k[0], (8, 16)) * 0.3, jax.random.normal(k[1], (16, 4)) * 0.3]
    batch = {"x": jax.random.normal(k[2], (batch_size, 8)),
             "y": jax.random.normal(k[3], (batch_size, 4))}
    return {"params": params, "opt": OPT.init(params)}, batch


def _runs_like_the_serial_step(step, batch_size: int = 16) -> None:
    state, batch = _inputs(batch_size)
    want_state, want_loss = jax.jit(STEP)(state, batch)
    got_state, got_loss = step(state, batch)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(want_state), jax.tree_util.tree_leaves(got_state),
                    strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    assert not step.plan_was_cached(state, batch)


def _one_line_warning(record, *needles: str) -> None:
    messages = [str(w.message) for w in record if issubclass(w.category, PlanCacheWarning)]
    assert len(messages) == 1, messages
    assert "\n" not in messages[0]
    for needle in needles:
        assert needle in messages[0], messages[0]


def test_a_cache_directory_that_is_a_file_costs_one_warning_not_the_step(tmp_path, monkeypatch):
    blocker = tmp_path / "plans"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(blocker))
    step = autopar.parallelize(STEP, method=autopar.ShardParallel(mesh_shape=(2, 4)))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _runs_like_the_serial_step(step)
        _runs_like_the_serial_step(step, batch_size=32)  # another signature: no second line
    _one_line_warning(record, str(blocker))
    assert blocker.read_text() == "a file where the cache directory should be"


@pytest.mark.parametrize("fault", ["permission", "full-disk"])
def test_a_cache_write_that_fails_costs_one_warning_not_the_step(fault, tmp_path, monkeypatch):
    cache_dir = tmp_path / "plans"
    cache_dir.mkdir()
    real_mkstemp = tempfile.mkstemp
    if fault == "permission":  # what a directory of another user is to a non-root writer
        def mkstemp(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied")
        needle = "Permission denied"
    else:  # the temporary file is created, and every write to it fails as on a full disk
        if not os.path.exists("/dev/full"):
            pytest.skip("needs /dev/full")

        def mkstemp(*args, **kwargs):
            fd, name = real_mkstemp(*args, **kwargs)
            full = os.open("/dev/full", os.O_WRONLY)
            os.dup2(full, fd)  # the kernel answers ENOSPC to the writer's own write
            os.close(full)
            return fd, name
        needle = "No space left on device"
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    step = autopar.parallelize(STEP, method=autopar.ShardParallel(mesh_shape=(2, 4)),
                               cache=cache_dir)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _runs_like_the_serial_step(step)
        _runs_like_the_serial_step(step, batch_size=32)
    _one_line_warning(record, str(cache_dir), needle)
    assert os.listdir(cache_dir) == []  # no entry, and no half-written temporary file
