"""The intra-operator ILP's decision variables: one per graph input and per operator, with
cheap operators *following* an operand's variable instead of getting their own.

A follower (elementwise, cast, reshape...) takes, for each strategy of the variable it follows,
its cheapest strategy that reads the operand as it comes; it then rides on that variable. The
table also records where each tensor is produced (its *home*), which the edges, the memory rows
and the read-back of the solution all look up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.fusion import kernel_bytes
from autopar.compiler.graph.op_costs import ELEMENTWISE
from autopar.compiler.graph.opgraph import OpGraph, OpNode, TensorInfo
from autopar.compiler.intra_op.strategies import strategies_for
from autopar.compiler.intra_op.strategies.base import Strategy, StrategyContext, specs_on_mesh
from autopar.compiler.intra_op.strategies.control import repeated
from autopar.plan import ShardingSpec

# Nodes whose layout is best decided by an operand's: merged into that operand's variable.
FOLLOWERS = ELEMENTWISE | frozenset(
    {
        "convert_element_type",
        "reduce_precision",
        "copy",
        "copy_p",
        "reshape",
        "transpose",
        "squeeze",
        "stop_gradient",
    }
)
# Producers a follower should not follow when another operand is available: their own layout
# is a free choice that should adapt to the consumer, not dictate it.
_WEAK_PRODUCERS = frozenset({"broadcast_in_dim", "iota"})
# Followers that may change rank: any operand can lead them.
_RANK_CHANGING = frozenset({"reshape", "transpose", "squeeze"})

# Weight of per-device state bytes in the objective: breaks ties towards less memory without
# ever outweighing a real cost (1 GiB per device adds about a nanosecond).
MEMORY_TIE_BREAK_S_PER_BYTE = 1e-18
# Weight of each collective in the objective: among plans that move the same bytes, the one
# with fewer collectives wins. Partial sums all-reduced cost exactly what a reduce-scatter plus
# the all-gathers back to whole cost (a ring all-reduce is both halves), and without this the
# solver picks either; XLA's own propagation all-reduces, and on CPU XLA runs a
# reduce-scatter as an all-reduce plus a slice, so the split path is the worse one there.
COLLECTIVE_TIE_BREAK_S = 1e-10


def decision_cost(strategy: Strategy) -> float:
    """What choosing ``strategy`` adds to the objective: its cost, plus the collective
    tie-break per collective it runs."""
    count = sum(c.count for c in strategy.collectives)
    return strategy.cost + COLLECTIVE_TIE_BREAK_S * count


@dataclass
class Variable:
    """One ILP decision: a root (graph input or operator) and the followers riding on it.

    ``members[m][i]`` is the strategy of member ``m`` when the variable takes choice ``i``.
    """

    index: int
    root: int  # op node id, or -(1 + input position) for a graph input
    members: dict[int, list[Strategy]] = field(default_factory=dict)
    costs: list[float] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.costs)


def input_key(position: int) -> int:
    """The member key of graph input ``position`` (op nodes use their non-negative ids)."""
    return -(1 + position)


def node_signature(graph: OpGraph, node: OpNode) -> tuple:
    """What a node's strategies depend on: primitive, parameters, operand and result types,
    and how often it runs per step (inside scan regions). Computed once per node of a graph
    (``OpGraph.node_fact``)."""
    return graph.node_fact("node_signature", node, _node_signature)


def _node_signature(graph: OpGraph, node: OpNode) -> tuple:
    params = tuple(sorted((k, repr(v)) for k, v in node.params.items()))
    types = tuple(
        (graph.tensors[t].shape, graph.tensors[t].dtype) for t in (*node.inputs, *node.outputs)
    )
    return (node.primitive, params, types, len(node.inputs), node.repeat)


def leaf_role(path: str) -> str:
    """A leaf path with its list indices as ``*``: the same parameter of every layer of a
    list of layers (``state/params/blocks/*/attn/q/bias``) has one role."""
    return "/".join("*" if part.isdigit() else part for part in path.split("/"))


def input_strategies(
    info: TensorInfo, mesh: LogicalMesh, is_batch: bool, pinned: ShardingSpec | None
) -> list[Strategy]:
    """The specs a graph input may take, and what each costs per step.

    A batch leaf is fed anew every step: each device receives its share over its own link, so a
    split batch costs less to feed than a replicated one. State stays on the devices; its specs
    differ only in memory, which breaks ties.
    """
    if pinned is not None:
        specs = [pinned]
    else:
        specs = list(specs_on_mesh(info.shape, mesh)) if info.ndim else [ShardingSpec(())]
    sizes = {a: mesh.axis_size(a) for a in mesh.axis_names}
    feed_beta = min(mesh.beta) if mesh.beta else 0.0
    out = []
    for spec in specs:
        share = info.nbytes / spec.num_shards(sizes)
        cost = share * (feed_beta if is_batch else MEMORY_TIE_BREAK_S_PER_BYTE)
        out.append(Strategy(spec.to_string(), (spec,), (), compute_time_s=cost))
    return out


@dataclass
class MeshCaches:
    """What builds of the ILP on one mesh share: strategy lists by node signature, followers'
    lists, resharding costs and edge matrices. Each entry depends only on the mesh and on what
    it is keyed by (types, specs, the identity of shared strategy lists), never on one graph,
    so the same layer met again in another piece or candidate is priced from the cache."""

    strategies: dict[tuple, list[Strategy]] = field(default_factory=dict)
    interned: dict[tuple, list[Strategy]] = field(default_factory=dict)
    by_spec: dict[tuple, dict] = field(default_factory=dict)
    ambiguous: dict[tuple, frozenset] = field(default_factory=dict)
    follow: dict[tuple, list[Strategy] | None] = field(default_factory=dict)
    reshard_costs: dict[tuple, Any] = field(default_factory=dict)
    reshard_steps: dict[tuple, Any] = field(default_factory=dict)
    matrices: dict[tuple, Any] = field(default_factory=dict)
    # each shared strategy list's ``decision_cost``s, by the list's id (the lists above
    # live as long as these caches: every id here names a list they hold)
    decision_costs: dict[int, list[float]] = field(default_factory=dict)


class DecisionVariables:
    """The variables of one graph on one mesh, which variable each member rides on, and
    where each tensor is produced.

    Strategy lists are cached by what they depend on, so the same op of every repeated layer
    shares one list object; later stages (tying, edge matrices) key their caches on that.
    """

    def __init__(self, graph: OpGraph, mesh: LogicalMesh, caches: MeshCaches | None = None):
        self.graph = graph
        self.mesh = mesh
        self.variables: list[Variable] = []
        self.var_of: dict[int, int] = {}  # member key -> variable index
        self.tensor_home: dict[int, tuple[int, int]] = {}  # tensor -> (member key, output idx)
        # node id -> node_signature, plus the roles and pins of the graph inputs it reads: what
        # tying's structural labels start from (see node_strategies)
        self.signatures: dict[int, tuple] = {}
        # graph-input tensor -> (its role: the leaf path with list indices as "*", its pin)
        self.input_tags: dict[int, tuple[str, ShardingSpec | None]] = {}
        self.caches = caches if caches is not None else MeshCaches()
        self._strategy_cache = self.caches.strategies
        self._interned = self.caches.interned
        self._by_spec_cache = self.caches.by_spec
        self._ambiguous_cache = self.caches.ambiguous
        self._follow_cache = self.caches.follow

    # -- lookups -----------------------------------------------------------------------------

    def variable_of(self, member: int) -> Variable:
        """The variable ``member`` (an op node id or an input key) rides on."""
        return self.variables[self.var_of[member]]

    def home_variable(self, tensor: int) -> Variable:
        """The variable deciding the layout of ``tensor`` (which must have a home)."""
        return self.variable_of(self.tensor_home[tensor][0])

    def member_outputs(self, member: int) -> list[int]:
        """The tensors a member produces: a graph input's own tensor, or an op's outputs."""
        if member < 0:
            return [self.graph.inputs[-member - 1].tensor]
        return list(self.graph.nodes[member].outputs)

    # -- building ----------------------------------------------------------------------------

    def decision_costs(self, strategies: list[Strategy]) -> list[float]:
        """``decision_cost`` of each of ``strategies``, a list the caches hold (the same op
        of every repeated layer shares one: a whole model's build asks millions of times)."""
        found = self.caches.decision_costs.get(id(strategies))
        if found is None:
            found = self.caches.decision_costs[id(strategies)] = [decision_cost(s)
                                                                   for s in strategies]
        return found

    def new_variable(self, key: int, strategies: list[Strategy]) -> None:
        var = Variable(len(self.variables), key, {key: strategies},
                       list(self.decision_costs(strategies)))
        self.variables.append(var)
        self.var_of[key] = var.index

    def add_inputs(
        self, batch_argnums: tuple[int, ...], pinned_inputs: Mapping[str, ShardingSpec]
    ) -> None:
        """One variable per graph input; ``pinned_inputs`` (by leaf path) leave one choice."""
        for position, io in enumerate(self.graph.inputs):
            key = input_key(position)
            info = self.graph.tensors[io.tensor]
            is_batch = io.arg_index in batch_argnums
            pinned = pinned_inputs.get(io.path)
            self.input_tags[io.tensor] = (leaf_role(io.path), pinned)
            # inputs of one shape and role share one list (and so their cached matrices)
            list_key = ("input", info.shape, info.dtype, is_batch, pinned)
            strategies = self._strategy_cache.get(list_key)
            if strategies is None:
                strategies = input_strategies(info, self.mesh, is_batch, pinned)
                self._strategy_cache[list_key] = strategies
            self.new_variable(key, strategies)
            self.tensor_home.setdefault(io.tensor, (key, 0))

    def add_nodes(self) -> None:
        """A variable per operator, except followers that can ride on an operand's."""
        for node in self.graph.nodes:
            strategies = self.node_strategies(node)
            followed = node.primitive in FOLLOWERS and self.try_follow(node, strategies)
            if not followed:
                self.new_variable(node.id, strategies)
            for out_index, t in enumerate(node.outputs):
                self.tensor_home[t] = (node.id, out_index)

    def node_strategies(self, node: OpNode) -> list[Strategy]:
        """Strategies depend only on the op's kind, params and shapes: identical ops of
        repeated layers share one generated list.

        The node's tying signature adds the role and pin of every graph input it reads
        (``input_tags``). Identical layers' same parameter has one role (``leaf_role``), so
        their ops still tie; two parameters of one shape in different roles (a query bias, an
        output bias) get optimizer updates that look alike for many hops, but where Megatron
        splits one and keeps the other whole, tying their updates would force one to reshard.
        Likewise two layers whose kernels are pinned differently are not the same layer."""
        key = node_signature(self.graph, node)
        if self.mesh.device.memory_bandwidth_bytes_per_s:
            # its time depends on what its kernel moves, which its neighbours decide
            key = (*key, kernel_bytes(self.graph, node))
        tags = tuple((k, self.input_tags[t]) for k, t in enumerate(node.inputs)
                     if t in self.input_tags)
        self.signatures[node.id] = (*key, tags) if tags else key
        found = self._strategy_cache.get(key)
        if found is None:
            found = strategies_for(StrategyContext(node=node, graph=self.graph, mesh=self.mesh))
            if node.repeat > 1:  # a scan body's op: its own collectives happen every iteration
                found = repeated(found, node.repeat)
            self._strategy_cache[key] = found
        return found

    # -- following ---------------------------------------------------------------------------

    def followed_operand(self, node: OpNode) -> int | None:
        """Operand position a follower rides on: same rank as the output, largest, and not
        produced by a weak producer when a better one exists."""
        out_rank = self.graph.tensors[node.outputs[0]].ndim if node.outputs else -1
        best: tuple | None = None
        for k, t in enumerate(node.inputs):
            info = self.graph.tensors[t]
            if t not in self.tensor_home or info.ndim == 0:
                continue
            if node.primitive not in _RANK_CHANGING and info.ndim != out_rank:
                continue
            producer = self.graph.producer.get(t)
            weak = producer is not None and self.graph.nodes[producer].primitive in _WEAK_PRODUCERS
            rank = (not weak, info.size, -k)
            if best is None or rank > best[0]:
                best = (rank, k)
        return None if best is None else best[1]

    def _cheapest_by_input_spec(
        self, strategies: list[Strategy], k: int
    ) -> dict[ShardingSpec | None, Strategy]:
        key = (id(strategies), k)
        found = self._by_spec_cache.get(key)
        if found is None:
            found = {}
            for s in strategies:
                spec = s.input_specs[k]
                if spec not in found or decision_cost(s) < decision_cost(found[spec]):
                    found[spec] = s
            self._by_spec_cache[key] = found
        return found

    def _ambiguous_input_specs(
        self, strategies: list[Strategy], k: int
    ) -> frozenset[ShardingSpec | None]:
        """Specs of operand ``k`` that several of the node's strategies read with different
        output layouts: a broadcasting op whose followed operand lacks some of the output's
        extent (``eq(x[..., None], iota)``), or a reshape that may put a split on either of
        two dimensions. Which one is best depends on the node's users, which a follower's
        per-choice cheapest pick never sees (it would split the broadcast dimension to save
        a little compute, and every user reading it whole would gather it back): such a node
        makes a decision of its own."""
        key = (id(strategies), k)
        found = self._ambiguous_cache.get(key)
        if found is None:
            outputs: dict[ShardingSpec | None, set] = {}
            for s in strategies:
                outputs.setdefault(s.input_specs[k], set()).add(s.output_specs)
            found = frozenset(spec for spec, outs in outputs.items() if len(outs) > 1)
            self._ambiguous_cache[key] = found
        return found

    def try_follow(self, node: OpNode, strategies: list[Strategy]) -> bool:
        """Make ``node`` ride on its followed operand's variable; False when some choice of
        that variable leaves the node no strategy reading the operand as it comes."""
        k = self.followed_operand(node)
        if k is None:
            return False
        home_member, out = self.tensor_home[node.inputs[k]]
        var = self.variable_of(home_member)
        src_list = var.members[home_member]
        # The answer depends only on the producer's and this op's strategy lists, which tied
        # layers share: look each combination up once.
        key = (id(src_list), out, id(strategies), k)
        if key not in self._follow_cache:
            by_spec = self._cheapest_by_input_spec(strategies, k)
            ambiguous = self._ambiguous_input_specs(strategies, k)
            found = [by_spec.get(s.output_specs[out]) for s in src_list]
            if any(s.output_specs[out] in ambiguous for s in src_list):
                found = [None]
            # the same follower of every tied layer shares one list (and its cached matrices)
            followed = [s for s in found if s is not None]
            self._follow_cache[key] = (
                None if len(followed) < len(found)
                else self._interned.setdefault(tuple(followed), followed)
            )
        chosen = self._follow_cache[key]
        if chosen is None:
            return False
        var.members[node.id] = chosen
        var.costs = [c + d for c, d in zip(var.costs, self.decision_costs(chosen), strict=True)]
        self.var_of[node.id] = var.index
        return True
