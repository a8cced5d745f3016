"""Typed errors raised by autopar.

Every error a user can cause (bad option, bad mesh, bad batch, untraceable step) is an
``AutoparError``; its message is one line naming the problem and the valid choices, and the
CLI prints exactly that line and exits with status 2.
"""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class InvalidOptionError(AutoparError, ValueError):
    """An option (model, size, method, cluster, schedule, ...) is not one of the valid choices."""


class MeshError(AutoparError, ValueError):
    """A mesh shape does not match the devices it should cover."""


class BatchSizeError(AutoparError, ValueError):
    """A batch dimension is not divisible by the parallel degree that must split it."""


class CoupledBatchError(BatchSizeError):
    """The loss function mixes the examples of its batch (a batch statistic, a branch on a
    batch sum): cut into microbatches it would compute another loss, so it is not pipelined."""


class TraceError(AutoparError):
    """The train step could not be traced to a jaxpr."""


class PlanError(AutoparError, ValueError):
    """A plan is malformed, of an unknown format version, or does not match the step."""


class NoLossFunctionError(PlanError):
    """Pipelining needs the loss function marked by autopar.value_and_grad / autopar.grad."""


class NoStageFitsError(PlanError):
    """No stage assignment of a pipeline fits the memory budget; ``min_peak_bytes``: the
    least per-device memory one needs."""

    def __init__(self, message: str, min_peak_bytes: float):
        super().__init__(message)
        self.min_peak_bytes = min_peak_bytes


class CannotWinError(PlanError):
    """A full-search candidate left unfinished: its fastest plan is over the memory budget and
    already estimated no faster than a plan that fits (what is left, a memory-constrained
    solve or recomputation, only makes it slower). ``estimate_s`` and ``peak_bytes``: that
    fastest plan's."""

    def __init__(self, message: str, estimate_s: float, peak_bytes: float):
        super().__init__(message)
        self.estimate_s = estimate_s
        self.peak_bytes = peak_bytes


class DistributedError(AutoparError):
    """A multi-process run could not start or went on without a peer (coordinator not
    reachable, bad process id or address, a process gone)."""


class HloParseError(AutoparError, ValueError):
    """Compiled HLO text holds a collective (or collective attributes) in a form that
    ``autopar.runtime.hlo`` cannot parse; the message names the line."""


def choices_text(choices) -> str:
    """Format valid choices for an error message: ``a, b, c``."""
    return ", ".join(str(c) for c in choices)


def format_bytes(b: float) -> str:
    """``b`` bytes in the largest binary unit it fills, for messages and reports
    (``528.25 KiB``, ``1.50 GiB``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"
