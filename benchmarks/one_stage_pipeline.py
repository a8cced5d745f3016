"""One-stage pipelined GPT vs ShardParallel of the same stage on the local devices.

GPT hidden 256, 4 layers, seq 64, batch 16, vocab 1024 (the local suite's "gpt small"), on
8 (or ``--devices``) simulated CPU devices in one process. Both steps are built and warmed
up, then timed in interleaved rounds (one step of each in turn, as ``bench.measure`` does)
so that the shared machine's load falls on both alike. Prints the medians, their ratio, and
the pipelined step's runtime overhead (step / sum of its tasks' measured compute, from
``ParallelizedStep.timed_call``).

    PYTHONPATH=. python benchmarks/one_stage_pipeline.py [--devices 8] [--rounds 10]
        [--microbatches 4] [--stages 1]

(``--stages 2``: an equal two-stage pipeline beside ShardParallel on every device, for its
runtime overhead.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


class DirectRunner:
    """A training loop over a runner called directly (its flat inputs and outputs)."""

    def __init__(self, runner, pp, inputs) -> None:
        import jax

        self.runner, self.pp, self.state, self.batch = runner, pp, inputs.state, inputs.batch
        self.leaves = jax.tree_util.tree_leaves

    def __call__(self):
        import jax

        out = self.runner(self.leaves((self.state, self.batch)))
        self.state, loss = jax.tree_util.tree_unflatten(self.pp.outer.out_tree, out)
        return loss


def main() -> None:
    """Time both plans and print the ratio."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--microbatches", type=int, default=4)
    # more than one: equal stages (uniform), beside ShardParallel on every device
    ap.add_argument("--stages", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    import jax

    import autopar
    from autopar.bench.measure import TrainingLoop, make_inputs
    from autopar.models import get_model

    model = get_model("gpt", "tiny", hidden_size=256, num_layers=4, seq_len=64, batch_size=16,
                      vocab_size=1024).with_value_and_grad(autopar.value_and_grad)
    inputs = make_inputs(model)
    devices = jax.devices()[: args.devices]
    pipelined = autopar.PipeshardParallel(num_stages=args.stages, stages="uniform",
                                          num_microbatches=args.microbatches)
    loops, steps = {}, {}

    def build(name: str, method: object) -> None:
        step = autopar.parallelize(model.train_step, method=method, devices=devices,
                                   cache=False)
        loops[name] = TrainingLoop(step, inputs.state, inputs.batch)
        for _ in range(3):
            jax.block_until_ready(loops[name]())
        steps[name] = step
        plan = step.get_plan(inputs.state, inputs.batch)
        print(name, plan.method, "stages", len(plan.stages),
              [s.logical_mesh_shape for s in plan.stages], flush=True)

    build("pipeline-1", pipelined)
    # the same stage (its logical mesh) run by ShardParallel; several: over every device
    stage = steps["pipeline-1"].get_plan(inputs.state, inputs.batch).stages[0]
    mesh = tuple(stage.logical_mesh_shape) if args.stages == 1 else None
    build("shard", autopar.ShardParallel(mesh_shape=mesh))
    if args.stages == 1:  # the same plan as one program (runtime.fused_step)
        from autopar.ir.pipeline_program import build_pipeline_program
        from autopar.runtime.pipeline import PipelineRunner

        plan = steps["pipeline-1"].get_plan(inputs.state, inputs.batch)
        pp = build_pipeline_program(model.train_step, (inputs.state, inputs.batch), (1,),
                                    args.microbatches)
        runner = PipelineRunner.from_plan(pp, plan, devices, fuse=True)
        direct = DirectRunner(runner, pp, inputs)
        for _ in range(3):
            jax.block_until_ready(direct())
        loops["pipeline-1 one program"] = direct
    times: dict[str, list[float]] = {n: [] for n in loops}
    for _ in range(args.rounds):
        for name, loop in loops.items():
            start = time.perf_counter()
            jax.block_until_ready(loop())
            times[name].append(time.perf_counter() - start)
    med = {n: statistics.median(t) for n, t in times.items()}
    for n, m in med.items():
        print(f"{n}: median {m:.4f} s over {len(times[n])}")
    for n in med:
        print(f"ratio {n} / shard = {med[n] / med['shard']:.3f}")
    loop = loops["pipeline-1"]
    _, records = steps["pipeline-1"].timed_call(loop.state, inputs.batch)
    busy = sum(r.end_s - r.start_s for r in records)
    print(f"pipeline-1: {len(records)} task records, compute {busy:.4f} s; "
          f"runtime overhead {med['pipeline-1'] / busy:.3f}")


if __name__ == "__main__":
    main()
