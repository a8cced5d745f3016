"""Benchmark: how long tracing (and data-parallel planning) takes for GPT at the Alpa sizes.

Everything is abstract (``jax.ShapeDtypeStruct``): no parameter is allocated, so the 39B model
is traced on any laptop. Writes ``docs/benchmarks/tracing.md`` and ``tracing.jsonl``.

    python benchmarks/trace_gpt.py [--sizes 350M,39B] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from autopar.bench.machine import machine_text  # noqa: E402
from autopar.cluster import load_cluster  # noqa: E402
from autopar.compiler.graph.trace import trace_step  # noqa: E402
from autopar.compiler.planners.dispatch import plan_traced  # noqa: E402
from autopar.methods import DataParallel  # noqa: E402
from autopar.models import get_model  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def measure(size: str, repeats: int) -> dict:
    model = get_model("gpt", size)
    args = model.abstract_inputs()
    cluster = load_cluster("aws-p3.16xlarge")
    make_jaxpr_s, trace_s, plan_s = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.make_jaxpr(model.train_step)(*args)
        t1 = time.perf_counter()
        traced = trace_step(model.train_step, args)
        t2 = time.perf_counter()
        plan_traced(traced, DataParallel(), cluster)
        t3 = time.perf_counter()
        make_jaxpr_s.append(t1 - t0)
        trace_s.append(t2 - t1)
        plan_s.append(t3 - t2)
    cfg = model.config
    return {
        "model": f"gpt {size}",
        "layers": cfg.num_layers,
        "hidden": cfg.hidden_size,
        "params": model.num_params(),
        "ops": traced.graph.num_nodes,
        "make_jaxpr_s": statistics.median(make_jaxpr_s),
        "trace_s": statistics.median(trace_s),
        "data_parallel_plan_s": statistics.median(plan_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,350M,1.3B,2.6B,6.7B,15B,39B")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for size in args.sizes.split(","):
        row = measure(size, args.repeats)
        rows.append(row)
        print(json.dumps(row), flush=True)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "tracing.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    machine = machine_text()
    lines = [
        "# Tracing and planning time: GPT at the Alpa paper's sizes",
        "",
        "Produced by `python benchmarks/trace_gpt.py` (median of "
        f"{args.repeats} runs; abstract shapes, nothing allocated). Machine: {machine}.",
        "",
        "`make_jaxpr` is JAX's own trace of the train step (forward, backward, Adam); `trace` is",
        "autopar's whole tracer (make_jaxpr + inlining + numbering + OpGraph with flop",
        "estimates); `plan` is the data-parallel plan on one aws-p3.16xlarge node (batch-split",
        "propagation, cost model, liveness).",
        "",
        "| model | layers | hidden | params | ops | make_jaxpr (s) | trace (s) | plan (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['hidden']} | {r['params'] / 1e9:.2f}B | "
            f"{r['ops']} | {r['make_jaxpr_s']:.2f} | {r['trace_s']:.2f} | "
            f"{r['data_parallel_plan_s']:.2f} |"
        )
    (OUT_DIR / "tracing.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT_DIR / 'tracing.md'}")


if __name__ == "__main__":
    main()
