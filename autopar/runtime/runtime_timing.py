"""Timing the runtime's own costs on the present devices (``RuntimeSample``, part of
``autopar profile``; :mod:`autopar.runtime.calibrate` times the collectives and matmuls).

A call of a trivial jitted program over all devices (what a one-stage step pays once), one
with 16 small operands on half the devices (a pipeline task on a stage), a
``jax.device_put`` of a small array to another device (a transfer between stages) and a
donated ``acc + g`` on one device at two sizes (the gradient accumulation's bandwidth), an
element-wise kernel on every device at once at two sizes (the memory bandwidth a fused kernel
sees), a program passing 4 and 36 small arrays through (what each array a step's call takes
and gives back costs) and one reading as many fed from the default device and already placed
(what each batch array costs the call), and programs of 8 and 40 links of a small matmul and
an all-reduce, beside the same links without the all-reduce (the difference of their slopes: an
all-reduce's latency inside a step). Calls go back to back, waited for at the end, as the
pipeline driver issues them; the median over rounds is kept.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autopar.calibration_samples import RuntimeSample

logger = logging.getLogger(__name__)


def sharded_ones(mesh: Mesh, local: int, dtype: Any) -> jax.Array:
    """A (*mesh.shape, local) array, one (1, .., local) block per device, made on the devices."""
    # device_put of a host array: no program to compile per shape (compiles dominate the run)
    host = np.ones((*mesh.devices.shape, local), dtype)
    return jax.device_put(host, NamedSharding(mesh, P(*mesh.axis_names, None)))


def shard_mapped(mesh: Mesh, body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` per device over every axis of ``mesh``, jitted."""
    spec = P(*mesh.axis_names, None)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=False))


_CALLS_PER_ROUND = 20
_RUNTIME_ROUNDS = 5
_ACCUMULATE_BYTES = (1 << 20, 16 << 20)
# Per device: an element-wise kernel on every device at once, at two sizes (the slope is the
# memory bandwidth a fused kernel sees; the call's and the kernel's fixed costs cancel).
_STREAM_BYTES = (256 << 10, 4 << 20)
# Chain lengths of the in-program all-reduces: long enough that running them takes longer
# than issuing the call (calls go back to back, so a short chain's time is the dispatch's,
# about 0.3 ms on 8 CPU devices), and far enough apart that the slope is above the noise:
# 9 and 17 on 2 CPU devices timed 646 and 385 us (2026-11-29), a slope below zero that left
# the calibrated latency at 0, where chains of 4 to 128 give 83-88 us an all-reduce
# (226 us on 8 devices). And the elements each device all-reduces: few enough that only
# latency counts. Each link computes a little before its all-reduce, as a step does: chains of
# bare all-reduces, back to back, ran either at 6-9 us an all-reduce on 2 CPU devices or at
# 60-85, by how the devices' threads fell on the cores from one profile to the next (the
# calibrated file of 2026-12-07 11:25 took 7 us), where a step's all-reduces, between its
# kernels, took 60-90 us every time; with a 16x16 matmul and tanh in each link, 79-91 us in
# six runs (8 devices: 180-186 us, as bare chains gave; 2026-12-07). The same links without the
# all-reduce are timed too, and their slope taken off.
ALL_REDUCE_CHAINS = (8, 40)
# A step's call takes each of its arrays in and hands each back, a buffer per device each way:
# a program passing few and many small arrays through (donated: no copy) over every device.
# Passing 8 and 64 took 127 and 327 us on 2 CPU devices, 206 and 826 us on 8 (2026-12-07).
# And the batch a step is fed: a program reading as many arrays split over every device,
# given from the default device at each call (``feeds``) and already in place (``placed``).
# Eight (32 x 16) arrays fed so took 87 us more an array than placed on 2 CPU devices, 191
# us on 8 (2026-12-07).
BUFFER_COUNTS = (4, 36)
_ALL_REDUCE_ROUNDS = 15
_LATENCY_ELEMENTS = 16


def _per_call(fn: Callable[[], Any], calls: int = _CALLS_PER_ROUND,
              rounds: int = _RUNTIME_ROUNDS) -> float:
    """Median over ``rounds`` of the seconds per call of ``calls`` calls issued back to back
    and waited for at the end (after one untimed round: the first call compiles)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def time_runtime(devices: Sequence[Any]) -> list[RuntimeSample]:
    """The runtime's own costs on ``devices`` (see the module docstring)."""
    n = len(devices)
    out = []
    every = Mesh(np.array(devices), ("d",))
    trivial = jax.jit(lambda x: x + 1)
    x = sharded_ones(every, 16, jnp.float32)
    out.append(RuntimeSample("call", n, 0.0, _per_call(lambda: trivial(x))))
    half = max(1, n // 2)
    stage = Mesh(np.array(devices[:half]), ("d",))
    operands = [sharded_ones(stage, 16, jnp.float32) for _ in range(16)]
    task = jax.jit(lambda *a: [v + 1 for v in a])
    out.append(RuntimeSample("task", half, 0.0, _per_call(lambda: task(*operands))))
    small = jax.device_put(np.ones(256, np.float32), devices[0])
    target = jax.sharding.SingleDeviceSharding(devices[-1])
    out.append(RuntimeSample("transfer", 1, float(small.nbytes),
                             _per_call(lambda: jax.device_put(small, target))))
    add = jax.jit(lambda acc, g: acc + g, donate_argnums=(0,))
    for nbytes in _ACCUMULATE_BYTES:
        grad = jax.device_put(np.ones(nbytes // 4, np.float32), devices[0])
        held = {"acc": jax.device_put(np.zeros(nbytes // 4, np.float32), devices[0])}

        def accumulate(held: dict = held, grad: Any = grad) -> Any:
            held["acc"] = add(held["acc"], grad)
            return held["acc"]

        out.append(RuntimeSample("accumulate", 1, float(nbytes),
                                 _per_call(accumulate, calls=5)))
    scale = jax.jit(lambda v: v * 0.5 + 1.0)
    for nbytes in _STREAM_BYTES:
        v = sharded_ones(every, nbytes // 4, jnp.float32)
        # bytes moved per device: its part read once and written once
        out.append(RuntimeSample("stream", n, 2.0 * nbytes,
                                 _per_call(partial(scale, v), calls=5)))
    out += [RuntimeSample("buffers", n, 0.0, _time_passing(every, count), count=count)
            for count in BUFFER_COUNTS]
    out += [RuntimeSample(kind, n, 0.0, _time_feeding(every, count, kind == "placed"),
                          count=count)
            for kind in ("feeds", "placed") for count in BUFFER_COUNTS]
    out += _time_all_reduce_chains(every)
    for sample in out:
        logger.info("runtime %s (%d device(s), %d bytes, %d): %.0f us", sample.kind,
                    sample.devices, sample.nbytes, sample.count, sample.seconds * 1e6)
    return out


def _time_passing(mesh: Mesh, count: int) -> float:
    """Seconds per call of a program handing ``count`` small arrays split over ``mesh`` back
    as they came (donated), each call taking what the one before gave back."""
    held = [sharded_ones(mesh, 16, jnp.float32) for _ in range(count)]
    passing = jax.jit(lambda *arrays: arrays, donate_argnums=tuple(range(count)))

    def call() -> Any:
        held[:] = passing(*held)
        return held

    return _per_call(call)


def _time_feeding(mesh: Mesh, count: int, placed: bool) -> float:
    """Seconds per call of a program reading ``count`` small arrays split over ``mesh``,
    each given on the default device (a batch as a step is fed it) or, ``placed``, already
    split."""
    split = NamedSharding(mesh, P(mesh.axis_names))
    host = np.ones((2 * mesh.size, 16), np.float32)
    arrays = [jax.device_put(host, split) if placed else jnp.asarray(host)
              for _ in range(count)]
    # each array's own element-wise kernel, split as it came: no collective
    reading = jax.jit(lambda *a: [v + 1 for v in a], in_shardings=split, out_shardings=split)
    return _per_call(lambda: reading(*arrays))


def _time_all_reduce_chains(mesh: Mesh) -> list[RuntimeSample]:
    """Programs of ``ALL_REDUCE_CHAINS`` links, each a small matmul and an all-reduce over
    ``mesh``'s one axis (``all-reduces`` samples), and the same links without the all-reduce
    (``links``), timed in turn within each round (a slow spell of the shared cores lands on
    all of them), the median over the rounds."""
    small = sharded_ones(mesh, _LATENCY_ELEMENTS, jnp.float32)
    calls = {(kind, count): partial(jax.jit(shard_mapped(mesh, partial(
        _all_reduce_chain, axis="d", count=count, reduce=kind == "all-reduces"))), small)
        for kind in ("all-reduces", "links") for count in ALL_REDUCE_CHAINS}
    times: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    for call in calls.values():
        jax.block_until_ready(call())  # compiled before the rounds
    for _ in range(_ALL_REDUCE_ROUNDS):
        for key, call in calls.items():
            times[key].append(_per_call(call, calls=5, rounds=1))
    # each all-reduce: the (L, L) matrix a link makes
    return [RuntimeSample(kind, mesh.size, float(_LATENCY_ELEMENTS ** 2 * 4),
                          statistics.median(seen), count=count)
            for (kind, count), seen in times.items()]


def _all_reduce_chain(x: jax.Array, axis: str, count: int, reduce: bool = True) -> jax.Array:
    """``count`` links, each reading the one before: an ``(L, L)`` matmul and tanh of a
    matrix made of ``x``'s ``L`` elements, then (``reduce``) an all-reduce of it over
    ``axis``."""
    size = x.size
    m = jnp.broadcast_to(x.reshape(1, size), (size, size))
    weight = jnp.full((size, size), 0.01, x.dtype)
    for _ in range(count):
        m = jnp.tanh(m @ weight)
        if reduce:
            m = jax.lax.psum(m, axis) * 0.5
        m = jax.lax.optimization_barrier(m)
    return m[:1].reshape(x.shape)


def profile_runtime(devices: Sequence[Any] | None = None) -> tuple[RuntimeSample, ...]:
    """Only the runtime's own costs (see the module docstring), on ``devices`` (default:
    all): a few seconds, for a cluster description's ``runtime`` entry."""
    return tuple(time_runtime(list(jax.devices() if devices is None else devices)))
