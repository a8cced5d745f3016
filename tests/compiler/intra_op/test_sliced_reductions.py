"""A reduction does not slice its operand along a dimension it sums over to reduce less: the
slice spends what it saves.

On a GPT's backward, a bias gradient is the sum of a cotangent over the batch and the
sequence. With the sequence whole on one mesh axis (the attention reads it whole), the ILP
could slice it along that axis and sum half of it on each device, an all-reduce completing
the sum, the slice priced at nothing. XLA fuses such a slice into the reduction and makes the
sliced values twice: on CPU devices GPT small's 2 x 4 plan spent 100 of its 400 ms there
(docs/cost-model.md). Priced at the bytes its kernel reads and writes (``reshard_cost``'s
``price_slice``), no slice pays for itself there.
"""

from autopar.cluster import ClusterSpec, load_cluster
from autopar.compiler.planners import dispatch
from autopar.methods import ShardParallel
from autopar.models import get_model
from autopar.plan import ShardingSpec


def _slices(have: ShardingSpec | None, need: ShardingSpec, summed: set[int]) -> bool:
    """Whether ``need`` only splits further what ``have`` holds (a slice, no collective),
    and splits one of the ``summed`` dimensions so."""
    if have is None or have == need:
        return False
    pairs = list(zip(have.dims, need.dims, strict=True))
    return all(tuple(n[:len(h)]) == tuple(h) for h, n in pairs) and any(
        len(n) > len(h) for d, (h, n) in enumerate(pairs) if d in summed)


def test_no_reduction_of_a_gpt_step_reads_its_operand_sliced():
    import autopar

    model = get_model("gpt", "tiny", hidden_size=64, num_layers=2, seq_len=64, batch_size=16,
                      vocab_size=1024)
    described = load_cluster("cpu-sim").to_dict()
    described["device"]["memory_bandwidth_bytes_per_s"] = 1e11
    step = dispatch.trace(model.with_value_and_grad(autopar.value_and_grad).train_step,
                          model.abstract_inputs(), ShardParallel(mesh_shape=(2, 4)), (1,))
    stage = dispatch.plan(step, ClusterSpec.from_dict(described)).plan.stages[0]
    eqns = {e.index: e for e in step.traced.program.eqns}
    reductions = [(i, k) for i, k in stage.operand_shardings if eqns[i].name == "reduce_sum"]
    sliced = [(i, k) for i, k in reductions if _slices(
        stage.tensor_shardings.get(eqns[i].inputs[k]), stage.operand_shardings[(i, k)],
        set(eqns[i].params["axes"]))]
    assert sliced == [], [(eqns[i].name, stage.operand_shardings[(i, k)]) for i, k in sliced]
    # the plan still reshards where it pays: the check above is not vacuous
    assert stage.operand_shardings
