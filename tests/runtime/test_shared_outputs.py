"""Which results a pipelined step puts on every device: the loss, the loss function's aux
metrics and every scalar, so that every process reads them with ``float()``; not the new
state, even where the loss function returns part of it as aux (batch statistics), which the
next step reads where the stage made it."""

import jax
import jax.numpy as jnp

import autopar
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.models import get_model
from autopar.runtime.pipeline_state import shared_outputs


def loss_fn(p, stats, x):
    h = x @ p["w"]
    new_stats = 0.9 * stats + 0.1 * jnp.mean(h, axis=0)  # a running mean, as batch norm's
    per_class = jnp.mean(h, axis=0)  # a metric vector the step only reports
    return jnp.mean(h**2), {"stats": new_stats, "per_class": per_class, "mean": jnp.mean(h)}


def step(state, batch):
    (loss, aux), grads = autopar.value_and_grad(loss_fn, has_aux=True)(
        state["p"], state["stats"], batch)
    new = {"p": jax.tree.map(lambda p, g: p - 0.1 * g, state["p"], grads),
           "stats": aux["stats"]}
    return new, {"loss": loss, "per_class": aux["per_class"], "mean": aux["mean"]}


def shared_paths(fn, args):
    pp = build_pipeline_program(fn, args, (1,), 2)
    shared = shared_outputs(pp)
    return {path for path, v in zip(pp.outer.out_paths, pp.outer.out_ids, strict=True)
            if v in shared}


def test_the_loss_metrics_and_scalars_are_shared_and_state_returned_as_aux_is_not():
    args = ({"p": {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)},
             "stats": jax.ShapeDtypeStruct((4,), jnp.float32)},
            jax.ShapeDtypeStruct((16, 8), jnp.float32))
    paths = shared_paths(step, args)
    # the per-class metric has the statistics' shape: only the path tells them apart
    assert paths == {"out/1/loss", "out/1/per_class", "out/1/mean"}


def test_wide_resnet_keeps_its_batch_statistics_where_its_stage_makes_them():
    model = get_model("wresnet", "tiny").with_value_and_grad(autopar.value_and_grad)
    paths = shared_paths(model.train_step, model.abstract_inputs())
    # the loss and Adam's step count (a scalar); no batch statistic: they are state
    assert paths == {"out/1", "out/0/opt_state/0/count"}
