"""The benchmark suites: which models, at which sizes, on which clusters, against which baselines.

A ``BenchCase`` is one zoo model planned by the full search (``PipeshardParallel``) for either
the local devices (``cluster=None``: planned, then run and timed) or a described cluster (a
shipped name such as ``aws-p3.16xlarge-8nodes``: planned only, from abstract shapes, so no
memory is needed). A ``ScalingPoint`` is one planning-time measurement of the planner itself.

Suites: ``smoke`` (a minute on 2 cores: every code path once, at toy sizes), ``local`` (small
models run on the local devices with every baseline), ``paper`` (the Alpa paper's sizes on its
testbed, described, with the two what-if cases), ``scaling`` (planning time versus layers and
devices) and ``full`` (local + paper + scaling).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from autopar.errors import InvalidOptionError, choices_text
from autopar.method_options import LayerMode

# Memory is not enforced on described clusters: without rematerialisation (not implemented
# yet) the Alpa sizes keep more activations than a 16 GB V100 holds, and the planner would
# refuse every stage. A budget no stage reaches times the same search.
NO_MEMORY_LIMIT = 1e18


class Baseline(enum.Enum):
    """A plan the full search is compared with, in the same run."""

    SINGLE_DEVICE = "single-device"  # jax.jit on one device (local: measured; else estimated)
    DATA_PARALLEL = "data-parallel"  # autopar.DataParallel() over every device
    INTRA_OP = "intra-op-only"  # autopar.ShardParallel(): the ILP on the whole mesh, no stages
    MEGATRON = "megatron"  # GPT only: Megatron-LM's tensor-parallel specs, pinned
    EQUAL_LAYER = "equal-layer"  # as many stages as the DP's, equal layers on equal submeshes
    EQUAL_OPERATOR = "equal-operator"  # as many stages, equal operator counts
    # local cases: PipeshardParallel with one stage over every device, timed beside the same
    # stage (its logical mesh) run by ShardParallel: the pipeline runtime's own cost
    ONE_STAGE_PIPELINE = "one-stage pipeline"


ALL_BASELINES: tuple[Baseline, ...] = tuple(Baseline)
# Families whose parameters follow the GPT block layout that the Megatron specs name.
MEGATRON_FAMILIES: tuple[str, ...] = ("gpt",)


class ScalingAxis(enum.Enum):
    """What a scaling sweep varies."""

    LAYERS = "layers"
    DEVICES = "devices"
    STEP_TIME = "step time"  # a big model's estimated step time as the cluster grows


@dataclass(frozen=True)
class Published:
    """What was published for the same model and cluster, shown beside autopar's estimate:
    TFLOPS per device (None when the source gives no number, only a plot), where, and how
    the run was configured. ``counts_recompute``: the figure counts the forward recomputed
    under rematerialisation as work (Alpa's ``checkpoint_activations=True`` count)."""

    tflops_per_device: float | None
    source: str
    setting: str
    counts_recompute: bool = True


@dataclass(frozen=True)
class BenchCase:
    """One model planned (and, on local devices, run) with the full search and baselines.

    ``overrides``: config fields replaced (``(("num_layers", 2),)``), as ``get_model`` takes
    them. ``cluster``: a shipped cluster name or cluster JSON path (planned only), or None for
    the local devices (planned, run and timed). ``hosts``: replaces the cluster's host count.
    ``pipeline_layers``: ``"auto"`` or the number of layers the loss forward is clustered into.
    ``comparable``: whether ``published`` describes this very configuration (False for a
    reduced copy that only exercises the what-if path). ``devices``: a local case uses only
    the first this many local devices (default: all the run has). ``hand_plans``: also plan
    (and, locally, run with ``jax.jit``) every expert layout of ``bench.hand_plans`` that
    applies (``bench.hand_baselines``).
    """

    model: str
    size: str
    overrides: tuple[tuple[str, Any], ...] = ()
    cluster: str | None = None
    hosts: int | None = None
    microbatches: int = 4
    pipeline_layers: int | str = LayerMode.AUTO
    baselines: tuple[Baseline, ...] = ALL_BASELINES
    published: Published | None = None
    comparable: bool = True
    label: str = ""
    devices: int | None = None
    warmup_steps: int = 2
    timed_steps: int = 5
    hand_plans: bool = True

    @property
    def local(self) -> bool:
        """Whether the case runs on this process's devices."""
        return self.cluster is None

    @property
    def name(self) -> str:
        """A short unique name: the label, else model, size, overrides and where."""
        if self.label:
            return self.label
        extra = "".join(f", {k}={v}" for k, v in self.overrides)
        where = "local" if self.cluster is None else self.cluster  # (local: no cluster)
        if self.local and self.devices:
            where += f" ({self.devices} devices)"
        hosts = f" x{self.hosts} hosts" if self.hosts else ""
        return f"{self.model} {self.size}{extra} @ {where}{hosts}"

    def config_overrides(self) -> dict[str, Any]:
        """The overrides as keyword arguments of ``get_model``."""
        return dict(self.overrides)


@dataclass(frozen=True)
class ScalingPoint:
    """One planning-time measurement: a model at ``num_layers`` on ``hosts`` hosts of a
    described cluster (of ``devices_per_host`` devices each, default the cluster's)."""

    axis: ScalingAxis
    model: str
    size: str
    num_layers: int
    cluster: str
    hosts: int
    devices_per_host: int | None = None
    microbatches: int = 32
    pipeline_layers: int | str = LayerMode.AUTO
    overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        """Model, size, layers and cluster, as the rows name the point."""
        per_host = f"x{self.devices_per_host}" if self.devices_per_host else ""
        return (f"{self.model} {self.size}, {self.num_layers} layers @ {self.cluster} "
                f"x{self.hosts}{per_host}")


@dataclass(frozen=True)
class Suite:
    """A named set of cases and scaling points, run in one invocation."""

    name: str
    description: str
    cases: tuple[BenchCase, ...] = ()
    scaling: tuple[ScalingPoint, ...] = ()

    def __add__(self, other: Suite) -> Suite:
        """Both suites' cases and points, in order."""
        return Suite(f"{self.name}+{other.name}", f"{self.description}; {other.description}",
                     self.cases + other.cases, self.scaling + other.scaling)


SUITE_NAMES: tuple[str, ...] = ("smoke", "local", "paper", "scaling", "full")

V100_NODE = "aws-p3.16xlarge"
V100_8_NODES = "aws-p3.16xlarge-8nodes"

ALPA_GPT_2_6B = Published(
    tflops_per_device=37.01,
    source="Alpa's benchmark README (benchmark/alpa/README.md, gpt.perf_test_manual on one "
           "AWS p3.16xlarge)",
    setting="GPT-2.6B, global batch 32, 4 microbatches, data x operator x pipeline = 2 x 2 x 2, "
            "fp16, rematerialisation",
)
ALPA_GPT_39B = Published(
    tflops_per_device=None,
    source="Alpa (OSDI 2022), Figure 7a: plotted, no per-GPU number given in the text",
    setting="GPT-39B, global batch 1024, 64 V100s (8 p3.16xlarge), fp16, rematerialisation, "
            "Alpa's full search",
)

# Alpa's own GPT-2.6B run: global batch 32 in fp16, 4 microbatches.
_GPT_2_6B_WHAT_IF = (("batch_size", 32), ("dtype", "float16"))


def smoke_suite() -> Suite:
    """Every code path once, in about a minute on 2 cores: a local case on 2 devices (planned,
    run, timed, HLO counted, with measured baselines and an estimated pipeline split), a
    described what-if case (reduced: 1 of GPT-2.6B's 32 layers; the Megatron plan among its
    estimated baselines) and a two-point scaling sweep on each axis (2-device hosts). The
    local case is an MLP: compiling GPT steps on CPU costs tens of seconds each."""
    return Suite(
        "smoke", "toy sizes, every code path once",
        cases=(
            BenchCase("mlp", "tiny", devices=2, microbatches=2, pipeline_layers=2,
                      warmup_steps=1, timed_steps=3,
                      baselines=(Baseline.SINGLE_DEVICE, Baseline.DATA_PARALLEL,
                                 Baseline.ONE_STAGE_PIPELINE, Baseline.EQUAL_LAYER)),
            BenchCase("gpt", "2.6B", _GPT_2_6B_WHAT_IF + (("num_layers", 1),),
                      cluster=V100_NODE, microbatches=4, pipeline_layers=1,
                      baselines=(Baseline.SINGLE_DEVICE, Baseline.DATA_PARALLEL,
                                 Baseline.MEGATRON),
                      published=ALPA_GPT_2_6B, comparable=False),
        ),
        scaling=tuple(
            ScalingPoint(axis, "mlp", "tiny", layers, V100_NODE, hosts, devices_per_host=2,
                         microbatches=2, pipeline_layers=2)
            for axis, layers, hosts in ((ScalingAxis.LAYERS, 2, 1), (ScalingAxis.LAYERS, 4, 1),
                                        (ScalingAxis.DEVICES, 2, 1), (ScalingAxis.DEVICES, 2, 2))
        ),
    )


def local_suite() -> Suite:
    """Small models on the local (simulated) devices, run and timed, with every baseline."""
    gpt_small = (("hidden_size", 256), ("num_layers", 4), ("seq_len", 64), ("batch_size", 16),
                 ("vocab_size", 1024))
    return Suite(
        "local", "small models run on the local devices",
        # timed steps per plan per round (MEASURE_ROUNDS rounds): more for the fast steps,
        # whose plans are close and whose times the machine's load moves most
        cases=(
            BenchCase("gpt", "tiny", timed_steps=10),
            BenchCase("gpt", "tiny", gpt_small, label="gpt small (hidden 256, 4 layers) @ local"),
            BenchCase("moe", "tiny", timed_steps=10),
            BenchCase("wresnet", "tiny", timed_steps=10),
            BenchCase("mlp", "tiny", timed_steps=25),
        ),
    )


def paper_suite() -> Suite:
    """The Alpa paper's sizes on its testbed (described: planned, not run): GPT-2.6B on one
    8-GPU node and GPT-39B on 8 nodes (the what-if cases), MoE and Wide-ResNet at the sizes
    the paper runs on 8 GPUs."""
    pipeline_only = (Baseline.SINGLE_DEVICE, Baseline.DATA_PARALLEL, Baseline.EQUAL_LAYER,
                     Baseline.EQUAL_OPERATOR)
    return Suite(
        "paper", "Alpa sizes on described V100 clusters",
        cases=(
            BenchCase("gpt", "2.6B", _GPT_2_6B_WHAT_IF, cluster=V100_NODE, microbatches=4,
                      published=ALPA_GPT_2_6B),
            # Alpa's auto-search runs of GPT-39B on 64 GPUs: batch 1024, 128+ microbatches
            BenchCase("gpt", "39B", (("dtype", "float16"),), cluster=V100_8_NODES,
                      microbatches=128, pipeline_layers=16, baselines=pipeline_only,
                      published=ALPA_GPT_39B),
            BenchCase("moe", "1.3B", (("dtype", "float16"),), cluster=V100_NODE,
                      microbatches=16, baselines=pipeline_only),
            BenchCase("wresnet", "1B", (("dtype", "float16"),), cluster=V100_NODE,
                      microbatches=16, baselines=pipeline_only),
        ),
    )


# Planning time of GPT-2.6B's block (hidden 2560) at these depths on 64 described GPUs, and of
# its 32 layers on 1 to 2,048 hosts of 8 (8 to 16,384 GPUs) at its batch of 1,024 sequences.
SCALING_LAYERS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64, 96)
SCALING_HOSTS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# Against devices, one sequence per microbatch: the pipeline's replicas share out the
# microbatches, so this lets the search go down to one sequence per replica (1,024 replicas),
# as the devices grow at the same global batch.
SCALING_DEVICE_MICROBATCHES = 1024


# GPT-39B (Alpa's 64-GPU case: batch 1024, 128 microbatches) on 8, 32 and 128 hosts of 8.
SCALING_39B_HOSTS: tuple[int, ...] = (8, 32, 128)


def scaling_suite() -> Suite:
    """Planning time versus layers (1..96, 64 described GPUs) and devices (8..16,384), and
    GPT-39B's estimated step time on 64, 256 and 1,024 described GPUs."""
    by_layers = tuple(ScalingPoint(ScalingAxis.LAYERS, "gpt", "2.6B", n, V100_8_NODES, 8)
                      for n in SCALING_LAYERS)
    by_devices = tuple(ScalingPoint(ScalingAxis.DEVICES, "gpt", "2.6B", 32, V100_8_NODES, h,
                                    microbatches=SCALING_DEVICE_MICROBATCHES)
                       for h in SCALING_HOSTS)
    gpt_39b = tuple(ScalingPoint(ScalingAxis.STEP_TIME, "gpt", "39B", 48, V100_8_NODES, h,
                                 microbatches=128, pipeline_layers=16,
                                 overrides=(("dtype", "float16"),))
                    for h in SCALING_39B_HOSTS)
    return Suite("scaling", "planning time versus layers and devices; GPT-39B's estimated "
                 "step time versus devices", scaling=by_layers + by_devices + gpt_39b)


def get_suite(name: str) -> Suite:
    """The suite called ``name`` (one of ``SUITE_NAMES``)."""
    if name == "smoke":
        return smoke_suite()
    if name == "local":
        return local_suite()
    if name == "paper":
        return paper_suite()
    if name == "scaling":
        return scaling_suite()
    if name == "full":
        full = local_suite() + paper_suite() + scaling_suite()
        return Suite("full", full.description, full.cases, full.scaling)
    raise InvalidOptionError(f"unknown suite '{name}'; valid suites: {choices_text(SUITE_NAMES)}")
