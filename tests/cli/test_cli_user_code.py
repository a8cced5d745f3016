"""``autopar compile FILE.py:FUNCTION``, ``autopar show``, ``--log-level`` and the progress line.

Every bad input is one line on stderr (``autopar: error: ...``) and exit status 2, never a
traceback."""

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import jax
import pytest
import repo_paths

import autopar
from autopar import __version__
from autopar.cli.main import main
from autopar.cluster import load_cluster
from autopar.compiler.planners.status import PlanningStatus
from autopar.frontend.planning import plan_train_step
from autopar.frontend.progress import Progress
from autopar.models import get_model
from autopar.plan import FORMAT_VERSION, Plan

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

ROOT = repo_paths.REPO
EXAMPLE = f"{ROOT / 'examples' / 'mlp_step.py'}:make_step"

# A step without autopar.value_and_grad (the full search falls back to one shard stage), with
# the batch first and a static scale third when wrapped by parallelize below.
PLAIN_STEP = """
import jax
import jax.numpy as jnp
import numpy as np

import autopar
import repo_paths


def train_step(state, batch):
    loss, g = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(state["params"])
    return {"params": state["params"] - 0.1 * g}, loss


def batch_first(batch, state, scale):
    new_state, loss = train_step(state, batch)
    return new_state, loss * scale


STATE = {"params": np.ones((8, 4), np.float32)}
BATCH = {"x": np.ones((16, 8), np.float32)}
"""


def write(tmp_path, text, name="user_step.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def run(argv, capsys):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, out, err, message):
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("autopar: error: "), err
    assert message in lines[0], lines[0]
    assert "Traceback" not in out + err


# -- happy paths --------------------------------------------------------------------------------
def test_example_with_the_full_search_and_show_of_its_json(tmp_path, capsys):
    auto = tmp_path / "auto.json"
    code, out, err = run(["compile", EXAMPLE, "--time-limit", "5", "--json", auto], capsys)
    assert code == 0, err
    assert err == ""  # quiet: no log lines at the default level, no progress off a terminal
    assert f"autopar compile report: {EXAMPLE}" in out
    # the full search lists what it compared, the plan first among the fitting ones
    assert "candidates compared" in out and "pipeshard" in out
    doc = json.loads(auto.read_text())
    assert doc["plan"]["planning"]["method_options"]["method"] == "auto"
    assert doc["method"] == next(c["method"] for c in doc["candidates"] if c["chosen"])

    report = tmp_path / "report.json"
    code, out, err = run(["compile", EXAMPLE, "--method", "pipeshard", "--time-limit", "5",
                          "--json", report], capsys)
    assert code == 0, err
    assert "method            pipeshard" in out and "pipeline: 1f1b, 4 microbatches" in out
    assert "parameters        11.47K" in out  # counted under state["params"]
    assert "graph             195 ops" in out
    doc = json.loads(report.read_text())
    assert doc["method"] == "pipeshard" and doc["plan"]["format_version"] == FORMAT_VERSION

    swimlane = tmp_path / "lanes.png"
    code, shown, err = run(["show", report, "--swimlane", swimlane], capsys)
    assert code == 0, err
    assert f"autopar compile report: {EXAMPLE}" in shown
    assert "graph             195 ops" in shown  # a report document keeps its graph
    assert swimlane.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_example_sharded_counts_hlo_collectives(capsys):
    code, out, err = run(["compile", EXAMPLE, "--method", "shard", "--mesh", "2x4",
                          "--time-limit", "5"], capsys)
    assert code == 0, err
    assert "method            shard" in out and "mesh              2x4" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("all-reduce"))
    assert "| hlo" in row and "bytes ratio 1.00" in row


def test_parallelized_step_brings_method_batch_and_static_args(tmp_path, capsys):
    path = write(tmp_path, PLAIN_STEP + """
def make_step():
    step = autopar.parallelize(batch_first, method=autopar.DataParallel(), batch_argnums=(0,),
                               static_argnums=(2,), cache=False)
    return step, (BATCH, STATE, 2.0)
""")
    report = tmp_path / "r.json"
    code, out, err = run(["compile", f"{path}:make_step", "--no-hlo", "--json", report], capsys)
    assert code == 0, err
    assert "method            data" in out
    assert "parameters        32" in out
    data = json.loads(report.read_text())
    assert data["shardings"] == {"batch/x": "P('x', None)", "state/params": "P(None, None)"}
    # --method overrides the step's method; its batch and static arguments stay
    code, out, err = run(["compile", f"{path}:make_step", "--no-hlo", "--method", "shard",
                          "--mesh", "8"], capsys)
    assert code == 0, err
    assert "method            shard" in out and "batch/x" in out
    # parallelize(plan=...): the saved plan is reported, checked against the trace
    saved = tmp_path / "plan.json"
    Plan.from_dict(data["plan"]).save(saved)
    with path.open("a") as fh:
        fh.write(textwrap.dedent(f"""
            def make_saved():
                return autopar.parallelize(batch_first, batch_argnums=(0,), static_argnums=(2,),
                                           plan={str(saved)!r}, cache=False), (BATCH, STATE, 2.0)
            """))
    code, out, err = run(["--log-level", "info", "compile", f"{path}:make_saved", "--no-hlo"],
                         capsys)
    assert code == 0, err
    assert "method            data" in out and "plan from the step's saved plan" in err
    assert_one_line_error(*run(["compile", f"{path}:make_saved", "--mesh", "4"], capsys),
                          "--mesh: the step runs a saved plan (parallelize(plan=...)); pass "
                          "--method as well")


def test_full_search_falls_back_to_one_shard_stage_without_value_and_grad(tmp_path, capsys):
    path = write(tmp_path, PLAIN_STEP + """
def make_step():
    return train_step, (STATE, BATCH)
""")
    code, out, err = run(["compile", f"{path}:make_step", "--no-hlo"], capsys)
    assert code == 0, err
    assert "method            pipeshard" not in out
    assert "note: no pipelined candidate: PipeshardParallel needs" in out


def test_plans_user_code_for_a_described_cluster(capsys):
    code, out, err = run(["compile", EXAMPLE, "--cluster", "aws-p3.16xlarge", "--time-limit",
                          "5"], capsys)
    assert code == 0, err
    assert "cluster           aws-p3.16xlarge" in out and "candidates compared" in out


def test_show_prints_a_saved_plan_without_a_graph(tmp_path, capsys):
    report = tmp_path / "report.json"
    code, _, err = run(["compile", EXAMPLE, "--method", "data", "--no-hlo", "--json", report],
                       capsys)
    assert code == 0, err
    plan = Plan.from_dict(json.loads(report.read_text())["plan"])
    saved = tmp_path / "plan.json"
    plan.save(saved)
    again = tmp_path / "again.json"
    code, out, err = run(["show", saved, "--json", again], capsys)
    assert code == 0, err
    assert f"autopar compile report: {saved}" in out
    assert "graph             -" in out and "parameters        -" in out
    assert "method            data" in out and "batch/x" in out
    assert "HLO not counted: a report of a saved plan" in out
    doc = json.loads(again.read_text())
    assert doc["graph"]["nodes"] is None and doc["num_params"] is None
    assert Plan.from_dict(doc["plan"]).to_dict() == plan.to_dict()


def test_log_level_before_or_after_the_subcommand(capsys):
    code, _, err = run(["--log-level", "info", "compile", "--model", "mlp", "--method", "data",
                        "--no-hlo"], capsys)
    assert code == 0
    lines = err.strip().splitlines()
    assert lines and all(line.startswith("autopar: INFO: ") for line in lines), err
    assert any("tracing and planning done in" in line for line in lines)
    code, _, err = run(["compile", EXAMPLE, "--method", "data", "--no-hlo", "--log-level",
                        "debug"], capsys)
    assert code == 0
    assert "autopar: DEBUG: importing" in err and "plan from the planner" in err
    # the logger is restored after the command
    assert not logging.getLogger("autopar").handlers


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"autopar {__version__}"


# -- progress -----------------------------------------------------------------------------------
class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def screen(text):
    """What a terminal shows after ``text`` (carriage returns overwrite the line)."""
    line, col = [], 0
    for ch in text:
        if ch == "\r":
            col = 0
            continue
        if col < len(line):
            line[col] = ch
        else:
            line.append(ch)
        col += 1
    return "".join(line)


def test_progress_updates_one_line_on_a_terminal_and_clears_it(caplog):
    stream = FakeTerminal()
    with caplog.at_level(logging.INFO, logger="autopar.frontend.progress"), Progress(
        stream, interval_s=0.01
    ) as progress:
        with progress.phase("planning"):
            time.sleep(0.1)
            assert "autopar: planning (" in screen(stream.getvalue())  # elapsed seconds
        with pytest.raises(RuntimeError), progress.phase("compiling HLO"):
            raise RuntimeError("stop")
    text = stream.getvalue()
    assert "\n" not in text and text.startswith("\rautopar: planning ...")
    assert "autopar: compiling HLO ..." in text
    assert screen(text).strip() == ""  # cleared, also after the failed phase
    assert "planning done in" in caplog.text


def test_progress_is_silent_off_a_terminal():
    stream = io.StringIO()
    progress = Progress(stream, interval_s=0.01)
    with progress, progress.phase("tracing"):
        time.sleep(0.05)
    assert stream.getvalue() == ""


def test_progress_shows_the_planners_status_after_its_delay():
    stream = FakeTerminal()
    status = PlanningStatus()
    status.enter("pipelines")
    status.expect(4)
    status.solved(3)
    with Progress(stream, interval_s=0.01, delay_s=0.05) as progress:
        with progress.phase("planning", detail=status.describe):
            time.sleep(0.02)
            assert stream.getvalue() == ""  # a quick phase leaves the terminal alone
            time.sleep(0.15)
            assert "planning (" in screen(stream.getvalue())
            assert "pipelines: 3 ILPs solved, 3 of 4 in this batch" in screen(stream.getvalue())
    assert screen(stream.getvalue()).strip() == ""


def test_the_planning_status_counts_every_ilp_the_stage_search_solved():
    model = get_model("gpt", "tiny", num_layers=4).with_value_and_grad(autopar.value_and_grad)
    state, batch = model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(1))
    status = PlanningStatus()
    method = autopar.PipeshardParallel(num_microbatches=2)
    plan = plan_train_step(model.train_step, (state, batch), method, load_cluster("cpu-sim"),
                           batch_argnums=(1,), status=status).plan
    assert status.phase == "pipelines"
    assert status.ilps_solved == plan.planning.stage_search["ilp_solves"] > 0
    assert "ILPs solved" in status.describe()


# -- bad input ----------------------------------------------------------------------------------
def test_target_errors_are_one_line(tmp_path, capsys):
    cases = [
        (f"{ROOT / 'examples' / 'mlp_step.py'}", None, "names no function; write FILE.py:FUNCTION"),
        (f"{tmp_path / 'nope.py'}:make_step", None, "no such file"),
        ("{}:make_step", "X = 1\nraise ValueError('boom\\nsecond line')\n",
         "cannot import '{}': ValueError: boom (line 2)"),
        ("{}:make_step", "def make_step(:\n", "cannot import '{}': SyntaxError"),
        ("{}:make_step", "def other():\n    pass\n",
         "has no function 'make_step'; functions defined there: other"),
        ("{}:make_step", "X = 1\n", "has no function 'make_step'; it defines no functions"),
        ("{}:make_step", "make_step = 3\n", "'make_step' in '{}' is a int, not a function"),
        ("{}:make_step", "def make_step(n):\n    return n\n", "must take no arguments; it needs n"),
        ("{}:make_step", "def make_step():\n    raise RuntimeError('no data here')\n",
         "{}:make_step raised RuntimeError: no data here (line 2)"),
        ("{}:make_step", "def make_step():\n    return 1, 2, 3\n",
         "must return (step, args); it returned a tuple of 3 item(s)"),
        ("{}:make_step", "def make_step():\n    return None\n",
         "must return (step, args); it returned None"),
        ("{}:make_step", "def make_step():\n    return 'step', ()\n",
         "returned is a str ('step'), not a function"),
        ("{}:make_step", PLAIN_STEP + "def make_step():\n    return train_step, STATE\n",
         "must be a tuple of the step's positional arguments; got a dict"),
        ("{}:make_step", PLAIN_STEP + "def make_step():\n"
                                      "    return train_step, (STATE, {'x': 'text'})\n",
         "argument leaf 'batch/x' of the args"),
    ]
    for i, (target, source, message) in enumerate(cases):
        path = tmp_path / f"bad_{i}.py"
        if source is not None:
            path.write_text(source)
        target = target.format(path)
        message = message.replace("(line", f"({path} line").format(path)
        code, out, err = run(["compile", target, "--method", "data", "--no-hlo"], capsys)
        assert_one_line_error(code, out, err, message)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compile", EXAMPLE, "--model", "mlp", "--size", "tiny"],
         "--model, --size choose a zoo model; the target"),
        (["compile", "--batch-argnums", "0"], "--batch-argnums applies to a target"),
        (["compile", EXAMPLE, "--batch-argnums", "x"], "--batch-argnums takes argument positions"),
        (["compile", EXAMPLE, "--batch-argnums", "5", "--method", "data"],
         "batch argument 5 is out of range"),
        (["compile", EXAMPLE, "--method", "data", "--microbatches", "2"],
         "--microbatches applies to --method pipeshard/auto, not data"),
        (["compile", EXAMPLE, "--method", "data", "--planning-workers", "2"],
         "--planning-workers applies to --method pipeshard/auto, not data"),
        (["compile", EXAMPLE, "--method", "pipeshard", "--planning-workers", "0"],
         "planning_workers must be a positive integer or None, got 0"),
        (["compile", "--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        (["compile", EXAMPLE, "--method", "data", "--dump-ilp", "x.json"],
         "--dump-ilp needs an ILP; method 'data' solves none"),
    ],
)
def test_option_errors_are_one_line(argv, message, capsys):
    assert_one_line_error(*run(argv, capsys), message)


def test_pipeshard_without_value_and_grad_is_one_line(tmp_path, capsys):
    path = write(tmp_path, PLAIN_STEP + "def make_step():\n    return train_step, (STATE, BATCH)\n")
    assert_one_line_error(*run(["compile", f"{path}:make_step", "--method", "pipeshard"], capsys),
                          "exactly one autopar.value_and_grad or autopar.grad call; found 0")


def test_show_errors_are_one_line(tmp_path, capsys):
    data_plan = tmp_path / "data.json"
    code, _, err = run(["compile", "--model", "mlp", "--method", "data", "--no-hlo",
                        "--json", data_plan], capsys)
    assert code == 0, err
    plan = json.loads(data_plan.read_text())["plan"]
    files = {
        "text.json": "not json {",
        "list.json": "[1, 2]",
        "other.json": '{"name": "x"}',
        "future.json": json.dumps(plan | {"format_version": 99}),
        "partial.json": '{"format_version": 1, "method": "data"}',
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    cases = [
        ("missing.json", [], "cannot read plan file"),
        ("text.json", [], "is not a plan: not JSON"),
        ("list.json", [], "is not a plan: expected a file from Plan.save"),
        ("other.json", [], "got a JSON object with keys name"),
        ("future.json", [], "plan format version 99 is not supported"),
        ("partial.json", [], "plan is missing the field"),
        ("data.json", ["--swimlane", tmp_path / "s.png"], "--swimlane draws a pipeline schedule"),
        ("data.json", ["--json", tmp_path / "no_dir" / "x.json"], "cannot write --json file"),
    ]
    for name, extra, message in cases:
        assert_one_line_error(*run(["show", tmp_path / name, *extra], capsys), message)


def test_console_script_bad_target_exits_2_without_traceback(tmp_path):
    broken = write(tmp_path, "import numpy\nraise ImportError('no module named thing')\n")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "autopar", "compile", f"{broken}:make_step"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"autopar: error: cannot import '{broken}': ImportError: no module named thing "
        f"({broken} line 2)"
    ]
    assert proc.stdout == ""


def test_html_and_mesh_png_from_compile_and_show(tmp_path, capsys):
    page, mesh, report = tmp_path / "r.html", tmp_path / "mesh.png", tmp_path / "r.json"
    code, out, err = run(["compile", EXAMPLE, "--method", "data", "--no-hlo", "--json", report,
                          "--html", page, "--mesh-png", mesh], capsys)
    assert code == 0, err
    assert f"wrote {page}" in out and f"wrote {mesh}" in out
    assert "<!DOCTYPE html>" in page.read_text() and mesh.read_bytes()[:4] == b"\x89PNG"
    saved = tmp_path / "plan.json"
    Plan.from_dict(json.loads(report.read_text())["plan"]).save(saved)
    page.unlink()
    mesh.unlink()
    code, out, err = run(["show", saved, "--html", page, "--mesh-png", mesh], capsys)
    assert code == 0, err
    assert "<!DOCTYPE html>" in page.read_text() and mesh.read_bytes()[:4] == b"\x89PNG"
