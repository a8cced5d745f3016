"""The benchmark harness behind ``autopar bench``: suites of zoo models planned with the full
search against baselines, on described clusters (planned only) and on the local devices (also
run and timed), with JSON lines, a Markdown page and PNG plots as results.

``suites`` defines what runs, ``runner`` runs one case, ``harness`` a whole suite, ``outputs``
and ``plots`` write the results; ``measure`` is the only module that touches devices.
"""

from __future__ import annotations

from autopar.bench.suites import SUITE_NAMES, Baseline, BenchCase, ScalingPoint, Suite, get_suite

__all__ = ["SUITE_NAMES", "Baseline", "BenchCase", "ScalingPoint", "Suite", "get_suite"]
