"""Cluster descriptions: the hardware a plan is made for.

A :class:`ClusterSpec` describes hardware: hosts, devices per host, one device type (peak flops
per dtype, memory) and two links (inside a host, between hosts). Shipped descriptions live in
``autopar/clusters/NAME.json``; :func:`load_cluster` also reads any JSON file of the same
layout, so a user can plan for a cluster they do not have. ``autopar profile`` writes one from
measurements of the present devices (``autopar.calibration_samples``).

Link bandwidths are per device and per direction: the bandwidth one device can push into the
link while all devices of its group do the same (the "one link per worker" of the cost model).

Plain data shared by the compiler (which costs plans on it), the decorator (which describes
the local devices) and the calibration; nothing here touches devices or imports JAX.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from dataclasses import field as dataclass_field
from importlib import resources
from pathlib import Path
from typing import Any

from autopar.errors import InvalidOptionError, MeshError, choices_text

__all__ = [
    "ClusterSpec",
    "DeviceSpec",
    "LinkSpec",
    "RuntimeCosts",
    "available_clusters",
    "format_mesh_shape",
    "load_cluster",
    "parse_mesh_shape",
]

_CLUSTER_PACKAGE = "autopar"
_CLUSTER_DIR = "clusters"
_FALLBACK_DTYPE = "float32"


def _need(data: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(data, Mapping):
        field = where.rstrip(".") or "cluster"
        raise InvalidOptionError(f"bad field '{field}': expected an object, got {data!r}")
    if key not in data:
        raise InvalidOptionError(f"missing field '{where}{key}'")
    return data[key]


def _number(value: Any, field: str, *, positive: bool = True, integer: bool = False) -> Any:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    if ok and positive:
        ok = value > 0
    elif ok:
        ok = value >= 0
    if not ok:
        kind = "a positive integer" if integer else "a positive number" if positive else (
            "a non-negative number")
        raise InvalidOptionError(f"bad field '{field}': {value!r} is not {kind}")
    return int(value) if integer else float(value)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator type.

    ``peak_flops`` maps a dtype name (``"float32"``, ``"tf32"``, ``"bfloat16"``, ``"float16"``,
    ...) to the dense peak rate in flop/s; ``memory_bytes`` is the device memory;
    ``memory_bandwidth_bytes_per_s`` its peak bandwidth (the datasheet's), against which
    the cost model prices the bytes each op's kernel reads and writes (0: not described, each
    op priced by its flops alone); ``multiprocessors`` its streaming multiprocessors (the
    datasheet's SM count), which take a matrix multiplication's output tiles in waves
    (``cost.gemm``: 0, not described, prices every GEMM at the same fraction of the peak);
    ``kernel_launch_s`` the fixed seconds each kernel the device runs costs beside its work
    (its launch and the threads' start: 0, not described), which decides small steps'
    time; ``gemm_flops`` (per dtype; empty, not described) the flop/s a large matrix
    multiplication reaches where that is far above what ``peak_flops`` and the cluster's
    efficiency give other ops (a CPU's vectorised GEMM on every core of its host), and
    ``gemm_threading_s`` what spreading one GEMM over those cores costs: a GEMM is priced at
    the faster of that and the general rate (``cost.gemm.described_gemm_time_s``);
    ``host_link_bytes_per_s`` its link to its host's memory per direction (PCIe: 0, not
    described, offers no optimizer state off the device, ``cost.host_state``).
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float = 0.0
    multiprocessors: int = 0
    kernel_launch_s: float = 0.0
    gemm_flops: Mapping[str, float] = dataclass_field(default_factory=dict)
    gemm_threading_s: float = 0.0
    host_link_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        if _FALLBACK_DTYPE not in self.peak_flops:
            raise InvalidOptionError(
                f"device '{self.name}': peak_flops needs a '{_FALLBACK_DTYPE}' entry")
        object.__setattr__(self, "peak_flops", {str(k): float(v)
                                                for k, v in self.peak_flops.items()})
        object.__setattr__(self, "gemm_flops", {str(k): float(v)
                                                for k, v in self.gemm_flops.items()})

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.peak_flops.items())), self.memory_bytes,
                     self.memory_bandwidth_bytes_per_s, self.multiprocessors,
                     self.kernel_launch_s, tuple(sorted(self.gemm_flops.items())),
                     self.gemm_threading_s, self.host_link_bytes_per_s))

    def flops_for(self, dtype: Any) -> float:
        """Peak flop/s for ``dtype`` (a name or a numpy/JAX dtype); float32 if it is unknown."""
        key = str(getattr(dtype, "name", dtype))
        if key in self.peak_flops:
            return float(self.peak_flops[key])
        return float(self.peak_flops[_FALLBACK_DTYPE])

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        out: dict[str, Any] = {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "memory_bytes": self.memory_bytes,
        }
        if self.memory_bandwidth_bytes_per_s:
            out["memory_bandwidth_bytes_per_s"] = self.memory_bandwidth_bytes_per_s
        if self.multiprocessors:
            out["multiprocessors"] = self.multiprocessors
        if self.kernel_launch_s:
            out["kernel_launch_s"] = self.kernel_launch_s
        if self.gemm_flops:
            out["gemm_flops"] = dict(self.gemm_flops)
            out["gemm_threading_s"] = self.gemm_threading_s
        if self.host_link_bytes_per_s:
            out["host_link_bytes_per_s"] = self.host_link_bytes_per_s
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "") -> DeviceSpec:
        """Inverse of :meth:`to_dict`; ``where`` prefixes field names in error messages."""
        name = str(_need(data, "name", where))
        flops = _need(data, "peak_flops", where)
        if not isinstance(flops, Mapping) or _FALLBACK_DTYPE not in flops:
            raise InvalidOptionError(
                f"bad field '{where}peak_flops': needs at least a '{_FALLBACK_DTYPE}' entry")
        peak = {str(k): _number(v, f"{where}peak_flops.{k}") for k, v in flops.items()}
        memory = _number(_need(data, "memory_bytes", where), f"{where}memory_bytes",
                         integer=True)
        bandwidth = _number(data.get("memory_bandwidth_bytes_per_s", 0.0),
                            f"{where}memory_bandwidth_bytes_per_s", positive=False)
        multiprocessors = _number(data.get("multiprocessors", 0), f"{where}multiprocessors",
                                  integer=True, positive=False)
        launch = _number(data.get("kernel_launch_s", 0.0), f"{where}kernel_launch_s",
                         positive=False)
        gemm = data.get("gemm_flops", {})
        if not isinstance(gemm, Mapping):
            raise InvalidOptionError(f"bad field '{where}gemm_flops': needs a mapping of "
                                     "dtype names to flop/s")
        gemm_flops = {str(k): _number(v, f"{where}gemm_flops.{k}") for k, v in gemm.items()}
        threading = _number(data.get("gemm_threading_s", 0.0), f"{where}gemm_threading_s",
                            positive=False)
        host_link = _number(data.get("host_link_bytes_per_s", 0.0),
                            f"{where}host_link_bytes_per_s", positive=False)
        return cls(name=name, peak_flops=peak, memory_bytes=memory,
                   memory_bandwidth_bytes_per_s=bandwidth, multiprocessors=multiprocessors,
                   kernel_launch_s=launch, gemm_flops=gemm_flops, gemm_threading_s=threading,
                   host_link_bytes_per_s=host_link)


@dataclass(frozen=True)
class LinkSpec:
    """A link in the alpha-beta model: per-direction bandwidth and per-message latency."""

    bandwidth_bytes_per_s: float
    latency_s: float

    @property
    def alpha(self) -> float:
        """Latency per message round, seconds."""
        return self.latency_s

    @property
    def beta(self) -> float:
        """Seconds per byte (1 / bandwidth)."""
        return 1.0 / self.bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, float]:
        """JSON-able form."""
        return {"bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "latency_s": self.latency_s}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "") -> LinkSpec:
        """Inverse of :meth:`to_dict`; ``where`` prefixes field names in error messages."""
        bw = _number(_need(data, "bandwidth_bytes_per_s", where), f"{where}bandwidth_bytes_per_s")
        lat = _number(_need(data, "latency_s", where), f"{where}latency_s", positive=False)
        return cls(bandwidth_bytes_per_s=bw, latency_s=lat)


@dataclass(frozen=True)
class RuntimeCosts:
    """What the runtime itself costs on these devices, beside the program's compute and
    communication (docs/cost-model.md, "The runtime's own costs").

    ``call_s``: one call of a jitted program over all devices (a one-stage step pays one);
    ``task_s``: one pipeline task launched by the driver (a stage's forward or backward, a
    segment of the update, a microbatch slice: every jitted call or eager operation the
    driver issues, one after the other on the host); ``transfer_s``: the fixed cost of one
    ``jax.device_put`` of a value to another stage (its bytes go over the links as usual);
    ``accumulate_bytes_per_s``: gradient bytes per second added into the accumulator (one read
    of each operand, one write: memory bandwidth over three); ``buffer_s``: each device buffer
    a one-stage step's call takes in or hands back (JAX's dispatch handles each of them);
    ``feed_s``: each device's piece of a batch array the call places from the host.
    Older cluster files have no ``runtime`` entry: they get these defaults, GPU figures (see
    docs/cost-model.md for their sources)."""

    call_s: float = 10e-6
    task_s: float = 10e-6
    transfer_s: float = 10e-6
    accumulate_bytes_per_s: float = 300e9
    buffer_s: float = 0.0
    feed_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("call_s", "task_s", "transfer_s", "buffer_s", "feed_s"):
            _number(getattr(self, name), f"runtime.{name}", positive=False)
        _number(self.accumulate_bytes_per_s, "runtime.accumulate_bytes_per_s")

    def to_dict(self) -> dict[str, float]:
        """JSON-able form."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, where: str = "runtime.") -> RuntimeCosts:
        """Inverse of :meth:`to_dict`; a missing entry (or a missing field) takes the
        default; an unknown field is an error naming it."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise InvalidOptionError(f"bad field '{where.rstrip('.')}': expected an object, "
                                     f"got {data!r}")
        known = set(cls().to_dict())
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidOptionError(f"unknown field '{where}{unknown[0]}'; valid: "
                                     f"{choices_text(sorted(known))}")
        values = {}
        for name in known:
            if name in data:
                values[name] = _number(data[name], f"{where}{name}",
                                       positive=name == "accumulate_bytes_per_s")
        return cls(**values)


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster: ``num_hosts`` hosts of ``devices_per_host`` identical devices.

    Device ``i`` lives on host ``i // devices_per_host``.
    """

    name: str
    description: str
    num_hosts: int
    devices_per_host: int
    device: DeviceSpec
    intra_host: LinkSpec
    inter_host: LinkSpec
    compute_efficiency: float
    source: str = ""
    notes: str = ""
    runtime: RuntimeCosts = RuntimeCosts()

    def __post_init__(self) -> None:
        for field in ("num_hosts", "devices_per_host"):
            value = getattr(self, field)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise InvalidOptionError(
                    f"cluster '{self.name}': {field} must be a positive integer, got {value!r}")
            object.__setattr__(self, field, int(value))
        if not 0.0 < self.compute_efficiency <= 1.0:
            raise InvalidOptionError(
                f"cluster '{self.name}': compute_efficiency must be in (0, 1], "
                f"got {self.compute_efficiency!r}")

    @property
    def num_devices(self) -> int:
        """Total number of devices."""
        return self.num_hosts * self.devices_per_host

    def host_of(self, device_id: int) -> int:
        """Index of the host holding physical device ``device_id``."""
        if not 0 <= device_id < self.num_devices:
            raise MeshError(
                f"device {device_id} is not in cluster '{self.name}' "
                f"(devices 0..{self.num_devices - 1})")
        return device_id // self.devices_per_host

    def with_hosts(self, num_hosts: int) -> ClusterSpec:
        """The same cluster with ``num_hosts`` hosts."""
        return replace(self, num_hosts=num_hosts)

    def with_devices(self, num_hosts: int, devices_per_host: int) -> ClusterSpec:
        """The same cluster with ``num_hosts`` hosts of ``devices_per_host`` devices each."""
        return replace(self, num_hosts=num_hosts, devices_per_host=devices_per_host)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (the layout of the shipped cluster files)."""
        return {
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "notes": self.notes,
            "num_hosts": self.num_hosts,
            "devices_per_host": self.devices_per_host,
            "device": self.device.to_dict(),
            "intra_host": self.intra_host.to_dict(),
            "inter_host": self.inter_host.to_dict(),
            "compute_efficiency": self.compute_efficiency,
            "runtime": self.runtime.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterSpec:
        """Inverse of :meth:`to_dict`; raises :class:`InvalidOptionError` naming a bad field."""
        if not isinstance(data, Mapping):
            raise InvalidOptionError(f"a cluster must be a JSON object, got {type(data).__name__}")
        return cls(
            name=str(_need(data, "name", "")),
            description=str(data.get("description", "")),
            num_hosts=_number(_need(data, "num_hosts", ""), "num_hosts", integer=True),
            devices_per_host=_number(_need(data, "devices_per_host", ""), "devices_per_host",
                                     integer=True),
            device=DeviceSpec.from_dict(_need(data, "device", ""), "device."),
            intra_host=LinkSpec.from_dict(_need(data, "intra_host", ""), "intra_host."),
            inter_host=LinkSpec.from_dict(_need(data, "inter_host", ""), "inter_host."),
            compute_efficiency=_number(_need(data, "compute_efficiency", ""),
                                       "compute_efficiency"),
            source=str(data.get("source", "")),
            notes=str(data.get("notes", "")),
            runtime=RuntimeCosts.from_dict(data.get("runtime")),
        )


def available_clusters() -> tuple[str, ...]:
    """Names of the shipped cluster descriptions, sorted."""
    folder = resources.files(_CLUSTER_PACKAGE).joinpath(_CLUSTER_DIR)
    names = [p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json")]
    return tuple(sorted(names))


def load_cluster(name_or_path: str | Path) -> ClusterSpec:
    """Load a shipped cluster by name (see :func:`available_clusters`) or a cluster JSON file."""
    text_name = str(name_or_path)
    shipped = available_clusters()
    if text_name in shipped:
        resource = resources.files(_CLUSTER_PACKAGE).joinpath(_CLUSTER_DIR, f"{text_name}.json")
        where, text = text_name, resource.read_text(encoding="utf-8")
    else:
        path = Path(text_name)
        if not (text_name.endswith(".json") or path.is_file()):
            raise InvalidOptionError(
                f"unknown cluster '{text_name}'; valid clusters: {choices_text(shipped)} "
                "(or a path to a cluster JSON file)")
        if not path.is_file():
            raise InvalidOptionError(f"cluster file '{text_name}' does not exist")
        where, text = text_name, path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidOptionError(f"cluster file '{where}' is not valid JSON: {err}") from None
    try:
        return ClusterSpec.from_dict(data)
    except InvalidOptionError as err:
        raise InvalidOptionError(f"cluster '{where}': {err}") from None


_SHAPE_RE = re.compile(r"^\s*(\d+)\s*(?:[xX×]\s*(\d+)\s*)*$")


def parse_mesh_shape(text: str) -> tuple[int, ...]:
    """``"8"`` -> ``(8,)``, ``"2x4"`` -> ``(2, 4)``; raises :class:`MeshError` on garbage."""
    if not isinstance(text, str) or not _SHAPE_RE.match(text):
        raise MeshError(f"invalid mesh shape '{text}'; expected AxB such as 2x4, or N")
    dims = tuple(int(part) for part in re.split(r"[xX×]", text.strip()))
    if any(d < 1 for d in dims):
        raise MeshError(f"invalid mesh shape '{text}'; every dimension must be positive")
    return dims


def format_mesh_shape(shape: Sequence[int]) -> str:
    """``(2, 4)`` -> ``"2x4"``."""
    return "x".join(str(d) for d in shape)
