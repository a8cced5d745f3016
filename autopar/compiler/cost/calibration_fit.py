"""Fitting the cost model to measured collectives and matmuls (``autopar profile``).

The runtime (:mod:`autopar.runtime.calibrate`) times collectives and matmuls on the present
devices and hands over plain samples; this module turns them into a :class:`ClusterSpec`. It
touches no devices.

Collectives. Every collective of the cost model is linear in its link's numbers:
``t = alpha * rounds + beta * bytes_term``, where ``rounds`` and ``bytes_term`` are what
:mod:`autopar.compiler.cost.collectives` charges (a ring all-gather: ``n-1`` rounds of
``M/n`` bytes).
We take those two features from the model's own functions, evaluated with unit alpha and beta,
so a fitted pair plugs straight back into the formulas the planner prices with. A sample is one
jitted call, which also pays a dispatch cost that a collective inside a step does not: the fit
has a free constant ``d`` for it (``t = d + alpha * rounds + beta * bytes_term``), shared by all
samples (the same devices launch every program), and drops it afterwards, so dispatch does not
end up in alpha. Within one axis and kind every sample has the same number of rounds, so alpha
and ``d`` are one column there: a per-axis fit takes ``d`` from its kind's fit over all axes,
where the group sizes differ (2, 4, 8 on a 2x4 mesh plus the 1-D mesh of 8).

The all-reduce is priced as the cheapest of its algorithms, which depends on (alpha, beta): we
fit with the ring first, re-pick every sample's cheapest algorithm under the fitted pair and refit
until the choice no longer changes (keeping the best fit seen). Each fit is a small non-negative
least squares (alpha, beta and d >= 0), solved exactly by trying every set of free variables,
on relative errors ``(model - measured) / measured``: weighted by seconds, the 16 MiB
samples would decide everything and alpha would be noise.

Which pair goes into the cluster. A one-host ``ClusterSpec`` has one link (``intra_host``) that
every mesh axis and every collective kind is priced on, so the honest answer to "which link
makes the model predict these devices best" is one joint fit over all samples (every kind, every
axis, each sample with its own kind's formula): that is the default (``link_from="all"``).
``link_from="all-reduce"`` (or another kind) takes that kind's fit over all axes instead, for
steps dominated by it (data parallelism: gradient all-reduces). Every per-kind and per-axis fit
is reported beside it, so their spread shows how far one alpha-beta link is from the devices.

Compute. The device's ``peak_flops`` per dtype is the best matmul rate measured with every
device busy at once (a step keeps all devices busy; simulated CPU devices share the host's
cores, so that rate is far below the one-device rate). ``compute_efficiency`` is then 1.0: the
rate is already an attained one. Dtypes that were not measured keep the base cluster's ratio to
float32. On a CPU (``gemm_only``) that rate is a GEMM's alone, ``device.gemm_flops``, and the
other ops keep the base's rate: XLA:CPU's matmuls run vectorised on all the host's cores, the
rest does not. (On the local suite's compute-bound GPT at hidden 256, measured / calibrated
estimate went from 1.85 to 1.30 on 8 devices and from 1.67 to 1.14 on 2, 2026-11-29.)

The runtime's own costs (``runtime_fit.fit_runtime``): ``call_s``, ``task_s`` and
``transfer_s`` are the measured medians as they are (one call, one task, one transfer); the
accumulation's bandwidth is the slope between its two sizes (the bytes added per second once
the call's own cost is out). What was not measured keeps the base cluster's figure. The link's
latency is the all-reduce latency measured inside a program where one was
(``runtime_fit.fit_in_program_latency``), the per-call fit's alpha otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autopar.calibration_samples import (
    CALIBRATED_KINDS,
    CollectiveSample,
    MatmulSample,
    RuntimeSample,
)
from autopar.cluster import ClusterSpec, DeviceSpec, LinkSpec
from autopar.compiler.cost.collectives import (
    AllReduceAlgorithm,
    all_to_all_time,
    allgather_time,
    allreduce_time,
    cheapest_allreduce,
    reduce_scatter_time,
)
from autopar.compiler.cost.gemm import fit_gemm_flops, fit_peak_flops, gemm_source
from autopar.compiler.cost.runtime_fit import (
    fit_in_program_latency,
    fit_memory_bandwidth,
    fit_runtime,
)
from autopar.errors import InvalidOptionError, choices_text
from autopar.plan import CollectiveKind

__all__ = [
    "CALIBRATED_KINDS",
    "Calibration",
    "CollectiveSample",
    "FitOptions",
    "LinkFit",
    "MIN_BETA",
    "MatmulSample",
    "calibrate_cluster",
    "fit_all",
    "fit_link",
    "fit_memory_bandwidth",
    "fit_peak_flops",
    "fit_runtime",
    "model_time",
]

_TIME_OF: dict[str, Callable[[float, int, float, float], float]] = {
    CollectiveKind.ALL_GATHER.value: allgather_time,
    CollectiveKind.REDUCE_SCATTER.value: reduce_scatter_time,
    CollectiveKind.ALL_TO_ALL.value: all_to_all_time,
}
# A beta of 0 would be an infinite bandwidth, which LinkSpec rejects: 1 PB/s stands for it.
MIN_BETA = 1e-15
_MAX_REFITS = 10


@dataclass(frozen=True)
class LinkFit:
    """Fitted ``alpha`` (s per round) and ``beta`` (s per byte) for ``kind`` on ``axis``
    (``"all"`` for a fit over every kind or axis). ``dispatch_s``: the per-call constant (fitted
    when ``dispatch_fitted``, else given), left out of the cluster. ``rms_rel_error``: root mean
    square of ``(fit - measured) / measured`` over the ``num_samples`` samples."""

    kind: str
    axis: str
    group_sizes: tuple[int, ...]
    alpha: float
    beta: float
    dispatch_s: float
    dispatch_fitted: bool
    rms_rel_error: float
    num_samples: int

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """``1 / beta``."""
        return 1.0 / max(self.beta, MIN_BETA)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"kind": self.kind, "axis": self.axis, "group_sizes": list(self.group_sizes),
                "alpha_s": self.alpha, "beta_s_per_byte": self.beta,
                "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "dispatch_s": self.dispatch_s, "dispatch_fitted": self.dispatch_fitted,
                "rms_rel_error": self.rms_rel_error, "num_samples": self.num_samples}


@dataclass(frozen=True)
class FitOptions:
    """How to turn samples into a cluster.

    ``link_from``: ``"all"`` (one joint fit over every sample) or a collective kind whose fit
    over all axes becomes the cluster's link. ``relative``: fit relative errors (else seconds).
    """

    link_from: str = "all"
    relative: bool = True

    def __post_init__(self) -> None:
        if self.link_from not in ("all", *CALIBRATED_KINDS):
            raise InvalidOptionError(f"unknown link fit '{self.link_from}'; valid: "
                                     f"{choices_text(('all', *CALIBRATED_KINDS))}")


@dataclass(frozen=True)
class Calibration:
    """The fitted cluster and everything behind it (``to_dict`` is the JSON written)."""

    cluster: ClusterSpec
    link: LinkFit
    fits: tuple[LinkFit, ...]
    peak_flops: Mapping[str, float]
    options: FitOptions = field(default_factory=FitOptions)
    measured: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The cluster's JSON (``load_cluster`` reads it) plus a ``calibration`` key it ignores."""
        return self.cluster.to_dict() | {"calibration": {
            "link_from": self.options.link_from,
            "relative_errors": self.options.relative,
            "link": self.link.to_dict(),
            "fits": [f.to_dict() for f in self.fits],
            "measured_peak_flops": dict(self.peak_flops),
            **self.measured,
        }}


def model_time(kind: str, nbytes: float, n: int, alpha: float, beta: float,
               algorithm: AllReduceAlgorithm | None = None) -> float:
    """The cost model's seconds for one ``kind`` collective (all-reduce: ``algorithm``, or the
    cheapest when None)."""
    if kind == CollectiveKind.ALL_REDUCE.value:
        return allreduce_time(nbytes, n, alpha, beta, algorithm)
    if kind not in _TIME_OF:
        raise InvalidOptionError(f"cannot fit collective '{kind}'; valid: "
                                 f"{choices_text(CALIBRATED_KINDS)}")
    return _TIME_OF[kind](nbytes, n, alpha, beta)


def _features(kind: str, nbytes: float, n: int, algorithm: AllReduceAlgorithm | None
              ) -> tuple[float, float]:
    """(rounds, bytes_term): the model's time with unit alpha, then with unit beta (it is
    linear in both, so ``t = alpha * rounds + beta * bytes_term``)."""
    return (model_time(kind, nbytes, n, 1.0, 0.0, algorithm),
            model_time(kind, nbytes, n, 0.0, 1.0, algorithm))


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||x c - y|| over c >= 0, exactly, for a few columns: the problem is convex, so its
    optimum is the unconstrained optimum on its own support; try every support (2^k lstsq
    solves for k columns) and keep the best feasible one."""
    k = x.shape[1]
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale  # alpha's and beta's columns differ by ~1e6: scale them for lstsq
    best, best_err = np.zeros(k), float(np.linalg.norm(y))
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        c, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
        if (c < 0).any():
            continue
        cand = np.zeros(k)
        cand[cols] = c
        err = float(np.linalg.norm(xs @ cand - y))
        if err < best_err:
            best, best_err = cand, err
    return best / scale


def _rms_rel(samples: Sequence[CollectiveSample], alpha: float, beta: float,
             dispatch: float) -> float:
    errs = [(dispatch + model_time(s.kind, s.nbytes, s.group_size, alpha, beta) - s.seconds)
            / s.seconds for s in samples]
    return float(math.sqrt(sum(e * e for e in errs) / len(errs)))


def fit_link(samples: Sequence[CollectiveSample], kind: str = "all", axis: str = "all",
             relative: bool = True, dispatch_s: float | None = None) -> LinkFit:
    """Least-squares (alpha, beta) >= 0 so that the cost model's formulas plus a per-call
    constant reproduce ``samples`` (see the module docstring). ``dispatch_s``: that constant, or
    None to fit it too (needs samples with different numbers of rounds). ``kind`` and ``axis``
    only label the result."""
    rows = [s for s in samples if s.group_size > 1 and s.seconds > 0]
    if not rows:
        raise InvalidOptionError(f"no timed collectives to fit for {kind} on axis {axis} (a "
                                 "group of one device has nothing to time)")
    y = np.array([s.seconds for s in rows])
    weight = 1.0 / y if relative else np.ones_like(y)
    target = y - (dispatch_s or 0.0)
    algos: list[AllReduceAlgorithm | None] = [
        AllReduceAlgorithm.RING if s.kind == CollectiveKind.ALL_REDUCE.value else None
        for s in rows]
    best: tuple[float, float, float, float] | None = None
    for _ in range(_MAX_REFITS):
        x = np.array([_features(s.kind, s.nbytes, s.group_size, a)
                      for s, a in zip(rows, algos, strict=True)])
        if dispatch_s is None:
            x = np.hstack([x, np.ones((len(rows), 1))])
        c = _nnls(x * weight[:, None], target * weight)
        alpha, beta = float(c[0]), max(float(c[1]), MIN_BETA)
        dispatch = float(c[2]) if dispatch_s is None else dispatch_s
        err = _rms_rel(rows, alpha, beta, dispatch)
        if best is None or err < best[3]:
            best = (alpha, beta, dispatch, err)
        # the model prices each all-reduce with its cheapest algorithm under (alpha, beta)
        chosen = [cheapest_allreduce(s.nbytes, s.group_size, alpha, beta)[0]
                  if a is not None else None for s, a in zip(rows, algos, strict=True)]
        if chosen == algos:
            break
        algos = chosen
    assert best is not None
    sizes = tuple(sorted({s.group_size for s in rows}))
    return LinkFit(kind=kind, axis=axis, group_sizes=sizes, alpha=best[0], beta=best[1],
                   dispatch_s=best[2], dispatch_fitted=dispatch_s is None,
                   rms_rel_error=best[3], num_samples=len(rows))


def fit_all(samples: Sequence[CollectiveSample], relative: bool = True) -> list[LinkFit]:
    """Per kind: its fit over all axes (dispatch fitted), then one per axis (with that kind's
    dispatch); last, one fit over every sample (dispatch fitted)."""
    kinds = [k for k in CALIBRATED_KINDS if any(s.kind == k for s in samples)]
    axes = list(dict.fromkeys(s.label for s in samples if s.group_size > 1))
    fits = []
    for kind in kinds:
        overall = fit_link([s for s in samples if s.kind == kind], kind, "all", relative)
        fits.append(overall)
        for axis in axes:
            rows = [s for s in samples if s.kind == kind and s.label == axis]
            if rows and len(axes) > 1:
                fits.append(fit_link(rows, kind, axis, relative, overall.dispatch_s))
    fits.append(fit_link(samples, "all", "all", relative))
    return fits


def calibrate_cluster(
    samples: Sequence[CollectiveSample],
    matmuls: Sequence[MatmulSample],
    base: ClusterSpec,
    *,
    num_devices: int,
    name: str,
    device_name: str,
    source: str,
    memory_bytes: int | None = None,
    options: FitOptions | None = None,
    measured: Mapping[str, Any] | None = None,
    runtime: Sequence[RuntimeSample] = (),
    gemm_only: bool = False,
) -> Calibration:
    """A 1-host x ``num_devices`` cluster fitted to ``samples`` and ``matmuls``.

    ``gemm_only``: the matmul rate is a GEMM's alone (``device.gemm_flops``) and every other
    op keeps ``base``'s rate and efficiency: a CPU, whose matmuls run vectorised over the
    host's cores and reach several times what the rest does (on a GPU the peak is a GEMM's
    and the rest is priced by its bytes, so the measured rate is the device's peak).

    ``base``: where what was not measured comes from (unmeasured dtypes' rates, relative to
    float32; memory when ``memory_bytes`` is None). ``measured``: extra facts recorded under
    ``calibration`` in the JSON (sizes, repeats, dispatch overhead, the samples).
    ``runtime``: the runtime's own costs measured (``fit_runtime``; else the base's)."""
    options = options or FitOptions()
    fits = fit_all(samples, options.relative)
    # fit_all puts each kind's fit over all axes first among its own, the joint fit last
    link = fits[-1] if options.link_from == "all" else next(
        (f for f in fits if f.kind == options.link_from and f.axis == "all"), None)
    if link is None:
        raise InvalidOptionError(f"no {options.link_from} samples to take the link from")
    peak = fit_gemm_flops(matmuls) if gemm_only else fit_peak_flops(matmuls)
    if "float32" not in peak:
        raise InvalidOptionError("no float32 matmul timed: the device's rate needs one")
    ratio = peak["float32"] / base.device.flops_for("float32")
    rates = {d: r * ratio for d, r in base.device.peak_flops.items()} | peak
    bandwidth = fit_memory_bandwidth(runtime)
    latency = fit_in_program_latency(runtime, link.beta)
    device = DeviceSpec(name=device_name,
                        peak_flops=dict(base.device.peak_flops) if gemm_only else rates,
                        memory_bytes=int(memory_bytes or base.device.memory_bytes),
                        memory_bandwidth_bytes_per_s=(
                            bandwidth or base.device.memory_bandwidth_bytes_per_s),
                        multiprocessors=base.device.multiprocessors,
                        kernel_launch_s=base.device.kernel_launch_s,
                        gemm_flops=rates if gemm_only else {},
                        gemm_threading_s=base.device.gemm_threading_s if gemm_only else 0.0)
    link_spec = LinkSpec(bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
                         latency_s=link.alpha if latency is None else latency)
    which = ("the joint fit over every collective and axis" if link.kind == "all"
             else f"the {link.kind} fit over every axis")
    notes = (
        f"intra_host = inter_host = {which} ({link.num_samples} samples, rms relative error "
        f"{link.rms_rel_error:.0%}; a per-call dispatch of {link.dispatch_s * 1e6:.0f} us "
        "fitted and left out); "
        "per-kind and per-axis fits under 'calibration'. "
        + (f"gemm_flops: {gemm_source(matmuls)} with all {num_devices} devices busy at once "
           f"(measured: {', '.join(sorted(peak))}; other dtypes scaled from '{base.name}'); "
           f"peak_flops and compute_efficiency, every other op's, are '{base.name}''s. "
           if gemm_only else
           f"peak_flops: best matmul rate with all {num_devices} devices busy at once "
           f"(measured: {', '.join(sorted(peak))}; other dtypes scaled from '{base.name}'), so "
           "compute_efficiency is 1.0. ")
        + ("memory_bandwidth_bytes_per_s: an element-wise kernel's bytes per second on one "
           "device with all busy (the slope between two sizes)." if bandwidth else
           "memory bandwidth not measured: element-wise ops are priced by their flops.")
        + (f" kernel_launch_s: '{base.name}''s ({base.device.kernel_launch_s * 1e6:.0f} us),"
           " not measured."
           if base.device.kernel_launch_s else "")
        + (" latency_s: the alpha under which the model prices one small all-reduce as a "
           "chain of them took inside one program (the per-call fit's alpha "
           f"{link.alpha * 1e6:.1f} us)." if latency is not None else "")
    )
    cluster = ClusterSpec(
        name=name,
        description=f"1 host x {num_devices} devices ({device_name}), by autopar profile",
        num_hosts=1, devices_per_host=num_devices, device=device, intra_host=link_spec,
        inter_host=link_spec, compute_efficiency=base.compute_efficiency if gemm_only else 1.0,
        source=source, notes=notes,
        runtime=fit_runtime(runtime, base.runtime),
    )
    return Calibration(cluster=cluster, link=link, fits=tuple(fits), peak_flops=peak,
                       options=options, measured=dict(measured or {}))
