"""Progress of long phases: one updating status line on a terminal, nothing otherwise.

``Progress`` writes ``autopar: planning (12.5 s, pipelines: 312 ILPs solved)`` to its stream
(default ``sys.stderr``), rewriting the same line (``\\r``) every ``interval_s`` from a daemon
thread while a phase runs, and clears it when the phase ends; with ``delay_s`` nothing shows
before that many seconds. When the stream is not a terminal (a pipe, a file, a test's
capture) it writes nothing at all: long solves show progress on a terminal and stay quiet
otherwise. Every phase's duration is logged at INFO on ``autopar.frontend.progress`` either way.

There is no module-level state: the CLI makes one ``Progress`` per command and passes it on;
``autopar.parallelize`` one per planning.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

logger = logging.getLogger(__name__)


def is_terminal(stream: object) -> bool:
    """Whether ``stream`` is an interactive terminal (False when it cannot tell)."""
    try:
        # any object: one without isatty is answered by the AttributeError below
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False


def status_text(name: str, elapsed_s: float, detail: Callable[[], str] | None = None) -> str:
    """``tracing and planning (14.2 s, pipelines: 312 ILPs solved)``."""
    extra = ""
    if detail is not None:
        try:
            extra = detail()
        except Exception:  # a display must never stop the work it shows
            extra = ""
    return f"{name} ({elapsed_s:.1f} s{', ' + extra if extra else ''})"


class Progress:
    """A status line for the phases of one command (``with progress.phase("planning"): ...``).

    ``stream``: where the line goes (default: ``sys.stderr`` at construction); it is only
    written to when it is a terminal. ``interval_s``: how often the elapsed time is rewritten.
    Used as a context manager, the line is cleared on exit whatever happened.
    """

    def __init__(self, stream: TextIO | None = None, *, interval_s: float = 0.5,
                 prefix: str = "autopar: ", delay_s: float = 0.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = is_terminal(self.stream)
        self.interval_s = interval_s
        self.delay_s = delay_s
        self.prefix = prefix
        self._lock = threading.Lock()
        self._shown = 0  # characters of the status line now on screen (0: none)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.clear_line()

    @contextmanager
    def phase(self, name: str, detail: Callable[[], str] | None = None) -> Iterator[None]:
        """Show ``name``, its elapsed seconds and ``detail()`` (the planner's phase and ILP
        count) while the block runs; clear the line after. Nothing is shown before
        ``delay_s``: a quick phase leaves the terminal as it was."""
        start = time.perf_counter()
        stop = threading.Event()
        ticker = None
        if self.enabled:
            if not self.delay_s:
                self._show(f"{name} ...")
            ticker = threading.Thread(target=self._tick, args=(name, start, stop, detail),
                                      daemon=True, name=f"autopar-progress-{name}")
            ticker.start()
        try:
            yield
        except BaseException:
            logger.debug("%s stopped after %.2f s", name, time.perf_counter() - start)
            raise
        else:
            logger.info("%s done in %.2f s", name, time.perf_counter() - start)
        finally:
            stop.set()
            if ticker is not None:
                ticker.join()
            self.clear_line()

    def clear_line(self) -> None:
        """Erase the status line, if one is shown (the next update draws it again)."""
        with self._lock:
            if self._shown:
                self._write("\r" + " " * self._shown + "\r")
                self._shown = 0

    def _tick(self, name: str, start: float, stop: threading.Event,
              detail: Callable[[], str] | None) -> None:
        if stop.wait(self.delay_s):
            return
        while True:
            self._show(status_text(name, time.perf_counter() - start, detail))
            if stop.wait(self.interval_s):
                return

    def _show(self, text: str) -> None:
        line = self.prefix + text
        with self._lock:
            pad = " " * max(0, self._shown - len(line))
            if self._write("\r" + line + pad):
                self._shown = len(line)

    def _write(self, text: str) -> bool:
        if not self.enabled:
            return False
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: stop drawing
            self.enabled = False
            return False
        return True
