"""Multi-process runs on JAX's own multi-controller runtime (``jax.distributed``).

Every process runs the same script with the same data. :func:`initialize` (before any JAX
computation) connects the process to the others; then ``jax.devices()`` lists every process's
devices, ``autopar.parallelize`` plans for all of them (one host per process, see
``autopar.runtime.local_cluster``) and every process runs the same driver, each executing the work
of its own devices. Values cross processes with :func:`put`; :func:`to_host` gives a step's
outputs as numpy on every process.

Launch: the same command on every host, each with its process id::

    AUTOPAR_COORDINATOR=10.0.0.1:7000 AUTOPAR_NUM_PROCESSES=2 AUTOPAR_PROCESS_ID=0 python train.py

or ``autopar launch --processes 2 -- python train.py`` for simulated hosts on this machine.
Facts this module relies on (jax 0.10.2, CPU): cross-process collectives need gloo; a
``device_put`` between processes needs ``jax_cross_host_transfer_socket_address`` set to an
address and explicit port of the process's own (port 0 does not work: the receiver waits
forever), and every process must issue every cross-process transfer, in the same order, even
one whose devices it does not hold (otherwise the transfers are paired wrongly and hang). The
CPU client runs executions and transfer sends on one thread pool of max(cores, local devices)
threads, and a collective across processes holds one of them per local device until the other
processes join; :func:`initialize` therefore makes the pool larger than the local device count
(see :func:`_size_cpu_thread_pool`), or a send can starve behind a collective that waits for it.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from autopar.errors import DistributedError

__all__ = [
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_TRANSFER_ADDRESS",
    "global_devices",
    "host_layout",
    "initialize",
    "is_multiprocess",
    "put",
    "same_plan_everywhere",
    "to_host",
]

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


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    transfer_address: str | None = None,
    initialization_timeout: float = 60.0,
    heartbeat_timeout: int = 30,
    shutdown_timeout: int = 60,
) -> bool:
    """Join a multi-process run (thin over ``jax.distributed.initialize``); call it first.

    Arguments not given come from ``$AUTOPAR_COORDINATOR`` (``HOST:PORT`` of process 0),
    ``$AUTOPAR_NUM_PROCESSES``, ``$AUTOPAR_PROCESS_ID`` and ``$AUTOPAR_TRANSFER_ADDRESS``. With
    none of them anywhere this is a single-process run: nothing happens and it returns False.
    ``transfer_address``: ``HOST:PORT`` where this process receives device-to-device transfers
    from the others (default: its address towards the coordinator, port = coordinator port +
    1 + process id). The process fails within ``initialization_timeout`` seconds with a
    ``DistributedError`` when the coordinator cannot be reached (or, on process 0, when the
    others do not all come); ``heartbeat_timeout``: seconds after which a silent peer counts as
    dead and the survivors stop; ``shutdown_timeout``: how long exit waits for the others.
    """
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
        num_processes = _integer(os.environ[ENV_NUM_PROCESSES], "num_processes",
                                 ENV_NUM_PROCESSES)
    if process_id is None and os.environ.get(ENV_PROCESS_ID):
        process_id = _integer(os.environ[ENV_PROCESS_ID], "process_id", ENV_PROCESS_ID)
    if coordinator_address is None and num_processes is None and process_id is None:
        return False
    if coordinator_address is None or num_processes is None or process_id is None:
        raise DistributedError(
            "a multi-process run needs coordinator_address, num_processes and process_id (or "
            f"${ENV_COORDINATOR}, ${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID})")
    num_processes = _integer(num_processes, "num_processes", ENV_NUM_PROCESSES)
    process_id = _integer(process_id, "process_id", ENV_PROCESS_ID)
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise DistributedError(f"process_id={process_id} is not in 0..{num_processes - 1} "
                               f"(num_processes={num_processes})")
    host, port = _address(coordinator_address, "coordinator address")
    transfer_address = transfer_address or os.environ.get(ENV_TRANSFER_ADDRESS) or (
        f"{_own_address(host)}:{port + 1 + process_id}")
    _address(transfer_address, "transfer address")
    deadline = time.monotonic() + initialization_timeout
    if process_id == 0:
        _check_port_free(port)
    else:
        _wait_for_coordinator(host, port, deadline, process_id)
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
    return True


def _give_up(process_id: int, num_processes: int, address: str, timeout: float) -> None:
    """Runs on a timer thread while the main thread is stuck inside JAX's C++ connect, which no
    Python exception can interrupt: say what went wrong in one line and end the process."""
    print(f"autopar: error: process {process_id} of {num_processes}: the run did not start "
          f"within {timeout:g} s (coordinator {address}); are all {num_processes} processes "
          "started with the same coordinator address?", file=sys.stderr, flush=True)
    os._exit(3)


def is_multiprocess() -> bool:
    """Whether this is one process of a multi-process run."""
    return jax.process_count() > 1


def global_devices() -> list[Any]:
    """All devices of the run, host-major: by process, then by id (plan device ``d`` is on
    host ``d // devices_per_host``); in a single process, ``jax.devices()`` as it is."""
    if not is_multiprocess():
        return jax.devices()
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def host_layout(devices: Sequence[Any]) -> tuple[int, int]:
    """(hosts, devices per host) of ``devices``: one host per process that holds some.

    Raises ``DistributedError`` when the processes hold different numbers of them, or when
    they are not listed host-major (the plan's device ids must map to hosts by division)."""
    processes = [d.process_index for d in devices]
    hosts = sorted(set(processes))
    if len(hosts) <= 1:
        return 1, len(processes)
    counts = {p: processes.count(p) for p in hosts}
    per_host = counts[hosts[0]]
    if any(c != per_host for c in counts.values()) or processes != sorted(processes):
        raise DistributedError(
            f"the devices must be host-major with as many on each process; got per process "
            f"{counts} in the order {processes} (use autopar.runtime.distributed.global_devices())")
    return len(hosts), per_host


# -- moving values ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _reshard(sharding: Any) -> Any:
    """The identity, jitted to give ``sharding``: a reshard within one device set that every
    process runs (a process without devices in it does nothing)."""
    return jax.jit(lambda v: v, out_shardings=sharding)


def _processes(sharding: Any) -> set[int]:
    return {d.process_index for d in sharding.device_set}


def _placeholder(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Any:
    """This process's view of an array that lives only on other processes' devices."""
    return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)


def _same_layout(src: Any, dst: Any, ndim: int) -> bool:
    """Whether JAX can copy shard-by-shard between the two (same mesh shape and spec)."""
    if not isinstance(src, NamedSharding) or not isinstance(dst, NamedSharding):
        return False

    def spec(s: NamedSharding) -> tuple:
        return tuple(s.spec) + (None,) * (ndim - len(s.spec))

    return (src.mesh.axis_names == dst.mesh.axis_names
            and src.mesh.devices.shape == dst.mesh.devices.shape and spec(src) == spec(dst))


def put(x: Any, sharding: Any) -> Any:
    """``jax.device_put(x, sharding)`` that also works when ``x`` and ``sharding`` are on
    different processes. Every process must call it with the same arguments in the same order
    (the multi-controller contract). A numpy array, Python scalar or uncommitted ``jax.Array``
    is a host value: every process holds the same one, and each places its own shards."""
    if isinstance(x, jax.Array) and x.committed and x.sharding == sharding:
        # where it already is (a step's state fed back): jax.device_put's own check is slower
        return x
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    if not isinstance(x, jax.Array) or not x.committed:
        if sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        host = host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx],
                                            dtype=host.dtype)
    src = x.sharding
    if src.device_set == sharding.device_set:
        return _reshard(sharding)(x)
    src_procs, dst_procs = _processes(src), _processes(sharding)
    me = jax.process_index()
    if len(src_procs) == 1 and src_procs == dst_procs:  # within one process
        if me in src_procs:
            return jax.device_put(x, sharding)
        return _placeholder(x.shape, x.dtype, sharding)
    if (len(src_procs) == 1 and len(dst_procs) == 1 and src_procs != dst_procs
            and _same_layout(src, sharding, x.ndim)):
        return jax.device_put(x, sharding)  # JAX's cross-host copy, shard by shard
    return _relay(x, sharding)


def _relay(x: Any, dst: Any) -> Any:
    """Any layout to any layout across processes: replicate on the source devices, then send
    each destination device its slice from a source device (one on its own process when there
    is one), and assemble. Simple rather than minimal in bytes."""
    shape, dtype, me = x.shape, x.dtype, jax.process_index()
    sources = sorted(x.sharding.device_set, key=lambda d: (d.process_index, d.id))
    full = _reshard(NamedSharding(Mesh(np.array(sources), ("relay",)), PartitionSpec()))(x)
    held = {s.device: s.data for s in full.addressable_shards}
    mine = []
    for k, (device, index) in enumerate(dst.devices_indices_map(shape).items()):
        local = [s for s in sources if s.process_index == device.process_index]
        source = local[0] if local else sources[k % len(sources)]
        part = tuple(len(range(*sl.indices(n))) for sl, n in zip(index, shape, strict=True))
        whole = part == tuple(shape)
        if source in held:
            piece = held[source] if whole else held[source][index]
        elif local:  # a copy inside another process: nothing to do here
            continue
        else:
            piece = _placeholder(part, dtype, SingleDeviceSharding(source))
        # a cross-process device_put is issued by every process, in the same order
        piece = jax.device_put(piece, SingleDeviceSharding(device))
        if device.process_index == me:
            mine.append(piece)
    return jax.make_array_from_single_device_arrays(shape, dst, mine, dtype=dtype)


def to_host(tree: Any) -> Any:
    """Every leaf of ``tree`` (a step's outputs) as a numpy array, on every process; every
    process must call it. Leaves on other processes' devices are copied here first."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    firsts: dict[int, jax.Device] = {}  # per process: its first device
    for d in global_devices():
        firsts.setdefault(d.process_index, d)
    everywhere = NamedSharding(Mesh(np.array(list(firsts.values())), ("p",)), PartitionSpec())

    def leaf(x: Any) -> Any:
        if not isinstance(x, jax.Array) or not x.committed:
            return np.asarray(x)
        return np.asarray(put(x, everywhere).addressable_data(0))

    return jax.tree.map(leaf, tree)


def same_plan_everywhere(plan: Any) -> Any:
    """Process 0's plan, on every process: planning runs in every process, and a plan that came
    out differently (a solver time limit, a different cache entry) must not split the run."""
    if jax.process_count() == 1:
        return plan
    from jax.experimental import multihost_utils

    from autopar.plan import Plan

    text = plan.to_json().encode()
    first = jax.process_index() == 0
    size = int(np.asarray(multihost_utils.broadcast_one_to_all(
        np.array([len(text)], np.int64), is_source=first))[0])
    buffer = np.frombuffer(text, np.uint8) if first else np.zeros(size, np.uint8)
    got = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer, is_source=first)))
    if got == text:
        return plan
    log.info("process %d takes process 0's plan (its own differed)", jax.process_index())
    return Plan.from_json(got.decode())
