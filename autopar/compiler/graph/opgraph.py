"""OpGraph: the compiler's view of a traced train step.

One node per primitive equation of the flat program (nested calls already inlined), each with
its input and output tensors (shape, dtype) and flop/byte estimates. Tensor ids are the flat
program's value ids, so a sharding chosen for tensor ``t`` here is applied to value ``t`` by the
runtime. Graph algorithms (topological order, liveness, clustering) run on the networkx view
from :meth:`OpGraph.to_networkx`, which converts back losslessly with :meth:`OpGraph.from_networkx`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from autopar.ir.program import SCAN_ENTER as _ENTER
from autopar.ir.program import SCAN_EXIT as _EXIT

_Fact = TypeVar("_Fact")
_MISSING = object()  # a node fact not computed yet (``OpGraph.node_fact``)

if TYPE_CHECKING:  # networkx is imported where a view is asked for: it adds 0.15 s to
    import networkx as nx  # every ``import autopar``

# The primitive names of a scan region's ends (``ir.program``), for rooms that may not import
# ``ir`` themselves.
SCAN_ENTER: str = _ENTER.name
SCAN_EXIT: str = _EXIT.name


@functools.cache
def _itemsize(dtype: str) -> int:
    """Bytes per element of the dtype named ``dtype`` (looked up once per name)."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes such as PRNG keys
        return 8


@dataclass(frozen=True)
class TensorInfo:
    """A value of the program: id, shape, dtype and origin (input/const/literal/intermediate)."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    kind: str

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @cached_property
    def nbytes(self) -> int:
        # read for every tensor by every memory estimate and ILP build: computed once
        return self.size * self.itemsize


@dataclass(frozen=True)
class OpNode:
    """One primitive application. ``params`` are the primitive's own parameters (not JSON)."""

    id: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    flops: float
    bytes_accessed: float
    params: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # times it runs per step (inside scan regions: the scans' lengths multiplied). ``flops``
    # and ``bytes_accessed`` are per step; its tensors' shapes are per run (one iteration's)
    repeat: int = 1


@dataclass(frozen=True)
class GraphIO:
    """A graph input or output leaf: its tensor id and the pytree path in the step's signature."""

    tensor: int
    path: str
    arg_index: int = -1  # which positional argument (inputs) or result leaf (outputs) it is in


@dataclass(frozen=True)
class ScanLoop:
    """A scan region of the graph (``ir.program.ScanRegion`` by node ids): ``enters[k]`` is
    the node reading scan operand ``k`` (consts, carries, xs), ``exits[j]`` the node making
    result ``j`` (carries, ys); the body's nodes are ``body_start`` .. ``body_stop - 1``."""

    enters: tuple[int, ...]
    exits: tuple[int, ...]
    body_start: int
    body_stop: int
    length: int
    num_consts: int
    num_carry: int

    def carry_pairs(self) -> list[tuple[int, int]]:
        """(enter node, exit node) of each carry: one loop value, read and remade."""
        first = self.num_consts
        return [(self.enters[first + k], self.exits[k]) for k in range(self.num_carry)]


@dataclass
class OpGraph:
    """Nodes in program (topological) order, tensors by id, inputs/outputs by pytree path.

    ``loops``: the scan regions (empty unless the program was traced with its scans expanded);
    a region's nodes are consecutive: its enters, its body, its exits."""

    nodes: list[OpNode]
    tensors: dict[int, TensorInfo]
    inputs: list[GraphIO]
    outputs: list[GraphIO]
    loops: list[ScanLoop] = field(default_factory=list)
    # the tensor holding the cotangent of each value the traced step marked
    # (``ir.cotangent_marks``): marked value id, or a contraction's ``(eqn, k, role)`` ->
    # tensor id
    cotangents: dict[Any, int] = field(default_factory=dict)
    # facts other passes read off the graph, by what they are and their arguments: the graph
    # does not change once built, so each is computed once (``memory_model.parameter_inputs``,
    # read by every memory estimate of the step)
    derived: dict[tuple, Any] = field(default_factory=dict, compare=False, repr=False)

    def node_fact(self, name: str, node: OpNode,
                  compute: Callable[[OpGraph, OpNode], _Fact]) -> _Fact:
        """``compute(self, node)``, kept per node under ``name`` in ``derived``: what every
        ILP build on every mesh asks of every node (its fused bytes, its strategy signature)
        is computed once per graph."""
        known = self.derived.setdefault(("node_fact", name), {})
        found = known.get(node.id, _MISSING)
        if found is _MISSING:
            found = known[node.id] = compute(self, node)
        return found

    @cached_property
    def producer(self) -> dict[int, int]:
        """Tensor id -> id of the node that computes it (inputs, constants: absent)."""
        return {t: node.id for node in self.nodes for t in node.outputs}

    @cached_property
    def consumers(self) -> dict[int, list[int]]:
        """Tensor id -> ids of the nodes that read it, in program order (each node once)."""
        users: dict[int, list[int]] = {t: [] for t in self.tensors}
        for node in self.nodes:
            for t in dict.fromkeys(node.inputs):
                users[t].append(node.id)
        return users

    @cached_property
    def output_tensors(self) -> frozenset[int]:
        """Ids of the tensors the graph returns."""
        return frozenset(io.tensor for io in self.outputs)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def num_edges(self) -> int:
        """Producer -> consumer pairs (the edges of :meth:`to_networkx`)."""
        producer = self.producer
        return sum(len({producer[t] for t in n.inputs if t in producer}) for n in self.nodes)

    @property
    def total_flops(self) -> float:
        return float(sum(node.flops for node in self.nodes))

    def input_paths(self) -> dict[str, int]:
        return {io.path: io.tensor for io in self.inputs}

    def primitive_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self.nodes:
            counts[node.primitive] = counts.get(node.primitive, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def bytes_of(self, tensor_ids: Iterable[int]) -> int:
        return sum(self.tensors[t].nbytes for t in tensor_ids)

    # -- networkx view -------------------------------------------------------------------------

    def to_networkx(self) -> nx.DiGraph:
        """A DiGraph with one node per op (attribute ``op``) and an edge producer -> consumer per
        data dependency (attribute ``tensors``: the ids carried). Graph inputs, outputs and the
        tensor table ride along in ``G.graph`` so :meth:`from_networkx` loses nothing."""
        import networkx as nx

        g = nx.DiGraph(
            tensors=dict(self.tensors),
            inputs=list(self.inputs),
            outputs=list(self.outputs),
            loops=list(self.loops),
        )
        for node in self.nodes:
            g.add_node(node.id, op=node)
        producer = self.producer
        for node in self.nodes:
            for t in node.inputs:
                src = producer.get(t)
                if src is None:
                    continue
                if g.has_edge(src, node.id):
                    if t not in g.edges[src, node.id]["tensors"]:
                        g.edges[src, node.id]["tensors"].append(t)
                else:
                    g.add_edge(src, node.id, tensors=[t])
        return g

    @classmethod
    def from_networkx(cls, g: nx.DiGraph) -> OpGraph:
        """Rebuild an OpGraph from :meth:`to_networkx`'s output (node order: topological)."""
        import networkx as nx

        order = list(nx.lexicographical_topological_sort(g))
        return cls(
            nodes=[g.nodes[n]["op"] for n in order],
            tensors=dict(g.graph["tensors"]),
            inputs=list(g.graph["inputs"]),
            outputs=list(g.graph["outputs"]),
            loops=list(g.graph.get("loops", [])),
        )

    def peak_live_bytes(
        self, exclude: Iterable[int] = (), shards: Mapping[int, int] | None = None
    ) -> int:
        """Largest total size of intermediate tensors alive at once, in program order.

        A tensor is alive from the node that produces it until its last reader (or to the end if
        it is a graph output). ``exclude`` lists tensors counted elsewhere (state, batch);
        ``shards[t]`` divides tensor ``t``'s size (its per-device share under a sharding).
        """
        shards = shards or {}
        excluded = set(exclude)
        last_use: dict[int, int] = {}
        for node in self.nodes:
            for t in node.inputs:
                last_use[t] = node.id
        end = len(self.nodes)
        for io in self.outputs:
            last_use[io.tensor] = end
        frees: dict[int, list[int]] = {}
        live = peak = 0
        for node in self.nodes:
            for t in node.outputs:
                if t in excluded or t not in last_use:
                    continue
                live += self.tensors[t].nbytes // shards.get(t, 1)
                frees.setdefault(last_use[t], []).append(t)
            peak = max(peak, live)
            for t in frees.pop(node.id, []):
                live -= self.tensors[t].nbytes // shards.get(t, 1)
        return peak
