"""Benchmark: the full search's planning time at the sizes the published-runs issue sets
targets for that the published suite does not plan (abstract shapes, described clusters).

- ``175b``: Megatron's GPT-3 175B shape (96 layers, hidden 12,288, 96 heads, sequence 2,048,
  vocabulary 51,200, batch 1,536, bf16) on 1,024 A100s (128 DGX nodes), 192 microbatches
  (microbatch size 1 on 8 data-parallel replicas).
- ``405b``: the zoo's Llama-3 405B shape (batch 2,048 sequences of 8,192, bf16) on 16,384 H100s
  (2,048 nodes of 8), 16 microbatches (size 1 on 128 data-parallel replicas).

Each is ``AutoParallel(num_microbatches=m, schedule="auto")`` as ``autopar bench --suite
published`` runs its rows, timed from the trace on; one JSON line per case on stdout (wall
and CPU seconds, the phases, the plan's stages and estimate). Nothing is written to docs/:
docs/pipeline.md's "Planning time" quotes the runs.

    python benchmarks/plan_at_scale.py [175b] [405b]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from dataclasses import replace

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import autopar  # noqa: E402
from autopar.cluster import ClusterSpec, load_cluster  # noqa: E402
from autopar.compiler.planners import dispatch  # noqa: E402
from autopar.models import ZooModel, get_model  # noqa: E402

CASES = ("175b", "405b")


def case(name: str) -> tuple[ZooModel, ClusterSpec, int]:
    """The model, the described cluster and the microbatch count of ``name``."""
    if name == "175b":
        model = get_model("gpt", "tiny", batch_size=1536, seq_len=2048, hidden_size=12288,
                          num_layers=96, num_heads=96, vocab_size=51200, dtype="bfloat16")
        return model, replace(load_cluster("a100-80gb-x8"), num_hosts=128), 192
    if name == "405b":
        model = get_model("llama", "405B", batch_size=2048, dtype="bfloat16")
        return model, replace(load_cluster("h100-80gb-x8"), num_hosts=2048), 16
    raise ValueError(f"unknown case {name!r}; valid cases: {', '.join(CASES)}")


def cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(name: str) -> dict:
    model, cluster, m = case(name)
    marked = model.with_value_and_grad(autopar.value_and_grad)
    method = autopar.AutoParallel(num_microbatches=m, schedule="auto")
    start, cpu = time.perf_counter(), cpu_s()
    step = dispatch.trace(marked.train_step, marked.abstract_inputs(), method, (1,))
    traced = time.perf_counter()
    plan = dispatch.plan(step, cluster).plan
    return {
        "case": name, "devices": cluster.num_devices, "microbatches": m,
        "total_s": time.perf_counter() - start, "trace_s": traced - start,
        "cpu_s": cpu_s() - cpu,
        "phases_s": {k: round(v, 2) for k, v in plan.planning.phases.items()},
        "method": plan.method.value, "est_step_time_s": plan.est_step_time_s,
        "stages": [{"layers": [s.layers[0], s.layers[-1]], "submesh": list(s.submesh_shape),
                    "logical_mesh": list(s.logical_mesh_shape)} for s in plan.stages],
        "replicas": 1 if plan.pipeline is None else plan.pipeline.replicas,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", choices=CASES, default=list(CASES))
    for name in parser.parse_args().cases:
        print(json.dumps(measure(name)), flush=True)


if __name__ == "__main__":
    main()
