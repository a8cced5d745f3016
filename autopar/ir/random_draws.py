"""Random bits drawn in the loss function, made once per step as the serial step makes them.

The pipeline runs the loss forward traced at one microbatch's shapes. A draw there
(``jax.random.bernoulli`` for dropout binds ``random_bits``) asks for the microbatch's shape
with the step's key, so every microbatch would draw the same bits, and none the bits the serial
step draws for its rows. Where the serial step's draw is per example (its result's leading
dimension is the batch, the microbatch's is the microbatch) and its key is made from loss inputs
that are not cut into microbatches, the draw leaves the forward: the driver draws the whole
batch's bits once per step, with the whole-batch trace's own equations (the key's derivation
included: ``fold_in`` per layer, a ``split`` into one key per example), and the forward reads
microbatch ``i``'s rows as one more microbatch input. Row ``b`` of the batch then gets the bits
the serial step gives it, whatever the PRNG implementation.

Draws left per microbatch (``DrawRewrite.inexact`` says why): those inside a scan, loop or
branch (a scanned model's layers: the body draws with the shape it is traced at), draws whose
key depends on the batch, draws of other primitives (``rng_bit_generator``), and draws whose
batch dimension is not leading. A draw with the same shape in both traces (a mask broadcast
over the batch) is already the serial one in every microbatch and stays. Pure: programs in,
programs out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.errors import PlanError
from autopar.ir.program import FlatEqn, FlatProgram, TensorKind, bind_eqn

DRAW = "random_bits"
# primitives that draw random numbers (a draw of another kind is left per microbatch)
RANDOM_DRAWS = frozenset({DRAW, "threefry2x32", "rng_bit_generator", "rng_uniform"})


@dataclass(frozen=True)
class RandomDraw:
    """A per-example draw made once per step for the whole batch.

    ``bits``: the forward value that was the draw's result, now a loss input cut into
    microbatches; ``source``: the step value (no equation of the step makes it: the driver
    does) holding the whole batch's bits; ``chain``: the whole-batch trace's equations making
    the draw's key from loss inputs, in order; ``draw``: its ``random_bits`` equation;
    ``inputs``: the forward's loss inputs they read, and ``full_inputs`` the same inputs'
    ids in the whole-batch trace (the chain's ids); ``constants``: the literals they read."""

    bits: int
    source: int
    chain: tuple[FlatEqn, ...]
    draw: FlatEqn
    inputs: tuple[int, ...]
    full_inputs: tuple[int, ...]
    constants: dict[int, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DrawRewrite:
    """The microbatch forward without the draws made per step (their results are its last
    inputs), the draws (``source`` still 0: the step's ids are set later) and, for each draw
    left per microbatch, why."""

    forward: FlatProgram
    draws: tuple[RandomDraw, ...]
    inexact: tuple[str, ...]


def draw_function(draw: RandomDraw) -> Callable[..., Any]:
    """A function of the draw's loss inputs (``draw.inputs``' values) giving the whole batch's
    bits: the key made and the bits drawn as the whole-batch trace does (its equations)."""
    def run(*values: Any) -> Any:
        env = dict(draw.constants)
        env.update(zip(draw.full_inputs, values, strict=True))
        for eqn in draw.chain:
            env.update(zip(eqn.outputs, bind_eqn(eqn, [env[v] for v in eqn.inputs]),
                           strict=True))
        return bind_eqn(draw.draw, [env[v] for v in draw.draw.inputs])[0]

    return run


def _draws(program: FlatProgram) -> list[FlatEqn]:
    return [e for e in program.eqns if e.name in RANDOM_DRAWS]


def _subjaxprs(value: Any) -> Iterable[Any]:
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _subjaxprs(v)


def _draws_inside(eqn: FlatEqn) -> bool:
    """Whether a scan, loop or branch draws random numbers in its body."""
    stack = [j for v in eqn.params.values() for j in _subjaxprs(v)]
    while stack:
        jaxpr = stack.pop()
        for inner in jaxpr.eqns:
            if inner.primitive.name in RANDOM_DRAWS:
                return True
            stack.extend(j for v in inner.params.values() for j in _subjaxprs(v))
    return False


def _chain(program: FlatProgram, draw: FlatEqn, refused: set[int]) -> list[FlatEqn] | None:
    """The equations of ``program`` making the draw's operands from its inputs, in program
    order; None when they read an input in ``refused`` (or a value no equation makes)."""
    made_by = {v: e for e in program.eqns for v in e.outputs}
    inputs = set(program.in_ids)
    needed: dict[int, FlatEqn] = {}
    stack = list(draw.inputs)
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if v in seen or v in program.values:
            continue
        seen.add(v)
        if v in inputs:
            if v in refused:
                return None
            continue
        eqn = made_by.get(v)
        if eqn is None or eqn.name in RANDOM_DRAWS or _draws_inside(eqn):
            return None
        needed[eqn.index] = eqn
        stack.extend(eqn.inputs)
    return [needed[i] for i in sorted(needed)]


def rewrite_draws(forward: FlatProgram, full: FlatProgram, split: frozenset[int],
                  diff: frozenset[int], micro: int, batch: int) -> DrawRewrite:
    """Take the per-example draws out of ``forward`` (the loss forward at one microbatch) to
    be made once per step with ``full`` (the same loss function traced at the whole batch;
    its inputs correspond to ``forward``'s by position). ``split``: the loss inputs cut into
    microbatches, ``diff``: those differentiated (a key made from either is refused)."""
    inexact = [f"a scan, loop or branch ({e.name}) draws random numbers in its body"
               for e in forward.eqns if _draws_inside(e)]
    mine, theirs = _draws(forward), _draws(full)
    if len(mine) != len(theirs):
        inexact.append("the loss function draws differently at the batch's and at a "
                       "microbatch's shapes")
        return DrawRewrite(forward, (), tuple(inexact))
    to_micro = dict(zip(full.in_ids, forward.in_ids, strict=True))
    refused = {f for f, m in to_micro.items() if m in split or m in diff}
    draws = []
    for e, f in zip(mine, theirs, strict=True):
        shape = tuple(forward.avals[e.outputs[0]].shape)
        whole = tuple(full.avals[f.outputs[0]].shape)
        if shape == whole:
            continue  # the same bits for every row: each microbatch draws the serial ones
        if e.name != DRAW or len(e.outputs) != 1:
            inexact.append(f"{e.name} draws per microbatch")
            continue
        if not shape or shape[0] != micro or whole != (batch, *shape[1:]):
            inexact.append(f"random bits of shape {whole} do not have the batch leading")
            continue
        chain = _chain(full, f, refused)
        if chain is None:
            inexact.append("random bits drawn with a key made from the batch or the "
                           "parameters")
            continue
        read = {v for eqn in (*chain, f) for v in eqn.inputs}
        full_inputs = tuple(v for v in full.in_ids if v in read)
        draws.append(RandomDraw(
            bits=e.outputs[0], source=0, chain=tuple(chain), draw=f,
            inputs=tuple(to_micro[v] for v in full_inputs), full_inputs=full_inputs,
            constants={v: full.values[v] for v in read if v in full.values}))
    if not draws:
        return DrawRewrite(forward, (), tuple(inexact))
    return DrawRewrite(_without(forward, {d.bits for d in draws}), tuple(draws), tuple(inexact))


def _without(forward: FlatProgram, bits: set[int]) -> FlatProgram:
    """``forward`` with the equations making ``bits`` removed and ``bits`` its last inputs."""
    if forward.regions:
        raise PlanError("internal: the loss forward is flattened without scan regions")
    eqns = [e for e in forward.eqns if not set(e.outputs) & bits]
    eqns = [replace(e, index=i) for i, e in enumerate(eqns)]
    order = sorted(bits)
    kinds = dict(forward.kinds)
    kinds.update({v: TensorKind.INPUT for v in order})
    in_ids = [*forward.in_ids, *order]
    in_paths = [*forward.in_paths, *(f"loss/random_bits{k}" for k in range(len(order)))]
    return FlatProgram(eqns, dict(forward.avals), kinds, dict(forward.values), in_ids,
                       list(forward.out_ids), in_paths, list(forward.out_paths),
                       forward.in_tree, forward.out_tree, [(0, len(in_ids))])
