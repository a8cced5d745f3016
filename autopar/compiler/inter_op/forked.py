"""Running independent solves on every core: the stage search's layer ILPs, split over forked
children (``run_pulled``), and the full search's one-stage candidates beside its pipeline
search (``start_beside``).

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
import signal
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
               workers: int, meanwhile: Callable[[], Any] | None = None) -> list[Answer]:
    """``[solve(t) for t in tasks]``, over ``workers`` processes (this one and forked
    children), each taking the next task in order when it finishes one: put the slowest
    first. ``meanwhile()``: work of this process's own (it may call JAX, and fork) done
    first, while the children already solve (run first when nothing is forked)."""
    workers = min(workers, len(tasks))
    if workers <= 1 or not hasattr(os, "fork"):
        if meanwhile is not None:
            meanwhile()
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
    if meanwhile is not None:
        # before the readers: a child ``meanwhile`` forks inherits no running thread (the
        # children's answers wait in their pipes until read)
        try:
            meanwhile()
        except BaseException:
            for pid, fd in children:
                Beside(pid, fd).cancel()
            raise
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
        # nothing read: the child died before it wrote its answers
        status, payload = pickle.loads(received[k]) if received[k] else ("failed", {})
        if status == "ok":
            answers.update(payload)
    # the tasks a failed child took: solved here
    return [answers[k] if k in answers else solve(t) for k, t in enumerate(tasks)]


class Beside:
    """A forked child computing one answer while this process goes on (``start_beside``)."""

    def __init__(self, pid: int, read_fd: int) -> None:
        self.pid, self._fd = pid, read_fd

    def join(self) -> Any:
        """The child's answer, waited for (None if it failed). The child writes it once done,
        blocking until it is read here, so nothing is buffered meanwhile."""
        with os.fdopen(self._fd, "rb") as pipe:
            data = pipe.read()
        os.waitpid(self.pid, 0)
        status, payload = pickle.loads(data) if data else ("failed", None)
        return payload if status == "ok" else None

    def cancel(self) -> None:
        """End the child without its answer (this process failed, or was interrupted, before
        it had it); safe after a ``join`` that did not finish."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.close(self._fd)
        except OSError:  # closed by the interrupted join
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:  # reaped by the interrupted join
            pass


def start_beside(work: Callable[[], Answer]) -> Beside:
    """``work()`` in a forked child, beside what this process does next; ``join`` for its
    answer. ``work`` must not call JAX (see the module's note) and its answer must pickle."""
    return Beside(*_fork(work))


def _fork(work: Callable[[], Any]) -> tuple[int, int]:
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
