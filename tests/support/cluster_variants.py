"""Cluster descriptions varied for a test."""

import dataclasses

from autopar.cluster import ClusterSpec


def without_waves(cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` with its device's multiprocessors left out: every GEMM at the same fraction
    of the peak, whatever its shape (``cost.gemm``). For tests on small GEMMs whose subject
    is how the planner trades compute it can split against communication: on a described GPU
    such a GEMM fits in one wave, split or not, and splitting it gains nothing."""
    device = dataclasses.replace(cluster.device, multiprocessors=0)
    return dataclasses.replace(cluster, device=device)


def flops_only(cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` with its device's memory bandwidth and multiprocessors left out: every op
    priced by its flops alone at one efficiency (no roofline, no GEMM waves), for tests whose
    subject is something else."""
    device = dataclasses.replace(cluster.device, memory_bandwidth_bytes_per_s=0.0)
    return without_waves(dataclasses.replace(cluster, device=device))
