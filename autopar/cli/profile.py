"""``autopar profile --out cluster.json``: calibrate the cost model on the present devices.

Times all-reduce, all-gather, reduce-scatter and all-to-all over a range of message sizes on
every axis of each mesh (``runtime/calibrate.py``), and matmuls; fits alpha, beta and the
device's flop rate (``compiler/cost/calibration_fit.py``); writes a cluster description that
``--cluster`` and ``load_cluster`` read (1 host x the local devices), with every fit and sample
under its ``calibration`` key. See the "Calibration" section of docs/cost-model.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopar.errors import InvalidOptionError

if TYPE_CHECKING:  # the command loads JAX and the fit only when it runs
    from autopar.cluster import ClusterSpec
    from autopar.compiler.cost.calibration_fit import Calibration, FitOptions
    from autopar.runtime.calibrate import ProfileResult

__all__ = ["add_profile_parser", "calibrate_profile", "format_calibration", "parse_meshes",
           "parse_size", "parse_sizes", "run_profile"]

logger = logging.getLogger(__name__)

_LINKS = ("all", "all-reduce", "all-gather", "reduce-scatter", "all-to-all")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)
_MAX_SIZE = 1 << 32  # 4 GiB per message: beyond it the run would not fit in device memory


def add_profile_parser(sub: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    """Register ``autopar profile`` on the subparsers ``sub``; ``parser_class`` is the CLI's
    parser class, which ``sub`` already makes its parsers of (checked)."""
    from autopar.cli.options import add_log_level

    p = sub.add_parser(
        "profile", help="time collectives and matmuls here; write a calibrated cluster JSON",
        description="Time all-reduce, all-gather, reduce-scatter and all-to-all over a range of "
                    "message sizes on each axis of the present devices, and matmul throughput; "
                    "fit alpha, beta and flops; write a cluster description usable as "
                    "--cluster.",
    )
    if not isinstance(p, parser_class):  # one-line usage errors rely on it
        raise TypeError(f"'profile' parser is a {type(p).__name__}, not {parser_class.__name__}")
    p.add_argument("--out", required=True, metavar="FILE", help="the cluster JSON to write")
    p.add_argument("--devices", type=int, default=None,
                   help="simulate N CPU devices when no accelerator is present (default 8)")
    p.add_argument("--sizes", default="4K-16M", metavar="LO-HI|S,S,...",
                   help="message sizes in bytes (K, M, G: KiB, MiB, GiB): a range in x4 steps, "
                        "or a list (default 4K-16M)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed calls per sample, median kept (default 5; large messages stop "
                        "after 0.25 s)")
    p.add_argument("--meshes", default=None, metavar="AxB,N",
                   help="mesh shapes to time, each covering all devices (default: a 2-D mesh "
                        "such as 2x4 and the 1-D mesh of all devices)")
    p.add_argument("--link", default="all", choices=_LINKS,
                   help="which fit becomes the cluster's link: one over every collective "
                        "(default) or one kind's")
    p.add_argument("--base-cluster", default="cpu-sim", metavar="NAME",
                   help="cluster whose memory and unmeasured dtype rates are kept "
                        "(default cpu-sim)")
    add_log_level(p, argparse.SUPPRESS)


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"16MiB"`` -> 16777216; one-line error on anything else."""
    match = _SIZE_RE.match(text)
    if not match:
        raise InvalidOptionError(f"--sizes: bad size '{text}'; expected bytes such as 4096, "
                                 "4K, 16M or 1G")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if not 1 <= value <= _MAX_SIZE:
        raise InvalidOptionError(f"--sizes: size '{text}' must be between 1 byte and 4G")
    return value


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"4K-16M"`` (x4 steps, both ends included) or ``"4K,64K,1M"``."""
    from autopar.runtime.calibrate import size_range

    if "," in text or "-" not in text:
        sizes = tuple(sorted({parse_size(part) for part in text.split(",") if part.strip()}))
        if not sizes:
            raise InvalidOptionError(f"--sizes: no size in '{text}'")
        return sizes
    low_text, _, high_text = text.partition("-")
    low, high = parse_size(low_text), parse_size(high_text)
    if high < low:
        raise InvalidOptionError(f"--sizes: range '{text}' runs backwards; write LO-HI")
    return size_range(low, high)


def parse_meshes(text: str) -> tuple[tuple[int, ...], ...]:
    """``"2x4,8"`` -> ``((2, 4), (8,))``."""
    from autopar.cluster import parse_mesh_shape

    shapes = tuple(parse_mesh_shape(part) for part in text.split(",") if part.strip())
    if not shapes:
        raise InvalidOptionError(f"--meshes: no mesh shape in '{text}'")
    return shapes


def _check_writable(path_text: str) -> Path:
    """Fail before minutes of timing, not after, when ``--out`` cannot be written."""
    path = Path(path_text)
    folder = path.parent  # "." for a bare file name
    if path.is_dir():
        raise InvalidOptionError(f"cannot write --out file '{path}': it is a directory")
    if not folder.is_dir():
        raise InvalidOptionError(f"cannot write --out file '{path}': no directory '{folder}'")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InvalidOptionError(f"cannot write --out file '{path}': permission denied")
    return path


def run_profile(args: argparse.Namespace) -> int:
    """``autopar profile``: measure, fit, print the fits, write ``--out``."""
    from autopar.cluster import load_cluster
    from autopar.compiler.cost.calibration_fit import FitOptions

    sizes = parse_sizes(args.sizes)
    meshes = parse_meshes(args.meshes) if args.meshes is not None else ()
    if args.repeats < 1:
        raise InvalidOptionError(f"--repeats must be at least 1, got {args.repeats}")
    fit_options = FitOptions(link_from=args.link)
    base = load_cluster(args.base_cluster)
    out = _check_writable(args.out)

    from autopar.cli.compile import set_local_devices

    set_local_devices(args.devices if args.devices is not None else 8)
    from autopar.frontend.progress import Progress
    from autopar.runtime.calibrate import ProfileOptions, profile_devices

    options = ProfileOptions(mesh_shapes=meshes, sizes=sizes, repeats=args.repeats)
    with Progress() as progress, progress.phase("timing collectives and matmuls"):
        result = profile_devices(options)
    calibration = calibrate_profile(result, base, fit_options)
    print(format_calibration(calibration, result.elapsed_s))
    try:
        out.write_text(json.dumps(calibration.to_dict(), indent=2) + "\n")
    except OSError as exc:
        raise InvalidOptionError(f"cannot write --out file '{out}': {exc.strerror}") from exc
    print(f"wrote {out}")
    return 0


def format_calibration(calibration: Any, elapsed_s: float) -> str:
    """The fits as a short text table, then the cluster's link and flop rates."""
    from autopar.compiler.cost.calibration_fit import MIN_BETA

    cluster = calibration.cluster
    lines = [f"autopar profile: {cluster.name}, {cluster.num_devices} devices, "
             f"measured in {elapsed_s:.1f} s",
             f"{'collective':<15} {'axis':<7} {'n':>5} {'alpha us':>9} {'GB/s':>9} "
             f"{'dispatch us':>11} {'rms err':>8}"]
    for f in calibration.fits:
        sizes = ",".join(str(n) for n in f.group_sizes)
        # a beta fitted to 0 (the sizes never left the latency-bound range) is no bandwidth
        gbps = f"{f.bandwidth_bytes_per_s / 1e9:.3g}" if f.beta > MIN_BETA else "inf"
        lines.append(f"{f.kind:<15} {f.axis:<7} {sizes:>5} {f.alpha * 1e6:>9.2f} {gbps:>9} "
                     f"{f.dispatch_s * 1e6:>11.0f} {f.rms_rel_error:>7.0%}")
    link = cluster.intra_host
    lines.append(f"cluster link ({calibration.link.kind} fit): latency "
                 f"{link.latency_s * 1e6:.2f} us, bandwidth "
                 f"{link.bandwidth_bytes_per_s / 1e9:.3g} GB/s")
    rates = ", ".join(f"{d} {r / 1e9:.3g}" for d, r in sorted(calibration.peak_flops.items()))
    lines.append(f"matmul GFLOP/s per device, all busy: {rates}")
    bandwidth = cluster.device.memory_bandwidth_bytes_per_s
    lines.append("element-wise kernels per device, all busy: " + (
        f"{bandwidth / 1e9:.3g} GB/s" if bandwidth else "not measured (priced by flops)"))
    rt = cluster.runtime
    lines.append(f"runtime: call {rt.call_s * 1e6:.0f} us (and {rt.buffer_s * 1e6:.2f} us per "
                 f"device buffer in or out, {rt.feed_s * 1e6:.1f} us per device piece of a batch "
                 f"array fed), pipeline task {rt.task_s * 1e6:.0f} us, transfer "
                 f"{rt.transfer_s * 1e6:.0f} us, gradient accumulation "
                 f"{rt.accumulate_bytes_per_s / 1e9:.3g} GB/s")
    return "\n".join(lines)


def calibrate_profile(result: ProfileResult, base: ClusterSpec | None = None,
                      options: FitOptions | None = None) -> Calibration:
    """Fit ``result`` (``runtime.calibrate.profile_devices``) into a 1-host cluster named
    ``calibrated-PLATFORM-N``; what was not measured comes from ``base`` (default: the
    shipped ``cpu-sim``), on XLA's CPU devices as the ``N`` devices run it together
    (``runtime.local_cluster.sharing_one_host``: what the estimate takes for them without a
    calibration), as every figure profiled is timed with all of them busy. (A kernel's
    launch is not measured; taken as one device alone launches, it priced the 8 local
    devices' sharded steps at a third of their clock.)"""
    from autopar.cluster import ClusterSpec, format_mesh_shape, load_cluster
    from autopar.compiler.cost.calibration_fit import calibrate_cluster
    from autopar.runtime.local_cluster import sharing_one_host

    base = base or load_cluster("cpu-sim")
    if result.platform == "cpu" and result.num_devices > 1:
        shared = sharing_one_host(base.to_dict(), result.num_devices)
        shared["name"] = f"{base.name} as {result.num_devices} devices sharing the host"
        base = ClusterSpec.from_dict(shared)
    meshes = ", ".join(format_mesh_shape(s) for s in result.mesh_shapes)
    sizes = sorted({s.nbytes for s in result.collectives})
    kind = "" if result.device_kind == result.platform else f" ({result.device_kind})"
    source = (f"autopar profile, {result.started}: {result.num_devices} {result.platform} "
              f"device(s){kind}; meshes {meshes}; "
              f"{len(result.collectives)} collective samples of {_bytes_text(sizes[0])} to "
              f"{_bytes_text(sizes[-1])}, median of the timed calls; {len(result.matmuls)} "
              f"matmul samples; {result.elapsed_s:.0f} s")
    measured = {
        "platform": result.platform,
        "device_kind": result.device_kind,
        "mesh_shapes": [list(s) for s in result.mesh_shapes],
        "empty_program_s": dict(result.empty_program_s),
        "repeats": result.options.repeats,
        "max_sample_s": result.options.max_sample_s,
        "elapsed_s": result.elapsed_s,
        "collective_samples": [
            {"kind": s.kind, "axis": s.label, "group_size": s.group_size, "nbytes": s.nbytes,
             "seconds": s.seconds} for s in result.collectives],
        "matmul_samples": [
            {"dtype": m.dtype, "m": m.m, "n": m.n, "k": m.k, "gemms": m.gemms,
             "concurrent": m.concurrent, "seconds": m.seconds, "flops_per_s": m.flops_per_s}
            for m in result.matmuls],
        "runtime_samples": [
            {"kind": r.kind, "devices": r.devices, "nbytes": r.nbytes, "count": r.count,
             "seconds": r.seconds} for r in result.runtime],
    }
    return calibrate_cluster(
        result.collectives, result.matmuls, base, num_devices=result.num_devices,
        name=f"calibrated-{result.platform}-{result.num_devices}",
        device_name=_device_name(result), source=source,
        memory_bytes=result.memory_bytes, options=options, measured=measured,
        runtime=result.runtime, gemm_only=result.platform == "cpu",
    )


def _device_name(result: ProfileResult) -> str:
    if result.platform == "cpu":
        return "CPU devices sharing the host's cores"
    return f"{result.device_kind} ({result.platform})"


def _bytes_text(nbytes: float) -> str:
    """``4096`` -> ``"4 KiB"``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"
