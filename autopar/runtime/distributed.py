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
(``process_start._size_cpu_thread_pool``), or a send can starve behind a collective that waits
for it. Starting a process (arguments, coordinator, thread pool, the join) is in
``runtime.process_start``; moving values between processes is here.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from autopar.errors import DistributedError
from autopar.runtime.process_start import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_TRANSFER_ADDRESS,
    join,
    reach_coordinator,
    run_arguments,
    transfer_address_for,
)

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

log = logging.getLogger(__name__)


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
    arguments = run_arguments(coordinator_address, num_processes, process_id)
    if arguments is None:
        return False
    coordinator_address, num_processes, process_id = arguments
    transfer_address = transfer_address_for(transfer_address, coordinator_address, process_id)
    deadline = time.monotonic() + initialization_timeout
    reach_coordinator(coordinator_address, process_id, deadline)
    join(coordinator_address, num_processes, process_id, transfer_address, deadline,
         (initialization_timeout, heartbeat_timeout, shutdown_timeout))
    return True


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


def put_all(values: Sequence[Any], shardings: Sequence[Any]) -> list[Any]:
    """``put`` of each value (``None`` sharding: left as it is). Where one process runs, the
    values not already where they belong go in one ``jax.device_put`` of the list, which
    moves them together: a step's two batch leaves, placed one by one, took 286 us a call on
    2 CPU devices, as much as the step's program (2026-12-07)."""
    out = list(values)
    todo = [k for k, (x, s) in enumerate(zip(values, shardings, strict=True))
            if s is not None and not (isinstance(x, jax.Array) and x.committed
                                      and x.sharding == s)]
    if jax.process_count() != 1:
        for k in todo:
            out[k] = put(values[k], shardings[k])
    elif todo:
        moved = jax.device_put([values[k] for k in todo], [shardings[k] for k in todo])
        for k, value in zip(todo, moved, strict=True):
            out[k] = value
    return out


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
