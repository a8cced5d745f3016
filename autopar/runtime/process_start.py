"""Starting one process of a multi-process run (``runtime.distributed.initialize``): its
arguments, from the call or the environment; reaching the coordinator (or serving it, on
process 0); sizing the CPU client's thread pool; and joining JAX's runtime under a watchdog
that ends a process stuck in JAX's C++ connect with one line."""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
import time
from typing import Any

import jax

from autopar.errors import DistributedError

ENV_COORDINATOR = "AUTOPAR_COORDINATOR"  # host:port of process 0's coordinator service
ENV_NUM_PROCESSES = "AUTOPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "AUTOPAR_PROCESS_ID"
ENV_TRANSFER_ADDRESS = "AUTOPAR_TRANSFER_ADDRESS"  # this process's host:port for transfers

log = logging.getLogger(__name__)


def _address(text: str, what: str) -> tuple[str, int]:
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"{what} {text!r} is not HOST:PORT (e.g. 10.0.0.1:7000)")
    return host.strip("[]"), int(port)


def _integer(value: Any, what: str, env: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{what} {value!r} is not an integer (argument or ${env})") from None


def _own_address(coordinator_host: str) -> str:
    """This machine's address on the route to the coordinator (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((coordinator_host, 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _wait_for_coordinator(host: str, port: int, deadline: float, process_id: int) -> None:
    """Retry a TCP connection until process 0's coordinator answers: JAX itself aborts the
    whole process (a C++ fatal error, no Python exception) when it cannot connect."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"process {process_id} could not reach the coordinator at {host}:{port}; "
                    f"start process 0 there (or fix ${ENV_COORDINATOR} / coordinator_address)"
                ) from None
            time.sleep(0.2)


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as exc:
            raise DistributedError(f"process 0 cannot serve the coordinator on port {port}: "
                                   f"{exc.strerror}; choose another port") from None


def _local_cpu_devices() -> int:
    """How many CPU devices this process's CPU client will have (read before JAX creates it):
    ``jax_num_cpu_devices`` if set, else ``--xla_force_host_platform_device_count`` in
    ``$XLA_FLAGS``, else 1."""
    configured = getattr(jax.config, "jax_num_cpu_devices", -1)
    if isinstance(configured, int) and configured > 0:
        return configured
    counts = re.findall(r"--xla_force_host_platform_device_count=(\d+)",
                        os.environ.get("XLA_FLAGS", ""))
    return max(1, int(counts[-1])) if counts else 1


def _size_cpu_thread_pool() -> None:
    """Give the CPU client (created later, on first use) at least twice as many threads as
    local CPU devices, through ``$NPROC``, the one knob XLA reads for its size (default: the
    schedulable cores; the pool has max(that, local devices) threads).

    A collective across processes holds one pool thread per local device while it waits for
    the other processes, and this process's cross-process sends need a pool thread too. With
    no thread to spare (e.g. 4 simulated devices on 2 cores) a process whose peer waits for a
    transfer before it joins the next collective deadlocks: the peer never gets the transfer,
    until gloo gives up on the collective's set-up after 30 s (``GetKeyValue() timed out with
    key: cpu:gloo/...``) or the collective's own timeout. Only ever raises ``$NPROC`` (which
    also sizes XLA's intra-op pool on CPU); a value already large enough is kept."""
    needed = 2 * _local_cpu_devices()
    try:
        have = int(os.environ["NPROC"])
    except (KeyError, ValueError):
        have = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    if have < needed:
        os.environ["NPROC"] = str(needed)
        log.info("NPROC=%d: CPU client threads for %d local devices (had %d)", needed,
                 needed // 2, have)


def run_arguments(coordinator_address: str | None, num_processes: int | None,
                  process_id: int | None) -> tuple[str, int, int] | None:
    """(coordinator address, number of processes, this process's id), each from the call or
    else from its environment variable; None when none is given anywhere (a single-process
    run). Raises ``DistributedError`` naming what is missing or out of range."""
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
        num_processes = _integer(os.environ[ENV_NUM_PROCESSES], "num_processes",
                                 ENV_NUM_PROCESSES)
    if process_id is None and os.environ.get(ENV_PROCESS_ID):
        process_id = _integer(os.environ[ENV_PROCESS_ID], "process_id", ENV_PROCESS_ID)
    if coordinator_address is None and num_processes is None and process_id is None:
        return None
    if coordinator_address is None or num_processes is None or process_id is None:
        raise DistributedError(
            "a multi-process run needs coordinator_address, num_processes and process_id (or "
            f"${ENV_COORDINATOR}, ${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID})")
    num_processes = _integer(num_processes, "num_processes", ENV_NUM_PROCESSES)
    process_id = _integer(process_id, "process_id", ENV_PROCESS_ID)
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise DistributedError(f"process_id={process_id} is not in 0..{num_processes - 1} "
                               f"(num_processes={num_processes})")
    return coordinator_address, num_processes, process_id


def transfer_address_for(given: str | None, coordinator_address: str, process_id: int) -> str:
    """Where this process receives transfers: ``given``, else ``$AUTOPAR_TRANSFER_ADDRESS``,
    else its address towards the coordinator at the coordinator's port + 1 + its id. Raises
    ``DistributedError`` when either address is not ``HOST:PORT``."""
    host, port = _address(coordinator_address, "coordinator address")
    address = given or os.environ.get(ENV_TRANSFER_ADDRESS) or (
        f"{_own_address(host)}:{port + 1 + process_id}")
    _address(address, "transfer address")
    return address


def reach_coordinator(coordinator_address: str, process_id: int, deadline: float) -> None:
    """Process 0 checks that it can serve the coordinator's port; the others wait until the
    coordinator answers (until ``deadline``, ``time.monotonic()``)."""
    host, port = _address(coordinator_address, "coordinator address")
    if process_id == 0:
        _check_port_free(port)
    else:
        _wait_for_coordinator(host, port, deadline, process_id)


def join(coordinator_address: str, num_processes: int, process_id: int, transfer_address: str,
         deadline: float, timeouts: tuple[float, int, int]) -> None:
    """Join JAX's multi-controller runtime, ended with one line by a watchdog at ``deadline``
    (``time.monotonic()``). ``timeouts``: ``initialize``'s initialization, heartbeat and
    shutdown timeouts."""
    initialization_timeout, heartbeat_timeout, shutdown_timeout = timeouts
    host, port = _address(coordinator_address, "coordinator address")
    # Gloo gives the CPU backend its cross-process collectives (other backends ignore it); the
    # socket address turns on device_put between processes where the backend has no transfer
    # path of its own (CPU here).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_cross_host_transfer_socket_address", transfer_address)
    _size_cpu_thread_pool()
    watchdog = threading.Timer(max(1.0, deadline - time.monotonic()), _give_up,
                               (process_id, num_processes, coordinator_address,
                                initialization_timeout))
    watchdog.daemon = True
    watchdog.start()
    try:
        # JAX gets a longer timeout than the watchdog: its own failure is a C++ abort with a
        # page of log, so the watchdog's one line should come first.
        jax.distributed.initialize(
            coordinator_address=f"{host}:{port}", num_processes=num_processes,
            process_id=process_id, initialization_timeout=int(initialization_timeout) + 15,
            heartbeat_timeout_seconds=int(heartbeat_timeout),
            shutdown_timeout_seconds=int(shutdown_timeout),
        )
    except (RuntimeError, ValueError) as exc:  # JAX's own checks (called too late, twice)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistributedError(f"process {process_id} of {num_processes}: "
                               f"jax.distributed.initialize failed: {first}") from None
    finally:
        watchdog.cancel()
    log.info("process %d of %d joined %s (%d local devices of %d)", process_id, num_processes,
             coordinator_address, jax.local_device_count(), jax.device_count())


def _give_up(process_id: int, num_processes: int, address: str, timeout: float) -> None:
    """Runs on a timer thread while the main thread is stuck inside JAX's C++ connect, which no
    Python exception can interrupt: say what went wrong in one line and end the process."""
    print(f"autopar: error: process {process_id} of {num_processes}: the run did not start "
          f"within {timeout:g} s (coordinator {address}); are all {num_processes} processes "
          "started with the same coordinator address?", file=sys.stderr, flush=True)
    os._exit(3)
