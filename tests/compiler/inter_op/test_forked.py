"""``forked.run_pulled``: tasks over forked processes, each taking the next when free; the
answers as if solved here, whichever process solved them or failed."""

from __future__ import annotations

import os
import time

import pytest

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
