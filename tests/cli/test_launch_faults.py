"""``autopar launch`` ends every process of a run that it stops: on ``--timeout`` (exit 124) and
when one process fails (exit 1), including processes that ignore SIGTERM (the launcher must
escalate to SIGKILL) and processes that a child started in its own process group.

The run's processes (``fault_scripts/hang.py``) write their pids; the launcher runs inside
``fault_scripts/launch_and_check.py``, whose clock for the launcher starts once every process is
set up, and which checks the pids before it exits itself (after that the kernel's
parent-death signal would end the launcher's children whatever the launcher did). Subprocess
timeouts here are hang guards only; nothing is asserted about how long anything took."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import repo_paths
from guarded_runs import run_guarded

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

REPO = repo_paths.REPO
SCRIPTS = repo_paths.FAULT_SCRIPTS
HANG_GUARD_S = 120


def _launch(tmp_path: Path, processes: int, ready: int, *hang_args: str,
            timeout_s: float | None = None) -> tuple[dict, str]:
    """Launch ``hang.py`` as ``processes`` processes; returns the checker's report and stderr."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    launch = ["--processes", str(processes)]
    if timeout_s is not None:
        launch += ["--timeout", str(timeout_s)]
    argv = [sys.executable, str(SCRIPTS / "launch_and_check.py"), str(piddir), str(ready), "--",
            *launch, "--", sys.executable, str(SCRIPTS / "hang.py"), str(piddir), *hang_args]
    code, out, err = run_guarded(argv, HANG_GUARD_S)
    assert code == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("autopar: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_timeout_ends_every_child_even_one_that_ignores_sigterm(tmp_path):
    report, err = _launch(tmp_path, 2, 2, "--ignore-term", timeout_s=0.5)
    assert report["rc"] == 124
    assert _error_line(err) == ("autopar: error: the run exceeded --timeout 0.5 s; stopped "
                                "process(es) 0, 1 of 2")
    assert sorted(report["pids"]) == ["rank0", "rank1"]
    assert report["running"] == []


def test_timeout_ends_what_the_children_started(tmp_path):
    """Each child starts a process that ignores SIGTERM, then blocks itself: SIGTERM ends the
    children, the launcher must still see their process groups through with SIGKILL."""
    report, err = _launch(tmp_path, 2, 4, "--grandchild", timeout_s=0.5)
    assert report["rc"] == 124
    assert "the run exceeded --timeout 0.5 s" in _error_line(err)
    assert sorted(report["pids"]) == ["rank0", "rank0-grandchild", "rank1", "rank1-grandchild"]
    assert report["running"] == []


def test_a_failed_child_stops_the_others_even_ones_that_ignore_sigterm(tmp_path):
    report, err = _launch(tmp_path, 3, 3, "--ignore-term", "--fail-rank", "0")
    assert report["rc"] == 1
    assert _error_line(err) == ("autopar: error: process 0 of 3 exited with code 3; stopped "
                                "the other processes")
    assert sorted(report["pids"]) == ["rank0", "rank1", "rank2"]
    assert report["running"] == []
