"""Running the published-runs suite (``autopar bench --suite published``) and writing its page.

One row per :class:`~autopar.bench.published.PublishedRun`: the pinned configuration's and
the full search's estimates (seconds per step and TFLOPS per GPU on the source's formula),
beside the published measurement; the full search's planning time (trace included), its
chosen plan, and whether any ILP in either stopped on its time limit. Output:
``bench-published.jsonl``, ``bench-published.md`` and ``bench-published.png`` (estimated
against published TFLOPS per GPU).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from autopar.bench.machine import load_average, machine_info, machine_text
from autopar.bench.outputs import JsonlWriter
from autopar.bench.published import (
    PUBLISHED_RUNS,
    PlannedRun,
    PublishedRun,
    plan_full_search,
    plan_pinned,
    tflops,
)
from autopar.compiler.intra_op.problem import STOPPED_STATUSES
from autopar.plan import Plan

PREFIX = "bench-published"


def stopped_ilps(plan: Plan) -> int:
    """ILPs of a plan (its own and the stage search's, over every candidate the full search
    planned) that stopped before proving their answer."""
    count = 0
    if plan.solver and plan.solver.get("status") in STOPPED_STATUSES:
        count += 1
    search = plan.planning.stage_search or {}
    statuses = search.get("ilp_statuses") or {}
    count += sum(int(n) for status, n in statuses.items() if status in STOPPED_STATUSES)
    for row in plan.planning.candidates:
        count += row.get("ilp_status") in STOPPED_STATUSES and not row.get("chosen")
        for status, n in (row.get("ilp_statuses") or {}).items():
            if status in STOPPED_STATUSES:
                count += int(n)
    return count


def _plan_row(run: PublishedRun, planned: PlannedRun) -> dict[str, Any]:
    plan = planned.plan
    return {
        "method": plan.method.value,
        "num_microbatches": planned.num_microbatches,
        "est_step_time_s": plan.est_step_time_s,
        "est_tflops_per_gpu": tflops(run, plan.est_step_time_s),
        "peak_memory_gib": plan.peak_memory_bytes / 2**30,
        "fits": plan.peak_memory_bytes <= run.described_cluster().device.memory_bytes,
        "stages": [{"layers": [s.layers[0], s.layers[-1]] if s.layers else [],
                    "submesh": list(s.submesh_shape),
                    "logical_mesh": list(s.logical_mesh_shape)} for s in plan.stages],
        "schedule": None if plan.pipeline is None else str(plan.pipeline.schedule),
        "replicas": 1 if plan.pipeline is None else plan.pipeline.replicas,
        "recompute": _recompute(plan),
        "stopped_ilps": stopped_ilps(plan),
        "planning_s": planned.seconds,
        "phases_s": {k: round(v, 3) for k, v in plan.planning.phases.items()},
    }


def run_published(run: PublishedRun) -> dict[str, Any]:
    """Plan ``run`` pinned and by the full search; the row (a search that finds no plan
    within the device memory is the row's ``search_error``)."""
    import jax

    from autopar.errors import AutoparError

    pinned = plan_pinned(run)
    row: dict[str, Any] = {
        "label": run.label, "source": run.source, "system": run.system,
        "gpus": run.gpus, "cluster": run.cluster, "hosts": run.hosts,
        "degrees": dict(data=run.data, tensor=run.tensor, pipeline=run.pipeline),
        "schedule": run.schedule, "published_tflops_per_gpu": run.tflops,
        "formula": run.formula, "note": run.note, "pinned": _plan_row(run, pinned),
    }
    row["pinned_over_published"] = row["pinned"]["est_tflops_per_gpu"] / run.tflops
    # the same configuration with memory unbounded: where autopar's memory model overfills
    # the device that the publication ran on, the layouts it forces cost this much
    unbounded = plan_pinned(run, within_device=False)
    row["pinned_unbounded"] = {"est_tflops_per_gpu": tflops(run, unbounded.plan.est_step_time_s),
                               "peak_memory_gib": unbounded.plan.peak_memory_bytes / 2**30}
    # the earlier rows' cyclic garbage collected first, untimed: planning freezes what the
    # process holds (``planners.common.fewer_full_collections``), and GPT-39B's search
    # took 9.9 s after six rows' garbage where it took 9.3 s alone (2026-12-07). JAX's
    # caches of the earlier rows' traced steps are let go too, as a process planning one
    # model holds no others': after the six Alpa rows before it, GPT-39B's search took
    # 9.15-11.34 s with them kept, 8.84-10.15 s without (the same code, one after the
    # other, 2026-12-08)
    jax.clear_caches()
    gc.collect()
    started = time.perf_counter()
    try:
        searched = plan_full_search(run, pinned.num_microbatches)
    except AutoparError as err:
        row["search_error"] = " ".join(str(err).split())
        row["search_planning_s"] = time.perf_counter() - started
        return row
    row["full_search"] = _plan_row(run, searched)
    row["search_over_pinned"] = (pinned.plan.est_step_time_s
                                 / searched.plan.est_step_time_s)
    return row


def _f(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _recompute(plan: Plan) -> list[str]:
    """Per stage, what its backward recomputes: "full" (every layer), "selective" (all but
    the matmuls' outputs) or "none"; a one-stage plan's, "full" or "selective" where its
    layers run under ``jax.checkpoint``."""
    layout = plan.pipeline
    if layout is None:
        kind = "selective" if plan.remat_selective else "full"
        return [kind if plan.remat_positions else "none"] * len(plan.stages)
    selective = layout.selective_stages or (False,) * len(layout.remat_stages)
    return ["selective" if s else "full" if r else "none"
            for r, s in zip(layout.remat_stages, selective, strict=True)]


def _plan_text(p: dict[str, Any]) -> str:
    stages = p["stages"]
    meshes = sorted({"x".join(map(str, s["logical_mesh"])) for s in stages})
    text = f"{p['method']}, {len(stages)} stage(s) on {'/'.join(meshes)}"
    if p["replicas"] > 1:
        text += f" x {p['replicas']} replicas"
    if p["schedule"]:
        text += f", {p['schedule']}"
    text += f", m={p['num_microbatches']}"
    kinds = p.get("recompute") or []
    counts = [f"{kinds.count(k)} {k}" for k in ("full", "selective", "none") if k in kinds]
    if counts and kinds != ["none"] * len(kinds):
        text += f", recompute {' / '.join(counts)}"
    return text


def markdown(rows: Sequence[dict[str, Any]], info: dict[str, Any], command: str,
             load_before: str, load_after: str, seconds: float) -> str:
    lines = [
        "# Published runs: pinned configuration and full search, at their real sizes", "",
        f"Command: `{command}` ({seconds:.0f} s). Machine: {machine_text(info)}. "
        f"Load average before: {load_before}; after: {load_after}.", "",
        "Each row is a published measurement (sources: `shared/published/README.md`). "
        "*Pinned*: the published degrees, microbatches, schedule and full recomputation, "
        "planned by autopar (layouts inside each stage's data x tensor mesh are the ILP's). "
        "*Search*: `AutoParallel` with the same microbatch count, schedules compared. "
        "TFLOPS per GPU on the source's own formula (both sources count a recomputed forward: "
        "a plan that recomputes less is credited with it all the same, so these are step "
        "times set on one scale, not flops done). *Recompute*: stages that recompute every "
        "layer (full), all but their matmuls' outputs (selective) or nothing. *Stopped*: "
        "ILPs that ended on a time limit (pinned / search). Planning seconds include the "
        "trace (the earlier rows' garbage collected before each search, untimed).", "",
        "*Unbounded*: the pinned configuration planned with memory unbounded (its estimate "
        "and memory), where autopar's memory model puts the fastest layouts over the device "
        "that the publication ran on.", "",
        "| run | published | pinned plan | pinned est. | pinned / published | unbounded "
        "est. (GiB) | search plan "
        "| search est. | search / pinned | search planning s | stopped | memory GiB "
        "(pinned / search) |",
        "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | {r.get('published_tflops_per_gpu', '')} | "
                         f"error: {r['error']} | | | | | | | | | |")
            continue
        p = r["pinned"]
        s = r.get("full_search")
        fits = "" if p["fits"] else " (over the device)"
        search = (f"{_plan_text(s)} | {_f(s['est_tflops_per_gpu'])} | "
                  f"{_f(r['search_over_pinned'], 2)} | {_f(s['planning_s'])} | "
                  f"{p['stopped_ilps']} / {s['stopped_ilps']} | "
                  f"{_f(p['peak_memory_gib'])}{fits} / {_f(s['peak_memory_gib'])} |"
                  if s is not None else
                  f"no plan: {r['search_error']} | — | — | {_f(r['search_planning_s'])} | "
                  f"{p['stopped_ilps']} / — | {_f(p['peak_memory_gib'])}{fits} / — |")
        free = r.get("pinned_unbounded")
        free_text = (f"{_f(free['est_tflops_per_gpu'])} ({_f(free['peak_memory_gib'])})"
                     if free else "—")
        lines.append(
            f"| {r['label']} | {r['published_tflops_per_gpu']:.1f} | {_plan_text(p)} | "
            f"{_f(p['est_tflops_per_gpu'])} | {_f(r['pinned_over_published'], 2)} | "
            f"{free_text} | " + search)
    lines += ["", *error_summary(rows)]
    notes = sorted({r["note"] for r in rows if r.get("note")})
    if notes:
        lines += ["", "Notes: " + "; ".join(notes) + "."]
    return "\n".join(lines) + "\n"


# Which rows each GPU's ``compute_efficiency`` (the fraction of the peak a large GEMM
# reaches) was fitted on (docs/cost-model.md, "Matrix multiplications by shape"): every other
# row of each GPU's, so that the rows left out check the fit.
FIT_ROWS = "every other row per GPU, from the first"


def fitted(rows: Sequence[dict[str, Any]]) -> dict[str, bool]:
    """Whether each row (by label) is one its GPU's efficiency was fitted on
    (``FIT_ROWS``)."""
    seen: dict[str, int] = {}
    out = {}
    for r in rows:
        k = seen.get(r.get("cluster", ""), 0)
        seen[r.get("cluster", "")] = k + 1
        out[r["label"]] = k % 2 == 0
    return out


def error_summary(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The pinned estimates against the published measurements: the median and largest
    error, and the rows beyond 20%, over all rows and over those fitted on and not."""
    import statistics

    ok = [r for r in rows if "pinned_over_published" in r]
    if not ok:
        return []
    fit = fitted(ok)
    lines = ["Pinned estimate against the published measurement (error: |pinned / published "
             f"- 1|); each GPU's `compute_efficiency` was fitted on {FIT_ROWS} "
             "(docs/cost-model.md):", "",
             "| rows | count | median error | largest error | beyond 20% |",
             "|---|---:|---:|---:|---|"]
    for name, group in (("all", ok), ("fitted on", [r for r in ok if fit[r["label"]]]),
                        ("held out", [r for r in ok if not fit[r["label"]]])):
        if not group:
            continue
        errors = [abs(r["pinned_over_published"] - 1) for r in group]
        beyond = [r["label"] for r in group if abs(r["pinned_over_published"] - 1) > 0.2]
        lines.append(f"| {name} | {len(group)} | {statistics.median(errors):.1%} | "
                     f"{max(errors):.1%} | {'; '.join(beyond) or 'none'} |")
    return lines


def write_plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Estimated (pinned, search) against published TFLOPS per GPU, one point per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r and "full_search" in r]
    fig, ax = plt.subplots(figsize=(6, 5))
    pub = [r["published_tflops_per_gpu"] for r in ok]
    ax.scatter(pub, [r["pinned"]["est_tflops_per_gpu"] for r in ok], label="pinned (estimate)")
    ax.scatter(pub, [r["full_search"]["est_tflops_per_gpu"] for r in ok], marker="x",
               label="full search (estimate)")
    top = max([*pub, *(r["full_search"]["est_tflops_per_gpu"] for r in ok), 1.0]) * 1.1
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8, label="estimate = published")
    ax.set_xlabel("published TFLOPS per GPU")
    ax.set_ylabel("autopar's estimate, TFLOPS per GPU")
    ax.set_title("Published runs: estimate against measurement")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_suite(out_dir: str | Path, *, command: str, echo: Callable[[str], None],
              runs: Sequence[PublishedRun] = PUBLISHED_RUNS,
              stop_after_s: float | None = None) -> list[Path]:
    """Every run in order, rows written as they come; then the page and the plot. With
    ``stop_after_s``, no run starts after that many seconds: the page lists those left."""
    from autopar.errors import AutoparError

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info, load_before, start = machine_info(), load_average(), time.perf_counter()
    writer = JsonlWriter(out / f"{PREFIX}.jsonl")
    rows: list[dict[str, Any]] = []
    left: list[str] = []
    try:
        for i, run in enumerate(runs, 1):
            if stop_after_s is not None and time.perf_counter() - start > stop_after_s:
                left = [r.label for r in runs[i - 1:]]
                break
            try:
                row = run_published(run)
            except AutoparError as err:
                row = {"label": run.label, "published_tflops_per_gpu": run.tflops,
                       "error": " ".join(str(err).split())}
            rows.append(row)
            writer.write(row)
            echo(_line(i, len(runs), row))
    finally:
        writer.close()
    page = out / f"{PREFIX}.md"
    text = markdown(rows, info, command, load_before, load_average(),
                    time.perf_counter() - start)
    if left:
        text += (f"\nNot run (the run stopped starting rows after {stop_after_s:.0f} s): "
                 + "; ".join(left) + ".\n")
    page.write_text(text)
    plot = out / f"{PREFIX}.png"
    write_plot(rows, plot)
    return [out / f"{PREFIX}.jsonl", page, plot]


def _line(i: int, total: int, row: dict[str, Any]) -> str:
    if "error" in row:
        return f"[{i}/{total}] {row['label']}: error: {row['error']}"
    if "full_search" not in row:
        return (f"[{i}/{total}] {row['label']}: published {row['published_tflops_per_gpu']:.1f}"
                f", pinned {row['pinned']['est_tflops_per_gpu']:.1f} TFLOPS/GPU, search: "
                f"{row['search_error']}")
    return (f"[{i}/{total}] {row['label']}: published {row['published_tflops_per_gpu']:.1f}, "
            f"pinned {row['pinned']['est_tflops_per_gpu']:.1f}, search "
            f"{row['full_search']['est_tflops_per_gpu']:.1f} TFLOPS/GPU "
            f"(planned in {row['full_search']['planning_s']:.1f} s)")
