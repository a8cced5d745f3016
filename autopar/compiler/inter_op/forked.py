"""Running independent solves on every core: the stage search's layer ILPs, split over forked
children.

The layer ILPs are pure Python and HiGHS, hold no devices and never call JAX, so a forked child
can solve tasks from the parent's memory as it stands (graphs traced, caches filled) without
anything being sent to it; only the answers come back, through a pipe. The parent works too.
Each process takes the next task when it is free (a counter in shared memory), so a few slow
tasks do not hold up one process while the others wait: at GPT 76.1B on 1,024 GPUs the largest
meshes' ILPs take 5-10 s each, and a fixed split gave one process 123 of 153 seconds. A child
that fails leaves its tasks to the parent, so the answers never depend on the fork (where
``os.fork`` does not exist, everything runs here).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

Task = TypeVar("Task")
Answer = TypeVar("Answer")


def available_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def run_pulled(tasks: Sequence[Task], solve: Callable[[Task], Answer],
               workers: int) -> list[Answer]:
    """``[solve(t) for t in tasks]``, over ``workers`` processes (this one and forked
    children), each taking the next task in order when it finishes one: put the slowest
    first."""
    workers = min(workers, len(tasks))
    if workers <= 1 or not hasattr(os, "fork"):
        return [solve(t) for t in tasks]
    counter: Any = multiprocessing.get_context("fork").Value("i", 0)

    def take() -> int:
        with counter.get_lock():
            k = counter.value
            counter.value = k + 1
        return k

    def work() -> dict[int, Answer]:
        done: dict[int, Answer] = {}
        while (k := take()) < len(tasks):
            done[k] = solve(tasks[k])
        return done

    children = [_fork(work) for _ in range(workers - 1)]
    received: list[bytes] = [b""] * len(children)

    def read(k: int, fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            received[k] = pipe.read()

    # readers start after every fork, so that no child inherits a running thread
    readers = [threading.Thread(target=read, args=(k, fd), daemon=True)
               for k, (_, fd) in enumerate(children)]
    for reader in readers:
        reader.start()
    answers = work()
    for k, ((pid, _), reader) in enumerate(zip(children, readers, strict=True)):
        reader.join()
        os.waitpid(pid, 0)
        status, payload = pickle.loads(received[k]) if received[k] else ("failed", None)
        if status == "ok":
            answers.update(payload)
    # the tasks a failed child took: solved here
    return [answers[k] if k in answers else solve(t) for k, t in enumerate(tasks)]


def _fork(work: Callable[[], dict[int, Answer]]) -> tuple[int, int]:
    """A child running ``work``: its pid and the read end of the pipe its answers come on."""
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        # JAX warns at every fork that a child using it may deadlock: this one never does
        warnings.simplefilter("ignore", RuntimeWarning)
        pid = os.fork()
    if pid:
        os.close(write_fd)
        return pid, read_fd
    # the child: HiGHS's worker threads were the parent's, so it starts its own
    os.close(read_fd)
    try:
        import highspy

        highspy.Highs.resetGlobalScheduler(True)
        payload = pickle.dumps(("ok", work()))
    except BaseException as err:  # noqa: BLE001 - the parent solves its tasks instead
        payload = pickle.dumps(("failed", repr(err)))
    with os.fdopen(write_fd, "wb") as pipe:
        pipe.write(payload)
    os._exit(0)  # no atexit handlers, no flushing the parent's buffers twice
