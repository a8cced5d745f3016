"""The primitives that run replicated on purpose, each with the reason: every other primitive
``jax.lax`` defines has sharding strategies (``tests/compiler/intra_op/test_primitive_coverage``
checks both against the installed JAX; docs/intra-op.md has the table). A primitive in neither
runs replicated too, with a warning naming it (``strategies_for``)."""

from __future__ import annotations

_NAMED_AXIS = ("a collective over a named axis: it exists only inside a shard_map or pmap "
               "body, which autopar keeps whole as one node")
_TOKEN = "makes or joins effect tokens: no data to split"

REPLICATED_BY_DESIGN: dict[str, str] = {
    **{name: _NAMED_AXIS for name in ("all_gather", "all_to_all", "axis_index", "pmax", "pmin",
                                      "ppermute", "psum", "ragged_all_to_all")},
    "after_all": _TOKEN,
    "create_token": _TOKEN,
    "dce_sink": "keeps a value alive for its effects; it has no result to place",
    "custom_linear_solve": ("a linear solve with the user's own matvec and solve functions: "
                            "the solver's iterations read the whole vector"),
    "fft": ("transforms its trailing dims whole; its leading (batch) dims could split, which "
            "autopar does not offer yet (no model in the zoo or the tests uses an FFT)"),
    "reduce": ("a variadic reduction with the user's own body: partial results of an "
               "arbitrary body cannot be combined by an all-reduce; the named reductions "
               "(reduce_sum, reduce_max, argmax, ...) have strategies"),
}
