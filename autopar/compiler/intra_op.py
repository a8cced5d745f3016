"""The intra-operator pass: choose every tensor's sharding on one logical mesh with an ILP.

Steps: (1) one decision variable per graph input (its spec) and per operator (its strategy);
cheap nodes (elementwise, casts, reshapes) *follow* an operand: they take, for each strategy of
the operand's variable, their cheapest strategy that reads the operand as it comes, and ride on
that variable instead of getting one of their own; (2) every data edge between two variables
gets a resharding-cost matrix; a new-state output is tied to the input leaf it replaces, so the
state keeps one layout from step to step; (3) the ILP picks one strategy per variable; (4) the
choice is read back as specs per tensor and per operand use.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from autopar.compiler.collectives import CollectiveEstimate
from autopar.compiler.graph import OpGraph, OpNode, TensorInfo
from autopar.compiler.ilp import IntraOpProblem, IntraOpSolution, ProblemEdge, ProblemNode, solve
from autopar.compiler.mesh import LogicalMesh
from autopar.compiler.op_costs import ELEMENTWISE
from autopar.compiler.plan import ShardingSpec
from autopar.compiler.resharding import ReshardCost, reshard_cost
from autopar.compiler.strategies import strategies_for
from autopar.compiler.strategies.base import Strategy, StrategyContext, specs_on_mesh

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


@dataclass(frozen=True)
class IntraOpOptions:
    """Options of the intra-operator ILP."""

    memory_budget_bytes: float | None = None
    solver: str = "auto"
    time_limit_s: float = 30.0
    max_live_sets: int = 200
    batch_argnums: tuple[int, ...] = (1,)
    # input leaf path -> the spec it must take (the ILP chooses everything else)
    pinned_inputs: dict[str, ShardingSpec] = field(default_factory=dict)
    # hops of wiring that must match for two ops to count as the same op of identical layers
    # (and share one decision); 0 turns the tying off
    tie_rounds: int = 4


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


@dataclass
class IntraOpResult:
    """The pass's answer: a strategy per op node, a spec per graph input, and the ILP."""

    node_strategy: dict[int, Strategy]
    input_spec: dict[int, ShardingSpec]  # graph-input tensor id -> spec
    operand_specs: dict[tuple[int, int], ShardingSpec]  # (node id, operand) -> required spec
    tensor_spec: dict[int, ShardingSpec]  # every produced or input tensor -> its spec
    reshard_collectives: list[CollectiveEstimate]
    problem: IntraOpProblem
    solution: IntraOpSolution
    variables: list[Variable]
    build_time_s: float
    ties: list[tuple[int, int]] = field(default_factory=list)  # (new-state output, input) pairs


def _input_key(position: int) -> int:
    return -(1 + position)


# Weight of per-device state bytes in the objective: breaks ties towards less memory without
# ever outweighing a real cost (1 GiB per device adds about a nanosecond).
MEMORY_TIE_BREAK_S_PER_BYTE = 1e-18


def _input_strategies(
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


class _Builder:
    def __init__(self, graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions):
        self.graph = graph
        self.mesh = mesh
        self.options = options
        self.variables: list[Variable] = []
        self.var_of: dict[int, int] = {}  # member key -> variable index
        self.tensor_home: dict[int, tuple[int, int]] = {}  # tensor -> (member key, output idx)
        self._cost_cache: dict[tuple, ReshardCost] = {}
        self._strategy_cache: dict[tuple, list[Strategy]] = {}
        self._matrix_cache: dict[tuple, np.ndarray] = {}
        self._interned: dict[tuple, list[Strategy]] = {}
        self._by_spec_cache: dict[tuple, dict] = {}

    # -- variables ---------------------------------------------------------------------------

    def spec_of(self, member: int, choice: int, output: int) -> ShardingSpec:
        var = self.variables[self.var_of[member]]
        return var.members[member][choice].output_specs[output]

    def tensor_spec(self, tensor: int, choice: int) -> ShardingSpec | None:
        home = self.tensor_home.get(tensor)
        if home is None:
            return None
        return self.spec_of(home[0], choice, home[1])

    def new_variable(self, key: int, strategies: list[Strategy]) -> None:
        var = Variable(len(self.variables), key, {key: strategies}, [s.cost for s in strategies])
        self.variables.append(var)
        self.var_of[key] = var.index

    def add_inputs(self) -> None:
        for position, io in enumerate(self.graph.inputs):
            key = _input_key(position)
            info = self.graph.tensors[io.tensor]
            is_batch = io.arg_index in self.options.batch_argnums
            pinned = self.options.pinned_inputs.get(io.path)
            # inputs of one shape and role share one list (and so their cached matrices)
            list_key = ("input", info.shape, info.dtype, is_batch, pinned)
            strategies = self._strategy_cache.get(list_key)
            if strategies is None:
                strategies = _input_strategies(info, self.mesh, is_batch, pinned)
                self._strategy_cache[list_key] = strategies
            self.new_variable(key, strategies)
            self.tensor_home.setdefault(io.tensor, (key, 0))

    def followed_operand(self, node: OpNode) -> int | None:
        """Operand position a follower rides on: same rank as the output, largest, and not
        produced by a weak producer when a better one exists."""
        out_rank = self.graph.tensors[node.outputs[0]].ndim if node.outputs else -1
        best: tuple | None = None
        for k, t in enumerate(node.inputs):
            info = self.graph.tensors[t]
            if t not in self.tensor_home or info.ndim == 0:
                continue
            if node.primitive not in ("reshape", "transpose", "squeeze") and info.ndim != out_rank:
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
                if spec not in found or s.cost < found[spec].cost:
                    found[spec] = s
            self._by_spec_cache[key] = found
        return found

    def try_follow(self, node: OpNode, strategies: list[Strategy]) -> bool:
        k = self.followed_operand(node)
        if k is None:
            return False
        tensor = node.inputs[k]
        home_member, _ = self.tensor_home[tensor]
        var = self.variables[self.var_of[home_member]]
        by_spec = self._cheapest_by_input_spec(strategies, k)
        chosen: list[Strategy] = []
        for i in range(var.size):
            match = by_spec.get(self.tensor_spec(tensor, i))
            if match is None:
                return False
            chosen.append(match)
        # the same follower of every tied layer shares one list (and so its cached matrices)
        chosen = self._interned.setdefault(tuple(chosen), chosen)
        var.members[node.id] = chosen
        var.costs = [c + s.cost for c, s in zip(var.costs, chosen, strict=True)]
        self.var_of[node.id] = var.index
        return True

    def node_strategies(self, node: OpNode) -> list[Strategy]:
        """Strategies depend only on the op's kind, params and shapes: identical ops of
        repeated layers share one generated list."""
        key = _node_signature(self.graph, node)
        found = self._strategy_cache.get(key)
        if found is None:
            found = strategies_for(StrategyContext(node=node, graph=self.graph, mesh=self.mesh))
            self._strategy_cache[key] = found
        return found

    def add_nodes(self) -> None:
        for node in self.graph.nodes:
            strategies = self.node_strategies(node)
            followed = node.primitive in FOLLOWERS and self.try_follow(node, strategies)
            if not followed:
                self.new_variable(node.id, strategies)
            for out_index, t in enumerate(node.outputs):
                self.tensor_home[t] = (node.id, out_index)

        # -- tying identical layers --------------------------------------------------------------

    def tie_identical_variables(self, rounds: int) -> None:
        """Merge variables whose roots look alike within ``rounds`` hops (same ops, shapes and
        wiring): the same op of structurally identical layers. Merged variables make one choice
        together, so the ILP solves one layer where the model repeats it."""
        labels = _structural_labels(self.graph, self.options.batch_argnums, rounds)
        classes: dict[tuple, int] = {}
        merged: list[Variable] = []
        remap: dict[int, int] = {}
        for var in self.variables:
            members = sorted(var.members)
            signature = (
                labels[var.root],
                tuple(labels[m] for m in members if m != var.root),
                tuple(s.name for s in var.members[var.root]),
            )
            target = classes.get(signature)
            if target is None:
                target = len(merged)
                classes[signature] = target
                merged.append(Variable(target, var.root, dict(var.members), list(var.costs)))
            else:
                into = merged[target]
                into.members.update(var.members)
                into.costs = [a + b for a, b in zip(into.costs, var.costs, strict=True)]
            remap[var.index] = target
        self.variables = merged
        self.var_of = {m: remap[v] for m, v in self.var_of.items()}

    # -- edges -------------------------------------------------------------------------------

    def cost(self, src: ShardingSpec, dst: ShardingSpec, info: TensorInfo) -> ReshardCost:
        key = (src, dst, info.shape, info.dtype)
        found = self._cost_cache.get(key)
        if found is None:
            found = reshard_cost(src, dst, info, self.mesh)
            self._cost_cache[key] = found
        return found

    def use_matrix(
        self, tensor: int, needs: Sequence[ShardingSpec | None], key: tuple
    ) -> np.ndarray:
        """Resharding seconds [producer choice][consumer choice] for one use of ``tensor``.

        Cached by the producer's and consumer's strategy lists: the same op of every tied
        layer reuses one matrix."""
        home, out = self.tensor_home[tensor]
        src_list = self.variables[self.var_of[home]].members[home]
        info = self.graph.tensors[tensor]
        full_key = (id(src_list), out, key, info.shape, info.dtype)
        found = self._matrix_cache.get(full_key)
        if found is None:
            src_specs = [s.output_specs[out] for s in src_list]
            found = np.zeros((len(src_specs), len(needs)))
            for j, need in enumerate(needs):
                if need is not None:
                    found[:, j] = [self.cost(spec, need, info).time_s for spec in src_specs]
            self._matrix_cache[full_key] = found
        return found

    def edges(self) -> list[ProblemEdge]:
        matrices: dict[tuple[int, int], np.ndarray] = {}
        notes: dict[tuple[int, int], list[str]] = {}

        def add_use(tensor: int, dst_var: Variable, needs, key: tuple, note: str) -> None:
            """``needs[j]``: the spec the use needs under the consumer's choice j."""
            src_var = self.variables[self.var_of[self.tensor_home[tensor][0]]]
            matrix = self.use_matrix(tensor, needs, key)
            if src_var.index == dst_var.index:
                # one decision at both ends: only the diagonal can happen
                src_var.costs = list(np.asarray(src_var.costs) + np.diagonal(matrix))
                return
            pair = (src_var.index, dst_var.index)
            if pair in matrices:
                matrices[pair] = matrices[pair] + matrix
            else:
                matrices[pair] = matrix
            notes.setdefault(pair, []).append(note)

        for node in self.graph.nodes:
            var = self.variables[self.var_of[node.id]]
            strategies = var.members[node.id]
            for k, t in enumerate(node.inputs):
                if t not in self.tensor_home:
                    continue  # literal or constant: every device holds it whole
                needs = [s.input_specs[k] for s in strategies]
                add_use(t, var, needs, ("use", id(strategies), k), f"t{t}->n{node.id}.{k}")
        for out_t, in_t in self.state_ties():
            in_member = self.tensor_home[in_t][0]
            in_var = self.variables[self.var_of[in_member]]
            in_list = in_var.members[in_member]
            needs = [s.output_specs[0] for s in in_list]
            add_use(out_t, in_var, needs, ("tie", id(in_list)), f"tie t{out_t}=t{in_t}")
        return [
            ProblemEdge(src, dst, matrix.tolist(), note="; ".join(notes[(src, dst)][:4]))
            for (src, dst), matrix in matrices.items()
            if matrix.any()
        ]

    def state_ties(self) -> list[tuple[int, int]]:
        """(output tensor, input tensor) pairs of new-state leaves and the leaves they replace:
        outputs whose path after the result index equals an input's path after the argument
        name (``out/0/params/w`` replaces ``state/params/w``) with the same shape and dtype."""
        by_suffix: dict[str, int] = {}
        for io in self.graph.inputs:
            suffix = io.path.split("/", 1)[1] if "/" in io.path else ""
            if io.arg_index == 0:
                by_suffix[suffix] = io.tensor
        ties = []
        for io in self.graph.outputs:
            parts = io.path.split("/", 2)
            if len(parts) < 3 or parts[1] != "0":
                continue
            in_t = by_suffix.get(parts[2])
            if in_t is None or io.tensor not in self.tensor_home:
                continue
            a, b = self.graph.tensors[io.tensor], self.graph.tensors[in_t]
            if (a.shape, a.dtype) == (b.shape, b.dtype):
                ties.append((io.tensor, in_t))
        return ties

    # -- memory ------------------------------------------------------------------------------

    def memory_vectors(self) -> list[list[float]]:
        sizes = {a: self.mesh.axis_size(a) for a in self.mesh.axis_names}
        vectors = []
        for var in self.variables:
            vec = [0.0] * var.size
            for member, strategies in var.members.items():
                outs = (
                    [self.graph.inputs[-member - 1].tensor]
                    if member < 0
                    else self.graph.nodes[member].outputs
                )
                for i, s in enumerate(strategies):
                    for t, spec in zip(outs, s.output_specs, strict=True):
                        vec[i] += self.graph.tensors[t].nbytes / spec.num_shards(sizes)
            vectors.append(vec)
        return vectors

    def live_sets(self) -> list[list[int]]:
        """Variables whose tensors are alive at sampled program points (inputs always)."""
        graph = self.graph
        last_use: dict[int, int] = {}
        for node in graph.nodes:
            for t in node.inputs:
                last_use[t] = node.id
        always = sorted({self.var_of[_input_key(p)] for p in range(len(graph.inputs))})
        step = max(1, len(graph.nodes) // self.options.max_live_sets)
        live: dict[int, int] = {}
        sets: list[list[int]] = []
        for node in graph.nodes:
            for t in node.outputs:
                if t in last_use:
                    live[t] = last_use[t]
            if node.id % step == 0:
                current = {self.var_of[self.tensor_home[t][0]] for t in live}
                sets.append(sorted(current | set(always)))
            for t in [t for t, end in live.items() if end <= node.id]:
                del live[t]
        return sets


def _node_signature(graph: OpGraph, node: OpNode) -> tuple:
    """What a node's strategies depend on: primitive, parameters, operand and result types."""
    params = tuple(sorted((k, repr(v)) for k, v in node.params.items()))
    types = tuple(
        (graph.tensors[t].shape, graph.tensors[t].dtype) for t in (*node.inputs, *node.outputs)
    )
    return (node.primitive, params, types, len(node.inputs))


def _structural_labels(
    graph: OpGraph, batch_argnums: tuple[int, ...], rounds: int
) -> dict[int, int]:
    """Weisfeiler-Lehman labels of ops (by id) and inputs (by -1 - position) after ``rounds``
    refinements over operand and user wiring. Equal labels: alike within ``rounds`` hops."""
    producer: dict[int, int] = {io.tensor: _input_key(p) for p, io in enumerate(graph.inputs)}
    producer.update(graph.producer)
    label: dict[int, int] = {}
    for p, io in enumerate(graph.inputs):
        info = graph.tensors[io.tensor]
        label[_input_key(p)] = hash(
            ("input", info.shape, info.dtype, io.arg_index in batch_argnums)
        )
    for node in graph.nodes:
        label[node.id] = hash(_node_signature(graph, node))
    operands: dict[int, list[tuple[int, int]]] = {k: [] for k in label}
    users: dict[int, list[tuple[int, int]]] = {k: [] for k in label}
    for node in graph.nodes:
        for k, t in enumerate(node.inputs):
            src = producer.get(t)
            if src is not None:
                operands[node.id].append((k, src))
                users[src].append((k, node.id))
    for _ in range(rounds):
        label = {
            key: hash(
                (
                    lab,
                    tuple((k, label[src]) for k, src in operands[key]),
                    tuple(sorted((k, label[dst]) for k, dst in users[key])),
                )
            )
            for key, lab in label.items()
        }
    return label


def build_problem(
    graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions
) -> tuple[IntraOpProblem, _Builder]:
    """Variables, costs and edges of the sharding ILP for ``graph`` on ``mesh``."""
    builder = _Builder(graph, mesh, options)
    builder.add_inputs()
    builder.add_nodes()
    if options.tie_rounds > 0:
        builder.tie_identical_variables(options.tie_rounds)
    edges = builder.edges()
    budget = options.memory_budget_bytes
    memory = builder.memory_vectors() if budget is not None else [None] * len(builder.variables)
    nodes = []
    for var, mem in zip(builder.variables, memory, strict=True):
        root = var.members[var.root]
        name = (
            f"input:{graph.inputs[-var.root - 1].path}"
            if var.root < 0
            else f"{graph.nodes[var.root].primitive}#{var.root}"
        )
        followers = [m for m in var.members if m != var.root]
        nodes.append(
            ProblemNode(
                name=name,
                costs=list(var.costs),
                strategy_names=[s.name for s in root],
                memory=mem,
                follow_note=f"followed by {len(followers)} node(s)" if followers else "",
            )
        )
    problem = IntraOpProblem(
        nodes=nodes,
        edges=edges,
        memory_budget=options.memory_budget_bytes,
        live_sets=builder.live_sets() if options.memory_budget_bytes is not None else [],
    )
    return problem, builder


def read_solution(builder: _Builder, choices: Sequence[int]) -> tuple[dict, dict, dict, dict, list]:
    """Per-node strategies, per-input specs, per-use operand specs and resharding collectives."""
    graph = builder.graph
    node_strategy: dict[int, Strategy] = {}
    input_spec: dict[int, ShardingSpec] = {}
    tensor_spec: dict[int, ShardingSpec] = {}
    for var, choice in zip(builder.variables, choices, strict=True):
        for member, strategies in var.members.items():
            strategy = strategies[choice]
            if member < 0:
                io = graph.inputs[-member - 1]
                input_spec[io.tensor] = strategy.output_specs[0]
                tensor_spec.setdefault(io.tensor, strategy.output_specs[0])
            else:
                node_strategy[member] = strategy
                for t, spec in zip(graph.nodes[member].outputs, strategy.output_specs, strict=True):
                    tensor_spec[t] = spec
    operand_specs: dict[tuple[int, int], ShardingSpec] = {}
    collectives: list[CollectiveEstimate] = []
    for node in graph.nodes:
        strategy = node_strategy[node.id]
        for k, t in enumerate(node.inputs):
            need = strategy.input_specs[k]
            have = tensor_spec.get(t)
            if need is None or have is None or need == have:
                continue
            operand_specs[(node.id, k)] = need
            collectives.extend(builder.cost(have, need, graph.tensors[t]).collectives)
    for out_t, in_t in builder.state_ties():
        have, need = tensor_spec[out_t], input_spec[in_t]
        if have != need:
            collectives.extend(builder.cost(have, need, graph.tensors[out_t]).collectives)
    return node_strategy, input_spec, operand_specs, tensor_spec, collectives


def solve_intra_op(graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions) -> IntraOpResult:
    """Build and solve the sharding ILP of ``graph`` on ``mesh``."""
    start = time.perf_counter()
    problem, builder = build_problem(graph, mesh, options)
    build_time = time.perf_counter() - start
    solution = solve(problem, solver=options.solver, time_limit_s=options.time_limit_s)
    node_strategy, input_spec, operand_specs, tensor_spec, collectives = read_solution(
        builder, solution.choices
    )
    return IntraOpResult(
        node_strategy=node_strategy,
        input_spec=input_spec,
        operand_specs=operand_specs,
        tensor_spec=tensor_spec,
        reshard_collectives=collectives,
        problem=problem,
        solution=solution,
        variables=builder.variables,
        build_time_s=build_time,
        ties=builder.state_ties(),
    )
