"""Benchmark: ShardParallel planning of GPT written with ``jax.lax.scan`` over stacked layers
against the same GPT unrolled (a Python loop over layers).

Abstract shapes only (GPT-39B's hyper-parameters at the layer counts asked for, nothing
allocated), planned for one aws-p3.16xlarge node on 1x8 and 2x4 logical meshes with HiGHS,
as ``benchmarks/plan_gpt.py`` does for the unrolled model. Each (layers, variant) is traced
once, then planned once per mesh. Reports tracing and planning seconds, the graph and ILP
sizes, and the plans' estimated step times side by side. Writes ``docs/benchmarks/scan.md``
and ``scan.jsonl``. Wall-clock times of single runs on a shared 2-core machine.

    python benchmarks/scan_plan.py [--layers 2,48] [--meshes 1x8,2x4]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from autopar.bench.machine import load_average, machine_text  # noqa: E402
from autopar.cluster import load_cluster  # noqa: E402
from autopar.compiler.cost.mesh import LogicalMesh, parse_mesh_shape  # noqa: E402
from autopar.compiler.graph.trace import TracedStep, trace_step  # noqa: E402
from autopar.compiler.intra_op.sharding_ilp import IntraOpOptions, solve_intra_op  # noqa: E402
from autopar.models import get_model  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
CLUSTER = "aws-p3.16xlarge"
VARIANTS = ("unrolled", "scanned")


def trace_gpt(layers: int, variant: str) -> tuple[TracedStep, float]:
    """GPT-39B's hyper-parameters at ``layers`` layers, unrolled or scanned, traced; and the
    tracing seconds."""
    model = get_model("gpt", "39B", num_layers=layers, scan_layers=variant == "scanned")
    start = time.perf_counter()
    traced = trace_step(model.train_step, model.abstract_inputs())
    return traced, time.perf_counter() - start


def measure(traced: TracedStep, mesh_text: str, time_limit: float) -> dict:
    """Plan ``traced`` on one mesh; timings, sizes and the estimated step time."""
    start = time.perf_counter()
    mesh = LogicalMesh.from_cluster(load_cluster(CLUSTER), parse_mesh_shape(mesh_text))
    result = solve_intra_op(traced.graph, mesh,
                            IntraOpOptions(solver="highs", time_limit_s=time_limit))
    plan_s = time.perf_counter() - start
    sol = result.solution
    return {
        "mesh": mesh_text,
        "ops": traced.graph.num_nodes,
        "decisions": len(result.variables),
        "ilp_nodes": sol.ilp_nodes,
        "ilp_edges": sol.ilp_edges,
        "ilp_variables": sol.num_variables,
        "build_s": result.build_time_s + sol.build_time_s,
        "solve_s": sol.solve_time_s,
        "plan_s": plan_s,
        "status": sol.status,
        "objective_s": sol.objective,
    }


def summary_lines(rows: list[dict]) -> list[str]:
    """Per mesh, at the most layers measured: the scanned model's planning time against the
    unrolled model's and against the scanned model at the fewest layers, and the estimates."""
    by_key = {(r["layers"], r["mesh"], r["variant"]): r for r in rows}
    most, fewest = max(r["layers"] for r in rows), min(r["layers"] for r in rows)
    lines = ["Summary (plan = everything after tracing):", ""]
    for mesh in dict.fromkeys(r["mesh"] for r in rows):
        scanned = by_key.get((most, mesh, "scanned"))
        unrolled = by_key.get((most, mesh, "unrolled"))
        small = by_key.get((fewest, mesh, "scanned"))
        if scanned is None or unrolled is None:
            continue
        ratio = scanned["plan_s"] / unrolled["plan_s"]
        line = (f"- {mesh}, {most} layers: scanned plans in {scanned['plan_s']:.1f} s "
                f"(+{scanned['trace_s']:.1f} s tracing), unrolled in {unrolled['plan_s']:.1f} s "
                f"(+{unrolled['trace_s']:.1f} s tracing): x{ratio:.2f}")
        if small is not None and fewest != most:
            line += (f"; {scanned['plan_s'] / small['plan_s']:.2f}x the scanned "
                     f"{fewest}-layer model's {small['plan_s']:.1f} s")
        line += (f". Estimates {scanned['objective_s']:.6g} s vs {unrolled['objective_s']:.6g} s "
                 f"({scanned['objective_s'] / unrolled['objective_s'] - 1:+.3%}).")
        lines.append(line)
    return lines


def write_docs(rows: list[dict], load_before: str, load_after: str) -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "scan.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    by_key = {(r["layers"], r["mesh"], r["variant"]): r for r in rows}
    lines = [
        "# Planning a scanned GPT: `jax.lax.scan` over stacked layers vs the unrolled model",
        "",
        f"Produced by `python benchmarks/scan_plan.py`. Machine: {machine_text()}.",
        "",
        "GPT with the 39B hyper-parameters (hidden 8192, 64 heads, seq 1024, batch 1024, vocab "
        "51200) at the layer counts shown, as the zoo writes it (`get_model(\"gpt\", \"39B\", "
        "num_layers=L)`: a Python loop over layers) and scanned (`scan_layers=True`: stacked "
        "block parameters, the blocks under `jax.lax.scan`). ShardParallel with HiGHS on one "
        f"`{CLUSTER}` node. Wall-clock seconds of single runs on a machine whose 2 cores are "
        f"shared with other jobs (load average {load_before} before, {load_after} after).",
        "",
        "`trace` is `trace_step` (jaxpr, flat program, graph); `plan` is everything after it "
        "(strategies, following, tying, edges, presolve, the MIP, reading the plan back); "
        "`ops` the graph's nodes (a scanned model's body is in it once); `decisions` the ILP's "
        "decision groups after following and tying; `estimate` the plan's modelled step time "
        "(the ILP objective).",
        "",
        *summary_lines(rows),
        "",
        "| layers | mesh | variant | ops | decisions | MIP nodes/edges | MIP vars | trace (s) "
        "| plan (s) | build (s) | solve (s) | estimate (s) | scanned / unrolled |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = ""
        other = by_key.get((r["layers"], r["mesh"], "unrolled"))
        if r["variant"] == "scanned" and other is not None:
            ratio = (f"plan x{r['plan_s'] / other['plan_s']:.2f}, trace "
                     f"x{r['trace_s'] / other['trace_s']:.2f}, estimate "
                     f"{r['objective_s'] / other['objective_s'] - 1:+.3%}")
        lines.append(
            f"| {r['layers']} | {r['mesh']} | {r['variant']} | {r['ops']} | {r['decisions']} | "
            f"{r['ilp_nodes']}/{r['ilp_edges']} | {r['ilp_variables']} | {r['trace_s']:.1f} | "
            f"{r['plan_s']:.1f} | {r['build_s']:.1f} | {r['solve_s']:.1f} | "
            f"{r['objective_s']:.6g} | {ratio} |"
        )
    (OUT_DIR / "scan.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT_DIR / 'scan.md'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,48")
    parser.add_argument("--meshes", default="1x8,2x4")
    parser.add_argument("--time-limit", type=float, default=120.0)
    parser.add_argument("--no-write", action="store_true", help="print rows only")
    parser.add_argument("--rewrite", action="store_true",
                        help="rewrite scan.md from scan.jsonl without measuring")
    args = parser.parse_args()
    if args.rewrite:
        lines = (OUT_DIR / "scan.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        write_docs(rows, *rows[0].get("load", ("?", "?")))
        return
    load_before = load_average()
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        for variant in VARIANTS:
            traced, trace_s = trace_gpt(layers, variant)
            for mesh in args.meshes.split(","):
                row = {"layers": layers, "variant": variant, "trace_s": trace_s}
                row.update(measure(traced, mesh, args.time_limit))
                rows.append(row)
                print(json.dumps(row), flush=True)
    if not args.no_write:
        load_after = load_average()
        for row in rows:
            row["load"] = [load_before, load_after]
        write_docs(rows, load_before, load_after)


if __name__ == "__main__":
    main()
