"""Numbers as the reports print them: counts with a metric suffix and durations in s, ms or
us (bytes: ``autopar.errors.format_bytes``, which the errors print too).
"""

from __future__ import annotations


def format_count(x: float) -> str:
    """A count with a metric suffix: ``1.50M``."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def format_seconds(x: float) -> str:
    """A duration in s, ms or us: ``1.500 ms``."""
    if x >= 1:
        return f"{x:.3f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3f} ms"
    return f"{x * 1e6:.1f} us"
