"""The published-runs suite: Megatron-LM's Table 1 and Alpa's Figure 7 (GPT) at their real sizes.

Each :class:`PublishedRun` is one measured run from a paper or its authors' artifact (the
figures, configurations and hardware, with their sources, are in the project's
``shared/published/README.md``): the model's shape, the cluster it ran on (a shipped cluster
description with its host count), the degrees it ran with (data x tensor x pipeline), its
microbatches and schedule, and the throughput it measured. For each run the suite plans,
from abstract shapes on the described cluster:

* the published configuration **pinned** (``autopar.pinned``: degrees, microbatches, schedule,
  recomputation and dtype as published; where the source leaves the microbatch size out, each
  size it names as best is tried and the faster estimate kept);
* the **full search** (``AutoParallel``) with the same microbatch count, timed, trace included.

Throughput is on the publication's own flops formula. Nothing here runs a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from autopar.cluster import ClusterSpec, load_cluster
from autopar.ir.schedules import ScheduleName
from autopar.method_options import SCHEDULE_AUTO, RematMode
from autopar.models import ZooModel, get_model
from autopar.plan import Plan

MEGATRON_SOURCE = ("Narayanan et al., Efficient Large-Scale Language Model Training on GPU "
                   "Clusters Using Megatron-LM (SC'21), Table 1")
ALPA_SOURCE = ("Zheng et al., Alpa (OSDI'22), Figure 7a: osdi22_artifact/results_e2e_ref.tsv "
               "(alpa-projects/alpa, branch osdi22_artifact)")
INTERLEAVED = ScheduleName.INTERLEAVED_1F1B.value
ONE_F_ONE_B = ScheduleName.ONE_F_ONE_B.value


@dataclass(frozen=True)
class PublishedRun:
    """One published measurement and the configuration it ran.

    ``shape``: GPT config fields (``get_model("gpt", ..., **shape)``); ``cluster`` and
    ``hosts``/``devices_per_host``: the described hardware; ``data``, ``tensor``,
    ``pipeline``: its degrees; ``microbatch_sizes``: sequences per microbatch to try (the
    source's, or the sizes it names as best where it gives none); ``schedule``; ``tflops``:
    the measured TFLOPS per GPU; ``formula``: ``"megatron"`` or ``"alpa"`` (how the source
    counts a step's flops); ``system``: whose run it is; ``note``: what is uncertain."""

    label: str
    source: str
    shape: tuple[tuple[str, Any], ...]
    cluster: str
    hosts: int
    data: int
    tensor: int
    pipeline: int
    microbatch_sizes: tuple[int, ...]
    schedule: str
    tflops: float
    formula: str
    system: str
    devices_per_host: int | None = None
    note: str = ""
    # the described cluster's compute_efficiency replaced: what the fit of that figure
    # (benchmarks/fit_compute_efficiency.py) plans the pinned configuration at
    compute_efficiency: float | None = None

    @property
    def gpus(self) -> int:
        return self.data * self.tensor * self.pipeline

    def model(self) -> ZooModel:
        """The zoo GPT at this run's shape."""
        return get_model("gpt", "tiny", **dict(self.shape))

    def described_cluster(self) -> ClusterSpec:
        """The shipped description with this run's hosts (and devices per host)."""
        base = load_cluster(self.cluster)
        per_host = self.devices_per_host or base.devices_per_host
        base = replace(base, num_hosts=self.hosts, devices_per_host=per_host)
        if self.compute_efficiency is not None:
            base = replace(base, compute_efficiency=self.compute_efficiency)
        return base

    def num_microbatches(self, microbatch_size: int) -> int:
        """Microbatches per pipeline at ``microbatch_size`` sequences each."""
        batch = dict(self.shape)["batch_size"]
        return max(1, batch // (self.data * microbatch_size))

    def step_flops(self) -> float:
        """One step's flops on the source's formula: Megatron's
        96 B s l h^2 (1 + s / 6h + V / 16 l h), or Alpa's 96 B s h^2 L (1 + s / 6h) + 6 B s h V
        (both count the recomputed forward)."""
        c = dict(self.shape)
        b, s, h, n, v = (c["batch_size"], c["seq_len"], c["hidden_size"], c["num_layers"],
                         c["vocab_size"])
        if self.formula == "megatron":
            return 96.0 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
        return 96.0 * b * s * h * h * n * (1 + s / (6 * h)) + 6.0 * b * s * h * v


def _megatron(params: str, heads: int, hidden: int, layers: int, t: int, p: int, d: int,
              batch: int, tflops: float) -> PublishedRun:
    gpus = t * p * d
    return PublishedRun(
        label=f"Megatron GPT {params} @ {gpus} A100", source=MEGATRON_SOURCE,
        shape=(("batch_size", batch), ("seq_len", 2048), ("hidden_size", hidden),
               ("num_layers", layers), ("num_heads", heads), ("vocab_size", 51200),
               ("dtype", "bfloat16")),
        cluster="a100-80gb-x8", hosts=gpus // 8, data=d, tensor=t, pipeline=p,
        microbatch_sizes=(1, 2), schedule=INTERLEAVED if p > 1 else ONE_F_ONE_B,
        tflops=tflops, formula="megatron", system="Megatron-LM",
        note="microbatch size not published (1 and 2 tried: section 5 finds them best)")


MEGATRON_TABLE_1: tuple[PublishedRun, ...] = (
    _megatron("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron("3.6B", 32, 3072, 30, 2, 1, 32, 512, 138),
    _megatron("7.5B", 32, 4096, 36, 4, 1, 32, 512, 142),
    _megatron("18.4B", 48, 6144, 40, 8, 1, 32, 1024, 135),
    _megatron("39.1B", 64, 8192, 48, 8, 2, 32, 1536, 138),
    _megatron("76.1B", 80, 10240, 60, 8, 4, 32, 1792, 140),
    _megatron("145.6B", 96, 12288, 80, 8, 8, 24, 2304, 148),
    _megatron("310.1B", 128, 16384, 96, 8, 16, 15, 2160, 155),
    _megatron("529.6B", 128, 20480, 105, 8, 35, 9, 2520, 163),
    _megatron("1008.0B", 160, 25600, 128, 8, 64, 6, 3072, 163),
)


def _alpa(gpus: int, params: str, hidden: int, layers: int, heads: int, system: str,
          d: int, t: int, p: int, microbatches: int, tflops: float,
          note: str = "") -> PublishedRun:
    batch = 1024
    per_host = min(gpus, 8)
    return PublishedRun(
        label=f"Alpa GPT {params} @ {gpus} V100 ({system}'s plan)", source=ALPA_SOURCE,
        shape=(("batch_size", batch), ("seq_len", 1024), ("hidden_size", hidden),
               ("num_layers", layers), ("num_heads", heads), ("vocab_size", 51200),
               ("dtype", "float16")),
        cluster="aws-p3.16xlarge", hosts=max(1, gpus // 8), devices_per_host=per_host,
        data=d, tensor=t, pipeline=p, microbatch_sizes=(batch // (d * microbatches),),
        schedule=ONE_F_ONE_B, tflops=tflops, formula="alpa", system=system, note=note)


# Megatron-LM's grid-searched best plan where the artifact has it (gpt_megatron_best_suite),
# else Alpa's own uniform plan (suite_artifact_e2e_gpt.py); 8 GPUs: Alpa's stages are uneven.
ALPA_FIGURE_7: tuple[PublishedRun, ...] = (
    _alpa(1, "350M", 1024, 24, 16, "Alpa", 1, 1, 1, 512, 45.07),
    _alpa(2, "760M", 1536, 24, 16, "Alpa", 1, 1, 2, 128, 57.92),
    _alpa(4, "1.3B", 2048, 24, 32, "Megatron-LM", 2, 1, 2, 128, 55.89),
    _alpa(8, "2.6B", 2560, 32, 32, "Megatron-LM", 1, 1, 8, 128, 50.44),
    _alpa(16, "6.7B", 4096, 32, 32, "Megatron-LM", 1, 2, 8, 256, 56.59),
    _alpa(32, "15B", 5120, 48, 40, "Megatron-LM", 1, 4, 8, 256, 58.24),
    _alpa(64, "39B", 8192, 48, 64, "Alpa", 1, 8, 8, 256, 57.0,
          note="Alpa's 64-GPU plan is from a 'tmp' suite, not confirmed as the reported one"),
)

PUBLISHED_RUNS: tuple[PublishedRun, ...] = ALPA_FIGURE_7 + MEGATRON_TABLE_1


@dataclass(frozen=True)
class PlannedRun:
    """A plan for a published run: the plan, how many microbatches it was planned with, and
    the seconds it took (trace included)."""

    plan: Plan
    num_microbatches: int
    seconds: float


def _plan(run: PublishedRun, method: Any) -> tuple[Plan, float]:
    import autopar
    from autopar.compiler.planners import dispatch

    model = run.model().with_value_and_grad(autopar.value_and_grad)
    args = model.abstract_inputs()  # the user's arguments: made before planning starts
    start = time.perf_counter()
    step = dispatch.trace(model.train_step, args, method, (1,))
    plan = dispatch.plan(step, run.described_cluster()).plan
    return plan, time.perf_counter() - start


# The pinned configuration ran on its hardware: where no plan of it fits the device's memory
# in autopar's model it is planned whatever memory it needs (reported beside, with whether it
# fits the device), so that a model that overstates memory shows as such rather than as a
# missing row.
UNBOUNDED_MEMORY = 1e18


def plan_pinned(run: PublishedRun, within_device: bool = True) -> PlannedRun:
    """The published configuration, pinned (``autopar.pinned``), at each microbatch size the
    run names, planned within the device's memory (else, or with ``within_device=False``,
    with it unbounded); the fastest estimate that fits the device memory (else the
    fastest)."""
    from autopar.errors import InvalidOptionError, PlanError
    from autopar.method_builders import pinned

    found = []
    skipped: list[str] = []
    budgets = (None, UNBOUNDED_MEMORY) if within_device else (UNBOUNDED_MEMORY,)
    for size in run.microbatch_sizes:
        m = run.num_microbatches(size)
        for budget in budgets:
            try:
                method = pinned(run.data, run.tensor, run.pipeline, num_microbatches=m,
                                schedule=run.schedule, remat=RematMode.LAYERS,
                                memory_budget_bytes=budget)
                plan, seconds = _plan(run, method)
            except InvalidOptionError as err:
                # a size the schedule cannot run (interleaved 1F1B needs the microbatches
                # to divide by the stages: 310B at size 2 has 72 for 16): not a candidate
                skipped.append(f"microbatch size {size}: {err}")
                break
            except PlanError:
                if budget is not None:  # not even with memory unbounded
                    raise
                continue
            found.append(PlannedRun(plan, m, seconds))
            break
    if not found:
        raise PlanError(f"{run.label}: no microbatch size of {list(run.microbatch_sizes)} "
                        f"plans pinned: {'; '.join(skipped)}")
    budget = run.described_cluster().device.memory_bytes
    fitting = [p for p in found if p.plan.peak_memory_bytes <= budget] or found
    return min(fitting, key=lambda p: p.plan.est_step_time_s)


def plan_full_search(run: PublishedRun, num_microbatches: int) -> PlannedRun:
    """``AutoParallel`` with ``num_microbatches`` (the pinned plan's) on the described
    cluster, its schedules compared; timed from the trace on."""
    import autopar

    method = autopar.AutoParallel(num_microbatches=num_microbatches, schedule=SCHEDULE_AUTO)
    plan, seconds = _plan(run, method)
    return PlannedRun(plan, num_microbatches, seconds)


def tflops(run: PublishedRun, step_s: float) -> float:
    """TFLOPS per GPU of a ``step_s`` step on the run's formula."""
    return run.step_flops() / step_s / run.gpus / 1e12
