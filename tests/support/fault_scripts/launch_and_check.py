"""Run ``autopar launch`` in this process and report which of the run's processes outlived it.

    python launch_and_check.py PIDDIR READY -- LAUNCH ARGUMENTS...

The processes of the run write their pids into PIDDIR (``hang.py``). The launcher's clock stands
still until READY pid files exist, so ``--timeout`` counts from the moment every process is set
up (its SIGTERM disposition included), whatever the machine's load. When the launcher returns,
and before this process exits (its children get SIGKILL from the kernel when it goes:
PR_SET_PDEATHSIG), this prints one JSON line: the launcher's exit status, the pid files and the
names of the processes still running; then it kills those, so a failing test leaks nothing.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import autopar.cli.launch
from autopar.cli.main import main as autopar_main


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a killed process nobody has reaped yet (a zombie) has ended
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


class ClockFromReady:
    """``time`` for the launcher: ``monotonic()`` stands still until READY pid files exist."""

    def __init__(self, piddir: Path, ready: int) -> None:
        self.piddir, self.ready, self.since = piddir, ready, None

    def monotonic(self) -> float:
        if self.since is None:
            if len(list(self.piddir.glob("*.pid"))) < self.ready:
                return 0.0
            self.since = time.monotonic()
        return time.monotonic() - self.since

    def __getattr__(self, name: str):
        return getattr(time, name)


def main(argv: list[str]) -> None:
    piddir, ready = Path(argv[0]), int(argv[1])
    launch_args = argv[argv.index("--") + 1:]
    autopar.cli.launch.time = ClockFromReady(piddir, ready)
    rc = autopar_main(["launch", *launch_args])
    pids = {p.stem: int(p.read_text()) for p in sorted(piddir.glob("*.pid"))}
    alive = [name for name, pid in pids.items() if running(pid)]
    print(json.dumps({"rc": rc, "pids": pids, "running": alive}), flush=True)
    for name in alive:
        try:
            os.kill(pids[name], signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    main(sys.argv[1:])
