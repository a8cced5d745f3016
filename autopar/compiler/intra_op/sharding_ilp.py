"""The intra-operator pass: choose every tensor's sharding on one logical mesh with an ILP.

Steps: (1) one decision variable per graph input (its spec) and per operator (its strategy);
cheap nodes (elementwise, casts, reshapes) *follow* an operand: they take, for each strategy of
the operand's variable, their cheapest strategy that reads the operand as it comes, and ride on
that variable instead of getting one of their own (``variables.py``); the same op of
structurally identical layers shares one variable (``tying.py``); (2) every data edge
between two variables gets a resharding-cost matrix; a new-state output is tied to the input
leaf it replaces, so the state keeps one layout from step to step (``edges.py``);
with a memory budget, per-choice bytes and live sets bound the peak (``memory_rows.py``);
(3) the ILP picks one strategy per variable; (4) the choice is read back as specs per tensor
and per operand use.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from autopar.compiler.cost.attention_blocks import transient_bytes
from autopar.compiler.cost.host_state import host_tensors
from autopar.compiler.cost.memory_model import (
    MemoryEstimate,
    estimate_memory,
)
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.opgraph import OpGraph
from autopar.compiler.intra_op.edges import ReshardingEdges, state_ties
from autopar.compiler.intra_op.ilp import evaluate, least_memory_choices, solve
from autopar.compiler.intra_op.memory_rows import live_sets, memory_vectors
from autopar.compiler.intra_op.problem import (
    IlpStatus,
    InfeasibleMemoryError,
    IntraOpProblem,
    IntraOpSolution,
    ProblemNode,
)
from autopar.compiler.intra_op.strategies.base import Strategy
from autopar.compiler.intra_op.tying import (
    tie_identical_variables,
    tie_in_alternation,
    tie_scan_carries,
)
from autopar.compiler.intra_op.variables import (
    FOLLOWERS,
    MEMORY_TIE_BREAK_S_PER_BYTE,
    DecisionVariables,
    MeshCaches,
    Variable,
)
from autopar.method_options import Solver
from autopar.plan import CollectiveEstimate, ShardingSpec

# The solution's status when the memory rows admit no plan but the memory model finds the
# least-memory plan within the budget (``solve_intra_op``): that plan, not the cheapest.
LEAST_MEMORY = IlpStatus.LEAST_MEMORY

# re-exported: the pass's public vocabulary lives in this module
__all__ = [
    "FOLLOWERS",
    "MEMORY_TIE_BREAK_S_PER_BYTE",
    "IntraOpOptions",
    "IntraOpResult",
    "MeshCaches",
    "ProblemParts",
    "Variable",
    "build_problem",
    "state_split_at_least",
    "read_solution",
    "solve_intra_op",
]


@dataclass(frozen=True)
class IntraOpOptions:
    """Options of the intra-operator ILP."""

    memory_budget_bytes: float | None = None
    solver: str = Solver.AUTO
    time_limit_s: float = 30.0
    # the MIP stops within this relative gap (1e-9: optimal up to solver tolerances)
    relative_gap: float = 1e-9
    max_live_sets: int = 200
    batch_argnums: tuple[int, ...] = (1,)
    # input leaf path -> the spec it must take (the ILP chooses everything else)
    pinned_inputs: dict[str, ShardingSpec] = field(default_factory=dict)
    # hops of wiring that must match for two ops to count as the same op of identical layers
    # (and share one decision); 0 turns the tying off
    tie_rounds: int = 4
    # tied ops share a decision with every tie_period-th occurrence of their kind (2: the odd
    # and the even layers decide apart, so consecutive identical layers may alternate, as
    # Megatron's column- and row-parallel kernels do in a deep MLP); 1: all occurrences tie
    tie_period: int = 2
    # the optimizer state kept in host memory between steps (``cost.host_state``): its memory
    # counted only around the update
    offload_optimizer_state: bool = False

    def host_tensors(self, graph: OpGraph) -> frozenset[int]:
        """The tensors of ``graph`` kept in host memory between steps (none unless
        ``offload_optimizer_state``)."""
        return host_tensors(graph, self.batch_argnums, self.offload_optimizer_state)


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


@dataclass
class ProblemParts:
    """What ``build_problem`` keeps besides the problem, to read a solution back."""

    table: DecisionVariables
    edges: ReshardingEdges
    ties: list[tuple[int, int]]  # (new-state output, input it replaces) tensor pairs

    @property
    def variables(self) -> list[Variable]:
        return self.table.variables


def build_problem(
    graph: OpGraph,
    mesh: LogicalMesh,
    options: IntraOpOptions,
    caches: MeshCaches | None = None,
) -> tuple[IntraOpProblem, ProblemParts]:
    """Variables, costs and edges of the sharding ILP for ``graph`` on ``mesh``.

    ``caches``: strategy lists, resharding costs and matrices to reuse, shared by builds on
    this same mesh (``MeshCaches``)."""
    table = DecisionVariables(graph, mesh, caches)
    table.add_inputs(options.batch_argnums, options.pinned_inputs)
    table.add_nodes()
    tie_scan_carries(table)  # a scan's carry keeps one layout around its loop
    if options.tie_rounds > 0:
        untied, untied_of = list(table.variables), dict(table.var_of)
        tie_identical_variables(table, options.batch_argnums, options.tie_rounds)
        if options.tie_period > 1:
            tie_in_alternation(table, untied, untied_of, options.tie_period)
    parts = ProblemParts(
        table, ReshardingEdges(table), state_ties(graph, table.tensor_home)
    )
    edges = parts.edges.edges(parts.ties)  # before the nodes: adds in-variable uses to costs
    budget = options.memory_budget_bytes
    memory = memory_vectors(table) if budget is not None else [None] * len(table.variables)
    nodes = []
    for var, mem in zip(table.variables, memory, strict=True):
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
        memory_budget=budget,
        live_sets=live_sets(table, options.max_live_sets, options.host_tensors(graph))
        if budget is not None else [],
    )
    return problem, parts


def read_solution(
    parts: ProblemParts, choices: Sequence[int]
) -> tuple[dict, dict, dict, dict, list]:
    """Per-node strategies, per-input specs, per-use operand specs, per-tensor specs and the
    resharding collectives the chosen plan implies."""
    graph = parts.table.graph
    node_strategy: dict[int, Strategy] = {}
    input_spec: dict[int, ShardingSpec] = {}
    tensor_spec: dict[int, ShardingSpec] = {}
    for var, choice in zip(parts.variables, choices, strict=True):
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
    for node in graph.nodes:
        strategy = node_strategy[node.id]
        for k, t in enumerate(node.inputs):
            need = strategy.input_specs[k]
            have = tensor_spec.get(t)
            if need is not None and have is not None and need != have:
                operand_specs[(node.id, k)] = need
    uses, tied = reshard_collectives(parts, node_strategy, tensor_spec)
    collectives = [c for moves in uses.values() for c in moves] + tied
    return node_strategy, input_spec, operand_specs, tensor_spec, collectives


def reshard_collectives(
    parts: ProblemParts, node_strategy: dict[int, Strategy], tensor_spec: dict[int, ShardingSpec]
) -> tuple[dict[tuple[int, int], tuple[CollectiveEstimate, ...]], list[CollectiveEstimate]]:
    """The resharding collectives a chosen plan implies: per operand use (node id, operand
    position) whose required spec differs from its producer's (a use inside a scan body on
    every iteration), and those of new-state outputs tied to an input leaf of another spec.
    Kept per use so that a caller can tell which run once per step (a pipeline stage's
    gradient into its update) from the rest."""
    graph = parts.table.graph
    uses: dict[tuple[int, int], tuple[CollectiveEstimate, ...]] = {}
    for node in graph.nodes:
        strategy = node_strategy[node.id]
        for k, t in enumerate(node.inputs):
            need = strategy.input_specs[k]
            have = tensor_spec.get(t)
            if need is None or have is None or need == have:
                continue
            moves = parts.edges.cost(have, need, graph.tensors[t]).collectives
            if node.repeat > 1:  # inside a scan body: on every iteration
                moves = tuple(dataclasses.replace(c, count=c.count * node.repeat,
                                                  time_s=c.time_s * node.repeat) for c in moves)
            uses[(node.id, k)] = tuple(moves)
    tied: list[CollectiveEstimate] = []
    for out_t, in_t in parts.ties:  # an input's spec is its tensor's (read_solution)
        have, need = tensor_spec[out_t], tensor_spec[in_t]
        if have != need:
            tied.extend(parts.edges.cost(have, need, graph.tensors[out_t]).collectives)
    return uses, tied


def state_split_at_least(parts: ProblemParts, batch_argnums: Sequence[int],
                         ways: int) -> dict[int, list[int]]:
    """Per decision variable of a state input (not a batch argument), its choices that split
    that input at least ``ways`` ways, or as many as it can be where fewer: ``ilp.restrict``
    to these gives the fastest plan among those holding at most that share of the state per
    device (parameters, and so their gradients and optimizer state). A ``ways`` of the mesh's
    size keeps each input's most-split choices (the memory-lean plan)."""
    graph, mesh = parts.table.graph, parts.table.mesh
    sizes = {a: mesh.axis_size(a) for a in mesh.axis_names}
    batch = set(batch_argnums)
    keep: dict[int, list[int]] = {}
    for index, var in enumerate(parts.variables):
        if var.root >= 0 or graph.inputs[-var.root - 1].arg_index in batch:
            continue
        shards = [s.output_specs[0].num_shards(sizes) for s in var.members[var.root]]
        need = min(ways, max(shards))
        keep[index] = [i for i, n in enumerate(shards) if n >= need]
    return keep


def choices_memory(parts: ProblemParts, choices: Sequence[int], options: IntraOpOptions,
                   copies: bool = True) -> MemoryEstimate:
    """``estimate_memory`` of the plan ``choices`` make (what the plan reports as its peak):
    its tensors' shards, and the operand copies it reshards (left out with ``copies=False``:
    what holds the least-memory plan's memory, whose layouts disagree from op to op as an
    artefact of picking each op's least memory on its own)."""
    node_strategy, _, operand_specs, tensor_spec, _ = read_solution(parts, choices)
    mesh = parts.table.mesh
    sizes = {a: mesh.axis_size(a) for a in mesh.axis_names}
    shards = {t: spec.num_shards(sizes) for t, spec in tensor_spec.items()}
    transient = transient_bytes(parts.table.graph, node_strategy, operand_specs, shards, sizes,
                                copies=copies)
    return estimate_memory(parts.table.graph, batch_argnums=options.batch_argnums,
                           shards=shards, resharded=transient,
                           host=options.host_tensors(parts.table.graph))


def with_memory_budget(problem: IntraOpProblem, parts: ProblemParts,
                       options: IntraOpOptions) -> IntraOpProblem:
    """``problem``, built without a memory budget, with ``options``' budget: each strategy's
    memory and the live sets, as ``build_problem`` makes them with that budget."""
    budget = options.memory_budget_bytes
    if budget is None:
        return problem
    nodes = [dataclasses.replace(node, memory=memory)
             for node, memory in zip(problem.nodes, memory_vectors(parts.table), strict=True)]
    return IntraOpProblem(nodes=nodes, edges=problem.edges, memory_budget=budget,
                          live_sets=live_sets(parts.table, options.max_live_sets,
                                              options.host_tensors(parts.table.graph)))


def _check_least_memory(parts: ProblemParts, problem: IntraOpProblem, budget: float,
                        options: IntraOpOptions) -> None:
    """Raise ``InfeasibleMemoryError`` when even the least-memory plan, its copies left out,
    is over ``budget`` (the problem's) by the memory model: each tensor there holds its
    smallest share, so no plan's figure is lower, and the memory rows (cruder: they may admit
    a plan the model puts over) would only make the MIP search for one (GPT 76.1B on a
    128 x 8 mesh: 25 s of HiGHS for an answer this gives in two)."""
    choices = least_memory_choices(problem)
    floor = choices_memory(parts, choices, options, copies=False)
    if floor.total > budget:
        least = choices_memory(parts, choices, options)
        raise InfeasibleMemoryError(budget, least.total, floor.dominant())


def solve_intra_op(
    graph: OpGraph,
    mesh: LogicalMesh,
    options: IntraOpOptions,
    caches: MeshCaches | None = None,
    built: dict[tuple, tuple[IntraOpProblem, ProblemParts]] | None = None,
) -> IntraOpResult:
    """Build and solve the sharding ILP of ``graph`` on ``mesh`` (``caches``: see
    ``build_problem``). ``built``: problems built without a budget, by mesh, to solve again
    under another budget without building them again (filled here)."""
    start = time.perf_counter()
    if built is None:
        problem, parts = build_problem(graph, mesh, options, caches)
    else:
        key = (id(graph), tuple(mesh.shape), tuple(mesh.device_ids), mesh.axis_names)
        if key not in built:
            built[key] = build_problem(
                graph, mesh, dataclasses.replace(options, memory_budget_bytes=None), caches)
        problem, parts = built[key]
        problem = with_memory_budget(problem, parts, options)
    build_time = time.perf_counter() - start
    if problem.memory_budget is not None:
        _check_least_memory(parts, problem, problem.memory_budget, options)
    try:
        solution = solve(problem, solver=options.solver, time_limit_s=options.time_limit_s,
                         relative_gap=options.relative_gap)
    except InfeasibleMemoryError as error:
        # The rows are linear and cruder than the memory model (they know neither which
        # temporaries borrow an output's buffer nor which result overwrites its operand), so
        # they may overstate a plan's memory: the least-memory plan is judged by the model,
        # which is what every plan's peak is, and the minimum stated is that plan's figure.
        choices = least_memory_choices(problem)
        least = choices_memory(parts, choices, options)
        if least.total > error.budget:
            raise InfeasibleMemoryError(error.budget, least.total, choices_memory(
                parts, choices, options, copies=False).dominant()) from None
        solution = IntraOpSolution(choices, evaluate(problem, choices), LEAST_MEMORY, False,
                                   None, "least-memory", 0, 0,
                                   time.perf_counter() - start - build_time, 0.0)
    node_strategy, input_spec, operand_specs, tensor_spec, collectives = read_solution(
        parts, solution.choices
    )
    return IntraOpResult(
        node_strategy=node_strategy,
        input_spec=input_spec,
        operand_specs=operand_specs,
        tensor_spec=tensor_spec,
        reshard_collectives=collectives,
        problem=problem,
        solution=solution,
        variables=parts.variables,
        build_time_s=build_time,
        ties=list(parts.ties),
    )
