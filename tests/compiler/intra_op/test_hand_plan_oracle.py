"""The hand-plan oracle: autopar's plans against what an expert writes by hand.

For each model (every zoo model at ``tiny`` and the families of ``hand_plan_models``: MLPs with
batch >> hidden and hidden >> batch, a BERT layer stack, an MoE layer, a conv/batch-norm stack,
a tied embedding) on a mesh (1x4, 2x2, 2x4; the zoo's MoE not on 2x2, its Wide-ResNet on 2x4
only), and each hand plan of :mod:`autopar.bench.hand_plans` that an expert would try on it:

1. **XLA from the same inputs.** ``jax.jit(step, in_shardings=hand, out_shardings=state as
   in)`` is what XLA's own sharding propagation makes of the hand plan's inputs. autopar's ILP
   with the same inputs pinned must move no more than that (5%), counted in the compiled HLO of
   its own ``ShardedProgram``.
2. **The free ILP.** With nothing pinned, the plan must move no more than the best hand plan
   (5%), and its objective must be no higher than any pinned plan's: the hand plans are points
   of its search space (up to tying, which pins refine: a higher free objective means tying
   merged decisions that should differ).

What is compared is the bytes the busiest device sends (``hand_oracle.collective_traffic``: an
all-reduce of M bytes over n devices sends 2(n-1)/n M, a reduce-scatter or all-gather
(n-1)/n M, an all-to-all (n-1)/n^2 M), plus the batch bytes each device is fed
(``feed_bytes``), which the ILP pays for too. XLA:CPU has no reduce-scatter (it all-reduces and
slices), so what the reduce-scatters an autopar plan predicts cost more on CPU is taken off
its count (``cpu_reduce_scatter_excess``); XLA's own plans never predict any, and get no
discount.

Two cost settings, both an A100 node without per-message latency (XLA combines the gradient
all-reduces of a step into one collective, while the model charges latency per collective;
with it, many small tensors distort the comparison of bytes):

* (1) runs with compute free ("comm"): the ILP's cheapest plan is then the one that moves
  least, exactly what is compared with XLA's. With compute priced, it may rightly move more
  to split work XLA leaves replicated (data-parallel convolutions under a hand plan that
  replicates the batch), which a byte count cannot judge.
* (2) runs at the A100's speed ("balanced"), where splitting work pays and the hand plans are
  the experts' answers.

Each case also checks that its hand plans apply (a path rule that stops matching fails here,
not silently) and that the pinned plan keeps the pins; the cheap ones compare the free plan's
numbers with the serial step's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import jax
import numpy as np
import pytest
from hand_plan_models import (
    Case,
    bert_layers,
    conv_bn_stack,
    dense_chain,
    moe_layer,
    tied_embedding,
)

from autopar.bench.hand_oracle import (
    collective_traffic,
    cpu_reduce_scatter_excess,
    feed_bytes,
    jit_collectives,
    plan_pinned,
)
from autopar.bench.hand_plans import graph_leaves, hand_plan, tree_leaves
from autopar.cluster import ClusterSpec, load_cluster
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import trace_step
from autopar.compiler.intra_op.sharding_ilp import MeshCaches
from autopar.models import get_model
from autopar.plan import ShardingSpec
from autopar.runtime.hlo import count_collectives
from autopar.runtime.shard import ShardedProgram

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

TOLERANCE = 1.05
# The objectives are compared, so every ILP must be solved to proof. Unloaded, the largest
# (zoo MoE and Wide-ResNet on 2-D meshes) take about 5 s; the default 30 s limit was reached
# once under a load of 7 on 2 cores, and an incumbent is not a bound. A solve that still
# stops on this limit fails the test with its status, never passes on an unproven plan.
SOLVE_LIMIT_S = 900.0
# scalars (the loss, a norm) may be reduced once more or less than in XLA's plan
SLACK_BYTES = 256


def _zoo(name: str) -> Case:
    model = get_model(name, "tiny")
    return Case(f"zoo-{name}", model.train_step, model.init_state(jax.random.key(0)),
                model.make_batch(jax.random.key(10)))


MODELS = {
    # hidden >> batch: Megatron's alternation is the answer (issue 18's deep ReLU MLP)
    "deep-mlp": lambda: dense_chain("deep-mlp", batch=8, width=512, depth=4),
    # batch >> hidden: data parallelism is
    "wide-batch-mlp": lambda: dense_chain("wide-batch-mlp", batch=1024, width=64, depth=3),
    "bert": bert_layers,
    "moe-layer": moe_layer,
    "conv-bn": conv_bn_stack,
    "tied-embedding": tied_embedding,
    "zoo-mlp": lambda: _zoo("mlp"),
    "zoo-gpt": lambda: _zoo("gpt"),
    "zoo-moe": lambda: _zoo("moe"),
    "zoo-wresnet": lambda: _zoo("wresnet"),
}


@dataclass(frozen=True)
class OracleCase:
    model: str
    mesh: tuple[int, int]
    plans: tuple[str, ...]
    numerics: bool = False

    @property
    def id(self) -> str:
        return f"{self.model}-{self.mesh[0]}x{self.mesh[1]}"


MESHES = ((1, 4), (2, 2), (2, 4))

# What an expert would try on each model: (on the 1-D mesh 1x4, on the 2-D meshes). A model's
# plans must apply on its meshes (checked below), so 2-D plans name data x tensor splits.
EXPERT_PLANS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "deep-mlp": (("megatron", "data"), ("data-megatron", "megatron")),
    "wide-batch-mlp": (("data", "zero2"), ("data", "zero2")),
    "bert": (("megatron",), ("data-megatron",)),
    "moe-layer": (("experts", "megatron"), ("experts",)),
    "conv-bn": (("conv-data-head-tensor",), ("conv-data-head-tensor",)),
    "tied-embedding": (("data", "zero3"), ("data", "zero3")),
    "zoo-mlp": (("megatron", "zero2"), ("data-megatron", "zero2")),
    "zoo-gpt": (("megatron",), ("data-megatron",)),
    "zoo-moe": (("experts",), ("experts",)),
    "zoo-wresnet": (("conv-data-head-tensor",), ("conv-data-head-tensor",)),
}
# Megatron's sequence-parallel plan (the batch's sequence split over the tensor axis too),
# beside Megatron's, on the zoo GPT at 1x4: each such plan costs another XLA compile and two
# pinned ILPs (the 2-D form, measured on BERT at 2x4 in docs/long-sequences.md, about 6 s
# more: left out for the suite's time, issue 34; its rules are tested below)
SEQUENCE_PARALLEL = {("zoo-gpt", (1, 4)): "megatron-sp"}
# the cases that also compare the free plan's numbers with the serial step's
NUMERICS = {("deep-mlp", (1, 4)), ("wide-batch-mlp", (2, 2)), ("moe-layer", (1, 4)),
            ("tied-embedding", (2, 2))}

# Most of the time is XLA compiling two or three programs a hand plan, and the free ILP of
# the larger 2-D cases. Every model on every mesh, but the zoo's Wide-ResNet and MoE, the
# slowest to compile: their layer kinds are on every mesh as the conv/batch-norm stack's and
# the MoE layer's; the zoo's MoE runs on 1x4 and 2x4, its Wide-ResNet on 2x4 only (a
# suite-time decision, issue 34).
SKIPPED = {(2, 2): frozenset({"zoo-wresnet", "zoo-moe"}), (1, 4): frozenset({"zoo-wresnet"})}
CASES = [
    OracleCase(model, mesh, EXPERT_PLANS[model][0 if mesh[0] == 1 else 1]
               + ((SEQUENCE_PARALLEL[model, mesh],) if (model, mesh) in SEQUENCE_PARALLEL
                  else ()),
               numerics=(model, mesh) in NUMERICS)
    for model in MODELS for mesh in MESHES if model not in SKIPPED.get(mesh, ())
]


def oracle_cluster(kind: str, num_devices: int) -> ClusterSpec:
    """An A100 node without per-message latency, every GEMM at the same fraction of the peak;
    ``kind == "comm"``: with compute free too. (These models' GEMMs, batch 8 and width 512,
    fit in one wave of the A100's multiprocessors (``cost.gemm``): split or not they take the
    same time, so on the described A100 the free plan would be chosen among layouts priced
    alike, and the bytes compared here would tell nothing about the ILP.)"""
    data = load_cluster("a100-80gb-x8").to_dict()
    data["name"] = f"oracle-{kind}"
    data["device"].pop("multiprocessors", None)
    for link in ("intra_host", "inter_host"):
        data[link]["latency_s"] = 1e-12
    if kind == "comm":
        data["device"]["peak_flops"] = {k: v * 1e6 for k, v in data["device"]["peak_flops"].items()}
    return ClusterSpec.from_dict(data).with_devices(1, num_devices)


@cache
def model_case(name: str):
    case = MODELS[name]()
    traced = trace_step(case.step, (case.state, case.batch))
    return case, traced


def moved(summary, plan=None, feed: float = 0.0) -> float:
    """Bytes the busiest device sends (CPU's reduce-scatter excess off an autopar plan's count),
    plus what it is fed."""
    excess = cpu_reduce_scatter_excess(plan) if plan is not None else 0.0
    return collective_traffic(summary) - excess + feed


def compiled_summary(traced, plan, flat, devices):
    program = ShardedProgram(traced.program, plan, devices)
    return program, count_collectives(program.hlo_text(flat))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_autopar_moves_no_more_than_the_hand_plans(case: OracleCase):
    model, traced = model_case(case.model)
    leaves = graph_leaves(traced.graph)
    n = math.prod(case.mesh)
    devices = jax.devices()[:n]
    flat = jax.tree_util.tree_leaves((model.state, model.batch))
    meshes = {kind: LogicalMesh.from_cluster(oracle_cluster(kind, n), case.mesh)
              for kind in ("comm", "balanced")}
    axes = dict(zip(meshes["comm"].axis_names, case.mesh, strict=True))
    # the ILPs on one mesh, pinned or free, share strategy lists and resharding costs (pins
    # key their own input lists): the same plans, built in less time
    caches = {kind: MeshCaches() for kind in meshes}

    hand_moves, pinned_objectives = {}, {}
    for name in case.plans:
        specs = hand_plan(name).specs(leaves, axes)
        assert specs is not None, f"hand plan {name} does not apply to {case.model}"
        feed = feed_bytes(leaves, specs, axes)
        xla, _ = jit_collectives(model.step, (model.state, model.batch), specs, devices,
                                 case.mesh, meshes["comm"].axis_names)
        hand_moves[name] = moved(xla, feed=feed)

        # (1) the ILP from the same inputs, where only moving data costs
        pinned = plan_pinned(traced, meshes["comm"], specs, cluster_name="oracle-comm",
                             devices_per_host=n, time_limit_s=SOLVE_LIMIT_S,
                             caches=caches["comm"])
        assert pinned.stages[0].input_shardings == specs
        _, summary = compiled_summary(traced, pinned, flat, devices)
        ours = moved(summary, pinned, feed)
        assert ours <= TOLERANCE * hand_moves[name] + SLACK_BYTES, (
            f"{case.id} {name}: autopar's plan from the hand plan's inputs moves {ours:.0f} "
            f"bytes per device, XLA's {hand_moves[name]:.0f}: {summary.by_kind()} vs "
            f"{xla.by_kind()}")

        balanced = plan_pinned(traced, meshes["balanced"], specs,
                               cluster_name="oracle-balanced", devices_per_host=n,
                               time_limit_s=SOLVE_LIMIT_S, caches=caches["balanced"]).solver
        assert balanced["proven_optimal"], (name, balanced["status"])
        pinned_objectives[name] = balanced["objective"]

    # (2) the free ILP where splitting work pays
    free = plan_pinned(traced, meshes["balanced"], {}, cluster_name="oracle-balanced",
                       devices_per_host=n, time_limit_s=SOLVE_LIMIT_S,
                       caches=caches["balanced"])
    assert free.solver["proven_optimal"], free.solver["status"]
    program, summary = compiled_summary(traced, free, flat, devices)
    feed = feed_bytes(leaves, free.stages[0].input_shardings, axes)
    ours = moved(summary, free, feed)
    best = min(hand_moves, key=hand_moves.get)
    assert ours <= TOLERANCE * hand_moves[best] + SLACK_BYTES, (
        f"{case.id}: the free plan moves {ours:.0f} bytes per device, the best hand plan "
        f"({best}) {hand_moves[best]:.0f}: {summary.by_kind()}")
    objective = free.solver["objective"]
    for name, pinned_objective in pinned_objectives.items():
        assert objective <= pinned_objective * (1 + 1e-6), (
            f"{case.id}: the free ILP's objective {objective:.6g} is above the {name} "
            f"plan's {pinned_objective:.6g}")

    if case.numerics:
        serial_state, serial_loss = jax.jit(model.step)(model.state, model.batch)
        out = program(flat)
        want = jax.tree_util.tree_leaves((serial_state, serial_loss))
        for got, ref in zip(out, want, strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=2e-5)


# -- the hand plans' rules, on paths and shapes alone --------------------------------------


def P(*dims) -> ShardingSpec:  # noqa: N802 - PartitionSpec-like shorthand
    """A spec from per-dimension axis tuples (None: whole)."""
    return ShardingSpec(tuple(tuple(d) if d else () for d in dims))


def zoo_leaves(name: str):
    return tree_leaves(get_model(name, "tiny").abstract_inputs())


def test_megatron_splits_transformer_pairs_and_alternates_dense_chains():
    specs = hand_plan("megatron").specs(zoo_leaves("gpt"), {"x": 1, "y": 4})
    block = "state/params/blocks/1"
    column, row, whole = P(None, ("y",)), P(("y",), None), P(None, None)
    for name in ("attn/q", "attn/k", "attn/v", "mlp/fc_in"):
        assert specs[f"{block}/{name}/kernel"] == column
    for name in ("attn/out", "mlp/fc_out"):
        assert specs[f"{block}/{name}/kernel"] == row
        assert specs[f"{block}/{name}/bias"] == P(None)
    assert specs[f"{block}/attn/q/bias"] == P(("y",))
    assert specs[f"{block}/ln1/bias"] == P(None)  # a layer norm is no dense layer
    assert specs["state/params/wte"] == whole
    # Adam's moments take their parameter's layout; the batch stays whole
    assert specs["state/opt_state/0/mu/blocks/1/attn/q/kernel"] == column
    assert specs["batch/tokens"] == whole
    chain = hand_plan("megatron").specs(zoo_leaves("mlp"), {"x": 4})
    assert chain["state/params/layers/0/kernel"] == P(None, ("x",))
    assert chain["state/params/layers/0/bias"] == P(("x",))
    assert chain["state/params/layers/1/kernel"] == P(("x",), None)
    assert chain["state/params/layers/1/bias"] == P(None)
    # the last layer's 16 outputs split over 4 (column again); over 32 they would not divide
    assert chain["state/params/layers/2/kernel"] == P(None, ("x",))
    assert hand_plan("megatron").specs(zoo_leaves("mlp"), {"x": 32})[
        "state/params/layers/2/kernel"] == whole


def test_data_zero_and_expert_plans():
    leaves = zoo_leaves("moe")
    axes = {"x": 2, "y": 2}
    both = ("x", "y")
    data = hand_plan("data").specs(leaves, axes)
    assert data["batch/tokens"] == P(both, None)
    assert data["state/params/blocks/0/moe/wi"] == P(None, None, None)
    zero2 = hand_plan("zero2").specs(leaves, axes)
    assert zero2["state/opt_state/0/mu/blocks/0/moe/wi"] == P(both, None, None)
    assert zero2["state/params/blocks/0/moe/wi"] == P(None, None, None)
    assert zero2["state/opt_state/0/count"] == P()
    zero3 = hand_plan("zero3").specs(leaves, axes)
    assert zero3["state/params/blocks/0/moe/wi"] == P(both, None, None)
    experts = hand_plan("experts").specs(leaves, axes)
    assert experts["state/params/blocks/0/moe/wo"] == P(both, None, None)
    assert experts["state/opt_state/0/nu/blocks/0/moe/wo"] == P(both, None, None)
    assert experts["state/params/blocks/0/moe/gate"] == P(None, None)
    assert experts["batch/tokens"] == P(both, None)


def test_hand_plans_apply_only_where_an_expert_would_use_them():
    mlp = zoo_leaves("mlp")
    assert hand_plan("experts").specs(mlp, {"x": 4}) is None  # no expert kernels
    assert hand_plan("conv-data-head-tensor").specs(mlp, {"x": 4}) is None  # no convolutions
    assert hand_plan("data-megatron").specs(mlp, {"x": 1, "y": 4}) is None  # one real axis
    mixed = hand_plan("data-megatron").specs(mlp, {"x": 2, "y": 4})
    assert mixed["batch/x"] == P(("x",), None)
    assert mixed["state/params/layers/0/kernel"] == P(None, ("y",))
    convs = hand_plan("conv-data-head-tensor").specs(zoo_leaves("wresnet"), {"x": 4})
    assert convs["state/params/head/kernel"] == P(None, ("x",))
    assert convs["state/params/stem/conv"] == P(None, None, None, None)
    assert convs["batch/images"] == P(("x",), None, None, None)


def test_sequence_parallel_plans_split_the_batch_sequence_over_the_tensor_axis():
    leaves = zoo_leaves("gpt")
    one_d = hand_plan("megatron-sp").specs(leaves, {"x": 1, "y": 4})
    assert one_d["batch/tokens"] == P(None, ("y",))
    assert one_d["state/params/blocks/1/attn/q/kernel"] == P(None, ("y",))
    two_d = hand_plan("data-megatron-sp").specs(leaves, {"x": 2, "y": 4})
    assert two_d["batch/tokens"] == P(("x",), ("y",))
    assert two_d["state/params/blocks/1/mlp/fc_out/kernel"] == P(("y",), None)
    # a dense chain has no transformer block: no sequence to split
    assert hand_plan("megatron-sp").specs(zoo_leaves("mlp"), {"x": 4}) is None


def test_megatron_kernels_on_one_sequence_run_as_sequence_parallelism():
    """Megatron's sequence parallelism (Korthikanti et al. 2022) out of the ILP's own
    strategies. With the GPT's kernels pinned to Megatron's layout on 1x4 and a batch of one
    sequence (nothing to split but the sequence), at the A100's rates without per-message
    latency: the residual stream and its layer norms run on a quarter of the sequence each, the
    row-parallel matmuls' partial sums are reduce-scattered onto the sequence where Megatron
    without it all-reduces them, and the column-parallel matmuls' inputs are all-gathered along
    it. No rule names the pattern: a dot's summed split may be reduce-scattered onto any output
    dimension, and resharding to the next matmul's whole input is an all-gather. XLA's program
    gathers the stream along the sequence, and the step equals the serial one."""
    seq, hidden, layers = 64, 64, 2
    model = get_model("gpt", "tiny", batch_size=1, seq_len=seq, hidden_size=hidden,
                      num_layers=layers)
    state, batch = model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(1))
    traced = trace_step(model.train_step, (state, batch))
    leaves = graph_leaves(traced.graph)
    mesh = LogicalMesh.from_cluster(oracle_cluster("balanced", 4), (1, 4))
    axes = dict(zip(mesh.axis_names, (1, 4), strict=True))
    tensor = mesh.axis_names[1]
    pins = {path: spec for path, spec in hand_plan("megatron").specs(leaves, axes).items()
            if path.startswith("state/")}
    plan = plan_pinned(traced, mesh, pins, cluster_name="oracle-balanced", devices_per_host=4,
                       time_limit_s=SOLVE_LIMIT_S)
    assert plan.solver["proven_optimal"], plan.solver["status"]
    stage = plan.stages[0]
    stream = [tid for tid, spec in stage.tensor_shardings.items()
              if tuple(traced.graph.tensors[tid].shape) == (1, seq, hidden)
              and spec.dims == ((), (tensor,), ())]
    assert len(stream) >= 2 * layers, stage.tensor_shardings  # the norms' inputs at least
    kinds = {c.kind.value for c in stage.collectives}
    assert {"reduce-scatter", "all-gather"} <= kinds, kinds

    flat = jax.tree_util.tree_leaves((state, batch))
    program, summary = compiled_summary(traced, plan, flat, jax.devices()[:4])
    gathered = [c for c in summary.collectives if c.kind == "all-gather"
                and any(tuple(dims) == (1, seq, hidden) for _, dims in c.result_shapes)]
    assert len(gathered) >= layers, summary.by_kind()
    want = jax.tree_util.tree_leaves(jax.jit(model.train_step)(state, batch))
    for got, ref in zip(program(flat), want, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=2e-5)
