"""Benchmark: ShardParallel planning time for GPT at 1, 12 and 48 layers, CBC vs HiGHS.

Abstract shapes only (GPT-39B's hyper-parameters, nothing allocated), planned for one
aws-p3.16xlarge node on 1x8 and 2x4 logical meshes. Writes ``docs/benchmarks/ilp.md`` and
``ilp.jsonl``. Times are wall-clock on this machine, single run each (planning is
deterministic; the spread between repeats is small next to the differences shown).

    python benchmarks/plan_gpt.py [--layers 1,12,48] [--meshes 1x8,2x4] [--solvers highs,cbc]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from autopar.compiler.intra_op import IntraOpOptions, solve_intra_op  # noqa: E402
from autopar.compiler.mesh import LogicalMesh, load_cluster, parse_mesh_shape  # noqa: E402
from autopar.compiler.trace import trace_step  # noqa: E402
from autopar.models import get_model  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def measure(layers: int, mesh_text: str, solver: str, time_limit: float) -> dict:
    model = get_model("gpt", "39B", num_layers=layers)
    t0 = time.perf_counter()
    traced = trace_step(model.train_step, model.abstract_inputs())
    t1 = time.perf_counter()
    mesh = LogicalMesh.from_cluster(load_cluster("aws-p3.16xlarge"), parse_mesh_shape(mesh_text))
    result = solve_intra_op(
        traced.graph, mesh, IntraOpOptions(solver=solver, time_limit_s=time_limit)
    )
    t2 = time.perf_counter()
    sol = result.solution
    return {
        "layers": layers,
        "mesh": mesh_text,
        "solver": sol.solver,
        "ops": traced.graph.num_nodes,
        "decisions": len(result.variables),
        "ilp_variables": sol.num_variables,
        "ilp_constraints": sol.num_constraints,
        "trace_s": t1 - t0,
        "build_s": result.build_time_s + sol.build_time_s,
        "solve_s": sol.solve_time_s,
        "plan_s": t2 - t1,
        "status": sol.status,
        "objective_s": sol.objective,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="1,12,48")
    parser.add_argument("--meshes", default="1x8,2x4")
    parser.add_argument("--solvers", default="highs,cbc")
    parser.add_argument("--time-limit", type=float, default=120.0)
    args = parser.parse_args()
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        for mesh in args.meshes.split(","):
            for solver in args.solvers.split(","):
                row = measure(layers, mesh, solver, args.time_limit)
                rows.append(row)
                print(json.dumps(row), flush=True)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "ilp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, jax {jax.__version__}"
    )
    lines = [
        "# ShardParallel planning time: GPT (39B hyper-parameters) on one 8-GPU node",
        "",
        f"Produced by `python benchmarks/plan_gpt.py`. Machine: {machine}.",
        "",
        "`plan` is everything after tracing: strategies, following, identical-layer tying,",
        "resharding matrices, presolve and the ILP solve. `decisions` is the number of ILP",
        "decision groups left after following and tying.",
        "",
        "| layers | mesh | solver | ops | decisions | ILP vars | trace (s) | build (s) | "
        "solve (s) | plan (s) | status |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layers']} | {r['mesh']} | {r['solver']} | {r['ops']} | {r['decisions']} | "
            f"{r['ilp_variables']} | {r['trace_s']:.1f} | {r['build_s']:.1f} | "
            f"{r['solve_s']:.1f} | {r['plan_s']:.1f} | {r['status']} |"
        )
    (OUT_DIR / "ilp.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT_DIR / 'ilp.md'}")


if __name__ == "__main__":
    main()
