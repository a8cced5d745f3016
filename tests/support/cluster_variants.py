"""Cluster descriptions varied for a test."""

import dataclasses

from autopar.cluster import ClusterSpec


def flops_only(cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` with its device's memory bandwidth left out: every op priced by its flops
    alone (no roofline), for tests whose subject is something else."""
    device = dataclasses.replace(cluster.device, memory_bandwidth_bytes_per_s=0.0)
    return dataclasses.replace(cluster, device=device)
