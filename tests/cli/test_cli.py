"""The ``autopar`` command: reports for every zoo model, JSON output, one-line errors."""

import json
import os
import subprocess
import sys

import pytest

from autopar.cli.main import main
from autopar.models import MODEL_NAMES

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_report_prints_for_every_zoo_model(name, capsys):
    # compiling the sharded program is what costs here: the two big models skip it
    with_hlo = name in ("mlp", "gpt")
    argv = ["compile", "--model", name, "--size", "tiny", "--devices", "8", "--mesh", "2x4",
            "--method", "data"] + ([] if with_hlo else ["--no-hlo"])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"autopar compile report: {name} tiny" in out
    for heading in ("graph", "parameters", "flops per step", "est. step time",
                    "per-device memory", "stages", "shardings"):
        assert heading in out
    row = next(line for line in out.splitlines() if line.strip().startswith("all-reduce"))
    if with_hlo:
        # the plan's predicted all-reduce bytes sit beside the bytes counted in compiled HLO
        assert "| hlo" in row and "bytes ratio 1.00" in row


def test_json_report_has_the_documented_keys(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["compile", "--model", "gpt", "--devices", "8", "--mesh", "2x4",
                 "--method", "data", "--json", str(path)]) == 0
    capsys.readouterr()
    data = json.loads(path.read_text())
    for key in ("method", "mesh_shape", "compile_time_s", "est_step_time_s", "stages",
                "shardings", "plan"):
        assert key in data
    assert data["method"] == "data" and data["mesh_shape"] == [2, 4]
    stage = data["stages"][0]
    for key in ("layers", "submesh_shape", "logical_mesh_shape", "est_time_s",
                "peak_memory_bytes"):
        assert key in stage
    assert data["shardings"]["batch/tokens"] == "P(('x', 'y'), None)"
    assert data["shardings"]["state/params/wte"] == "P(None, None)"
    # the memory model's figure beside XLA's own analysis of the compiled program
    assert data["xla_memory_bytes"] > 0
    assert data["peak_memory_bytes"] == pytest.approx(data["xla_memory_bytes"], rel=0.15)
    assert set(stage["memory_breakdown"]) == {
        "parameters", "optimizer_state", "batch", "updated_state", "activations"}


def test_shard_method_reports_the_ilp(tmp_path, capsys):
    dump = tmp_path / "ilp.json"
    assert main(["compile", "--model", "mlp", "--devices", "8", "--mesh", "1x8",
                 "--method", "shard", "--dump-ilp", str(dump)]) == 0
    out = capsys.readouterr().out
    assert "sharding ILP" in out and "proven optimal" in out
    data = json.loads(dump.read_text())
    assert data["nodes"] and "solution" in data


def test_plans_for_a_described_cluster(capsys):
    assert main(["compile", "--model", "gpt", "--size", "350M", "--cluster",
                 "aws-p3.16xlarge", "--mesh", "8", "--method", "data"]) == 0
    out = capsys.readouterr().out
    assert "aws-p3.16xlarge" in out and "HLO not compiled" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compile", "--model", "gtp"],
         "unknown model 'gtp'; valid models: mlp, gpt, moe, wresnet"),
        (["compile", "--size", "huge"], "unknown size 'huge'"),
        (["compile", "--method", "magic"],
         "unknown method 'magic'; valid methods: data, shard, zero2, zero3, pipeshard, auto"),
        (["compile", "--cluster", "nope"], "unknown cluster 'nope'; valid clusters:"),
        (["compile", "--devices", "8", "--mesh", "3x3", "--method", "data"], "covers 9 devices"),
        (["compile", "--devices", "8", "--mesh", "2x4"], "--mesh applies to --method shard/data"),
        (["compile", "--mesh", "axb"], "invalid mesh shape 'axb'"),
        (["compile", "--batch-size", "12", "--devices", "8", "--method", "data"],
         "not divisible by the data-parallel"),
        (["compile", "--method", "pipeshard", "--batch-size", "6", "--devices", "8"],
         "num_microbatches=4 must divide the batch size 6"),
        (["compile", "--bogus"], "unrecognized arguments: --bogus"),
        (["compile", "--measure-candidates", "-1", "--devices", "8"],
         "measure_candidates must be a non-negative integer"),
        (["compile", "--method", "data", "--measure-candidates", "2"],
         "--measure-candidates applies to --method auto"),
        (["compile", "--method", "shard", "--per-microbatch-statistics"],
         "--per-microbatch-statistics applies to --method pipeshard/auto"),
        (["compile", "--model", "wresnet", "--method", "pipeshard", "--microbatches", "2",
          "--devices", "8"], "mixes the examples of its batch"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("autopar: error: ")
    assert message in lines[0]
    assert "Traceback" not in captured.err + captured.out


def test_the_full_search_keeps_its_estimate_without_timing_when_asked(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["compile", "--model", "mlp", "--devices", "8", "--measure-candidates", "0",
                 "--json", str(path)]) == 0
    plan = json.loads(path.read_text())["plan"]
    # without the flag, local planning times its candidates: rows and a note say so
    assert not any(row.get("measured_step_time_s") for row in plan["planning"]["candidates"])
    assert not any(note.startswith("measured") for note in plan["notes"])


def test_console_script_sets_devices_before_jax_starts(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    path = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "autopar", "compile", "--model", "mlp", "--devices", "4",
         "--mesh", "2x2", "--method", "data", "--json", str(path)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(path.read_text())["plan"]["stages"][0]["device_ids"] == [0, 1, 2, 3]
    bad = subprocess.run(
        [sys.executable, "-m", "autopar", "compile", "--model", "nope"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "autopar: error: unknown model 'nope'; valid models: mlp, gpt, moe, wresnet, llama"
    ]
