"""``autopar launch``: run one command as N processes of a multi-process run on this machine.

``autopar launch --processes 2 --cpu-devices 4 -- python train.py`` starts ``python train.py``
twice, as simulated hosts on loopback: each child gets ``$AUTOPAR_COORDINATOR`` (a free port on
127.0.0.1), ``$AUTOPAR_NUM_PROCESSES``, ``$AUTOPAR_PROCESS_ID`` and its own
``$AUTOPAR_TRANSFER_ADDRESS``, which ``autopar.runtime.distributed.initialize()`` reads. The
launcher
watches its children: when one fails, or the run outlives ``--timeout``, it stops the others
and exits non-zero with one line naming the process and how it ended. Each child runs in a
process group of its own, and stopping it means the whole group: SIGTERM, then SIGKILL after a
grace for whatever is left (a process that ignores SIGTERM, or one the child started, even when
the child itself has gone). Real hosts need no
launcher: run the same command on each with those variables set (see docs/distributed.md).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from autopar.errors import InvalidOptionError
from autopar.runtime.process_start import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_TRANSFER_ADDRESS,
)

EXIT_CHILD_FAILED = 1
EXIT_TIMEOUT = 124  # as coreutils' timeout
KILL_GRACE_S = 1.0  # between SIGTERM and SIGKILL (JAX's preemption notifier catches SIGTERM)
POLL_S = 0.05


def add_launch_parser(sub: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    """Add the ``launch`` command to the ``autopar`` subparsers ``sub``."""
    p = sub.add_parser(
        "launch", help="run a command as N processes of a multi-process run on this machine",
        description="Run COMMAND as N processes joined by autopar.runtime.distributed.initialize() "
                    "over loopback (simulated hosts); stop them all when one fails.",
    )
    p.add_argument("--processes", type=int, required=True, metavar="N",
                   help="number of processes (simulated hosts)")
    p.add_argument("--cpu-devices", type=int, default=None, metavar="K",
                   help="give each process K simulated CPU devices (sets XLA_FLAGS and "
                        "JAX_PLATFORMS=cpu; default: the environment decides)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="stop the run after this long (default: no limit)")
    p.add_argument("--port", type=int, default=None,
                   help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("child_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the command every process runs")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = (int(x) for x in fh.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now, below the kernel's ephemeral range.

    Ports the kernel hands out on its own (``bind`` to port 0) come from the ephemeral range,
    which is also where the run's own outgoing connections (gloo's, the coordinator's clients)
    get their local ports: a port picked there and released can be taken by one of those
    before its server binds it. Below the range only explicit binds compete."""
    low, _ = _ephemeral_range()
    start = max(1024, low - 12_000)
    candidates = list(range(start, low))
    random.SystemRandom().shuffle(candidates)
    sockets: list[socket.socket] = []
    try:
        for port in candidates:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            sockets.append(s)  # held open together so none repeats
            if len(sockets) == count:
                return [t.getsockname()[1] for t in sockets]
        raise InvalidOptionError(
            f"found only {len(sockets)} free ports below {low} on 127.0.0.1; pass --port")
    finally:
        for t in sockets:
            t.close()


def _child_env(base: dict[str, str], rank: int, n: int, coordinator: str, transfer: str,
               cpu_devices: int | None) -> dict[str, str]:
    env = dict(base)
    env.update({ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(n),
                ENV_PROCESS_ID: str(rank), ENV_TRANSFER_ADDRESS: transfer})
    if cpu_devices is not None:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                       env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _die_with_parent() -> None:
    """In the child before exec: its own process group (so the launcher can stop everything it
    started), and on Linux a SIGKILL when the launcher itself dies."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group has no process left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that changed its user: the group is still there
        pass
    return True


def _stop(children: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every child's process group (the child and whatever it started that did not
    leave the group), then SIGKILL the groups that still hold a process after a grace, whether
    or not the child itself is gone; the children are reaped."""
    groups = [child.pid for child in children]  # each child leads its own group (setsid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [g for g in groups if _signal_group(g, sig)]
        end = time.monotonic() + KILL_GRACE_S
        while live and time.monotonic() < end:
            time.sleep(POLL_S)
            for child in children:
                child.poll()  # reap: a dead, unreaped child would keep its group "alive"
            live = [g for g in live if _signal_group(g, 0)]
        groups = live
        if not groups:
            break
    for child in children:
        try:
            child.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _wait_for_a_child(children: Sequence[subprocess.Popen], seconds: float) -> None:
    """Sleep up to ``seconds``, waking as soon as one of the running ``children`` ends (a
    pidfd per child, Linux; elsewhere a plain sleep). The first process to die is then seen on
    its own, before the peers it takes down with it end too (seen in one poll, the lowest rank
    would be named as the one that failed)."""
    fds = []
    try:
        for child in children:
            if child.returncode is None and hasattr(os, "pidfd_open"):
                try:
                    fds.append(os.pidfd_open(child.pid))
                except OSError:  # gone already (the poll sees it), or no pidfd here
                    pass
        if fds:
            select.select(fds, [], [], seconds)
        else:
            time.sleep(seconds)
    finally:
        for fd in fds:
            os.close(fd)


def run_launch(args: argparse.Namespace) -> int:
    """``autopar launch``: start, watch and stop the processes; returns the exit status."""
    command = list(args.child_command)
    if command and command[0] == "--":
        command = command[1:]
    n = args.processes
    if not command:
        raise InvalidOptionError("launch needs a command after '--', e.g. 'autopar launch "
                                 "--processes 2 -- python train.py'")
    if n < 1:
        raise InvalidOptionError(f"--processes {n} must be at least 1")
    if args.cpu_devices is not None and args.cpu_devices < 1:
        raise InvalidOptionError(f"--cpu-devices {args.cpu_devices} must be at least 1")
    if args.timeout is not None and args.timeout <= 0:
        raise InvalidOptionError(f"--timeout {args.timeout:g} must be positive")
    ports = _free_ports(n + 1)
    coordinator = f"127.0.0.1:{args.port if args.port is not None else ports[0]}"
    children: list[subprocess.Popen] = []
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    start = time.monotonic()
    try:
        for rank in range(n):
            env = _child_env(dict(os.environ), rank, n, coordinator,
                             f"127.0.0.1:{ports[rank + 1]}", args.cpu_devices)
            try:
                children.append(subprocess.Popen(command, env=env, preexec_fn=_die_with_parent))
            except OSError as exc:
                raise InvalidOptionError(f"cannot start {command[0]!r}: {exc.strerror}") from None
        while True:
            codes = [c.poll() for c in children]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                _stop(children)
                print(f"autopar: error: process {rank} of {n} {_how(code)}; stopped the "
                      "other processes", file=sys.stderr, flush=True)
                return EXIT_CHILD_FAILED
            if all(code == 0 for code in codes):
                return 0
            if args.timeout is not None and time.monotonic() - start > args.timeout:
                running = [rank for rank, code in enumerate(codes) if code is None]
                _stop(children)
                print(f"autopar: error: the run exceeded --timeout {args.timeout:g} s; stopped "
                      f"process(es) {', '.join(map(str, running))} of {n}", file=sys.stderr,
                      flush=True)
                return EXIT_TIMEOUT
            _wait_for_a_child(children, POLL_S)
    finally:
        _stop(children)
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # main() reports it; the finally above stops the children
