"""The layer clustering's two dynamic programs over cut positions (``layers.cluster_layers``):
pass 1 finds the smallest achievable largest cut with every layer's flops within a band around
the average; pass 2, among cuttings whose cuts are all at most that, the one with the least sum
of cuts, then the least sum of squared layer flops. Both read prefix sums of the nodes' flops
(``prefix[i]``: flops before boundary i) and each boundary's cut bytes.
"""

from __future__ import annotations

import numpy as np

# Relative slack on the flops cap so that prefix-sum rounding never rejects an exact fit.
_CAP_SLACK = 1e-12
# Elements per band block in the tie-break DP: bounds memory to a few tens of MB.
_BAND_BLOCK_ELEMENTS = 1 << 21


def flops_band(total: float, num_layers: int, tolerance: float) -> tuple[float, float]:
    """Fewest and most flops one layer may hold: (1 -/+ tolerance) x average.

    Alpa bounds layers only from above and relies on a minimum count of heavy ops per layer to
    stop degenerate layers; here elementwise ops carry flops too, so an upper bound alone lets
    the DP shave a cheap cut off with a one-op layer (seen on GPT: the final ``neg`` alone). The
    lower bound keeps every layer a real share of the work. Both get a little rounding slack.
    """
    average = total / num_layers
    low = (1.0 - tolerance) * average * (1.0 - _CAP_SLACK)
    high = (1.0 + tolerance) * average * (1.0 + _CAP_SLACK)
    return low, high


def _windows(prefix: np.ndarray, band: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """For each boundary i, the boundaries j (a contiguous range ``lo[i] .. hi[i]``, empty when
    ``hi < lo``) where a layer j..i may start: ``low <= prefix[i] - prefix[j] <= high``."""
    low, high = band
    lo = np.searchsorted(prefix, prefix - high, side="left")
    hi = np.searchsorted(prefix, prefix - low, side="right") - 1
    hi = np.minimum(hi, np.arange(len(prefix)) - 1)  # a layer holds at least one node
    return lo, hi


def min_max_cut(
    prefix: np.ndarray, bbytes: np.ndarray, num_layers: int, band: tuple[float, float]
) -> float:
    """Pass 1: the smallest achievable largest cut (a bottleneck DP); inf if none fits the band.

    ``best_k[i]`` = smallest largest cut over cuttings of boundaries 0..i into k layers. Layer k
    ends at i and starts at some j in the contiguous window ``lo[i] .. hi[i]``, so
    ``best_k[i] = min over the window of max(best_{k-1}[j], bytes[j])``: a range minimum,
    answered for all i at once from a sparse table -- O(H log H) per layer.
    """
    h = len(prefix) - 1
    lo, hi = _windows(prefix, band)
    best = np.where((lo == 0) & (hi >= 0), 0.0, np.inf)
    for _ in range(2, num_layers + 1):
        through = np.maximum(best, bbytes)
        through[0] = through[h] = np.inf  # a middle cut is never at the start or the end
        best = _range_min(through, lo, hi)
    return float(best[h])


def _range_min(values: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """``min(values[left[i] .. right[i]])`` for every i (inf where the range is empty)."""
    table = [values]
    width = 1
    while 2 * width <= len(values):
        prev = table[-1]
        table.append(np.minimum(prev[:-width], prev[width:]))
        width *= 2
    empty = right < left
    length = np.where(empty, 1, right - left + 1)
    level = np.floor(np.log2(length)).astype(np.int64)
    out = np.full(len(left), np.inf)
    for lvl in np.unique(level[~empty]):
        rows = np.flatnonzero((level == lvl) & ~empty)
        span = 1 << int(lvl)
        out[rows] = np.minimum(table[lvl][left[rows]], table[lvl][right[rows] - span + 1])
    return out


def min_sum_cut(
    prefix: np.ndarray,
    bbytes: np.ndarray,
    num_layers: int,
    band: tuple[float, float],
    max_cut: float,
) -> list[int]:
    """Pass 2: the cutting with every cut <= max_cut minimising (sum of cuts, sum of flops^2).

    Both keys are sums over cuts/layers, so the lexicographic pair has optimal substructure and
    the DP is exact. Reduction 2 (exact): only boundaries whose bytes are <= the optimal largest
    cut can appear, so the DP runs over that compacted list; on real models these are the few
    places where only the residual stream is live, which keeps the band below small. Each row i
    scans its window of j (a band of width W, about (1 + 2 tol) x K / L) in blocks, so the work
    is O(L x K x W) and memory stays bounded. Returns the chosen boundary indices (1..H-1).
    """
    h = len(prefix) - 1
    allowed = np.flatnonzero(bbytes <= max_cut)
    allowed = np.unique(np.concatenate(([0], allowed[(allowed > 0) & (allowed < h)], [h])))
    pref = prefix[allowed]
    cut = bbytes[allowed]
    k_count = len(allowed)
    lo, hi = _windows(pref, band)
    width = max(int(np.max(hi - lo + 1)), 1)
    sum_cost = np.where((lo == 0) & (hi >= 0), 0.0, np.inf)
    sq_cost = np.where(np.isfinite(sum_cost), pref**2, np.inf)
    parents: list[np.ndarray] = []
    block = max(_BAND_BLOCK_ELEMENTS // width, 1)
    offsets = np.arange(width)
    low, high = band
    remaining_flops = pref[-1] - pref
    for layer in range(2, num_layers + 1):
        through_sum = sum_cost + cut
        through_sum[0] = through_sum[-1] = np.inf
        new_sum = np.full(k_count, np.inf)
        new_sq = np.full(k_count, np.inf)
        parent = np.zeros(k_count, dtype=np.int64)
        # Only rows that some finite state reaches and whose remaining flops the remaining
        # layers can still hold are worth a band row: this skips most rows for middle layers.
        reached = np.concatenate(([0], np.cumsum(np.isfinite(through_sum))))
        left = num_layers - layer
        live_rows = np.flatnonzero(
            (reached[np.maximum(hi + 1, lo)] > reached[lo])
            & (remaining_flops <= left * high)
            & (remaining_flops >= left * low)
        )
        for start in range(0, len(live_rows), block):
            rows = live_rows[start : start + block]
            cols = lo[rows, None] + offsets[None, :]
            valid = cols <= hi[rows, None]
            cols = np.where(valid, cols, 0)
            cand_sum = np.where(valid, through_sum[cols], np.inf)
            layer_flops = pref[rows, None] - pref[cols]
            cand_sq = np.where(valid, sq_cost[cols] + layer_flops**2, np.inf)
            row_min = cand_sum.min(axis=1)
            cand_sq = np.where(cand_sum == row_min[:, None], cand_sq, np.inf)
            pick = cand_sq.argmin(axis=1)
            line = np.arange(len(rows))
            new_sum[rows] = row_min
            new_sq[rows] = np.where(np.isfinite(row_min), cand_sq[line, pick], np.inf)
            parent[rows] = cols[line, pick]
        sum_cost, sq_cost = new_sum, new_sq
        parents.append(parent)
    if not np.isfinite(sum_cost[-1]):  # pass 1 proved a cutting exists under max_cut
        raise AssertionError("layer clustering DP found no cutting under its own bound")
    chosen: list[int] = []
    at = k_count - 1
    for parent in reversed(parents):
        at = int(parent[at])
        chosen.append(int(allowed[at]))
    return chosen[::-1]
