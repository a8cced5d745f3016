"""Benchmark: the asynchronous schedules' estimated throughput against 1F1B on GPT-39B.

Abstract shapes only: GPT-39B (48 layers, 16 pipeline layers, 32 microbatches) on
``aws-p3.16xlarge-8nodes`` (8 hosts of 8 V100s), planned with
``PipeshardParallel(schedule="auto", allow_async=True)``: 1F1B, ZB-H1, PipeDream and
PipeDream-2BW each get their own stage search on the same layer costs, and each is estimated
on the same cost model (an asynchronous one in its steady state: no flush between steps).
Memory is not enforced, as in ``plan_pipeline.py`` (GPT-39B needs rematerialisation to fit
16 GB V100s at all), so the weight versions do not change the stages here; the plan's
memory figures still count them. Writes ``docs/benchmarks/async_pipeline.md`` and
``async_pipeline.jsonl``.

    python benchmarks/async_pipeline.py [--layers 48] [--microbatches 32]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import autopar  # noqa: E402
from autopar.bench.machine import machine_text  # noqa: E402
from autopar.bench.suites import NO_MEMORY_LIMIT  # noqa: E402
from autopar.cluster import load_cluster  # noqa: E402
from autopar.compiler.planners import dispatch  # noqa: E402
from autopar.models import get_model  # noqa: E402
from autopar.report.async_text import async_facts  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def measure(layers: int, microbatches: int, cluster_name: str, pipeline_layers: int) -> dict:
    """Plan with every schedule (``schedule="auto"``) and return each one's estimate."""
    model = get_model("gpt", "39B", num_layers=layers).with_value_and_grad(
        autopar.value_and_grad)
    cluster = load_cluster(cluster_name)
    method = autopar.PipeshardParallel(num_microbatches=microbatches, layers=pipeline_layers,
                                       schedule="auto", allow_async=True,
                                       memory_budget_bytes=NO_MEMORY_LIMIT, replicas="none")
    start = time.perf_counter()
    step = dispatch.trace(model.train_step, model.abstract_inputs(), method, (1,))
    plan = dispatch.plan(step, cluster).plan
    elapsed = time.perf_counter() - start
    rows = {c["name"].removeprefix("schedule "): c["est_step_time_s"]
            for c in plan.planning.candidates}
    reference = rows["1f1b"]
    return {
        "model": f"gpt 39B, {layers} layers",
        "cluster": cluster_name,
        "devices": cluster.num_devices,
        "microbatches": microbatches,
        "pipeline_layers": pipeline_layers,
        "plan_s": elapsed,
        "est_step_time_s": rows,
        "throughput_vs_1f1b": {k: reference / v for k, v in rows.items() if v},
        "chosen": str(plan.pipeline.schedule),
        "stages": [
            {"layers": [s.layers[0], s.layers[-1]], "submesh": list(s.submesh_shape),
             "est_time_s": s.est_time_s, "memory": dict(s.memory_breakdown)}
            for s in plan.stages
        ],
        "chosen_steady_state": async_facts(plan),
        "notes": plan.notes[:2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--pipeline-layers", type=int, default=16)
    parser.add_argument("--cluster", default="aws-p3.16xlarge-8nodes")
    args = parser.parse_args()
    row = measure(args.layers, args.microbatches, args.cluster, args.pipeline_layers)
    print(json.dumps(row), flush=True)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "async_pipeline.jsonl").write_text(json.dumps(row) + "\n")
    lines = [
        "# Asynchronous pipelines: estimated throughput against 1F1B, GPT-39B on 64 GPUs",
        "",
        f"{row['model']}, {row['pipeline_layers']} pipeline layers, {row['microbatches']} "
        f"microbatches per step, on {row['cluster']} ({row['devices']} described V100s); "
        "`PipeshardParallel(schedule=\"auto\", allow_async=True)`, memory not enforced. Each "
        "schedule has its own stage search; estimates are the cost model's (the asynchronous "
        "ones per step of their steady state). Produced by `benchmarks/async_pipeline.py` "
        f"in {row['plan_s']:.0f} s.",
        "",
        "| schedule | est. step | throughput vs 1f1b |",
        "|---|---|---|",
    ]
    for name, est in row["est_step_time_s"].items():
        ratio = row["throughput_vs_1f1b"].get(name)
        shown = f"{ratio:.3f}x" if ratio else "-"
        lines.append(f"| {name}{' (chosen)' if name == row['chosen'] else ''} | "
                     f"{est:.4g} s | {shown} |" if est else f"| {name} | - | - |")
    facts = row["chosen_steady_state"]
    if facts:
        lines += ["", f"The chosen plan ({row['chosen']}): weight versions per stage "
                      f"{facts['weight_versions']}, staleness in updates "
                      f"{facts['staleness_updates']}; on its stages the schedule alone takes "
                      f"{facts['schedule_s_per_step']:.4g} s per step against 1F1B's "
                      f"{facts['one_f_one_b_schedule_s']:.4g} s "
                      f"({facts['throughput_vs_1f1b']:.3f}x)."]
    lines += ["", "Stages of the chosen plan:", ""]
    for i, s in enumerate(row["stages"]):
        lines.append(f"- stage {i}: layers {s['layers'][0]}-{s['layers'][1]} on "
                     f"{s['submesh'][0]}x{s['submesh'][1]}, est. {s['est_time_s']:.4g} s per "
                     f"microbatch, stashed weights "
                     f"{s['memory'].get('stashed_weights', 0) / 2**30:.1f} GiB per device")
    lines += ["", machine_text(), ""]
    (OUT_DIR / "async_pipeline.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
