"""The devices of this run described as a cluster: what ``parallelize`` plans for when the
user names no described cluster. Here, beside the runtime that owns the devices, so that the
CLI and the benchmarks ask the runtime for it rather than the API shell above them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autopar.cluster import ClusterSpec, load_cluster
from autopar.runtime.distributed import global_devices, host_layout

# Between the processes of a multi-process run data crosses sockets (gloo collectives, the
# cross-host transfer server), an order of magnitude slower than inside one process: the
# planner should see that link as the slow one (a rough figure for loopback; calibrate for
# real hosts).
MULTIPROCESS_INTER_HOST = {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4}


def local_cluster(devices: Sequence[Any] | None = None) -> ClusterSpec:
    """A description of ``devices`` (default: every device of the run): one host per process
    holding some of them (``jax.distributed``: one host per process, devices per host = its
    local devices), the devices host-major as :func:`autopar.runtime.distributed.global_devices`
    lists them; a single-process run is one host. ``cpu-sim``'s figures, which XLA's CPU
    devices divide among themselves (:func:`sharing_one_host`)."""
    devices = list(global_devices() if devices is None else devices)
    hosts, per_host = host_layout(devices)
    fields = load_cluster("cpu-sim").to_dict() | {"name": f"local-{devices[0].platform}"}
    if devices[0].platform == "cpu":  # XLA's CPU devices: threads sharing the host
        fields = sharing_one_host(fields, per_host)
    if hosts > 1:
        fields["inter_host"] = dict(MULTIPROCESS_INTER_HOST)
    return ClusterSpec.from_dict(fields).with_devices(hosts, per_host)


def sharing_one_host(fields: dict[str, Any], devices: int) -> dict[str, Any]:
    """A described CPU device's figures (``fields``, a cluster's dict: each device as if it ran
    alone on the host) as each of ``devices`` devices of one process runs them at once.

    XLA's CPU devices are threads of one process on the host's shared thread pool, and one
    device alone already uses every core the pool has for a large op: so ``devices`` of them
    running together split the host's rate ``devices`` ways, in every kind of work a device
    does: its compute (its GEMMs' too) and memory traffic, its kernels' launches, and the
    collectives' steps, which are copies and waits between those threads. Measured 2026-11-29
    on 2 cores: a chain of small kernels 3.1-4.0 us each on 1 or 2 devices, 11.5 us on 8; one
    all-reduce inside a program 15 us on 2 devices, 165-204 us on 8; the zoo's tiny steps on 8
    devices 2-5x the time of one; GPT at hidden 256, whose step is compute, about the same on
    1, 2 and 8 devices (the host's one rate, split). Everything the devices do is divided
    alike, so the plans the ILP prefers do not change, only what they are estimated at; the
    driver's own costs (``runtime``: calls, tasks, transfers) are the host's and stay."""
    if devices <= 1:
        return fields
    out = dict(fields)
    device = dict(fields["device"])
    device["peak_flops"] = {k: v / devices for k, v in device["peak_flops"].items()}
    if device.get("memory_bandwidth_bytes_per_s"):
        device["memory_bandwidth_bytes_per_s"] = device["memory_bandwidth_bytes_per_s"] / devices
    if device.get("kernel_launch_s"):
        device["kernel_launch_s"] = device["kernel_launch_s"] * devices
    if device.get("gemm_flops"):  # a GEMM's rate and its threading's seconds, split alike
        device["gemm_flops"] = {k: v / devices for k, v in device["gemm_flops"].items()}
        device["gemm_threading_s"] = device.get("gemm_threading_s", 0.0) * devices
    out["device"] = device
    for link in ("intra_host", "inter_host"):
        out[link] = {"bandwidth_bytes_per_s": fields[link]["bandwidth_bytes_per_s"] / devices,
                     "latency_s": fields[link]["latency_s"] * devices}
    runtime = dict(fields.get("runtime") or {})
    if "accumulate_bytes_per_s" in runtime:  # the devices add the gradients up
        runtime["accumulate_bytes_per_s"] = runtime["accumulate_bytes_per_s"] / devices
    out["runtime"] = runtime
    return out
