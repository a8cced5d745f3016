"""An on-disk plan cache: a step is planned once per program, method, cluster and devices.

An entry is ``<directory>/<key>.json``, plain JSON (never pickle): the key, the autopar and plan
format versions, the creation time and ``Plan.to_dict()``. Entries are written atomically (a
temporary file in the same directory, then ``os.replace``). A corrupt or stale entry is reported
with one ``PlanCacheWarning`` line, removed and planned again; an unusable directory is reported
once per cache and caching is skipped. The cache never fails a step.

A temporary file is named ``.autopar-tmp.<host>.<pid>.<key>.<random>.tmp``. A writer interrupted
by an exception (Ctrl-C) removes its own; one killed mid-write (SIGKILL, or SIGTERM's default
action, which runs no ``finally``) cannot, so a cache removes, on its first use, the temporary
files of writers on this host that are no longer running (another host's writers are left
alone: their process ids mean nothing here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import hashlib
import json
import os
import re
import socket
import sys
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from autopar.cluster import ClusterSpec
from autopar.errors import InvalidOptionError, PlanError
from autopar.ir.program import FlatProgram
from autopar.plan import FORMAT_VERSION, Plan
from autopar.version import __version__

# Reprs carry memory addresses (``<function f at 0x7f3a...>``) that differ between processes
# and say nothing about the program: they are masked before hashing.
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
# Keys become file names, so nothing that could leave the directory is accepted.
_KEY = re.compile(r"[0-9A-Za-z_-]{1,128}")
# The temporary file of an entry being written names its writer's host and process id.
_TEMP_PREFIX = ".autopar-tmp."
_TEMP = re.compile(re.escape(_TEMP_PREFIX) + r"(?P<host>[0-9A-Za-z_-]+)\.(?P<pid>[0-9]+)\..*\.tmp")


class PlanCacheWarning(UserWarning):
    """A cache entry was ignored (corrupt, stale) or the cache directory is unusable."""


def default_cache_dir() -> Path:
    """``$AUTOPAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/autopar/plans``, else the user cache
    directory (``~/Library/Caches`` on macOS, ``~/.cache`` elsewhere) + ``autopar/plans``."""
    if os.environ.get("AUTOPAR_CACHE_DIR"):
        return Path(os.environ["AUTOPAR_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec says relative values are to be ignored
        return Path(xdg) / "autopar" / "plans"
    base = Path.home() / ("Library/Caches" if sys.platform == "darwin" else ".cache")
    return base / "autopar" / "plans"


def _mask(text: str) -> str:
    return _ADDRESS.sub("0x?", text)


def _array_digest(value: Any) -> list[Any]:
    """dtype, shape and a hash of the bytes: constants can be large, their digest is not."""
    arr = np.ascontiguousarray(np.asarray(value))
    return ["array", str(arr.dtype), list(arr.shape), hashlib.sha256(arr.tobytes()).hexdigest()]


def _canon(obj: Any) -> Any:
    """A JSON-able, process-independent description of an equation parameter or value."""
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj  # (json keeps 1.0 apart from 1, and writes nan/inf as NaN/Infinity)
    if isinstance(obj, jcore.ClosedJaxpr):
        # the printed text names constvars, not their values: those are hashed alongside
        return ["closed_jaxpr", _mask(str(obj.jaxpr)), [_array_digest(c) for c in obj.consts]]
    if isinstance(obj, jcore.Jaxpr):
        return ["jaxpr", _mask(str(obj))]
    if isinstance(obj, np.integer | np.bool_):  # broadcast_dimensions may hold np.int64(0)
        return obj.item()  # exact; a value's dtype is hashed with its aval anyway
    if isinstance(obj, np.dtype):
        return ["dtype", str(obj)]
    if isinstance(obj, np.ndarray | np.generic):
        return _array_digest(obj)
    if isinstance(obj, enum.Enum):
        return ["enum", type(obj).__qualname__, obj.name]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # NamedTuple: keep field names
        return [type(obj).__qualname__, {f: _canon(getattr(obj, f)) for f in obj._fields}]
    if isinstance(obj, list | tuple):
        return [type(obj).__name__, [_canon(x) for x in obj]]
    if isinstance(obj, Mapping):  # sorted: insertion order is not part of the program
        return ["dict", sorted(([_canon(k), _canon(v)] for k, v in obj.items()), key=json.dumps)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _canon(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return [type(obj).__qualname__, fields]
    if hasattr(obj, "shape") and hasattr(obj, "dtype") and hasattr(obj, "__array__"):
        return _array_digest(obj)  # a concrete jax.Array, a literal's TypedNdArray
    if callable(obj) and hasattr(obj, "__qualname__"):
        # name and source line, not the address (two lambdas of one scope differ by line)
        code = getattr(obj, "__code__", None)
        where = None if code is None else [code.co_filename, code.co_firstlineno]
        return ["callable", f"{getattr(obj, '__module__', '')}.{obj.__qualname__}", where]
    return ["object", type(obj).__qualname__, _mask(repr(obj))]


def _aval(aval: Any) -> list[Any]:
    if getattr(aval, "shape", None) is None:  # a token or another value without a shape
        return ["other", _mask(str(aval))]
    return [list(aval.shape), str(aval.dtype), bool(getattr(aval, "weak_type", False))]


def program_fingerprint(program: FlatProgram) -> str:
    """sha256 (hex) of a canonical description of ``program``: every equation (primitive,
    params, operand/result ids, context), every value's aval, kind and (constants, literals)
    value, the input/output ids and paths, the pytree structures. Equal for two traces of one
    step, in this process or another; ``name_stack`` (provenance only) is left out."""
    h = hashlib.sha256()

    def feed(*part: Any) -> None:  # one JSON line per part: never one huge string
        h.update(json.dumps(part, sort_keys=True, separators=(",", ":")).encode() + b"\n")

    feed("autopar-flat-program", 1)
    for eqn in program.eqns:
        params = {str(k): _canon(v) for k, v in eqn.params.items()}
        context = None if eqn.context is None else _mask(repr(eqn.context))
        feed("eqn", eqn.index, eqn.name, params, list(eqn.inputs), list(eqn.outputs), context)
    for vid in sorted(program.avals):
        value = _canon(program.values[vid]) if vid in program.values else None
        feed("value", vid, _aval(program.avals[vid]), program.kinds.get(vid), value)
    feed("in", list(program.in_ids), list(program.in_paths))
    feed("out", list(program.out_ids), list(program.out_paths))
    feed("trees", _mask(str(program.in_tree)), _mask(str(program.out_tree)))
    feed("arg_leaf_ranges", [list(r) for r in program.arg_leaf_ranges])
    return h.hexdigest()


def _autopar_version() -> str:
    return __version__


def _device(device: Any) -> Any:
    if hasattr(device, "platform") and hasattr(device, "id"):
        return [device.platform, str(getattr(device, "device_kind", "")), int(device.id)]
    return str(device)


def cache_key(program_fingerprint: str, *, method: object, cluster: ClusterSpec,
              batch_argnums: tuple[int, ...], devices: Sequence[Any] | None,
              extra: dict | None = None) -> str:
    """sha256 (hex) naming the plan for this program fingerprint, method (type and options),
    cluster, batch arguments and devices (``jax.Device`` objects or strings), made by this
    autopar (and plan format, and JAX) version. ``extra``: anything else a plan depends on
    (JSON-able; other values count by ``str``)."""
    if not dataclasses.is_dataclass(method) or isinstance(method, type):
        raise TypeError(f"method must be a method dataclass instance, got {method!r}")
    document = {
        "fingerprint": program_fingerprint,
        "method": [f"{type(method).__module__}.{type(method).__qualname__}",
                   dataclasses.asdict(method)],
        "cluster": cluster.to_dict(),
        "batch_argnums": [int(i) for i in batch_argnums],
        "devices": None if devices is None else [_device(d) for d in devices],
        "extra": extra,
        "autopar_version": _autopar_version(),
        "plan_format_version": FORMAT_VERSION,
        "jax_version": jax.__version__,  # it decides how a step traces and lowers
    }
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def check_cache_dir(path: str | os.PathLike) -> Path:
    """The directory a user asked for, created if needed; ``InvalidOptionError`` (one line)
    when it is not a directory or cannot be created or written."""
    directory = Path(path).expanduser()

    def fail(reason: str) -> InvalidOptionError:
        return InvalidOptionError(f"cache directory '{directory}' is not usable: {reason}; "
                                  "pass another directory or cache=False")

    if directory.exists() and not directory.is_dir():
        raise fail("it is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # a real write: os.access says yes to root, and knows nothing of quotas
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as exc:
        raise fail(exc.strerror or type(exc).__name__) from None
    return directory


def _decode_entry(raw: bytes, key: str) -> Plan:
    """The plan in an entry file; ``PlanError`` saying why for a corrupt or stale entry."""
    try:
        entry = json.loads(raw)  # from bytes: invalid UTF-8 is a ValueError too
    except ValueError as exc:
        raise PlanError(f"not valid JSON ({type(exc).__name__})") from None
    if not isinstance(entry, dict) or not isinstance(entry.get("plan"), dict):
        raise PlanError("not a plan cache entry")
    if entry.get("key") != key:
        raise PlanError("its stored key does not match its file name")
    version, fmt = entry.get("autopar_version"), entry.get("format_version")
    if version != _autopar_version() or fmt != FORMAT_VERSION:
        raise PlanError(f"stale (autopar {version!r}, plan format {fmt!r})")
    try:
        return Plan.from_dict(entry["plan"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # PlanError included
        raise PlanError(f"invalid plan ({type(exc).__name__}: {exc})") from None


def _host() -> str:
    """This host's name as it appears in temporary file names."""
    return re.sub(r"[^0-9A-Za-z_-]", "-", socket.gethostname())[:64] or "host"


def _running(pid: int) -> bool:
    """Whether process ``pid`` of this host is still running (a zombie is not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: an existence check, nothing is sent
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it runs, as another user
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:  # Linux: state Z is a zombie
            return fh.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


class PlanCache:
    """Plans on disk, one JSON file per key. ``get`` and ``put`` never raise for disk or data
    problems: they warn (``PlanCacheWarning``, one line) and behave as a miss."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory or default_cache_dir()).expanduser()
        self._warned: set[str] = set()  # problems reported once per cache, not per step
        self._swept = False

    def _sweep(self) -> None:
        """Once per cache: remove the temporary files that writers on this host left behind
        when they died mid-write (their process is gone). Never raises."""
        if self._swept:
            return
        self._swept = True
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        host = _host()
        for name in names:
            m = _TEMP.fullmatch(name)
            if m and m["host"] == host and not _running(int(m["pid"])):
                with contextlib.suppress(OSError):
                    os.unlink(self.directory / name)

    def path(self, key: str) -> Path:
        """The entry file for ``key`` (``ValueError`` for a key unfit for a file name)."""
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"invalid plan cache key {key!r}")
        return self.directory / f"{key}.json"

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, PlanCacheWarning, stacklevel=3)

    def get(self, key: str) -> Plan | None:
        """The cached plan for ``key``, or None (missing, unreadable, corrupt or stale)."""
        path = self.path(key)
        self._sweep()
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._warn_once("directory", f"cannot read plan cache entry '{path}': "
                                         f"{exc.strerror or exc}; planning again")
            return None
        try:
            return _decode_entry(raw, key)
        except PlanError as exc:
            reason = (str(exc).strip().splitlines() or ["?"])[0]
            warnings.warn(f"ignoring plan cache entry '{path}': {reason}; planning again",
                          PlanCacheWarning, stacklevel=2)
            with contextlib.suppress(OSError):  # if it stays, the next put overwrites it
                path.unlink()
            return None

    def put(self, key: str, plan: Plan) -> None:
        """Store ``plan`` under ``key`` atomically; on a disk problem warn once and go on."""
        path = self.path(key)
        created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        entry = {"key": key, "autopar_version": _autopar_version(),
                 "format_version": FORMAT_VERSION, "created": created, "plan": plan.to_dict()}
        try:
            text = json.dumps(entry, indent=1)
        except (TypeError, ValueError) as exc:  # e.g. an option value JSON cannot hold
            self._warn_once("encode", f"plan not cached: it is not JSON-serialisable ({exc})")
            return
        tmp: str | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._sweep()
            prefix = f"{_TEMP_PREFIX}{_host()}.{os.getpid()}.{key[:16]}."
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=prefix, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, path)  # a reader sees the old entry or the new one, never half
            tmp = None
        except OSError as exc:
            self._warn_once("directory", f"plan cache directory '{self.directory}' is not "
                                         f"writable ({exc.strerror or exc}); plans are not cached")
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
