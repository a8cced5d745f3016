"""The published-runs suite: its transcribed runs agree with their sources' own totals, and a
run (a small one here) is planned pinned and by the full search into a row, a page and a
plot. The real rows are planned by ``autopar bench --suite published`` (docs/benchmarks)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autopar.bench.published import (
    ALPA_FIGURE_7,
    INTERLEAVED,
    MEGATRON_TABLE_1,
    ONE_F_ONE_B,
    PublishedRun,
    tflops,
)
from autopar.bench.published_suite import run_suite
from autopar.errors import PlanError

# Megatron-LM Table 1: (params in billions, aggregate PFLOP/s), as printed beside each row
MEGATRON_TOTALS = [(1.7, 4.4), (3.6, 8.8), (7.5, 18.2), (18.4, 34.6), (39.1, 70.8),
                   (76.1, 143.8), (145.6, 227.1), (310.1, 297.4), (529.6, 410.2),
                   (1008.0, 502.0)]


def test_megatron_rows_match_the_tables_own_totals_and_parameter_counts():
    assert len(MEGATRON_TABLE_1) == 10
    for run, (params_b, aggregate) in zip(MEGATRON_TABLE_1, MEGATRON_TOTALS, strict=True):
        # per-GPU TFLOPS x GPUs is the table's aggregate throughput
        assert run.tflops * run.gpus / 1000 == pytest.approx(aggregate, rel=0.01), run.label
        # the shape transcribed gives the model size the table names (abstract shapes)
        assert run.model().num_params() / 1e9 == pytest.approx(params_b, rel=0.03), run.label
        assert run.gpus % 8 == 0 and run.hosts * 8 == run.gpus
        assert run.described_cluster().num_devices == run.gpus


def test_alpa_rows_cover_figure_7_gpt():
    assert [r.gpus for r in ALPA_FIGURE_7] == [1, 2, 4, 8, 16, 32, 64]
    for run in ALPA_FIGURE_7:
        assert run.described_cluster().num_devices == run.gpus
        assert dict(run.shape)["batch_size"] == 1024 and run.formula == "alpa"
    # Alpa's formula counts the recomputed forward: 96 B s h^2 L (1 + s / 6h) + 6 B s h V
    run = ALPA_FIGURE_7[3]  # GPT-2.6B on 8 GPUs
    b, s, h, n, v = 1024, 1024, 2560, 32, 51200
    assert run.step_flops() == pytest.approx(96 * b * s * h * h * n * (1 + s / (6 * h))
                                             + 6 * b * s * h * v)
    assert tflops(run, 1.0) == pytest.approx(run.step_flops() / 8 / 1e12)


def small_run() -> PublishedRun:
    return PublishedRun(
        label="small GPT @ 8 A100", source="test", cluster="a100-80gb-x8", hosts=1,
        shape=(("batch_size", 8), ("seq_len", 16), ("hidden_size", 64), ("num_layers", 2),
               ("num_heads", 8), ("vocab_size", 256), ("dtype", "bfloat16")),
        data=2, tensor=2, pipeline=2, microbatch_sizes=(2,), schedule=ONE_F_ONE_B,
        tflops=100.0, formula="megatron", system="test")


def test_a_run_is_planned_pinned_and_searched_into_a_row_a_page_and_a_plot(tmp_path):
    lines = []
    files = run_suite(tmp_path, command="autopar bench --suite published", echo=lines.append,
                      runs=[small_run()])
    assert [f.name for f in files] == ["bench-published.jsonl", "bench-published.md",
                                       "bench-published.png"]
    row = json.loads((tmp_path / "bench-published.jsonl").read_text())
    pinned, searched = row["pinned"], row["full_search"]
    assert pinned["method"] == "pipeshard" and pinned["num_microbatches"] == 2
    assert [s["logical_mesh"] for s in pinned["stages"]] == [[2, 2], [2, 2]]
    # pinned as Megatron ran: every stage recomputes every layer (the page says so)
    assert pinned["recompute"] == ["full", "full"]
    assert set(searched["recompute"]) <= {"full", "selective", "none"}
    assert len(searched["recompute"]) == len(searched["stages"])
    assert searched["num_microbatches"] == 2 and searched["planning_s"] > 0
    assert pinned["stopped_ilps"] == 0 and searched["stopped_ilps"] == 0
    assert row["search_over_pinned"] == pytest.approx(
        pinned["est_step_time_s"] / searched["est_step_time_s"])
    assert row["pinned_over_published"] == pytest.approx(pinned["est_tflops_per_gpu"] / 100.0)
    page = (tmp_path / "bench-published.md").read_text()
    assert "small GPT @ 8 A100" in page and "Load average before" in page
    assert "m=2, recompute 2 full |" in page
    assert (tmp_path / "bench-published.png").stat().st_size > 1000
    assert len(lines) == 1 and lines[0].startswith("[1/1] small GPT @ 8 A100: published 100.0")


def test_a_microbatch_size_the_schedule_cannot_run_is_not_pinned():
    """Interleaved 1F1B needs the microbatches to divide by the stages: a size that makes
    them not divide is skipped (Megatron's 310B row at size 2: 72 microbatches for 16
    stages), the others planned; with none left, one line names the sizes and why."""
    from autopar.bench.published import plan_pinned

    # 4 layers on 2 stages of 2 chunks; 8 sequences over 2 replicas: size 1 gives 4
    # microbatches (divisible by 2 stages), size 4 gives 1 (not)
    run = dataclasses.replace(small_run(), tensor=2, data=2, pipeline=2,
                              shape=(("batch_size", 8), ("seq_len", 16), ("hidden_size", 64),
                                     ("num_layers", 4), ("num_heads", 8),
                                     ("vocab_size", 256), ("dtype", "bfloat16")),
                              schedule=INTERLEAVED, microbatch_sizes=(4, 1))
    assert plan_pinned(run).num_microbatches == 4
    with pytest.raises(PlanError, match=r"no microbatch size of \[4\] plans pinned: "
                                        r"microbatch size 4: .*divisible"):
        plan_pinned(dataclasses.replace(run, microbatch_sizes=(4,)))


def test_a_stopped_suite_lists_the_runs_it_did_not_start(tmp_path):
    files = run_suite(tmp_path, command="autopar bench --suite published --stop-after 0",
                      echo=lambda line: None, runs=[small_run(), MEGATRON_TABLE_1[0]],
                      stop_after_s=-1.0)
    page = files[1].read_text()
    assert "Not run (the run stopped starting rows after -1 s): small GPT @ 8 A100; " \
           "Megatron GPT 1.7B @ 32 A100." in page
    assert (tmp_path / "bench-published.jsonl").read_text() == ""


def test_a_search_without_a_plan_keeps_the_pinned_row(tmp_path, monkeypatch):
    from autopar.bench import published_suite
    from autopar.errors import PlanError

    def no_plan(run, m):
        raise PlanError("no candidate of the full search fits in 80.00 GiB per device")

    monkeypatch.setattr(published_suite, "plan_full_search", no_plan)
    lines = []
    files = run_suite(tmp_path, command="c", echo=lines.append, runs=[small_run()])
    row = json.loads(files[0].read_text())
    assert "full_search" not in row and row["search_error"].startswith("no candidate")
    assert row["pinned"]["method"] == "pipeshard"
    assert "| no plan: no candidate of the full search fits" in files[1].read_text()
    assert lines[0].endswith("search: no candidate of the full search fits in 80.00 GiB "
                             "per device")


def test_the_page_sets_the_fitted_rows_apart_from_the_held_out_ones():
    from autopar.bench.published_suite import error_summary, fitted

    # per GPU, every other row in order is one its efficiency was fitted on
    rows = [{"label": f"{gpu} {k}", "cluster": gpu, "pinned_over_published": ratio}
            for gpu, ratios in (("v100", (1.0, 0.9, 1.1)), ("a100", (0.95, 1.3)))
            for k, ratio in enumerate(ratios)]
    assert fitted(rows) == {"v100 0": True, "v100 1": False, "v100 2": True,
                            "a100 0": True, "a100 1": False}
    table = {line.split(" | ")[0].lstrip("| "): line for line in error_summary(rows)
             if line.startswith("| ") and "count" not in line}
    # all: errors 0, .1, .1, .05, .3 -> median 10%, one beyond 20%
    assert table["all"].split(" | ")[1:4] == ["5", "10.0%", "30.0%"]
    assert table["all"].endswith("| a100 1 |")
    assert table["fitted on"].split(" | ")[1:5] == ["3", "5.0%", "10.0%", "none |"]
    assert table["held out"].split(" | ")[1:4] == ["2", "20.0%", "30.0%"]
