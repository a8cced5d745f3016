"""Benchmark: the estimate ``autopar.parallelize`` makes for the local devices (no calibration
file: ``runtime.local_cluster``) beside the clock, for the zoo's tiny models on 1, 2 and 8 of
the simulated CPU devices.

Each case plans with the default method (the full search, its candidates measured as it
does by default), runs 3 warm-up steps, then times 15 steps (each waited for) and keeps the
median. Writes ``docs/benchmarks/local-estimate.md`` (a table: plan, estimate, measured,
measured / estimated) and prints each row; nothing is asserted (the issue's bound is [0.5,
2.0]: docs/cost-model.md quotes the run).

    python benchmarks/local_estimate.py [--models gpt,moe,mlp,wresnet,gpt-small] [--devices 1,2,8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

import autopar  # noqa: E402
from autopar.models import get_model  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "local-estimate.md"
# ``gpt-small``: the local suite's GPT at hidden 256 (``bench.suites.local_suite``), whose
# step is compute, where the tiny models' are launches and collectives
SHAPES = {"gpt-small": ("gpt", {"hidden_size": 256, "num_layers": 4, "seq_len": 64,
                                "batch_size": 16, "vocab_size": 1024})}


def measure(name: str, devices: int, steps: int = 15) -> dict:
    """The default plan's estimate and the median of ``steps`` timed steps."""
    zoo, sizes = SHAPES.get(name, (name, {}))
    model = get_model(zoo, "tiny", **sizes)
    step = autopar.parallelize(model.train_step, cache=False, devices=jax.devices()[:devices])
    state = model.init_state(jax.random.key(0))
    batch = model.make_batch(jax.random.key(1))
    plan = step.get_plan(state, batch)
    for _ in range(3):
        state, _loss = step(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, _loss = step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    measured = statistics.median(times)
    meshes = " + ".join("x".join(map(str, s.logical_mesh_shape)) for s in plan.stages)
    return {"model": name, "devices": devices, "method": plan.method.value, "mesh": meshes,
            "est_s": plan.est_step_time_s, "measured_s": measured,
            "ratio": measured / plan.est_step_time_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,moe,mlp,wresnet,gpt-small")
    parser.add_argument("--devices", default="1,2,8")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()
    rows = []
    for name in args.models.split(","):
        for n in (int(d) for d in args.devices.split(",")):
            row = measure(name, n)
            rows.append(row)
            print(f"{name:8s} {n} devices  {row['method']:6s} {row['mesh']:6s} "
                  f"est {row['est_s'] * 1e3:8.3f} ms  measured {row['measured_s'] * 1e3:8.3f} "
                  f"ms  measured / est. {row['ratio']:5.2f}", flush=True)
    ratios = [r["ratio"] for r in rows]
    lines = [
        "# The local devices' estimate beside the clock",
        "",
        f"Written by `python benchmarks/local_estimate.py` on {started}, load average "
        f"{load[0]:.1f} before, {os.getloadavg()[0]:.1f} after; {os.cpu_count()} cores, "
        "simulated CPU devices (XLA's host platform, 8 in the process; each case uses the "
        "first 1, 2 or 8). The estimate is the one `autopar.parallelize` plans with for "
        "these devices without a calibration file (`runtime.local_cluster`: `cpu-sim`'s "
        "figures for one device alone, divided among the devices that run together; "
        "docs/cost-model.md, \"Kernel launches and devices sharing a host\"); measured is "
        "the median of 15 steps after 3 warm-up steps, each waited for.",
        "",
        "| model (tiny; gpt-small: hidden 256, 4 layers) | devices | plan | est. (ms) "
        "| measured (ms) | measured / est. |",
        "|---|---:|---|---:|---:|---:|",
        *(f"| {r['model']} | {r['devices']} | {r['method']} {r['mesh']} | "
          f"{r['est_s'] * 1e3:.3f} | {r['measured_s'] * 1e3:.3f} | {r['ratio']:.2f} |"
          for r in rows),
        "",
        f"measured / estimated: {min(ratios):.2f} to {max(ratios):.2f} over {len(rows)} cases.",
        "",
    ]
    OUT.write_text("\n".join(lines))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
