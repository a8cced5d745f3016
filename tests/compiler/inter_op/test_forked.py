"""``forked.run_pulled``: tasks over forked processes, each taking the next when free; the
answers as if solved here, whichever process solved them or failed."""

from __future__ import annotations

import os
import time

import pytest

from autopar.compiler.inter_op import forked
from autopar.compiler.inter_op.forked import run_pulled

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def test_answers_come_in_task_order_from_every_process():
    parent = os.getpid()

    def solve(task: int) -> tuple[int, int]:
        time.sleep(0.02)
        return task * task, os.getpid()

    answers = run_pulled(list(range(12)), solve, workers=2)
    assert [a for a, _ in answers] == [k * k for k in range(12)]
    solvers = {pid for _, pid in answers}
    assert parent in solvers and len(solvers) == 2  # both processes took tasks


def test_a_slow_task_does_not_hold_up_the_others(tmp_path):
    """One slow task first (it waits until the last task has run): the process that takes it
    solves nothing else while the other takes every remaining task (a fixed split would have
    left it half of them, and waited)."""
    flag = tmp_path / "last-task-ran"

    def solve(task: int) -> int:
        if task == 8:
            flag.touch()
        if task == 0:
            waited = 0.0
            while not flag.exists() and waited < 30:
                time.sleep(0.01)
                waited += 0.01
        return os.getpid()

    pids = run_pulled(list(range(9)), solve, workers=2)
    assert pids[0] not in pids[1:]


def test_the_tasks_of_a_failed_child_are_solved_here():
    parent = os.getpid()

    def solve(task: int) -> tuple[int, int]:
        if os.getpid() != parent:
            raise RuntimeError("lost child")
        return task + 1, os.getpid()

    answers = run_pulled(list(range(8)), solve, workers=2)
    assert answers == [(k + 1, parent) for k in range(8)]


def test_this_processs_own_work_runs_while_the_child_solves(tmp_path):
    """``meanwhile`` runs here once, after the child is forked: the child takes tasks while it
    runs (here it waits until the child has solved one), and the answers are all there."""
    parent = os.getpid()
    solved = tmp_path / "a-child-solved"
    ran = []

    def solve(task: int) -> int:
        if os.getpid() != parent:
            solved.touch()
        return task * 2

    def meanwhile() -> None:
        waited = 0.0
        while not solved.exists() and waited < 30:
            time.sleep(0.01)
            waited += 0.01
        ran.append(os.getpid())

    assert run_pulled(list(range(6)), solve, workers=2, meanwhile=meanwhile) == \
        [k * 2 for k in range(6)]
    assert ran == [parent] and solved.exists()
    # with nothing to fork, it runs first, here
    assert run_pulled([1], solve, workers=2, meanwhile=lambda: ran.append(0)) == [2]
    assert ran == [parent, 0]


def test_children_are_ended_when_this_processs_own_work_fails(monkeypatch):
    pids = []
    real = forked._fork

    def kept(work):
        pid, fd = real(work)
        pids.append(pid)
        return pid, fd

    monkeypatch.setattr(forked, "_fork", kept)

    def solve(task: int) -> int:
        time.sleep(0.01)
        return task

    def meanwhile() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_pulled(list(range(50)), solve, workers=2, meanwhile=meanwhile)
    assert len(pids) == 1
    with pytest.raises(ChildProcessError):  # reaped: no such child any more
        os.waitpid(pids[0], os.WNOHANG)
