"""The machine a benchmark ran on, described for its written results: the CPU, cores, memory
and the library versions the numbers depend on, and the load average around a run.

Shared by the benchmark's Markdown pages (``outputs``, ``published_suite``) and the
``benchmarks/`` scripts.
"""

from __future__ import annotations

import datetime
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Any


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, or ``unknown``."""
    try:
        return ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory and the library versions the numbers depend on."""
    try:
        memory_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):
        memory_gib = None
    return {
        "cpu": cpu_model(), "arch": platform.machine(), "cores": os.cpu_count(),
        "memory_gib": memory_gib, "python": platform.python_version(),
        "versions": {p: _version(p) for p in ("jax", "jaxlib", "highspy", "PuLP")},
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def machine_text(info: dict[str, Any] | None = None) -> str:
    """``machine_info`` as one sentence."""
    info = info or machine_info()
    memory = f", {info['memory_gib']:.0f} GiB RAM" if info.get("memory_gib") else ""
    versions = ", ".join(f"{p} {v}" for p, v in info["versions"].items())
    return (f"{info['cpu']} ({info['arch']}), {info['cores']} cores{memory}; "
            f"Python {info['python']}, {versions}")
