"""The MIP form of a presolved sharding ILP, and the two solvers that answer it.

``build_mip`` turns what presolve left into solver-neutral sparse arrays; ``run_mip`` hands
them to HiGHS (through highspy directly: PuLP's per-variable Python objects cost more than
HiGHS's own solve on a 48-layer GPT, docs/benchmarks/ilp.md) or to PuLP's bundled CBC.

Solver output never reaches standard output: HiGHS's banner (printed from C++ when a process
makes its first ``highspy.Highs()``) is caught by redirecting file descriptor 1 around that
construction, and both solvers' logs go to this module's logger (``autopar.compiler.intra_op.mip``)
at debug level, collected only when that level is enabled (``autopar compile --log-level
debug``); ``intra_op.solver_output`` does both.
"""

from __future__ import annotations

import logging
import math
import os
import re
import tempfile
import warnings
from dataclasses import dataclass

import numpy as np
import pulp

from autopar.compiler.intra_op.presolve import ReducedProblem
from autopar.compiler.intra_op.problem import IlpStatus
from autopar.compiler.intra_op.solver_output import HighsLog, log_lines, new_highs
from autopar.errors import InvalidOptionError, choices_text
from autopar.methods import Solver

# HiGHS's default relative gap (1e-4) stops at measurably worse plans; at 1e-9 the solvers'
# integrality/feasibility tolerances (~1e-6) are what limit "optimal" (docs/ilp-format.md).
MIP_REL_GAP = 1e-9

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MipModel:
    """min c·x subject to row_lower <= A x <= row_upper, 0 <= x <= 1, x[integer] integral.

    Columns ``node_columns[u]`` are node u's one-hot binaries; the rest are pair variables.
    ``start`` is a feasible warm start (or None). Costs are divided by ``scale`` so that the
    solvers' absolute tolerances meet O(1) numbers."""

    cost: np.ndarray
    integer: np.ndarray  # bool per column
    row_start: np.ndarray  # CSR of A
    row_index: np.ndarray
    row_value: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    node_columns: dict[int, np.ndarray]
    scale: float
    start: np.ndarray | None

    @property
    def num_columns(self) -> int:
        return len(self.cost)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)


@dataclass(frozen=True)
class MipResult:
    """``status``: ``OPTIMAL``, ``TIME_LIMIT`` (stopped at the time limit with a plan),
    ``NO_SOLUTION`` (stopped with none) or ``SOLVER_ERROR`` (the solver failed: ``message``
    says how); ``bound``: the
    solver's lower bound on the scaled objective (None when it gave none); ``core``: each free
    node's chosen strategy."""

    status: IlpStatus
    bound: float | None
    core: dict[int, int]
    message: str = ""


def solver_name(solver: str) -> str:
    """Check ``solver`` (a :class:`~autopar.methods.Solver` or its string); "auto" stays "auto"
    (resolved by ``resolve_auto``)."""
    try:
        name = Solver(solver)
    except ValueError:
        raise InvalidOptionError(
            f"unknown ILP solver {solver!r}; valid: {choices_text(Solver)}"
        ) from None
    if name != Solver.AUTO and not available(name):
        raise InvalidOptionError(f"ILP solver '{name}' is not installed (highs needs highspy, "
                                 "cbc PuLP's bundled binary); valid: auto")
    return name.value


def resolve_auto() -> str:
    # HiGHS keeps to its time limit and, called directly, skips PuLP's model-building overhead.
    return (Solver.HIGHS if available(Solver.HIGHS) else Solver.CBC).value


def available(solver: str) -> bool:
    if solver == Solver.HIGHS:
        try:
            import highspy  # noqa: F401
        except ImportError:
            return False
        return True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(pulp.PULP_CBC_CMD().available())


def _groups(m: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Group of each row (rows equal bit for bit) and each group's first row; a dict of row
    bytes is ~50x faster than ``np.unique(axis=0)`` on these small matrices."""
    ids: dict[bytes, int] = {}
    of: list[int] = []
    reps: list[int] = []
    for i, row in enumerate(m + 0.0):  # + 0.0 turns -0.0 into 0.0
        of.append(ids.setdefault(row.tobytes(), len(ids)))
        if of[-1] == len(reps):
            reps.append(i)
    return np.array(of), reps


class _Rows:
    """Sparse rows collected as Python lists, turned into CSR once."""

    def __init__(self) -> None:
        self.start: list[int] = [0]
        self.index: list[int] = []
        self.value: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def add(self, cols, vals, lower: float, upper: float) -> None:
        self.index.extend(int(c) for c in cols)
        self.value.extend(float(v) for v in vals)
        self.start.append(len(self.index))
        self.lower.append(lower)
        self.upper.append(upper)


def build_mip(r: ReducedProblem, start: dict[int, int] | None) -> MipModel:
    """One-hot binaries per node; per edge, continuous pair variables whose row and column
    sums equal the two one-hots (exact: a one-hot row/column forces the pair to be one-hot)."""
    scale = max([float(np.abs(c).max()) for c in r.cost.values()]
                + [float(np.abs(m).max()) for a in r.adj.values() for m in a.values()])
    scale = scale or 1.0
    cost: list[float] = []
    start_values: list[float] = []
    node_columns: dict[int, np.ndarray] = {}
    rows = _Rows()
    for u, c in r.cost.items():
        first = len(cost)
        node_columns[u] = np.arange(first, first + len(c))
        cost.extend(c / scale)
        start_values.extend(float(start is not None and start[u] == i) for i in range(len(c)))
        rows.add(node_columns[u], np.ones(len(c)), 1.0, 1.0)
    num_binary = len(cost)
    for u, nbrs in r.adj.items():
        for w, m in nbrs.items():
            if w < u:
                continue
            # Strategies whose rows (columns) of the matrix are equal cost the same against
            # every choice of the other end: one pair variable serves the whole group. Exact:
            # a group's one-hot sum is 0 or 1, so the pair variables are still forced one-hot.
            # Resharding matrices depend only on the tensor's spec, so groups are large.
            row_of, rep_rows = _groups(m)
            col_of, rep_cols = _groups(m[rep_rows].T)
            g = m[np.ix_(rep_rows, rep_cols)]
            first = len(cost)
            pair = first + np.arange(g.size).reshape(g.shape)
            cost.extend((g / scale).ravel())
            chosen = (None if start is None
                      else (row_of[start[u]], col_of[start[w]]))
            start_values.extend(float(chosen is not None and (a, b) == chosen)
                                for a in range(g.shape[0]) for b in range(g.shape[1]))
            for a in range(g.shape[0]):
                members = node_columns[u][row_of == a]
                rows.add([*pair[a], *members],
                         [1.0] * g.shape[1] + [-1.0] * len(members), 0.0, 0.0)
            # The last column group is implied by the rows and the other columns: leave it out.
            for b in range(g.shape[1] - 1):
                members = node_columns[w][col_of == b]
                rows.add([*pair[:, b], *members],
                         [1.0] * g.shape[0] + [-1.0] * len(members), 0.0, 0.0)
    for terms, rhs in r.rows:
        rs = max(float(d.max()) for _, d in terms) or 1.0  # memory rows scaled to O(1) too
        cols = [node_columns[u][i] for u, d in terms for i in range(len(d)) if d[i]]
        vals = [d[i] / rs for u, d in terms for i in range(len(d)) if d[i]]
        rows.add(cols, vals, -math.inf, rhs / rs)
    integer = np.zeros(len(cost), bool)
    integer[:num_binary] = True
    return MipModel(
        np.asarray(cost, float), integer, np.asarray(rows.start, np.int64),
        np.asarray(rows.index, np.int64), np.asarray(rows.value, float),
        np.asarray(rows.lower, float), np.asarray(rows.upper, float), node_columns, scale,
        np.asarray(start_values, float) if start is not None else None)


def run_mip(
    model: MipModel, name: str, time_limit_s: float, relative_gap: float = MIP_REL_GAP
) -> MipResult:
    """Solve ``model`` with ``name`` ("highs" or "cbc") within ``time_limit_s``, stopping at
    ``relative_gap`` between the incumbent and the bound."""
    run = _run_highs if name == Solver.HIGHS else _run_cbc
    try:
        values, status, bound = run(model, time_limit_s, relative_gap)
    except _SolverFailed as failed:
        logger.warning("%s failed: %s", name, failed)
        return MipResult(IlpStatus.SOLVER_ERROR, None, {}, f"{name}: {failed}")
    core = {} if values is None else {
        u: int(np.argmax(values[cols])) for u, cols in model.node_columns.items()}
    return MipResult(status if values is not None else IlpStatus.NO_SOLUTION, bound, core)


class _SolverFailed(Exception):
    """The solver failed (an error status or exception), as opposed to running out of time."""


def _run_highs(
    model: MipModel, limit: float, gap: float
) -> tuple[np.ndarray | None, IlpStatus, float | None]:
    import highspy

    h = new_highs()
    log = HighsLog() if logger.isEnabledFor(logging.DEBUG) else None
    h.setOptionValue("output_flag", log is not None)  # the callback only hears enabled output
    if log is not None:
        h.setOptionValue("log_to_console", False)
        h.cbLogging.subscribe(log)
    h.setOptionValue("time_limit", float(limit))
    h.setOptionValue("mip_rel_gap", gap)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = model.num_columns, model.num_rows
    lp.col_cost_ = model.cost
    lp.col_lower_ = np.zeros(model.num_columns)
    lp.col_upper_ = np.ones(model.num_columns)
    lp.row_lower_ = np.where(np.isinf(model.row_lower), -highspy.kHighsInf, model.row_lower)
    lp.row_upper_ = model.row_upper
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = model.num_columns, model.num_rows
    lp.a_matrix_.start_ = model.row_start
    lp.a_matrix_.index_ = model.row_index
    lp.a_matrix_.value_ = model.row_value
    kinds = (highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger)
    lp.integrality_ = [kinds[int(b)] for b in model.integer]
    h.passModel(lp)
    if model.start is not None:
        warm = highspy.HighsSolution()
        warm.col_value = model.start
        warm.value_valid = True
        h.setSolution(warm)
    try:
        run_status = h.run()
    finally:
        if log is not None:
            log.flush()
    model_status = h.getModelStatus()
    failures = {highspy.HighsModelStatus.kSolveError, highspy.HighsModelStatus.kModelError,
                highspy.HighsModelStatus.kLoadError, highspy.HighsModelStatus.kPresolveError,
                highspy.HighsModelStatus.kPostsolveError}
    if run_status == highspy.HighsStatus.kError or model_status in failures:
        raise _SolverFailed(f"HiGHS ended with {h.modelStatusToString(model_status)}")
    info = h.getInfo()
    has = info.primal_solution_status == 2  # kSolutionStatusFeasible
    optimal = h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else None
    values = np.asarray(h.getSolution().col_value) if has else None
    return values, (IlpStatus.OPTIMAL if optimal else IlpStatus.TIME_LIMIT), bound


def lp_rounding(model: MipModel, time_limit_s: float) -> tuple[float, dict[int, int]]:
    """The LP relaxation's optimum (a lower bound on the scaled MIP objective) and each free
    node's largest-weight strategy in it (HiGHS). ``(-inf, {})`` when the LP is not solved."""
    relaxed = MipModel(model.cost, np.zeros_like(model.integer), model.row_start,
                       model.row_index, model.row_value, model.row_lower, model.row_upper,
                       model.node_columns, model.scale, None)
    try:
        values, status, _ = _run_highs(relaxed, time_limit_s, MIP_REL_GAP)
    except _SolverFailed as failed:  # the MIP that follows reports its own failure
        logger.debug("highs LP relaxation failed: %s", failed)
        return -math.inf, {}
    if values is None or status != IlpStatus.OPTIMAL:
        return -math.inf, {}
    rounded = {u: int(np.argmax(values[cols])) for u, cols in model.node_columns.items()}
    return float(model.cost @ values), rounded


def _run_cbc(
    model: MipModel, limit: float, gap: float
) -> tuple[np.ndarray | None, IlpStatus, float | None]:
    prob = pulp.LpProblem("autopar_intra_op", pulp.LpMinimize)
    # PuLP 3.3 deprecates free-standing LpVariable for prob.add_variable (PuLP 4.0's only way).
    var = getattr(prob, "add_variable", pulp.LpVariable)
    xs = [var(f"x{j}", lowBound=0, upBound=1,
              cat=pulp.LpBinary if model.integer[j] else pulp.LpContinuous)
          for j in range(model.num_columns)]
    if model.start is not None:
        for x, v in zip(xs, model.start, strict=True):
            x.setInitialValue(float(v))
    for k in range(model.num_rows):
        lo, hi = model.row_start[k], model.row_start[k + 1]
        expr = pulp.LpAffineExpression(
            [(xs[j], v) for j, v in zip(model.row_index[lo:hi], model.row_value[lo:hi],
                                        strict=True)])
        if model.row_lower[k] == model.row_upper[k]:
            prob += expr == float(model.row_upper[k])
        else:
            prob += expr <= float(model.row_upper[k])
    prob.setObjective(pulp.LpAffineExpression(
        [(x, float(c)) for x, c in zip(xs, model.cost, strict=True) if c]))
    fd, log = tempfile.mkstemp(suffix=".log", prefix="autopar-cbc-")
    os.close(fd)
    try:
        with warnings.catch_warnings():  # PuLP 3.3: "PULP_CBC_CMD is deprecated" (bundled CBC)
            warnings.simplefilter("ignore", DeprecationWarning)
            cbc = pulp.PULP_CBC_CMD(msg=False, timeLimit=limit, gapRel=gap, logPath=log,
                                    warmStart=model.start is not None)
        try:
            prob.solve(cbc)
        finally:  # CBC's log (msg=False keeps it off stdout) to the debug log, solved or not
            with open(log, errors="replace") as f:
                text = f.read()
            if logger.isEnabledFor(logging.DEBUG):
                log_lines(Solver.CBC, text)
    except pulp.PulpSolverError as exc:
        reason = " ".join(str(exc).split())[:200]
        raise _SolverFailed(f"CBC raised {type(exc).__name__}: {reason}") from None
    finally:
        os.unlink(log)
    # CBC's summary says "Lower bound: x" on time limit, nothing when optimal.
    found = re.search(r"^Lower bound:\s*(\S+)", text, re.M)
    bound = float(found.group(1)) if found else None
    status = {pulp.LpSolutionOptimal: IlpStatus.OPTIMAL,
              pulp.LpSolutionIntegerFeasible: IlpStatus.TIME_LIMIT}.get(
        prob.sol_status, IlpStatus.NO_SOLUTION)
    if status == IlpStatus.NO_SOLUTION:
        return None, status, bound
    return np.asarray([x.varValue or 0.0 for x in xs]), status, bound
