"""Replica groups in compiled HLO: the groups a collective's ``replica_groups=`` names, in
every form XLA prints, and which axes of a device mesh a set of groups runs over
(``runtime.hlo`` reads each collective's groups with it).

Replica-group forms parsed: explicit ``{{0,1},{2,3}}``; empty ``{}`` (every device); iota
``[2,4]<=[8]`` and ``[4,2]<=[2,4]T(1,0)``; and the mesh-axes form that XLA prints in
jax 0.10, ``mesh['axis_0'=2,'axis_1'=4] {'axis_0'}``, optionally with
``, device_ids=([2,2,2]T(1,0,2))`` and sub-axes such as ``{'axis_1':(2)2}``.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence

import numpy as np

from autopar.errors import HloParseError

__all__ = ["bracket_end", "infer_mesh_axes", "parse_replica_groups"]

_IOTA_RE = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_RE = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>.*?)\))?\s*\{(?P<group>[^}]*)\}")
_AXIS_REF_RE = re.compile(r"""^\s*['"]?([^'":]+?)['"]?(?::\((\d+)\)(\d+))?\s*$""")


def _ints(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"\d+", text)]


def bracket_end(text: str, i: int, open_: str, close: str) -> int:
    """Index just past the bracket that closes ``text[i]`` (which is ``open_``)."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    raise HloParseError(f"unbalanced '{open_}' in: {text[i:i + 200]}")


def _iota(reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    array = np.arange(math.prod(reshape), dtype=np.int64).reshape(tuple(reshape))
    return array.transpose(tuple(perm)) if perm else array


def _mesh_groups(match: re.Match[str]) -> np.ndarray:
    names, sizes = [], []
    for part in match.group("axes").split(","):
        name, _, size = part.rpartition("=")
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    ids_text = (match.group("ids") or "").strip()
    if not ids_text:
        devices = np.arange(math.prod(sizes), dtype=np.int64)
    else:
        ids_text = ids_text.removeprefix("devices=")
        iota = re.fullmatch(r"(?:\[[\d,]+\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?", ids_text)
        if iota:
            devices = _iota(_ints(iota.group(1)), _ints(iota.group(2) or ""))
        else:
            devices = np.asarray(_ints(ids_text), dtype=np.int64)
    devices = devices.reshape(sizes)
    # Which (sub-)axes are grouped, per mesh dimension, in the order given.
    refs: dict[int, list[tuple[int, int] | None]] = {}
    for part in match.group("group").split(","):
        ref = _AXIS_REF_RE.match(part)
        if not ref or ref.group(1) not in names:
            raise HloParseError(f"unknown mesh axis reference '{part}' in: {match.group(0)}")
        dim = names.index(ref.group(1))
        sub = (int(ref.group(2)), int(ref.group(3))) if ref.group(2) else None
        refs.setdefault(dim, []).append(sub)
    # Reshape each referenced dimension into (pre, size, post) pieces and note the grouped ones.
    new_sizes: list[int] = []
    grouped: list[int] = []
    for dim, full in enumerate(sizes):
        subs = refs.get(dim)
        if subs is None:
            new_sizes.append(full)
            continue
        if subs == [None]:
            grouped.append(len(new_sizes))
            new_sizes.append(full)
            continue
        pairs = [s for s in subs if s is not None]
        if len(pairs) < len(subs):
            raise HloParseError(f"mesh axis used whole and split in: {match.group(0)}")
        order = sorted(range(len(pairs)), key=lambda k: pairs[k][0])
        position: dict[int, int] = {}
        prefix = 1
        for k in order:
            pre, size = pairs[k]
            if pre != prefix:
                new_sizes.append(pre // prefix)
                prefix = pre
            position[k] = len(new_sizes)
            new_sizes.append(size)
            prefix *= size
        if prefix != full:
            new_sizes.append(full // prefix)
        grouped.extend(position[k] for k in range(len(subs)))
    rest = [d for d in range(len(new_sizes)) if d not in grouped]
    group_size = math.prod(new_sizes[d] for d in grouped)
    return devices.reshape(new_sizes).transpose(rest + grouped).reshape(-1, group_size)


def parse_replica_groups(text: str) -> tuple[tuple[int, ...], ...] | None:
    """Parse the value of ``replica_groups=`` (the text right after the ``=``).

    Returns the groups, or ``None`` for the empty ``{}`` (every device is one group).
    """
    text = text.strip()
    if text.startswith("{"):
        inner = text[1:bracket_end(text, 0, "{", "}") - 1].strip()
        if not inner:
            return None
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([^{}]*)\}", inner))
    iota = _IOTA_RE.match(text)
    if iota:
        groups_shape = _ints(iota.group(1))
        array = _iota(_ints(iota.group(2)), _ints(iota.group(3) or ""))
        return tuple(tuple(int(d) for d in row) for row in array.reshape(groups_shape[0], -1))
    mesh = _MESH_RE.match(text)
    if mesh:
        return tuple(tuple(int(d) for d in row) for row in _mesh_groups(mesh))
    raise HloParseError(f"unknown replica_groups form: {text[:120]}")


def infer_mesh_axes(
    replica_groups: Sequence[Sequence[int]] | None, device_grid: np.ndarray
) -> tuple[int, ...] | None:
    """Which axes of ``device_grid`` (physical ids in mesh shape) the groups run over.

    ``None`` groups mean all devices, i.e. all axes. Returns ``None`` if no set of axes gives
    exactly these groups.
    """
    grid = np.asarray(device_grid)
    axes_all = tuple(range(grid.ndim))
    if replica_groups is None:
        return axes_all
    target = {frozenset(int(d) for d in g) for g in replica_groups}
    for size in range(1, grid.ndim + 1):
        for axes in itertools.combinations(axes_all, size):
            rest = [a for a in axes_all if a not in axes]
            rows = grid.transpose(rest + list(axes)).reshape(-1, math.prod(
                grid.shape[a] for a in axes))
            if {frozenset(int(d) for d in row) for row in rows} == target:
                return axes
    return None
