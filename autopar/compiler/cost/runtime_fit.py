"""Fitting the runtime's own costs and what a step pays inside its programs to the samples
``autopar profile`` takes (``RuntimeSample``; :mod:`autopar.runtime.calibrate`): the memory
bandwidth with every device busy, the latency of an all-reduce inside a program, the
driver's call, task, transfer and accumulation costs, and each array's buffers in a call.
Pure: it touches no devices. :mod:`autopar.compiler.cost.calibration_fit` puts them into the
calibrated cluster.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autopar.calibration_samples import RuntimeSample
from autopar.cluster import RuntimeCosts
from autopar.compiler.cost.collectives import allreduce_time


def _slope(samples: Sequence[RuntimeSample], kind: str, by: str) -> float | None:
    """Seconds per unit of ``by`` (``"nbytes"`` or ``"count"``) between the smallest and the
    largest ``kind`` sample: the fixed costs both pay (the call's, the kernel's) cancel. None
    when fewer than two sizes were timed or the slope is not positive."""
    rows = sorted((r for r in samples if r.kind == kind), key=lambda r: getattr(r, by))
    if len(rows) < 2 or getattr(rows[-1], by) <= getattr(rows[0], by):
        return None
    slope = (rows[-1].seconds - rows[0].seconds) / (getattr(rows[-1], by) - getattr(rows[0], by))
    return slope if slope > 0 else None


def fit_memory_bandwidth(samples: Sequence[RuntimeSample]) -> float | None:
    """Bytes per second one device's element-wise kernels move with every device busy (the
    ``stream`` samples' slope); None when not measured."""
    slope = _slope(samples, "stream", "nbytes")
    return None if slope is None else 1.0 / slope


def fit_in_program_latency(samples: Sequence[RuntimeSample], beta: float) -> float | None:
    """The link latency (alpha) under which the cost model prices one small all-reduce over
    the sampled devices as it took inside a program (the ``all-reduces`` chains' slope), with
    ``beta`` as fitted: the per-call fit leaves alpha to the call's dispatch it takes out,
    which a step's collectives, many to a program, do not pay. Where the same chains were
    timed without their all-reduces (``links`` samples: each link's matmul), that slope is
    taken off. None if not measured."""
    per = _slope(samples, "all-reduces", "count")
    rows = [r for r in samples if r.kind == "all-reduces"]
    if per is None or rows[0].devices < 2:
        return None
    work = _slope(samples, "links", "count")
    if work is not None:
        per = max(per - work, 0.0)
    n, nbytes = rows[0].devices, rows[0].nbytes
    if allreduce_time(nbytes, n, 0.0, beta) >= per:
        return 0.0
    low, high = 0.0, per  # every algorithm has a round at least: the time at alpha = per >= per
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if allreduce_time(nbytes, n, mid, beta) < per else (low, mid)
    return high


def fit_runtime(samples: Sequence[RuntimeSample], base: RuntimeCosts) -> RuntimeCosts:
    """The runtime's costs from ``samples`` (``runtime.calibrate``); ``base``'s for kinds not
    measured."""
    by_kind: dict[str, list[RuntimeSample]] = {}
    for sample in samples:
        by_kind.setdefault(sample.kind, []).append(sample)

    def median(kind: str, default: float) -> float:
        rows = by_kind.get(kind)
        return float(np.median([r.seconds for r in rows])) if rows else default

    bandwidth = base.accumulate_bytes_per_s
    rows = by_kind.get("accumulate", [])
    slope = _slope(rows, "accumulate", "nbytes")
    if slope is not None:
        bandwidth = 1.0 / slope
    elif len({r.nbytes for r in rows}) == 1 and rows[0].seconds > 0:  # one size: its rate
        bandwidth = rows[0].nbytes / rows[0].seconds
    return RuntimeCosts(call_s=median("call", base.call_s), task_s=median("task", base.task_s),
                        transfer_s=median("transfer", base.transfer_s),
                        accumulate_bytes_per_s=bandwidth,
                        buffer_s=fit_buffer_s(samples, base.buffer_s),
                        feed_s=fit_feed_s(samples, base.feed_s))


def fit_buffer_s(samples: Sequence[RuntimeSample], default: float) -> float:
    """What each device buffer a call takes in or hands back costs: the ``buffers``
    programs' slope per array passed through, over its two buffers (in, out) on each
    device; ``default`` when not measured."""
    rows = [r for r in samples if r.kind == "buffers"]
    per_array = _slope(rows, "buffers", "count")
    return default if per_array is None else per_array / (2 * rows[0].devices)


def fit_feed_s(samples: Sequence[RuntimeSample], default: float) -> float:
    """What each device's piece of an array fed to a call from the default device costs: the
    ``feeds`` programs' slope per array less the ``placed`` ones', over the devices;
    ``default`` when not measured."""
    fed, placed = _slope(samples, "feeds", "count"), _slope(samples, "placed", "count")
    if fed is None or placed is None:
        return default
    devices = next(r.devices for r in samples if r.kind == "feeds")
    return max(fed - placed, 0.0) / devices
