"""A process of a launched run that never finishes on its own (tests of ``autopar launch``).

    python hang.py PIDDIR [--ignore-term] [--grandchild] [--fail-rank R]

Writes ``PIDDIR/rank<R>.pid`` (R: ``$AUTOPAR_PROCESS_ID``) once it is set up, then blocks.
``--ignore-term``: SIGTERM is ignored (the launcher must escalate to SIGKILL).
``--grandchild``: first start ``hang.py --ignore-term`` as a child of its own, in this process
group, which writes ``rank<R>-grandchild.pid`` (the launcher must end what its children start).
``--fail-rank R``: process R exits with code 3 (instead of blocking) once every process of the
run has written its pid file.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def write_pid(piddir: Path, name: str) -> None:
    part = piddir / f".{name}.part"
    part.write_text(str(os.getpid()))
    os.replace(part, piddir / f"{name}.pid")  # complete, or not there


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("piddir", type=Path)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--grandchild", action="store_true")
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    rank = int(os.environ["AUTOPAR_PROCESS_ID"])
    name = args.name or f"rank{rank}"
    fails = args.name is None and args.fail_rank == rank
    everyone = int(os.environ["AUTOPAR_NUM_PROCESSES"])
    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_term else signal.SIG_DFL)
    if args.grandchild:
        subprocess.Popen([sys.executable, __file__, str(args.piddir), "--ignore-term",
                          "--name", f"{name}-grandchild"])
    write_pid(args.piddir, name)
    while True:
        ranks = [p for p in args.piddir.glob("rank*.pid") if "-" not in p.stem]
        if fails and len(ranks) >= everyone:
            sys.exit(3)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
