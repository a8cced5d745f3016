"""Solver output never reaches stdout: HiGHS's banner and both solvers' logs go to the
``autopar`` logger at debug level (autopar/compiler/intra_op/mip.py).

HiGHS prints its banner once per process, when the first ``highspy.Highs()`` is made, so the
checks that it is kept off stdout run fresh processes."""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
import textwrap

import pytest

from autopar.compiler.intra_op import solver_output
from autopar.compiler.intra_op.ilp import solve
from autopar.compiler.intra_op.problem import IntraOpProblem, ProblemEdge, ProblemNode

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

MIP_LOGGER = "autopar.compiler.intra_op.mip"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "autopar", "compile", *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def lines_with(text: str, word: str) -> list[str]:
    return [line for line in text.splitlines() if word in line]


def small_problem() -> IntraOpProblem:
    """Three nodes, two strategies each, on a path: the MIP has something to do with
    ``presolve=False``."""
    nodes = [ProblemNode(f"op{u}", [1.0, 0.5 + 0.25 * u], ["R", "S"]) for u in range(3)]
    edges = [ProblemEdge(0, 1, [[0.0, 0.75], [0.5, 0.0]]),
             ProblemEdge(1, 2, [[0.0, 0.5], [0.75, 0.0]])]
    return IntraOpProblem(nodes, edges)


# Below the fastest plan's 55 KiB per device: memory rows, which only the MIP solves (without
# them elimination answers the MLP's ILP and HiGHS never starts).
BINDING_BUDGET_GIB = "0.00004"


def test_compile_prints_no_solver_banner() -> None:
    proc = cli("--model", "mlp", "--size", "tiny", "--devices", "8", "--method", "shard",
               "--memory-budget", BINDING_BUDGET_GIB)
    assert "autopar compile report: mlp tiny" in proc.stdout
    assert "highs" in proc.stdout  # the report names the solver: HiGHS did run
    assert lines_with(proc.stdout, "HiGHS") == []
    assert lines_with(proc.stderr, "HiGHS") == []


def test_compile_with_debug_log_shows_the_highs_log_on_stderr() -> None:
    proc = cli("--model", "mlp", "--size", "tiny", "--devices", "8", "--method", "shard",
               "--no-hlo", "--log-level", "debug", "--memory-budget", BINDING_BUDGET_GIB)
    assert lines_with(proc.stdout, "HiGHS") == []
    highs = lines_with(proc.stderr, "autopar: DEBUG: highs: ")
    assert any("Running HiGHS" in line for line in highs)  # the banner, caught and logged
    assert any("MIP has" in line for line in highs)  # the solve's own log
    assert any("Solving report" in line for line in highs)


def test_gpt_compile_prints_no_solver_banner() -> None:
    # The full pipeshard search: many ILPs (per layer range and submesh), one banner at most.
    proc = cli("--model", "gpt", "--size", "tiny", "--devices", "8", "--no-hlo")
    assert "autopar compile report: gpt tiny" in proc.stdout
    assert lines_with(proc.stdout, "HiGHS") == []
    assert lines_with(proc.stderr, "HiGHS") == []


def test_a_fresh_process_solve_writes_no_banner(capfd) -> None:
    # The child inherits pytest's captured descriptors: capfd sees whatever it writes there.
    script = textwrap.dedent("""
        print("before the solve")  # buffered Python output still reaches stdout
        from autopar.compiler.intra_op.problem import IntraOpProblem, ProblemEdge, ProblemNode
        from autopar.compiler.intra_op.ilp import solve
        problem = IntraOpProblem.from_json(%r)
        for solver in ("highs", "cbc"):
            print(solver, solve(problem, solver=solver, presolve=False).solver)
    """) % small_problem().to_json()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    out, err = capfd.readouterr()
    assert out.splitlines() == ["before the solve", "highs highs", "cbc cbc"]
    assert "HiGHS" not in out + err
    assert "CBC" not in out + err


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_solver_log_goes_to_the_logger_at_debug_only(solver: str, capfd, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=MIP_LOGGER)
    solve(small_problem(), solver=solver, presolve=False)
    assert [r for r in caplog.records if r.name == MIP_LOGGER] == []
    caplog.set_level(logging.DEBUG, logger=MIP_LOGGER)
    got = solve(small_problem(), solver=solver, presolve=False)
    assert got.solver == solver and got.proven_optimal
    logged = [r.getMessage() for r in caplog.records if r.name == MIP_LOGGER]
    assert logged and all(m.startswith(f"{solver}: ") for m in logged)
    # HiGHS: its MIP log; CBC: the log file PuLP had it write
    assert any(("MIP has" if solver == "highs" else "Welcome to the CBC") in m for m in logged)
    out, err = capfd.readouterr()
    assert "HiGHS" not in out + err and "CBC" not in out + err
    assert out == ""


def test_fd1_capture_takes_c_stdio_buffered_output(capfd) -> None:
    try:
        printf = ctypes.CDLL(None).printf
    except (OSError, AttributeError):
        pytest.skip("no C library to call printf from")
    print("python before", flush=False)
    result, text = solver_output.with_fd1_captured(lambda: printf(b"from C stdio\n") and 7)
    print("python after")
    assert (result, text) == (7, "from C stdio\n")
    out, _ = capfd.readouterr()
    assert out == "python before\npython after\n"
