"""How much of a GPU's peak a matrix multiplication reaches, by its shape.

A GPU runs a GEMM as a grid of output tiles, one thread block each, and its multiprocessors
(SMs) take the tiles in *waves*: a GEMM whose tiles leave the last wave part empty, or whose
dimensions are not whole tiles, pays for the empty places as if they worked (NVIDIA, "Matrix
Multiplication Background User's Guide", chapter 3: tile and wave quantization). So a small or
skinny GEMM, or one split over many devices, reaches less of the peak than a large one: the
fraction is ``wave_efficiency``. The rest of what separates a large GEMM from the peak is the
cluster's ``compute_efficiency``.

A CPU's GEMMs have a rate of their own (``DeviceSpec.gemm_flops``): ``fit_gemm_flops`` reads
it off ``autopar profile``'s timed matmuls.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from autopar.calibration_samples import MatmulSample

if TYPE_CHECKING:
    from autopar.cluster import DeviceSpec

# The output tile one thread block computes (cuBLAS's common 128 x 128 tile on Volta, Ampere
# and Hopper; the guide lists 256 x 128 down to 64 x 64, larger for large GEMMs): square, so
# which operand's free dimensions form the rows does not matter.
TILE = 128

# What a loop of a GEMM is to its output tiles: rows and columns are the tile grid's sides,
# batch multiplies the number of tiles, contracting runs inside each tile.
ROWS, COLUMNS, BATCH, CONTRACTING = "rows", "columns", "batch", "contracting"


def wave_efficiency(rows: int, columns: int, batch: int, multiprocessors: int) -> float:
    """The fraction of the tile places in every wave that compute something: the GEMM's
    ``rows x columns`` output (``batch`` times) over the ``TILE``-square tiles it needs,
    rounded up to whole waves of ``multiprocessors`` tiles. 1.0 where ``multiprocessors`` is 0
    (the device's SMs not described: a CPU, a calibrated description)."""
    if multiprocessors <= 0 or rows <= 0 or columns <= 0 or batch <= 0:
        return 1.0
    tiles = math.ceil(rows / TILE) * math.ceil(columns / TILE) * batch
    waves = math.ceil(tiles / multiprocessors)
    return rows * columns * batch / (waves * multiprocessors * TILE * TILE)


def dot_loops(lhs_shape: Sequence[int], rhs_shape: Sequence[int],
              dimension_numbers: tuple) -> list[tuple[str, int, tuple[tuple[int, int], ...]]]:
    """The loops of a ``dot_general`` in output order: its batch pairs, the lhs's free
    dimensions (rows), the rhs's (columns), then the contracting pairs; each as (role, size,
    the (operand, dimension) pairs it runs over). The output's dimensions are the
    non-contracting loops in this order."""
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
    loops: list[tuple[str, int, tuple[tuple[int, int], ...]]] = [
        (BATCH, lhs_shape[lb], ((0, lb), (1, rb))) for lb, rb in zip(lhs_b, rhs_b, strict=True)]
    loops += [(ROWS, lhs_shape[d], ((0, d),)) for d in range(len(lhs_shape))
              if d not in lhs_c and d not in lhs_b]
    loops += [(COLUMNS, rhs_shape[d], ((1, d),)) for d in range(len(rhs_shape))
              if d not in rhs_c and d not in rhs_b]
    loops += [(CONTRACTING, lhs_shape[lc], ((0, lc), (1, rc)))
              for lc, rc in zip(lhs_c, rhs_c, strict=True)]
    return loops


def dot_efficiency(lhs_shape: Sequence[int], rhs_shape: Sequence[int],
                   dimension_numbers: tuple, parts: int, multiprocessors: int) -> float:
    """``wave_efficiency`` of a ``dot_general`` run ``parts`` ways by splitting its batch:
    the loop that carries the lhs's leading dimension (a batch of activations: rows in the
    forward, contracting in a weight's gradient) is cut ``parts`` ways where it divides, else
    the rhs's; where neither divides, the whole GEMM's. The one-stage planners that split
    only the batch price a dot so (the ILP's strategies know each loop's split)."""
    loops = dot_loops(lhs_shape, rhs_shape, dimension_numbers)
    sizes = [size for _, size, _ in loops]
    if parts > 1:
        for leading in ((0, 0), (1, 0)):
            cut = [k for k, (_, size, dims) in enumerate(loops)
                   if leading in dims and size % parts == 0]
            if cut:
                sizes[cut[0]] //= parts
                break
    return gemm_efficiency(sizes, [role for role, _, _ in loops], multiprocessors)


def gemm_efficiency(sizes: Sequence[int], roles: Sequence[str], multiprocessors: int) -> float:
    """``wave_efficiency`` of a GEMM whose loops (per device) have ``sizes`` and ``roles``."""
    extent = {ROWS: 1, COLUMNS: 1, BATCH: 1, CONTRACTING: 1}
    for size, role in zip(sizes, roles, strict=True):
        extent[role] *= int(size)
    return wave_efficiency(extent[ROWS], extent[COLUMNS], extent[BATCH], multiprocessors)


def described_gemm_time_s(flops: float, device: DeviceSpec, dtype: str) -> float | None:
    """Seconds of a GEMM of ``flops`` on a device that describes its GEMM rate for ``dtype``
    (``DeviceSpec.gemm_flops``, with the fixed ``gemm_threading_s`` of spreading it over
    the host's cores), or None where it does not. The caller takes the faster of this and
    the general rate: a small GEMM runs on one core without the threading's cost."""
    rate = device.gemm_flops.get(dtype)
    if not rate:
        return None
    return flops / rate + device.gemm_threading_s


def fit_peak_flops(matmuls: Sequence[MatmulSample]) -> dict[str, float]:
    """Per dtype, the best rate attained with every device busy (single-device samples only
    where a dtype has no concurrent ones)."""
    out: dict[str, float] = {}
    for dtype in dict.fromkeys(m.dtype for m in matmuls):
        rows = [m for m in matmuls if m.dtype == dtype and m.seconds > 0]
        busy = [m for m in rows if m.concurrent] or rows
        if busy:
            out[dtype] = max(m.flops_per_s for m in busy)
    return out


def gemm_source(matmuls: Sequence[MatmulSample]) -> str:
    """Where ``fit_gemm_flops``' rate comes from, for a calibrated file's notes."""
    layers = {(m.m, m.k, m.n) for m in matmuls if m.gemms > 1 and m.concurrent}
    if not layers:
        return "best matmul rate"
    return (f"median rate of a dense layer's three GEMMs (forward and both gradients) at "
            f"{len(layers)} sizes, rows x inputs x outputs "
            + ", ".join(f"{m}x{k}x{n}" for m, k, n in sorted(layers)) + ",")


def fit_gemm_flops(matmuls: Sequence[MatmulSample]) -> dict[str, float]:
    """Per dtype, the rate a CPU step's GEMMs reach: the median of the dense layers' (their
    three GEMMs timed as one, every device busy) over their sizes, where there are any; else
    ``fit_peak_flops``. A step's GEMMs span sizes and forms, and a CPU reaches its best rate
    only on the largest squares: with 8 devices on 2 cores the dense layers reached 19-36
    GF/s per device and a 512^3 square 37 (2026-12-07)."""
    out = fit_peak_flops(matmuls)
    for dtype in out:
        rates = sorted(m.flops_per_s for m in matmuls
                       if m.dtype == dtype and m.concurrent and m.gemms > 1 and m.seconds > 0)
        if rates:
            out[dtype] = statistics.median(rates)
    return out
