"""Fit each GPU's ``compute_efficiency`` (the fraction of the peak a large GEMM reaches in a
training step, beside its wave efficiency: docs/cost-model.md) on the published runs.

Every published configuration is planned pinned (``autopar.bench.published.plan_pinned``) at
two efficiencies, 0.5 and 0.7; its estimated step is then ``a + b / efficiency`` (compute
scales with it, the rest does not) through those two points. Per GPU, the efficiency in steps
of 0.05 whose estimates are closest to the published measurements (the median of
``|published / estimated - 1|``) on every other row (``published_suite.fitted``) is printed,
with each row's error, the rows left out checking it. The shipped cluster files carry what it
printed on 2026-11-28; a row's estimate at the fitted figure is planned again by
``autopar bench --suite published``.

    python benchmarks/fit_compute_efficiency.py
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from autopar.bench.published import PUBLISHED_RUNS, plan_pinned  # noqa: E402
from autopar.bench.published_suite import fitted  # noqa: E402

LOW, HIGH = 0.5, 0.7
CHOICES = [round(0.4 + 0.05 * k, 2) for k in range(13)]


def main() -> None:
    steps: dict[str, tuple[float, float]] = {}
    for run in PUBLISHED_RUNS:
        low = plan_pinned(replace(run, compute_efficiency=LOW)).plan.est_step_time_s
        high = plan_pinned(replace(run, compute_efficiency=HIGH)).plan.est_step_time_s
        steps[run.label] = (low, high)
        print(f"{run.label}: {low:.3f} s at {LOW}, {high:.3f} s at {HIGH}", flush=True)
    rows = [{"label": r.label, "cluster": r.cluster} for r in PUBLISHED_RUNS]
    fit = fitted(rows)
    for cluster in dict.fromkeys(r.cluster for r in PUBLISHED_RUNS):
        runs = [r for r in PUBLISHED_RUNS if r.cluster == cluster]

        def ratio(run, efficiency: float) -> float:
            low, high = steps[run.label]
            b = (low - high) / (1 / LOW - 1 / HIGH)
            a = low - b / LOW
            # estimated over published throughput: the published step (the formula's flops
            # at the measured rate) over the estimated one
            published_s = run.step_flops() / (run.tflops * 1e12 * run.gpus)
            return published_s / (a + b / efficiency)

        def median_error(efficiency: float, chosen) -> float:
            return statistics.median(abs(ratio(r, efficiency) - 1) for r in chosen)

        on = [r for r in runs if fit[r.label]]
        best = min(CHOICES, key=lambda e: median_error(e, on))
        print(f"\n{cluster}: compute_efficiency {best}")
        for r in runs:
            print(f"  {'fitted' if fit[r.label] else 'held out'}  {r.label}: "
                  f"estimate / published {ratio(r, best):.3f}")
        held = [r for r in runs if not fit[r.label]]
        if held:
            print(f"  median error: fitted {median_error(best, on):.1%}, "
                  f"held out {median_error(best, held):.1%}")


if __name__ == "__main__":
    main()
