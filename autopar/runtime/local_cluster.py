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
    lists them; a single-process run is one host."""
    devices = list(global_devices() if devices is None else devices)
    hosts, per_host = host_layout(devices)
    fields = load_cluster("cpu-sim").to_dict() | {"name": f"local-{devices[0].platform}"}
    if hosts > 1:
        fields["inter_host"] = dict(MULTIPROCESS_INTER_HOST)
    return ClusterSpec.from_dict(fields).with_devices(hosts, per_host)
