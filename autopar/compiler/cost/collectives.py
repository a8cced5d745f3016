"""Cost model of collective communication (alpha-beta model).

Model: sending ``b`` bytes in one message round costs ``alpha + beta * b`` seconds, where
``alpha`` is the per-round latency and ``beta`` the seconds per byte of one link. Links are
full duplex and each worker has one link, so a round costs what its busiest link carries.

``nbytes`` always means the FULL (unsharded) tensor size:

* all-reduce: the buffer each device holds (and gets back reduced);
* all-gather: the gathered result;
* reduce-scatter: the input each device holds;
* all-to-all: the whole logical tensor across the group (each device holds ``nbytes / n``);
* collective-permute: the buffer each device sends.

All-reduce algorithms (the seeds' table of total traffic for N workers and M bytes) are each
described by an explicit round-by-round :class:`AllReduceSchedule`, so total traffic and time
come from the same description:

================  ===============  ===========================  ==============================
algorithm         seeds' traffic   exact schedule traffic       time
================  ===============  ===========================  ==============================
parameter server  2NM              2NM                          2 (alpha + N M beta)
naive             N(N-1)M          N(N-1)M                      alpha + (N-1) M beta
ring              2NM              2(N-1)M                      2(N-1)(alpha + beta M/N)
tree              2NM              2(N-1)M                      2 ceil(log2 N)(alpha + beta M)
butterfly         NM log N         N M ceil(log2 N)             ceil(log2 N)(alpha + beta M)
================  ===============  ===========================  ==============================

The seeds count N rounds for the ring's reduce-scatter and all-gather phases and N senders per
tree phase; the exact schedules need N-1 of each, so the seeds' 2NM is the leading-order value
of the exact 2(N-1)M (their ratio (N-1)/N tends to 1).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from enum import StrEnum

from autopar.compiler.cost.mesh import LogicalMesh
from autopar.errors import InvalidOptionError, MeshError, choices_text
from autopar.plan import CollectiveEstimate, CollectiveKind, collective_kind

__all__ = [
    "AllReduceAlgorithm",
    "AllReduceSchedule",
    "CollectiveEstimate",
    "CollectiveKind",
    "Round",
    "all_to_all_time",
    "allgather_time",
    "allreduce_schedule",
    "allreduce_time",
    "allreduce_traffic",
    "cheapest_allreduce",
    "collective_permute_time",
    "collective_time",
    "reduce_scatter_time",
]


class AllReduceAlgorithm(StrEnum):
    """All-reduce algorithms of the cost model."""

    PARAMETER_SERVER = "parameter_server"
    NAIVE = "naive"
    RING = "ring"
    TREE = "tree"
    BUTTERFLY = "butterfly"


# Tie-break order for the cheapest algorithm: what real libraries use first.
_PREFERENCE = (
    AllReduceAlgorithm.RING,
    AllReduceAlgorithm.TREE,
    AllReduceAlgorithm.BUTTERFLY,
    AllReduceAlgorithm.NAIVE,
    AllReduceAlgorithm.PARAMETER_SERVER,
)


@dataclass(frozen=True)
class Round:
    """One message round: ``senders`` workers each send ``bytes_per_sender`` bytes; the busiest
    link carries ``bottleneck_bytes`` in one direction, which sets the round's time."""

    senders: int
    bytes_per_sender: float
    bottleneck_bytes: float

    @property
    def traffic(self) -> float:
        """Bytes sent over all links in this round."""
        return self.senders * self.bytes_per_sender

    def time(self, alpha: float, beta: float) -> float:
        """``alpha + beta * bottleneck_bytes``."""
        return alpha + beta * self.bottleneck_bytes


@dataclass(frozen=True)
class AllReduceSchedule:
    """Round-by-round description of one all-reduce of ``nbytes`` over ``n`` workers."""

    algorithm: AllReduceAlgorithm
    n: int
    nbytes: float
    rounds: tuple[Round, ...]
    # the rounds as (round, how many times in a row): a ring over 3,072 workers has 6,142
    # equal rounds, priced once (default: grouped from ``rounds``)
    runs: tuple[tuple[Round, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.runs and self.rounds:
            runs: list[tuple[Round, int]] = []
            for r in self.rounds:
                if runs and runs[-1][0] == r:
                    runs[-1] = (r, runs[-1][1] + 1)
                else:
                    runs.append((r, 1))
            object.__setattr__(self, "runs", tuple(runs))

    @property
    def traffic(self) -> float:
        """Total bytes sent over all links."""
        return sum(count * r.traffic for r, count in self.runs)

    def time(self, alpha: float, beta: float) -> float:
        """Sum over rounds of ``alpha + beta * bottleneck_bytes``."""
        return sum(count * r.time(alpha, beta) for r, count in self.runs)


def _log2_ceil(n: int) -> int:
    """``ceil(log2 n)`` exactly, for ``n >= 1``."""
    return (n - 1).bit_length()


def _binomial_tree_senders(n: int) -> list[int]:
    """Senders per round of a binomial-tree reduce over ``n`` workers (sum is ``n - 1``)."""
    counts = []
    for k in range(_log2_ceil(n)):
        d = 1 << k
        # workers i < n with i mod 2d == d: one per whole block of 2d, and one in the
        # partial block when it reaches past d
        counts.append(n // (2 * d) + (1 if n % (2 * d) > d else 0))
    return counts


def _check(n: int, nbytes: float) -> None:
    # ``type is int`` first: the ABC check costs a microsecond, and a layer's ILP build on a
    # mesh prices tens of thousands of collectives
    if (type(n) is not int and (not isinstance(n, numbers.Integral) or isinstance(n, bool))
            or n < 1):
        raise InvalidOptionError(f"collective group size must be a positive integer, got {n!r}")
    if nbytes < 0:
        raise InvalidOptionError(f"collective size must be non-negative, got {nbytes!r} bytes")


def _algorithm(algorithm: AllReduceAlgorithm | str) -> AllReduceAlgorithm:
    try:
        return AllReduceAlgorithm(algorithm)
    except ValueError:
        raise InvalidOptionError(
            f"unknown all-reduce algorithm '{algorithm}'; valid algorithms: "
            f"{choices_text(a.value for a in AllReduceAlgorithm)}") from None


def allreduce_schedule(
    algorithm: AllReduceAlgorithm | str, n: int, nbytes: float
) -> AllReduceSchedule:
    """The explicit schedule of ``algorithm`` for ``n`` workers holding ``nbytes`` each.

    * parameter server: ``n`` workers and one extra server; push (every worker sends M, the
      server's link receives nM), then pull (the server sends M to each worker: nM).
    * naive: one round; every worker sends its M to each of the other n-1.
    * ring: reduce-scatter then all-gather, n-1 rounds each; every worker sends M/n per round.
    * tree: binomial-tree reduce then broadcast, ceil(log2 n) rounds each; each of the n-1 tree
      edges carries M once per phase, one message per link per round.
    * butterfly (recursive doubling): ceil(log2 n) rounds; every worker exchanges all M with
      its partner (exact for powers of two).
    """
    algo = _algorithm(algorithm)
    _check(n, nbytes)
    m = float(nbytes)
    if n == 1:
        return AllReduceSchedule(algo, n, m, ())
    runs: tuple[tuple[Round, int], ...] = ()
    rounds: tuple[Round, ...]
    if algo is AllReduceAlgorithm.PARAMETER_SERVER:
        rounds = (Round(n, m, n * m), Round(1, n * m, n * m))
    elif algo is AllReduceAlgorithm.NAIVE:
        rounds = (Round(n, (n - 1) * m, (n - 1) * m),)
    elif algo is AllReduceAlgorithm.RING:
        step = Round(n, m / n, m / n)
        rounds, runs = (step,) * (2 * (n - 1)), ((step, 2 * (n - 1)),)
    elif algo is AllReduceAlgorithm.TREE:
        reduce = [Round(s, m, m) for s in _binomial_tree_senders(n)]
        rounds = tuple(reduce + reduce[::-1])
    else:
        step = Round(n, m, m)
        rounds, runs = (step,) * _log2_ceil(n), ((step, _log2_ceil(n)),)
    return AllReduceSchedule(algo, n, m, rounds, runs)


def allreduce_traffic(algorithm: AllReduceAlgorithm | str, n: int, nbytes: float) -> float:
    """Total bytes sent over all links by one all-reduce (see the module table)."""
    return allreduce_schedule(algorithm, n, nbytes).traffic


@functools.lru_cache(maxsize=1024)
def _run_counts(algo: AllReduceAlgorithm, n: int) -> tuple[int, ...]:
    """How many equal rounds each run of ``algo``'s schedule over ``n`` workers has (their
    grouping does not depend on the bytes)."""
    return tuple(count for _, count in allreduce_schedule(algo, n, 1.0).runs)


def _schedule_time(algo: AllReduceAlgorithm, n: int, nbytes: float, alpha: float,
                   beta: float) -> float:
    """``allreduce_schedule(algo, n, nbytes).time(alpha, beta)``, to the last bit, without
    building the schedule: every round of one algorithm has one bottleneck (below, as
    ``allreduce_schedule`` computes it). The ILPs price an all-reduce per strategy pair
    (GPT-3 175B on 1,024 A100s: 83,000), each comparing the five algorithms."""
    _check(n, nbytes)
    m = float(nbytes)
    if algo is AllReduceAlgorithm.RING:
        bottleneck = m / n
    elif algo is AllReduceAlgorithm.NAIVE:
        bottleneck = (n - 1) * m
    elif algo is AllReduceAlgorithm.PARAMETER_SERVER:
        bottleneck = n * m
    else:
        bottleneck = m
    return sum(count * (alpha + beta * bottleneck) for count in _run_counts(algo, n))


def cheapest_allreduce(
    nbytes: float, n: int, alpha: float, beta: float
) -> tuple[AllReduceAlgorithm, float]:
    """The fastest algorithm and its time; ties go to ring, tree, butterfly, naive, PS."""
    times = [_schedule_time(a, n, nbytes, alpha, beta) for a in _PREFERENCE]
    k = min(range(len(_PREFERENCE)), key=lambda i: (times[i], i))
    return _PREFERENCE[k], times[k]


def allreduce_time(
    nbytes: float,
    n: int,
    alpha: float,
    beta: float,
    algorithm: AllReduceAlgorithm | str | None = None,
) -> float:
    """Seconds for one all-reduce; ``algorithm=None`` takes the cheapest."""
    if algorithm is None:
        return cheapest_allreduce(nbytes, n, alpha, beta)[1]
    return allreduce_schedule(algorithm, n, nbytes).time(alpha, beta)


def allgather_time(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Ring all-gather of an ``nbytes`` result: ``(n-1)(alpha + beta nbytes/n)``."""
    _check(n, nbytes)
    return (n - 1) * (alpha + beta * nbytes / n)


def reduce_scatter_time(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Ring reduce-scatter of an ``nbytes`` input: ``(n-1)(alpha + beta nbytes/n)``."""
    _check(n, nbytes)
    return (n - 1) * (alpha + beta * nbytes / n)


def all_to_all_time(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Pairwise-exchange all-to-all of an ``nbytes`` logical tensor: each device holds
    ``nbytes/n`` and sends a ``nbytes/n**2`` block to each of the n-1 others, one per round:
    ``(n-1)(alpha + beta nbytes/n**2)``."""
    _check(n, nbytes)
    return (n - 1) * (alpha + beta * nbytes / n**2)


def collective_permute_time(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Every device sends ``nbytes`` to one peer in one round: ``alpha + beta nbytes``."""
    _check(n, nbytes)
    return 0.0 if n == 1 else alpha + beta * nbytes


def collective_time(
    kind: CollectiveKind | str,
    nbytes: float,
    mesh: LogicalMesh,
    axes: tuple[int, ...] | int,
    algorithm: AllReduceAlgorithm | str | None = None,
) -> float:
    """Seconds for one collective over ``axes`` of ``mesh``.

    Several axes form one group of ``n = prod(sizes)`` devices limited by the slowest link:
    ``alpha = max`` and ``beta = max`` over the axes. ``algorithm`` applies to all-reduce only
    (``None``: the cheapest). Zero when the group has one device.
    """
    kind = collective_kind(kind)
    axes_t = (axes,) if isinstance(axes, int) else tuple(axes)
    for a in axes_t:
        if not 0 <= a < mesh.ndim:
            raise MeshError(f"mesh axis {a} out of range for a {mesh.ndim}-D mesh")
    if len(set(axes_t)) != len(axes_t):
        raise MeshError(f"mesh axes {axes_t} repeat an axis")
    n = math.prod(mesh.shape[a] for a in axes_t)
    if n == 1:
        return 0.0
    alpha = max(mesh.alpha[a] for a in axes_t)
    beta = max(mesh.beta[a] for a in axes_t)
    if kind is CollectiveKind.ALL_REDUCE:
        return allreduce_time(nbytes, n, alpha, beta, algorithm)
    if kind is CollectiveKind.ALL_GATHER:
        return allgather_time(nbytes, n, alpha, beta)
    if kind is CollectiveKind.REDUCE_SCATTER:
        return reduce_scatter_time(nbytes, n, alpha, beta)
    if kind is CollectiveKind.ALL_TO_ALL:
        return all_to_all_time(nbytes, n, alpha, beta)
    return collective_permute_time(nbytes, n, alpha, beta)


def estimate_collective(
    kind: CollectiveKind | str,
    nbytes: float,
    mesh: LogicalMesh,
    axes: tuple[int, ...] | int,
    count: int = 1,
) -> CollectiveEstimate:
    """Price ``count`` collectives of ``kind`` moving ``nbytes`` over ``axes`` with
    :func:`collective_time`: the plan's record of a predicted collective."""
    axes_t = (axes,) if isinstance(axes, int) else tuple(axes)
    one = collective_time(kind, nbytes, mesh, axes_t)
    return CollectiveEstimate(collective_kind(kind), count, float(nbytes), axes_t,
                              count * one)
