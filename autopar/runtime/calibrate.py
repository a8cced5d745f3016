"""Timing collectives and matmuls on the present devices (``autopar profile``).

For every mesh shape (default: the 1-D mesh of all devices and a 2-D one such as 2x4), every
axis and every collective (all-reduce ``psum``, all-gather, reduce-scatter ``psum_scatter``,
all-to-all), one ``jax.shard_map`` program per message size is compiled once, warmed up and timed
``repeats`` times; the median is kept. The other axis of a 2-D mesh is split too, so all its
groups run their collective at the same time, as they do in a sharded step.

Message sizes follow the cost model's full-tensor convention
(:mod:`autopar.compiler.cost.collectives`):
the buffer of an all-reduce, the input of a reduce-scatter, the gathered result of an all-gather,
the whole logical tensor of an all-to-all; each is rounded so its blocks divide evenly.

A sample is the median time of one call, dispatch included: the fit takes a constant out for
it. The median time of an empty ``shard_map`` program (``x + 1`` on a few elements) on
each mesh is recorded beside it, as a check. A sample stops early once its timed calls add up to
``max_sample_s`` (after three calls at least): the 16 MiB programs need no more to settle, and
compiling one program per size and kind is most of the run anyway.

The runtime's own costs (``RuntimeSample``): a call of a trivial jitted program over all
devices (what a one-stage step pays once), one with 16 small operands on half the devices (a
pipeline task on a stage), a ``jax.device_put`` of a small array to another device (a transfer
between stages) and a donated ``acc + g`` on one device at two sizes (the gradient
accumulation's bandwidth), and an element-wise kernel on every device at once at two sizes
(the memory bandwidth a fused kernel sees), and programs of 9 and 17 small all-reduces (the
slope: an all-reduce's latency inside a step). Calls go back to back, waited for at the end,
as the pipeline driver issues them; the median over rounds is kept.

Matmuls: ``m x m`` by ``m x m`` in each dtype, on one device alone and on every device at once
(``shard_map`` of a local matmul); the fit uses the latter, since a step keeps every device busy
(simulated CPU devices share the host's cores: with 8 of them busy each gets about an eighth).

The fit (pure, no devices) is :mod:`autopar.compiler.cost.calibration_fit`; ``autopar profile``
(:func:`autopar.cli.profile.calibrate_profile`) joins the two.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autopar.calibration_samples import (
    CALIBRATED_KINDS,
    CollectiveSample,
    MatmulSample,
    RuntimeSample,
)
from autopar.cluster import format_mesh_shape
from autopar.errors import InvalidOptionError, MeshError, choices_text

__all__ = [
    "ACCELERATOR_MATMUL_SIZES",
    "CPU_MATMUL_SIZES",
    "ProfileOptions",
    "ProfileResult",
    "default_mesh_shapes",
    "profile_devices",
    "profile_runtime",
    "size_range",
]

logger = logging.getLogger(__name__)

_AXIS_NAMES = ("x", "y")
_MIN_REPEATS_WHEN_SLOW = 3
CPU_MATMUL_SIZES = (128, 256, 512)  # 512^3 with 8 devices on 2 cores: ~0.1 s a call
ACCELERATOR_MATMUL_SIZES = (1024, 2048, 4096)


def size_range(low: int, high: int, factor: int = 4) -> tuple[int, ...]:
    """``low, low*factor, ...`` up to ``high`` inclusive (``high`` added if the steps miss it)."""
    if low < 1 or high < low or factor < 2:
        raise InvalidOptionError(f"bad size range {low}..{high} (x{factor}): need "
                                 "1 <= low <= high and a factor of at least 2")
    sizes = [low]
    while sizes[-1] * factor <= high:
        sizes.append(sizes[-1] * factor)
    if sizes[-1] != high:
        sizes.append(high)
    return tuple(sizes)


def default_mesh_shapes(num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The 1-D mesh of all devices and, when ``num_devices`` factors, the most square 2-D mesh
    (8 devices: 2x4 and 8)."""
    a = max(d for d in range(1, math.isqrt(num_devices) + 1) if num_devices % d == 0)
    two_d = ((a, num_devices // a),) if a > 1 else ()
    return (*two_d, (num_devices,))


@dataclass(frozen=True)
class ProfileOptions:
    """What ``profile_devices`` times.

    ``mesh_shapes``: empty for :func:`default_mesh_shapes`; each must use every device.
    ``sizes``: message sizes in bytes (full-tensor convention). ``repeats``: timed calls per
    sample (the median is kept) after ``warmup`` untimed ones (the first compiles).
    ``max_sample_s``: stop timing a sample once its calls add up to this (three calls at
    least). ``matmul_sizes``: square matmul sides (default by platform: an accelerator needs
    large ones to leave the dispatch-bound range); ``matmul_dtypes`` must include float32.
    """

    mesh_shapes: tuple[tuple[int, ...], ...] = ()
    sizes: tuple[int, ...] = field(default_factory=lambda: size_range(4 << 10, 16 << 20))
    repeats: int = 5
    warmup: int = 1
    max_sample_s: float = 0.25
    kinds: tuple[str, ...] = CALIBRATED_KINDS
    matmul_sizes: tuple[int, ...] = ()  # empty: CPU_MATMUL_SIZES or ACCELERATOR_MATMUL_SIZES
    matmul_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    dtype: str = "float32"  # of the collectives' buffers

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 1:
            raise InvalidOptionError(f"repeats must be at least 1 (got {self.repeats}) and "
                                     f"warmup at least 1, the call that compiles (got "
                                     f"{self.warmup})")
        if not self.sizes or min(self.sizes) < 1:
            raise InvalidOptionError(f"message sizes must be positive bytes, got {self.sizes}")
        bad = [k for k in self.kinds if k not in CALIBRATED_KINDS]
        if bad or not self.kinds:
            raise InvalidOptionError(f"unknown collective(s) {bad or '(none)'}; valid: "
                                     f"{choices_text(CALIBRATED_KINDS)}")
        if "float32" not in self.matmul_dtypes or min(self.matmul_sizes, default=1) < 1:
            raise InvalidOptionError("matmul_dtypes must include float32 and matmul_sizes be "
                                     "positive")


@dataclass(frozen=True)
class ProfileResult:
    """Everything measured: samples plus what the cluster file records about the run."""

    platform: str
    device_kind: str
    num_devices: int
    mesh_shapes: tuple[tuple[int, ...], ...]
    collectives: tuple[CollectiveSample, ...]
    matmuls: tuple[MatmulSample, ...]
    empty_program_s: dict[str, float]  # per mesh shape ("2x4"): an empty program's median time
    memory_bytes: int | None
    started: str  # ISO time, UTC
    elapsed_s: float
    options: ProfileOptions = field(default_factory=ProfileOptions)
    runtime: tuple[RuntimeSample, ...] = ()


def _median_time(fn: Callable[..., Any], args: Sequence[Any], options: ProfileOptions) -> float:
    """Median seconds of ``fn(*args)`` after ``options.warmup`` calls (the first compiles)."""
    for _ in range(options.warmup):
        jax.block_until_ready(fn(*args))
    times: list[float] = []
    while len(times) < options.repeats:
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
        if sum(times) > options.max_sample_s and len(times) >= _MIN_REPEATS_WHEN_SLOW:
            break
    return statistics.median(times)


def _local_elems(kind: str, nbytes: int, n: int, itemsize: int) -> tuple[int, int]:
    """Elements each device holds for a ``kind`` of ``nbytes`` over ``n`` devices, and the bytes
    that really moves in the full-tensor convention (after rounding to whole blocks)."""
    elems = max(1, round(nbytes / itemsize))
    if kind == "all-reduce":
        return elems, elems * itemsize
    if kind == "reduce-scatter":
        local = max(1, round(elems / n)) * n  # scattered into n equal blocks
        return local, local * itemsize
    if kind == "all-gather":
        local = max(1, round(elems / n))
        return local, local * n * itemsize
    local = max(1, round(elems / (n * n))) * n  # all-to-all: n blocks per device
    return local, local * n * itemsize


def _collective_body(kind: str, axis: str) -> Callable[[jax.Array], jax.Array]:
    def body(x: jax.Array) -> jax.Array:
        last = x.ndim - 1
        if kind == "all-reduce":
            return jax.lax.psum(x, axis)
        if kind == "all-gather":
            return jax.lax.all_gather(x, axis, axis=last, tiled=True)
        if kind == "reduce-scatter":
            return jax.lax.psum_scatter(x, axis, scatter_dimension=last, tiled=True)
        return jax.lax.all_to_all(x, axis, last, last, tiled=True)
    return body


def _sharded_ones(mesh: Mesh, local: int, dtype: Any) -> jax.Array:
    """A (*mesh.shape, local) array, one (1, .., local) block per device, made on the devices."""
    # device_put of a host array: no program to compile per shape (compiles dominate the run)
    host = np.ones((*mesh.devices.shape, local), dtype)
    return jax.device_put(host, NamedSharding(mesh, P(*mesh.axis_names, None)))


def _square_matmul(x: jax.Array, m: int) -> jax.Array:
    """One device's ``m`` x ``m`` matmul of its row of ``m * m`` elements by itself."""
    return (x.reshape(m, m) @ x.reshape(m, m)).reshape(1, m * m)


def _shard_mapped(mesh: Mesh, body: Callable[[jax.Array], jax.Array]) -> Callable[..., Any]:
    spec = P(*mesh.axis_names, None)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=False))


def _time_collectives(mesh: Mesh, options: ProfileOptions) -> list[CollectiveSample]:
    dtype = jnp.dtype(options.dtype)
    label = format_mesh_shape(mesh.devices.shape)
    out = []
    for axis in mesh.axis_names:
        n = mesh.shape[axis]
        if n == 1:
            continue
        for kind in options.kinds:
            fn = _shard_mapped(mesh, _collective_body(kind, axis))
            for nbytes in options.sizes:
                local, moved = _local_elems(kind, nbytes, n, dtype.itemsize)
                x = _sharded_ones(mesh, local, dtype)
                seconds = _median_time(fn, (x,), options)
                out.append(CollectiveSample(kind=kind, mesh=label, axis=axis, group_size=n,
                                            nbytes=float(moved), seconds=seconds))
                del x  # free the buffers before the next size
            logger.info("timed %s on %s:%s (%d devices): %s", kind, label, axis, n,
                        ", ".join(f"{s.seconds * 1e6:.0f} us" for s in out[-len(options.sizes):]))
    return out


def _time_matmuls(devices: Sequence[Any], options: ProfileOptions) -> list[MatmulSample]:
    out = []
    everyone = Mesh(np.array(devices), ("d",))
    sizes = options.matmul_sizes or (
        CPU_MATMUL_SIZES if devices[0].platform == "cpu" else ACCELERATOR_MATMUL_SIZES)
    for dtype_name in options.matmul_dtypes:
        dtype = jnp.dtype(dtype_name)
        for m in sizes:
            one = jax.device_put(np.ones((m, m), dtype), devices[0])
            single = _median_time(jax.jit(jnp.matmul), (one, one), options)
            out.append(MatmulSample(dtype_name, m, m, m, single, concurrent=False))
            if len(devices) > 1:
                a = _sharded_ones(everyone, m * m, dtype)
                fn = _shard_mapped(everyone, partial(_square_matmul, m=m))
                busy = _median_time(fn, (a,), options)
                out.append(MatmulSample(dtype_name, m, m, m, busy, concurrent=True))
            logger.info("timed %s matmul %d^3: %.3g GFLOP/s on one device, %.3g with all busy",
                        dtype_name, m, out[-1 - (len(devices) > 1)].flops_per_s / 1e9,
                        out[-1].flops_per_s / 1e9)
    return out


_CALLS_PER_ROUND = 20
_RUNTIME_ROUNDS = 5
_ACCUMULATE_BYTES = (1 << 20, 16 << 20)
# Per device: an element-wise kernel on every device at once, at two sizes (the slope is the
# memory bandwidth a fused kernel sees; the call's and the kernel's fixed costs cancel).
_STREAM_BYTES = (256 << 10, 4 << 20)
# Chain lengths of the in-program all-reduces: long enough that running them takes longer
# than issuing the call (calls go back to back, so a short chain's time is the dispatch's,
# about 0.3 ms on 8 CPU devices), and the elements each device all-reduces: few enough that
# only latency counts.
_ALL_REDUCE_CHAINS = (9, 17)
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


def _time_runtime(devices: Sequence[Any]) -> list[RuntimeSample]:
    """The runtime's own costs on ``devices`` (see the module docstring)."""
    n = len(devices)
    out = []
    every = Mesh(np.array(devices), ("d",))
    trivial = jax.jit(lambda x: x + 1)
    x = _sharded_ones(every, 16, jnp.float32)
    out.append(RuntimeSample("call", n, 0.0, _per_call(lambda: trivial(x))))
    half = max(1, n // 2)
    stage = Mesh(np.array(devices[:half]), ("d",))
    operands = [_sharded_ones(stage, 16, jnp.float32) for _ in range(16)]
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
        v = _sharded_ones(every, nbytes // 4, jnp.float32)
        # bytes moved per device: its part read once and written once
        out.append(RuntimeSample("stream", n, 2.0 * nbytes,
                                 _per_call(partial(scale, v), calls=5)))
    small = _sharded_ones(every, _LATENCY_ELEMENTS, jnp.float32)
    for count in _ALL_REDUCE_CHAINS:
        reduces = jax.jit(_shard_mapped(every, partial(_all_reduce_chain, axis="d",
                                                       count=count)))
        out.append(RuntimeSample("all-reduces", n, float(_LATENCY_ELEMENTS * 4),
                                 _per_call(partial(reduces, small), calls=5), count=count))
    for sample in out:
        logger.info("runtime %s (%d device(s), %d bytes, %d): %.0f us", sample.kind,
                    sample.devices, sample.nbytes, sample.count, sample.seconds * 1e6)
    return out


def _all_reduce_chain(x: jax.Array, axis: str, count: int) -> jax.Array:
    """``count`` all-reduces of ``x`` over ``axis``, each reading the one before."""
    for _ in range(count):
        x = jax.lax.optimization_barrier(jax.lax.psum(x, axis) * 0.5)
    return x


def _memory_bytes(device: Any) -> int | None:
    """The device's memory limit when the backend reports one (CPU devices do not)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats raise various errors
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def profile_devices(options: ProfileOptions | None = None,
                    devices: Sequence[Any] | None = None) -> ProfileResult:
    """Time collectives on every axis of each mesh over ``devices`` (default: all) and matmuls;
    see the module docstring."""
    options = options or ProfileOptions()
    devices = list(jax.devices() if devices is None else devices)
    count = len(devices)
    shapes = options.mesh_shapes or default_mesh_shapes(count)
    for shape in shapes:
        if not 1 <= len(shape) <= 2:
            raise MeshError(f"mesh {format_mesh_shape(shape)} has {len(shape)} dimensions; "
                            "profile times 1-D or 2-D meshes")
        if math.prod(shape) != count:
            raise MeshError(f"mesh {format_mesh_shape(shape)} does not cover the {count} "
                            f"device(s): use shapes whose product is {count}")
    if all(d == 1 for shape in shapes for d in shape):
        raise MeshError(f"no mesh axis has more than one device ({count} device(s)): nothing "
                        "to time collectives over")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    start = time.perf_counter()
    samples: list[CollectiveSample] = []
    empty: dict[str, float] = {}
    for shape in shapes:
        mesh = Mesh(np.array(devices).reshape(shape), _AXIS_NAMES[: len(shape)])
        label = format_mesh_shape(shape)
        empty[label] = _median_time(_shard_mapped(mesh, lambda x: x + 1),
                                    (_sharded_ones(mesh, 16, jnp.float32),), options)
        logger.info("mesh %s: empty program %.0f us", label, empty[label] * 1e6)
        samples += _time_collectives(mesh, options)
    matmuls = _time_matmuls(devices, options)
    runtime = _time_runtime(devices)
    return ProfileResult(
        platform=devices[0].platform, device_kind=str(devices[0].device_kind),
        num_devices=count, mesh_shapes=tuple(tuple(s) for s in shapes),
        collectives=tuple(samples), matmuls=tuple(matmuls), empty_program_s=empty,
        memory_bytes=_memory_bytes(devices[0]), started=started,
        elapsed_s=time.perf_counter() - start, options=options, runtime=tuple(runtime),
    )


def profile_runtime(devices: Sequence[Any] | None = None) -> tuple[RuntimeSample, ...]:
    """Only the runtime's own costs (see the module docstring), on ``devices`` (default:
    all): a few seconds, for a cluster description's ``runtime`` entry."""
    return tuple(_time_runtime(list(jax.devices() if devices is None else devices)))
