"""Calibration samples: what ``autopar profile`` measures on the present devices.

Timed collectives, matmuls and runtime operations, as plain data: the runtime measures them
(``runtime/calibrate.py``) and the compiler's fit turns them into a ``ClusterSpec``
(``compiler/cost/calibration_fit.py``), so neither half imports the other. Nothing here
touches devices or imports JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CALIBRATED_KINDS", "CollectiveSample", "MatmulSample", "RuntimeSample"]

# The collectives `autopar profile` times (collective-permute is one round: nothing to fit).
CALIBRATED_KINDS: tuple[str, ...] = (
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all",
)


@dataclass(frozen=True)
class CollectiveSample:
    """One timed collective: ``kind`` over axis ``axis`` of mesh ``mesh`` (``"2x4"``, ``"y"``), a
    group of ``group_size`` devices, ``nbytes`` in the cost model's full-tensor convention;
    ``seconds``: the median time of one call of a program holding just that collective (the
    call's dispatch included: the fit takes it out, see :func:`fit_link`)."""

    kind: str
    mesh: str
    axis: str
    group_size: int
    nbytes: float
    seconds: float

    @property
    def label(self) -> str:
        """``"2x4:y"``."""
        return f"{self.mesh}:{self.axis}"


@dataclass(frozen=True)
class MatmulSample:
    """One timed ``m x k`` by ``k x n`` matmul in ``dtype``; ``concurrent``: every device ran one
    at the same time (``seconds`` is then the time of the slowest, i.e. of the whole call).
    ``gemms`` 3: a dense layer's three GEMMs as a training step runs them (``m`` rows of
    ``k`` inputs by a ``k x n`` kernel; then the input's gradient from the output's, through
    the kernel transposed, and the kernel's, through the input transposed), timed as one."""

    dtype: str
    m: int
    n: int
    k: int
    seconds: float
    concurrent: bool
    gemms: int = 1

    @property
    def flops(self) -> float:
        """``2 m n k`` per GEMM, as :mod:`autopar.compiler.graph.op_costs` counts a matmul."""
        return 2.0 * self.m * self.n * self.k * self.gemms

    @property
    def flops_per_s(self) -> float:
        """Attained rate of one device."""
        return self.flops / self.seconds


@dataclass(frozen=True)
class RuntimeSample:
    """One timed runtime operation (``autopar profile``): ``kind`` is ``call`` (an empty
    jitted program over ``devices`` devices), ``task`` (an empty jitted program on one
    device, as a pipeline task is launched), ``transfer`` (``jax.device_put`` of ``nbytes``
    to another device), ``accumulate`` (a donated ``acc + g`` of ``nbytes``), ``stream`` (an
    element-wise kernel of ``nbytes`` per device on every device at once), ``all-reduces``
    (one program of ``count`` links over ``devices`` devices, each a small matmul and an
    all-reduce of ``nbytes``, one after the other), ``links`` (the same program without its
    all-reduces), ``buffers`` (a program over ``devices`` devices passing ``count`` small
    arrays through, donated), ``feeds`` (a program reading ``count`` small arrays split over
    ``devices`` devices, given from the default device) or ``placed`` (the same, given
    split); ``seconds``: the median of the timed calls."""

    kind: str
    devices: int
    nbytes: float
    seconds: float
    count: int = 1
