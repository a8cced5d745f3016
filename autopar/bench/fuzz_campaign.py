"""The differential campaign: generated programs (``fuzz_programs``) run under every method on
2, 4 and 8 local devices, each compared with the plain single-device ``jax.jit`` step.

Every (program, method, devices) case ends one of four ways: ``match`` (the loss of every step
and every leaf of the final state within the dtype's tolerance of the serial run), ``mismatch``,
``refused`` (a typed autopar error of one line: the method does not apply, and says why) or
``traceback`` (any other exception, or an autopar error whose message is not one line). A
mismatch or traceback is shrunk (``fuzz_programs.shrink``) and written out as a reproducer:
the spec's JSON with the method and device count that failed.
"""

from __future__ import annotations

import json
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

import autopar
from autopar.bench.fuzz_programs import ProgramSpec, build, leaves, shrink
from autopar.ir.schedules import ScheduleName
from autopar.plan import MethodName

STEPS = 2
DEVICE_COUNTS = (2, 4, 8)
PIPELINE_SCHEDULES = (ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B, ScheduleName.ZB_H1)


def _method(name: str, devices: int, spec: ProgramSpec) -> Any:
    """The method ``name`` for ``devices`` devices (None where it has no such form)."""
    if name == MethodName.DATA:
        return autopar.DataParallel()
    if name == "shard-1d":
        return autopar.ShardParallel(mesh_shape=(devices,))
    if name == "shard-2d":
        return None if devices < 4 else autopar.ShardParallel(mesh_shape=(2, devices // 2))
    if name == MethodName.ZERO2:
        return autopar.Zero2Parallel()
    if name == MethodName.ZERO3:
        return autopar.Zero3Parallel()
    if name == MethodName.PIPESHARD:
        schedule = PIPELINE_SCHEDULES[spec.seed % len(PIPELINE_SCHEDULES)]
        return autopar.PipeshardParallel(num_microbatches=2, num_stages=2, schedule=schedule)
    if name == "default":
        # the full search without timing its candidates: the choice between them is not
        # what is checked here, and timing would triple the campaign
        return autopar.AutoParallel(measure_candidates=0)
    raise ValueError(f"unknown method {name!r}; valid: {', '.join(METHODS)}")


METHODS = (MethodName.DATA, "shard-1d", "shard-2d", MethodName.ZERO2, MethodName.ZERO3,
           MethodName.PIPESHARD, "default")


@dataclass(frozen=True)
class CaseResult:
    """How one (program, method, devices) case ended, with a one-line ``detail``."""

    seed: int
    method: str
    devices: int
    status: str  # "match", "mismatch", "refused" or "traceback"
    detail: str
    seconds: float


def serial_run(spec: ProgramSpec, steps: int = STEPS) -> tuple[list[float], list[np.ndarray]]:
    """Losses and final state leaves of ``steps`` plain ``jax.jit`` steps on one device."""
    program = build(spec)
    step = jax.jit(program.step)  # uncommitted inputs: the default device, one device
    state, losses = program.state, []
    for i in range(steps):
        state, loss = step(state, program.batches(i))
        losses.append(float(loss))
    return losses, leaves(state)


def parallel_run(spec: ProgramSpec, method: Any, devices: int,
                 steps: int = STEPS) -> tuple[list[float], list[np.ndarray]]:
    """The same under ``method`` on the first ``devices`` local devices."""
    program = build(spec)
    step = autopar.parallelize(program.step, method=method,
                               devices=jax.devices()[:devices], cache=False)
    state, losses = program.state, []
    for i in range(steps):
        state, loss = step(state, program.batches(i))
        losses.append(float(loss))
    return losses, leaves(state)


def compare(reference: tuple[list[float], list[np.ndarray]],
            got: tuple[list[float], list[np.ndarray]], low_precision: bool) -> str | None:
    """Why ``got`` differs from ``reference`` beyond the tolerance, or None. bfloat16 anywhere
    in the program (``low_precision``) loosens it: its 8-bit mantissa rounds differently when
    a sum is split across devices."""
    rtol = 3e-2 if low_precision else 2e-4
    ref_losses, ref_leaves = reference
    losses, got_leaves = got
    for i, (serial, loss) in enumerate(zip(ref_losses, losses, strict=True)):
        if not np.isclose(loss, serial, rtol=rtol, atol=rtol * 0.1):
            return f"loss of step {i}: {loss!r} vs serial {serial!r}"
    if len(ref_leaves) != len(got_leaves):
        return f"{len(got_leaves)} state leaves vs serial {len(ref_leaves)}"
    for k, (want, have) in enumerate(zip(ref_leaves, got_leaves, strict=True)):
        if want.shape != have.shape or want.dtype != have.dtype:
            return f"state leaf {k}: {have.dtype}{list(have.shape)} vs serial " \
                   f"{want.dtype}{list(want.shape)}"
        loose = low_precision or want.dtype.itemsize < 4
        tol = 5e-2 if loose else 1e-3
        scale = float(np.max(np.abs(want.astype(np.float64)))) if want.size else 0.0
        if want.dtype.kind in "iub":
            if not np.array_equal(want, have):
                return f"state leaf {k} (integer) differs"
        elif not np.allclose(have.astype(np.float64), want.astype(np.float64), rtol=tol,
                             atol=tol * 0.1 * max(scale, 1e-2)):
            worst = float(np.max(np.abs(have.astype(np.float64) - want.astype(np.float64))))
            return f"state leaf {k}: max |difference| {worst:.3g} (largest value {scale:.3g})"
    return None


def _uses_bf16(spec: ProgramSpec) -> bool:
    return any(b.kind == "dense" and b.variant == 2 for b in spec.blocks)


def run_case(spec: ProgramSpec, method_name: str, devices: int,
             reference: tuple[list[float], list[np.ndarray]] | None = None) -> CaseResult:
    """One case, classified (see the module docstring); ``reference``: the serial run, when
    already computed."""
    start = time.perf_counter()

    def done(status: str, detail: str) -> CaseResult:
        return CaseResult(spec.seed, method_name, devices, status, detail,
                          time.perf_counter() - start)

    method = _method(method_name, devices, spec)
    if method is None:
        return done("refused", f"{method_name} has no form on {devices} devices")
    reference = reference or serial_run(spec)
    try:
        got = parallel_run(spec, method, devices)
    except autopar.AutoparError as err:
        text = str(err).strip()
        if text and "\n" not in text:
            return done("refused", f"{type(err).__name__}: {text}")
        return done("traceback", f"{type(err).__name__} of {text.count(chr(10)) + 1} lines: "
                                 f"{text.splitlines()[0] if text else ''}")
    except Exception as err:  # noqa: BLE001 (anything else is a bug found)
        last = traceback.extract_tb(err.__traceback__)[-1]
        first_line = str(err).splitlines()[0] if str(err) else ""
        return done("traceback", f"{type(err).__name__} at {Path(last.filename).name}:"
                                 f"{last.lineno}: {first_line}")
    why = compare(reference, got, _uses_bf16(spec))
    return done("match", "") if why is None else done("mismatch", why)


def reason(result: CaseResult) -> str:
    """A refusal's reason with the numbers taken out, for counting refusals by kind."""
    return "".join("N" if ch.isdigit() else ch for ch in result.detail)[:160]


def shrink_failure(spec: ProgramSpec, result: CaseResult) -> ProgramSpec:
    """The smallest program that still fails the way ``result`` did."""
    def fails(candidate: ProgramSpec) -> bool:
        again = run_case(candidate, result.method, result.devices)
        return again.status == result.status
    return shrink(spec, fails)


def write_reproducer(directory: Path, spec: ProgramSpec, result: CaseResult) -> Path:
    """The failing case as JSON: the (shrunk) spec, the method, devices and what happened."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"seed{spec.seed}-{result.method}-{result.devices}dev.json"
    path.write_text(json.dumps({"spec": json.loads(spec.to_json()), "method": result.method,
                                "devices": result.devices, "status": result.status,
                                "detail": result.detail}, indent=2) + "\n")
    return path


def campaign(specs: Iterable[ProgramSpec], methods: Sequence[str] = METHODS,
             device_counts: Sequence[int] = DEVICE_COUNTS,
             reproducers: Path | None = None,
             on_result: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """Every spec under every method on every device count; failures shrunk and written to
    ``reproducers`` (when given). ``on_result`` sees each case as it ends."""
    results = []
    for spec in specs:
        reference = serial_run(spec)
        for devices in device_counts:
            for name in methods:
                if _method(name, devices, spec) is None:
                    continue  # no such form on this many devices (a 2-D mesh of 2)
                result = run_case(spec, name, devices, reference)
                results.append(result)
                if on_result is not None:
                    on_result(result)
                if result.status in ("mismatch", "traceback") and reproducers is not None:
                    write_reproducer(reproducers, shrink_failure(spec, result), result)
    return results


def summary_table(results: Sequence[CaseResult]) -> str:
    """Markdown: per method and device count, cases by outcome; then refusals by reason."""
    keys = sorted({(r.method, r.devices) for r in results},
                  key=lambda k: (METHODS.index(k[0]) if k[0] in METHODS else 99, k[1]))
    lines = ["| method | devices | cases | match | mismatch | traceback | refused |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for method, devices in keys:
        mine = Counter(r.status for r in results if (r.method, r.devices) == (method, devices))
        lines.append(f"| {method} | {devices} | {sum(mine.values())} | {mine['match']} | "
                     f"{mine['mismatch']} | {mine['traceback']} | {mine['refused']} |")
    total = Counter(r.status for r in results)
    lines.append(f"| all | | {len(results)} | {total['match']} | {total['mismatch']} | "
                 f"{total['traceback']} | {total['refused']} |")
    refusals = Counter(reason(r) for r in results if r.status == "refused")
    if refusals:
        lines += ["", "| refusal (numbers as N) | cases |", "|---|---:|"]
        lines += [f"| {text} | {n} |" for text, n in refusals.most_common()]
    failures = [r for r in results if r.status in ("mismatch", "traceback")]
    if failures:
        lines += ["", "| seed | method | devices | outcome | detail |", "|---:|---|---:|---|---|"]
        lines += [f"| {r.seed} | {r.method} | {r.devices} | {r.status} | {r.detail} |"
                  for r in failures]
    return "\n".join(lines)


def result_rows(results: Sequence[CaseResult]) -> list[dict[str, Any]]:
    """The results as plain dicts (JSON lines)."""
    return [asdict(r) for r in results]
