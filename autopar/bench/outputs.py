"""The benchmark's written results: JSON lines, and a Markdown page describing the machine.

``JsonlWriter`` appends each row as it is made (a run that stops early keeps what it did);
``markdown_page`` renders every row of a suite as tables, with the machine, the definitions of
each column and the plots. The machine itself is described by ``machine``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from autopar.bench.hand_baselines import hand_plans_table
from autopar.bench.machine import machine_text
from autopar.bench.scaling_summary import device_scaling_lines
from autopar.report.units import format_count

Row = dict[str, Any]


class JsonlWriter:
    """Rows appended to a JSON-lines file as they come, flushed each time."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = open(self.path, "w")  # closed by close()

    def write(self, row: Row) -> None:
        """Append ``row`` as one JSON line."""
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


@dataclass(frozen=True)
class RunInfo:
    """What the page says about the run itself."""

    suite: str
    command: str
    machine: dict[str, Any]
    load_before: str
    load_after: str
    wall_s: float
    local_devices: int
    calibrated: str | None


def _f(x: float | None, digits: int = 3) -> str:
    """A number to ``digits`` significant digits (whole numbers from 1000 up); ``—`` for None."""
    if x is None:
        return "—"
    if abs(x) >= 1000:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def _stages(plan: dict | None, method: bool = False) -> str:
    if not plan:
        return "—"
    if "stages_text" in plan:  # a pipeline split the full search evaluated (layers@submesh)
        return f"{plan['num_stages']}: {plan['stages_text']}"
    parts = [f"{s['submesh'][0]}x{s['submesh'][1]}/{s['logical_mesh']}" for s in plan["stages"]]
    text = f"{plan['num_stages']}: " + ", ".join(parts)
    if method and plan.get("method"):
        text = f"{plan['method']} {text}"
    if plan.get("replicas", 1) > 1:
        text += f" (x{plan['replicas']} replicas)"
    return text


def _kinds(kinds: dict | None) -> str:
    if not kinds:
        return "none"
    shown = [f"{k} {v['count']:g}" for k, v in sorted(kinds.items()) if v["count"]]
    return ", ".join(shown) or "none"


def _cases_table(cases: Sequence[Row]) -> list[str]:
    lines = ["| case | where | devices | params | method stages: submesh/logical mesh | "
             "trace (s) | ILP (s) | DP (s) | planning total (s) | ILP solves | est. step (s) | "
             "est. TFLOPS/device | measured step (s) | measured TFLOPS/device | "
             "runtime overhead |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in cases:
        if r.get("error"):
            lines.append(f"| {r['case']} | {r.get('where', '')} | — | — | error: {r['error']} "
                         "| | | | | | | | | | |")
            continue
        p, m = r["planning"], r.get("measured") or {}
        lines.append(
            f"| {r['case']} | {r['where']} ({r['cluster']}) | {r['devices']} | "
            f"{format_count(r['params'])} | {_stages(r['plan'], True)} | {_f(p['trace_s'])} | "
            f"{_f(p['ilp_s'])} | {_f(p['dp_s'])} | {_f(p['total_s'])} | {r['ilp_solves']} | "
            f"{_f(r['est_step_time_s'])} | {_f(r['est_tflops_per_device'])} | "
            f"{_f(m.get('step_time_s'))} | {_f(m.get('tflops_per_device'))} | "
            f"{_f(m.get('runtime_overhead'), 2)} |")
    return lines


def _baselines_table(cases: Sequence[Row]) -> list[str]:
    lines = ["| case | baseline | plan | est. step (s) | est. / autopar's | measured step (s) | "
             "measured / autopar's | runtime overhead | note |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in cases:
        for b in r.get("baselines", []):
            note = f"error: {b['error']}" if b.get("error") else b.get("note", "")
            overhead = (b.get("measured") or {}).get("runtime_overhead")
            lines.append(
                f"| {r['case']} | {b['name']} | {_stages(b.get('plan'))} | "
                f"{_f(b['est_step_time_s'])} | {_f(b['est_ratio'])} | "
                f"{_f(b['measured_step_time_s'])} | {_f(b['measured_ratio'])} | "
                f"{_f(overhead, 2)} | {note} |")
    return lines


def _candidates_table(cases: Sequence[Row]) -> list[str]:
    lines = ["| case | candidate | method | est. step (s) | est. / chosen | note |",
             "|---|---|---|---:|---:|---|"]
    found = False
    for r in cases:
        chosen = r.get("est_step_time_s")
        for c in r.get("candidates") or []:
            found = True
            est = c.get("est_step_time_s")
            mark = " (chosen)" if c.get("chosen") else ""
            ratio = est / chosen if est is not None and chosen else None
            note = c.get("note") or ""
            if c.get("fits") is False and est is not None and "budget" not in note:
                note = (note + "; " if note else "") + "does not fit the memory budget"
            lines.append(f"| {r['case']} | {c['name']}{mark} | {c['method']} | {_f(est)} | "
                         f"{_f(ratio)} | {note} |")
    return lines if found else ["No case recorded its candidates."]


def _simple_vs_default_table(cases: Sequence[Row]) -> list[str]:
    lines = ["| case | devices | default plan | measured default (s) | best simple | "
             "measured best simple (s) | best simple / default |",
             "|---|---:|---|---:|---|---:|---:|"]
    found = False
    for r in cases:
        s = r.get("simple_vs_default")
        if not s:
            continue
        found = True
        lines.append(f"| {r['case']} | {r['devices']} | {_stages(r['plan'], True)} | "
                     f"{_f(s['default_s'])} | {s['best_simple']} | {_f(s['best_simple_s'])} | "
                     f"{s['ratio']:.2f} |")
    return lines if found else ["No local case in this suite."]


def _what_if_table(cases: Sequence[Row]) -> list[str]:
    rows = [r for r in cases if r.get("what_if")]
    if not rows:
        return ["No what-if case in this suite."]
    lines = ["| case | cluster | est. TFLOPS/GPU (traced flops) | est. TFLOPS/GPU (Alpa's "
             "formula) | published TFLOPS/GPU (as published) | published, without the "
             "recomputed forward | est. / published | published run | comparable |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        w = r["what_if"]
        published = w["published_tflops_per_device"]
        lines.append(
            f"| {r['case']} | {r['cluster']} ({r['devices']} GPUs) | "
            f"{_f(w['est_tflops_per_device'])} | {_f(w['est_tflops_per_device_alpa_formula'])} "
            f"| {f'{published:g}' if published else '—'} | "
            f"{_f(w['published_tflops_per_device_without_recompute'])} | "
            f"{_f(w['est_over_published'])} | {w['published_setting']}; "
            f"{w['published_source']} | "
            f"{'yes' if w['comparable'] else 'no: a reduced copy of the case'} |")
    lines += ["", "The estimates are the cost model's, not measurements. autopar plans without "
              "rematerialisation (memory is not enforced on described clusters), Alpa's runs "
              "recompute the forward and count it: both are put on Alpa's formula without the "
              "recomputed forward (72 B S H² L (1 + S/6H) + 6 B S H V flops per step) before "
              "the ratio."]
    return lines


def _cost_model_table(cases: Sequence[Row]) -> list[str]:
    lines = ["| case | plan | est. default (s) | measured (s) | measured / est. default | "
             "same plan calibrated | est. calibrated (s) | measured calibrated (s) | "
             "measured / est. calibrated |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    found = False
    for r in cases:
        items = [("autopar", r.get("cost_model"))]
        items += [(b["name"], b.get("cost_model")) for b in r.get("baselines", [])]
        for name, cm in items:
            if not cm:
                continue
            found = True
            same = "—" if cm["same_plan"] is None else ("yes" if cm["same_plan"] else "no")
            lines.append(
                f"| {r['case']} | {name} | {_f(cm['est_default_s'])} | "
                f"{_f(cm['measured_s'])} | {_f(cm['measured_over_default'])} | {same} | "
                f"{_f(cm['est_calibrated_s'])} | {_f(cm.get('measured_calibrated_s'))} | "
                f"{_f(cm['measured_over_calibrated'])} |")
    return lines if found else ["No local case in this suite."]


def _collectives_table(cases: Sequence[Row]) -> list[str]:
    lines = ["| case | plan | predicted (count by kind) | compiled HLO (count by kind) |",
             "|---|---|---|---|"]
    found = False
    for r in cases:
        items = [("autopar", r.get("predicted_communication"), r.get("measured"))]
        items += [(b["name"], b.get("predicted_communication"), b.get("measured"))
                  for b in r.get("baselines", [])]
        for name, predicted, measured in items:
            if not measured:
                continue
            found = True
            hlo = (_kinds(measured["hlo_collectives"])
                   if measured.get("hlo_collectives") is not None else measured["hlo_note"])
            pred = (_kinds(predicted["collectives"]) if predicted and predicted["collectives"]
                    else f"{_f((predicted or {}).get('time_s'))} s, kinds not recorded")
            lines.append(f"| {r['case']} | {name} | {pred} | {hlo} |")
    return lines if found else ["No local case in this suite."]


def _stage_table(cases: Sequence[Row]) -> list[str]:
    lines = ["| case | stage | layers | submesh | logical mesh | est. time per microbatch (s) |",
             "|---|---:|---|---|---|---:|"]
    for r in cases:
        for i, st in enumerate((r.get("plan") or {}).get("stages", [])):
            first, last = st["layers"]
            layers = f"{first}" if first == last else f"{first}-{last}"
            lines.append(f"| {r['case']} | {i} | {layers} | {st['submesh'][0]}x{st['submesh'][1]} "
                         f"| {st['logical_mesh']} | {_f(st['est_time_s'])} |")
    return lines


def _scaling_table(points: Sequence[Row]) -> list[str]:
    if not points:
        return ["No scaling point in this suite."]
    lines = ["| axis | model | layers | devices | pipeline layers | method | stages | replicas | "
             "ILP solves | trace (s) | ILP (s) | DP (s) | total (s) | est. step (s) | "
             "bound by |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in points:
        if r.get("error"):
            lines.append(f"| {r['axis']} | {r['case']} | error: {r['error']} | | | | | | | | | | "
                         "| | |")
            continue
        p, plan = r["planning"], r["plan"]
        layers = plan.get("pipeline_layers")
        lines.append(
            f"| {r['axis']} | {r['model']} {r['size']} | {r['num_layers']} | {r['devices']} | "
            f"{layers if layers is not None else '—'} | {plan.get('method', '')} | "
            f"{plan['num_stages']} | {plan.get('replicas', 1)} | {r['ilp_solves']} | "
            f"{_f(p['trace_s'])} | {_f(p['ilp_s'])} | {_f(p['dp_s'])} | {_f(p['total_s'])} | "
            f"{_f(r.get('est_step_time_s'))} | {r.get('bound_by', '')} |")
    return lines


_HAND_PLANS_TEXT = """\
Every expert layout of `autopar.bench.hand_plans` that applies to the model (data, Megatron,
data x Megatron on a 2-D mesh, ZeRO-2/3, expert parallelism, data-parallel convolutions with a
tensor-parallel head). *est.*: autopar's cost model on its ILP plan with the hand plan's
inputs pinned; *est. / autopar's* below 1 would mean the full search misses that layout.
*measured*: `jax.jit(step, in_shardings=hand)`, XLA's own propagation from the same inputs
(what a user gets without autopar), timed on the local devices; its collectives are what XLA
emitted."""

_DEFINITIONS = """\
How to read these tables:

- **The full search** is `autopar.AutoParallel()` (what `autopar.parallelize(step)` runs
  without `method=`): data parallelism, the intra-operator ILP (`ShardParallel`), ZeRO-2/3 and
  the pipelined stage search (the stage DP per replica count, beside the equal-layer and
  equal-operator splits) are all planned and estimated on one cost model, and the fastest plan
  that fits is kept; *method* is the one that made it. Here with `prune=False`: the pipelines
  are planned even where their bound shows they cannot win (the default then skips them, with
  the same plan), as they are baselines too. Every candidate and its estimate is in
  the "Candidates" table.
- **Planning time** is split by phase: *trace* (the whole step, and the pipeline cut: the
  step traced at the full batch and at one microbatch), *ILP* (every intra-operator ILP the
  full search solved: the one-stage ILP, one per distinct layer and mesh for the stage costs,
  then the chosen stages whole), *DP* (the stage search without the ILPs it asked for) and the
  *total* (trace, every candidate). *ILP solves* counts the distinct (layer, mesh) ILPs:
  structurally identical layers are solved once per mesh, which is what keeps the curve
  against layers flat.
- **est. step** is the cost model's step time for the plan on the described cluster (for local
  cases: the default description of the local devices, `cpu-sim`), the runtime's own costs
  included (one call for a one-stage plan; the driver's tasks, transfers and gradient
  accumulation for a pipeline; docs/cost-model.md); **est. TFLOPS/device** is the train
  step's flops *as traced* (forward, backward and the Adam update, no recomputation:
  `OpGraph.total_flops`) over est. step x devices. Measured TFLOPS use the same flops.
- **Baselines** are planned in the same run: *single-device* (local: `jax.jit` on one device,
  measured; described: the step on one device), *data-parallel* (`autopar.DataParallel()`)
  and *intra-op-only* (`autopar.ShardParallel()`), both the full search's own candidates,
  *megatron* (GPT: every parameter and Adam moment pinned to Megatron-LM's tensor-parallel
  spec, q/k/v/fc_in column-parallel, out/fc_out row-parallel, the rest replicated; tensor
  parallelism inside a host, data parallelism across hosts; the ILP places the batch and
  intermediates), *equal-layer* and *equal-operator* (as many stages as the DP chose, or the
  nearest count that splits evenly, 2 when the DP chose one; the full search evaluates them
  as candidates), *one-stage pipeline* (local: `PipeshardParallel` with one stage over every
  device, timed in the same rounds as the same stage, its logical mesh, run by
  `ShardParallel`, as the same pipeline at one microbatch, and as the same microbatches
  accumulated by a hand-written step (`lax.scan`, `bench/hand_accumulation.py`) under
  `jax.jit` from the ShardParallel plan's input layouts; the note gives the times and ratios:
  pipeline / ShardParallel is the microbatches' cost and the runtime's together, pipeline /
  one microbatch the microbatches' alone, one microbatch / ShardParallel the runtime's alone,
  and pipeline / hand accumulation the runtime's beside the same work written without
  autopar). A ratio above 1 means autopar's plan is faster.
  Every estimate is the whole step's (the pipelines' simulated schedule, tails and driver
  included).
- **Measured** step times are medians of several steps after warm-up, on the local devices
  (simulated CPU devices share the host's cores: they measure the plan's overheads, not a GPU
  cluster's speed), each step called as a training loop calls it: the state the previous
  step returned goes back in, the batch comes from the host. autopar's plan and the
  one-stage baselines are timed together, in interleaved rounds, so the machine's changing
  load falls on all of them alike. *Best simple / default* is the faster of data-parallel and
  intra-op-only measured over autopar's plan measured (1 or more: the default is at least as
  fast as the best simple plan). Pipelined plans run one program per stage task (a one-stage
  pipeline: one program per step, `runtime/fused_step.py`): their collectives are every
  program's, each times its calls. **Runtime overhead** (pipelined plans) is the measured
  step over the sum of its tasks' measured times, each task waited for
  (`ParallelizedStep.timed_call`, median of 3 steps): what the driver adds between the tasks
  (dispatch, transfers, slicing, waiting) beyond them; 1 is none.
- **Described clusters** are planned from abstract shapes, with memory not enforced:
  without rematerialisation the Alpa sizes keep more activations than a 16 GB V100 holds, and
  the comparison with Alpa's published runs is on its formula without the recomputed
  forward (see What-if). The paper suite plans them in fp16, as Alpa ran them (the zoo's
  default is fp32).
- **What-if** rows are estimates from the cost model, not measurements, beside figures
  published for real runs."""


def markdown_page(rows: Sequence[Row], info: RunInfo, plots: Sequence[Path]) -> str:
    """The suite's results as one Markdown page."""
    cases = [r for r in rows if r.get("kind") == "case"]
    points = [r for r in rows if r.get("kind") == "scaling"]
    m = info.machine
    calibrated = (f"; local cases also estimated under the calibrated description "
                  f"`{info.calibrated}`" if info.calibrated else "")
    lines = [
        f"# autopar benchmarks: the `{info.suite}` suite", "",
        f"Written by `{info.command}` on {m['date']} in {info.wall_s:.0f} s.", "",
        f"Machine: {machine_text(m)}. Local cases ran on simulated CPU devices (XLA's host "
        f"platform, {info.local_devices} in the process; a case may use fewer, see its "
        f"devices) sharing those cores{calibrated}. Load average "
        f"{info.load_before} before the run and {info.load_after} after: the machine may be "
        "shared, and wall-clock times carry that noise.", "",
        _DEFINITIONS, "",
        "## Cases", "", *_cases_table(cases), "",
        "## Stages chosen by the full search", "",
        "Layers are the pipeline layers the loss forward was clustered into.", "",
        *_stage_table(cases), "",
        "## Candidates compared by the full search", "", *_candidates_table(cases), "",
        "## Baselines", "", *_baselines_table(cases), "",
        "## Hand plans: pinned in autopar, and XLA's propagation from the same inputs", "",
        _HAND_PLANS_TEXT, "", *hand_plans_table(cases, _f), "",
        "## Measured: the default plan against the best simple plan (local cases)", "",
        *_simple_vs_default_table(cases), "",
        "## What-if: the Alpa paper's testbed (cost-model estimates)", "",
        *_what_if_table(cases), "",
        "## Cost model against measurement (local cases)", "", *_cost_model_table(cases), "",
        "## Collectives: predicted and in the compiled HLO (local cases)", "",
        *_collectives_table(cases), "",
        "## Planning time of the planner itself", "", *_scaling_table(points), "",
        *device_scaling_lines(points), "",
    ]
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
        lines.append("")
    notes = [(r["case"], n) for r in cases for n in r.get("notes", [])]
    if notes:
        lines += ["## Notes from the planner", ""]
        lines += [f"- {case}: {note}" for case, note in notes]
        lines.append("")
    return "\n".join(lines)
