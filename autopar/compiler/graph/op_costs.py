"""Flop estimates per primitive, for the cost model and layer clustering.

Conventions: a multiply-add counts 2 flops (a dot_general of MxK by KxN is 2MNK); arithmetic and
transcendental elementwise ops count one flop per output element; reductions one per input
element; pure data movement (reshape, transpose, broadcast, slicing, gather, copies, casts) counts
zero flops: its cost is memory traffic, estimated separately as bytes accessed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from autopar.ir.attention_op import BACKWARD_NAME, FORWARD_NAME

# Elementwise arithmetic whose cost is one flop per output element.
ELEMENTWISE = frozenset(
    """
    abs add add_any and atan2 cbrt ceil clamp cos cosh div eq erf erf_inv erfc exp exp2 expm1
    floor ge gt imag integer_pow is_finite le lgamma digamma log log1p logistic lt max min mul
    ne neg nextafter not or pow real rem round rsqrt select_n sign sin sinh sqrt square sub tan
    tanh xor shift_left shift_right_logical shift_right_arithmetic population_count
    acos acosh asin asinh atan atanh bessel_i0e bessel_i1e clz complex conj igamma
    igamma_grad_a igammac polygamma regularized_incomplete_beta zeta mulhi eq_to le_to lt_to
    """.split()
)

REDUCTIONS = frozenset(
    """
    reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin
    reduce_precision cumsum cumprod cummax cummin cumlogsumexp
    """.split()
)

# Control flow kept as one node: flops come from the body.
CONTROL_FLOW = frozenset({"scan", "while", "cond"})


def _prod(shape: Sequence[int]) -> int:
    return math.prod(shape)


def dot_general_flops(lhs_shape: Sequence[int], rhs_shape: Sequence[int], params: Any) -> float:
    """2 x (output elements) x (contracted elements): 2MNK for an MxK by KxN matmul."""
    (lhs_contract, _rhs_contract), (lhs_batch, _rhs_batch) = params["dimension_numbers"]
    contract = _prod([lhs_shape[d] for d in lhs_contract])
    batch = _prod([lhs_shape[d] for d in lhs_batch])
    lhs_free = _prod(
        [s for d, s in enumerate(lhs_shape) if d not in lhs_contract and d not in lhs_batch]
    )
    (_, rhs_contract), (_, rhs_batch) = params["dimension_numbers"]
    rhs_free = _prod(
        [s for d, s in enumerate(rhs_shape) if d not in rhs_contract and d not in rhs_batch]
    )
    return 2.0 * batch * lhs_free * rhs_free * contract


def conv_flops(rhs_shape: Sequence[int], out_shape: Sequence[int], params: Any) -> float:
    """2 x (output elements) x (kernel elements feeding one output: kernel size / out features)."""
    dnums = params["dimension_numbers"]
    rhs_out_dim = dnums.rhs_spec[0]
    per_output = _prod(rhs_shape) / max(rhs_shape[rhs_out_dim], 1)
    return 2.0 * _prod(out_shape) * per_output


def _jaxpr_flops(jaxpr: Any) -> float:
    """Flops of a (closed) jaxpr body, recursively, with the same per-primitive rules."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in inner.eqns:
        in_shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
        out_shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
        total += primitive_flops(eqn.primitive.name, eqn.params, in_shapes, out_shapes)
    return total


def _control_flow_flops(name: str, params: Any) -> float:
    if name == "scan":
        return params["length"] * _jaxpr_flops(params["jaxpr"])
    if name == "while":
        # The trip count is unknown at trace time: count one iteration of body and condition.
        return _jaxpr_flops(params["body_jaxpr"]) + _jaxpr_flops(params["cond_jaxpr"])
    if name == "cond":
        return max((_jaxpr_flops(b) for b in params["branches"]), default=0.0)
    return 0.0


def _nested_call_flops(params: Any) -> float:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = params.get(key)
        if body is not None and hasattr(getattr(body, "jaxpr", body), "eqns"):
            return _jaxpr_flops(body)
    return 0.0


def primitive_flops(
    name: str,
    params: Any,
    in_shapes: list[tuple[int, ...]],
    out_shapes: list[tuple[int, ...]],
) -> float:
    """Estimated flops of one primitive application."""
    if name == "dot_general":
        return dot_general_flops(in_shapes[0], in_shapes[1], params)
    if name == "conv_general_dilated":
        return conv_flops(in_shapes[1], out_shapes[0], params)
    if name in ELEMENTWISE:
        return float(sum(_prod(s) for s in out_shapes))
    if name in REDUCTIONS or name.startswith("reduce_") or name.startswith("cum"):
        return float(_prod(in_shapes[0])) if in_shapes else 0.0
    if name in CONTROL_FLOW:
        return _control_flow_flops(name, params)
    if name in ("jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call", "remat2"):
        return _nested_call_flops(params)
    if name in (FORWARD_NAME, BACKWARD_NAME):
        return attention_flops(name == BACKWARD_NAME, in_shapes)
    return 0.0


def attention_flops(backward: bool, in_shapes: list[tuple[int, ...]]) -> float:
    """The attention kernel's flops (``ir.attention_op``; q, k, v first among its operands):
    every block of scores whole, masked or not, as the kernel computes them. The forward: the
    scores and their product with the values, and about five element-wise steps per score
    (mask, maximum, exponential, sum, rescale); the backward: the scores again, then the
    value, probability, query and key gradients (four more matmuls) and about five steps per
    score."""
    (*lead, sq, d), sk, dv = in_shapes[0], in_shapes[1][-2], in_shapes[2][-1]
    pairs = _prod(lead) * sq * sk
    if backward:
        return float(pairs * (2 * d + 2 * dv + 2 * dv + 2 * d + 2 * d + 5))
    return float(pairs * (2 * d + 2 * dv + 5))
