"""Running a launcher or a script as a test's subprocess, in its own session, under a hang
guard: a run that does not end within the guard is killed (its whole process group) and the
test fails. The guard is not a timing assertion; a passing run ends long before it."""

import os
import signal
import subprocess

import pytest
import repo_paths


def repo_env() -> dict[str, str]:
    """This environment, unbuffered, with the repository on ``PYTHONPATH``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(repo_paths.REPO), env.get("PYTHONPATH")) if p)
    return env


def run_guarded(argv: list[str], guard_s: float, *,
                merge_stderr: bool = False) -> tuple[int, str, str]:
    """Run ``argv`` from the repository root; (exit status, stdout, stderr), stderr folded
    into stdout with ``merge_stderr``."""
    proc = subprocess.Popen(argv, env=repo_env(), cwd=repo_paths.REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=guard_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the run did not end within {guard_s} s")
    return proc.returncode, out, err or ""
