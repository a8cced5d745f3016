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

The runtime's own costs (``RuntimeSample``) are timed last: :mod:`autopar.runtime.runtime_timing`.

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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.calibration_samples import (
    CALIBRATED_KINDS,
    CollectiveSample,
    MatmulSample,
    RuntimeSample,
)
from autopar.cluster import format_mesh_shape
from autopar.errors import InvalidOptionError, MeshError, choices_text
from autopar.runtime.runtime_timing import (
    ALL_REDUCE_CHAINS,
    BUFFER_COUNTS,
    profile_runtime,
    shard_mapped,
    sharded_ones,
    time_runtime,
)

__all__ = [
    "ACCELERATOR_MATMUL_SIZES",
    "ALL_REDUCE_CHAINS",
    "BUFFER_COUNTS",
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
# a dense layer's rows x inputs x outputs, small to large (``_time_dense_layers``): the GEMMs a
# CPU step runs reach several rates by their sizes and forms (the largest, with 8 devices on 2
# cores, about 35 ms a call)
CPU_DENSE_LAYERS = ((256, 64, 256), (512, 128, 384), (1024, 256, 768))
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
    ``dense_layers``: a dense layer's rows x inputs x outputs, its three GEMMs timed as a
    training step runs them (default: ``CPU_DENSE_LAYERS`` on CPU devices, none elsewhere).
    """

    mesh_shapes: tuple[tuple[int, ...], ...] = ()
    sizes: tuple[int, ...] = field(default_factory=lambda: size_range(4 << 10, 16 << 20))
    repeats: int = 5
    warmup: int = 1
    max_sample_s: float = 0.25
    kinds: tuple[str, ...] = CALIBRATED_KINDS
    matmul_sizes: tuple[int, ...] = ()  # empty: CPU_MATMUL_SIZES or ACCELERATOR_MATMUL_SIZES
    matmul_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    dense_layers: tuple[tuple[int, int, int], ...] = ()
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
        if "float32" not in self.matmul_dtypes or min(self.matmul_sizes, default=1) < 1 \
                or any(min(shape) < 1 for shape in self.dense_layers):
            raise InvalidOptionError("matmul_dtypes must include float32 and matmul_sizes "
                                     "and dense_layers be positive")


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


def _square_matmul(x: jax.Array, m: int) -> jax.Array:
    """One device's ``m`` x ``m`` matmul of its row of ``m * m`` elements by itself."""
    return (x.reshape(m, m) @ x.reshape(m, m)).reshape(1, m * m)


def _time_collectives(mesh: Mesh, options: ProfileOptions) -> list[CollectiveSample]:
    dtype = jnp.dtype(options.dtype)
    label = format_mesh_shape(mesh.devices.shape)
    out = []
    for axis in mesh.axis_names:
        n = mesh.shape[axis]
        if n == 1:
            continue
        for kind in options.kinds:
            fn = shard_mapped(mesh, _collective_body(kind, axis))
            for nbytes in options.sizes:
                local, moved = _local_elems(kind, nbytes, n, dtype.itemsize)
                x = sharded_ones(mesh, local, dtype)
                seconds = _median_time(fn, (x,), options)
                out.append(CollectiveSample(kind=kind, mesh=label, axis=axis, group_size=n,
                                            nbytes=float(moved), seconds=seconds))
                del x  # free the buffers before the next size
            logger.info("timed %s on %s:%s (%d devices): %s", kind, label, axis, n,
                        ", ".join(f"{s.seconds * 1e6:.0f} us" for s in out[-len(options.sizes):]))
    return out


def _dense_layer(x: jax.Array, w: jax.Array, dy: jax.Array) -> tuple[jax.Array, ...]:
    """One device's dense layer GEMMs as a training step runs them: the forward, the input's
    gradient (the kernel transposed) and the kernel's (the input transposed)."""
    x, w, dy = x[0], w[0], dy[0]
    return (x @ w)[None], (dy @ w.T)[None], (x.T @ dy)[None]


def _time_dense_layers(devices: Sequence[Any], dtype_name: str,
                       options: ProfileOptions) -> list[MatmulSample]:
    """``_dense_layer`` on every device at once, at each of ``options.dense_layers``'
    shapes (``CPU_DENSE_LAYERS`` when it gives none)."""
    everyone = Mesh(np.array(devices), ("d",))
    fn = shard_mapped(everyone, _dense_layer)
    out = []
    for m, k, n in options.dense_layers or CPU_DENSE_LAYERS:
        shapes = ((m, k), (k, n), (m, n))
        args = [jax.device_put(np.ones((len(devices), *s), jnp.dtype(dtype_name)),
                               NamedSharding(everyone, PartitionSpec("d"))) for s in shapes]
        out.append(MatmulSample(dtype_name, m, n, k, _median_time(fn, tuple(args), options),
                                concurrent=True, gemms=3))
    return out


def _time_matmuls(devices: Sequence[Any], options: ProfileOptions) -> list[MatmulSample]:
    out = []
    everyone = Mesh(np.array(devices), ("d",))
    cpu = devices[0].platform == "cpu"
    sizes = options.matmul_sizes or (CPU_MATMUL_SIZES if cpu else ACCELERATOR_MATMUL_SIZES)
    for dtype_name in options.matmul_dtypes:
        dtype = jnp.dtype(dtype_name)
        if cpu or options.dense_layers:
            out.extend(_time_dense_layers(devices, dtype_name, options))
        for m in sizes:
            one = jax.device_put(np.ones((m, m), dtype), devices[0])
            single = _median_time(jax.jit(jnp.matmul), (one, one), options)
            out.append(MatmulSample(dtype_name, m, m, m, single, concurrent=False))
            if len(devices) > 1:
                a = sharded_ones(everyone, m * m, dtype)
                fn = shard_mapped(everyone, partial(_square_matmul, m=m))
                busy = _median_time(fn, (a,), options)
                out.append(MatmulSample(dtype_name, m, m, m, busy, concurrent=True))
            logger.info("timed %s matmul %d^3: %.3g GFLOP/s on one device, %.3g with all busy",
                        dtype_name, m, out[-1 - (len(devices) > 1)].flops_per_s / 1e9,
                        out[-1].flops_per_s / 1e9)
    return out


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
        empty[label] = _median_time(shard_mapped(mesh, lambda x: x + 1),
                                    (sharded_ones(mesh, 16, jnp.float32),), options)
        logger.info("mesh %s: empty program %.0f us", label, empty[label] * 1e6)
        samples += _time_collectives(mesh, options)
    matmuls = _time_matmuls(devices, options)
    runtime = time_runtime(devices)
    return ProfileResult(
        platform=devices[0].platform, device_kind=str(devices[0].device_kind),
        num_devices=count, mesh_shapes=tuple(tuple(s) for s in shapes),
        collectives=tuple(samples), matmuls=tuple(matmuls), empty_program_s=empty,
        memory_bytes=_memory_bytes(devices[0]), started=started,
        elapsed_s=time.perf_counter() - start, options=options, runtime=tuple(runtime),
    )
