"""Keeping the MIP solvers' output off standard output (``intra_op.mip`` runs them): HiGHS
prints a banner from C++ when a process makes its first ``highspy.Highs()``, caught by
redirecting file descriptor 1 around that construction; HiGHS's log, handed over in pieces by
its logging callback, and CBC's log file go to the debug log line by line.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from autopar.method_options import Solver

# the mip module's logger: the solvers' logs are documented (and tested) under its name
logger = logging.getLogger("autopar.compiler.intra_op.mip")


def log_lines(solver: str, text: str) -> None:
    """Each non-blank line of ``text`` to the debug log, prefixed by the ``solver``'s name."""
    for line in text.splitlines():
        if line.strip():
            logger.debug("%s: %s", solver, line.rstrip())


def _flush_c_stdio() -> None:
    """``fflush(NULL)``: push C stdio's buffered output to its file descriptors."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to load: nothing buffered
        pass


def with_fd1_captured(make: Callable[[], Any]) -> tuple[Any, str]:
    """``make()`` with file descriptor 1 (C-level stdout) sent to a temporary file; returns its
    result and what was written there. Runs ``make()`` plainly when fd 1 cannot be duplicated."""
    try:
        sys.stdout.flush()  # Python's own buffered text belongs to the real stdout
    except (AttributeError, OSError, ValueError):
        pass
    _flush_c_stdio()
    try:
        saved = os.dup(1)
    except OSError:
        return make(), ""
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        try:
            result = make()
        finally:
            _flush_c_stdio()
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        return result, sink.read().decode(errors="replace")


_first_highs_lock = threading.Lock()
_first_highs_made = False


def new_highs() -> Any:
    """A ``highspy.Highs()``; the process's first one is made with fd 1 captured, since HiGHS
    prints its banner to stdout then (once per process, before any option can be set)."""
    global _first_highs_made
    import highspy

    if _first_highs_made:
        return highspy.Highs()
    with _first_highs_lock:
        if _first_highs_made:
            return highspy.Highs()
        h, banner = with_fd1_captured(highspy.Highs)
        _first_highs_made = True
    if logger.isEnabledFor(logging.DEBUG):
        log_lines(Solver.HIGHS, banner)
    return h


class HighsLog:
    """HiGHS's log, which its logging callback hands over in pieces, to the logger by line."""

    def __init__(self) -> None:
        self.pending = ""

    def __call__(self, event: Any) -> None:
        self.pending += event.message
        *lines, self.pending = self.pending.split("\n")
        log_lines(Solver.HIGHS, "\n".join(lines))

    def flush(self) -> None:
        log_lines(Solver.HIGHS, self.pending)
        self.pending = ""
