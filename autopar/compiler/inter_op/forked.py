"""Running independent solves on every core: the stage search's layer ILPs, split over forked
children.

The layer ILPs are pure Python and HiGHS, hold no devices and never call JAX, so a forked child
can solve its share from the parent's memory as it stands (graphs traced, caches filled)
without anything being sent to it; only the answers come back, through a pipe. The parent
solves the first share itself. A child that fails leaves its share to the parent, so the
answers never depend on the fork (where ``os.fork`` does not exist, everything runs here).
"""

from __future__ import annotations

import os
import pickle
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

Task = TypeVar("Task")
Answer = TypeVar("Answer")


def available_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def run_shares(shares: Sequence[Sequence[Task]],
               solve: Callable[[Task], Answer]) -> list[list[Answer]]:
    """``[[solve(t) for t in share] for share in shares]``, the first share here and each
    other in a forked child, all at once."""
    if len(shares) <= 1 or not hasattr(os, "fork"):
        return [[solve(t) for t in share] for share in shares]
    children = [_fork(share, solve) for share in shares[1:]]
    received: list[bytes] = [b""] * len(children)

    def read(k: int, fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            received[k] = pipe.read()

    # readers start after every fork, so that no child inherits a running thread
    readers = [threading.Thread(target=read, args=(k, fd), daemon=True)
               for k, (_, fd) in enumerate(children)]
    for reader in readers:
        reader.start()
    answers = [[solve(t) for t in shares[0]]]
    for k, ((pid, _), reader) in enumerate(zip(children, readers, strict=True)):
        reader.join()
        os.waitpid(pid, 0)
        status, payload = pickle.loads(received[k]) if received[k] else ("failed", None)
        answers.append(payload if status == "ok" else [solve(t) for t in shares[k + 1]])
    return answers


def _fork(share: Sequence[Task], solve: Callable[[Task], Answer]) -> tuple[int, int]:
    """A child solving ``share``: its pid and the read end of the pipe its answers come on."""
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
        payload = pickle.dumps(("ok", [solve(t) for t in share]))
    except BaseException as err:  # noqa: BLE001 - the parent solves the share instead
        payload = pickle.dumps(("failed", repr(err)))
    with os.fdopen(write_fd, "wb") as pipe:
        pipe.write(payload)
    os._exit(0)  # no atexit handlers, no flushing the parent's buffers twice
