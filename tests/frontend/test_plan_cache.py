"""The on-disk plan cache: program fingerprints, cache keys, entries on disk and bad input."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import repo_paths

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.graph.trace import trace_step
from autopar.compiler.planners.dispatch import plan_traced
from autopar.errors import InvalidOptionError
from autopar.frontend import plan_cache
from autopar.frontend.plan_cache import (
    PlanCache,
    PlanCacheWarning,
    cache_key,
    check_cache_dir,
    default_cache_dir,
    program_fingerprint,
)
from autopar.ir.flatten import flatten_step
from autopar.models import get_model
from autopar.plan import FORMAT_VERSION
from autopar.runtime.local_cluster import local_cluster

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

ROOT = repo_paths.REPO

# ------------------------------------------------------------------ steps -----------------


def _make_step(act=jnp.tanh, inner=jnp.tanh, scale: float = 1.0, out: str = "tuple"):
    """A small step with a closed-over constant, a scan (a nested jaxpr param), a custom_jvp
    (relu) and a checkpoint with a policy (a callable param)."""
    table = np.arange(8, dtype=np.float32) * scale

    def step(params, batch):
        def loss(w):
            h = act(jax.nn.relu(batch["x"] @ w)) + table

            def body(c, row):
                c = jax.checkpoint(lambda a: inner(a) * 2.0,
                                   policy=jax.checkpoint_policies.nothing_saveable)(c + row)
                return c, c.sum()

            c, sums = jax.lax.scan(body, jnp.zeros(8), h)
            return (c.sum() + sums.sum() - batch["y"].sum()) ** 2

        value, grad = jax.value_and_grad(loss)(params["w"])
        new = {"w": params["w"] - 0.1 * grad}
        if out == "dict":
            return {"params": new, "loss": value}
        return [new, value] if out == "list" else (new, value)

    return step


def _args(batch: int = 4, dtype=jnp.float32):
    params = {"w": jax.ShapeDtypeStruct((16, 8), dtype)}
    data = {"x": jax.ShapeDtypeStruct((batch, 16), dtype),
            "y": jax.ShapeDtypeStruct((batch,), dtype)}
    return params, data


def reference_fingerprint() -> str:
    """The fingerprint the cross-process test recomputes in a fresh interpreter."""
    return program_fingerprint(flatten_step(_make_step(), _args()))


@pytest.fixture(scope="module")
def plan():
    model = get_model("mlp", "tiny")
    traced = trace_step(model.train_step, model.abstract_inputs())
    return plan_traced(traced, autopar.DataParallel(), local_cluster(), batch_argnums=(1,))


# ------------------------------------------------------------------ fingerprint -----------


def test_two_traces_of_one_step_have_one_fingerprint():
    first = flatten_step(_make_step(), _args())
    second = flatten_step(_make_step(), _args())
    assert first is not second and first.eqns[0] is not second.eqns[0]
    assert program_fingerprint(first) == program_fingerprint(second)
    assert len(program_fingerprint(first)) == 64


@pytest.mark.parametrize(
    "changed",
    [
        pytest.param(lambda: flatten_step(_make_step(), _args(batch=8)), id="shape"),
        pytest.param(lambda: flatten_step(_make_step(), _args(dtype=jnp.bfloat16)), id="dtype"),
        pytest.param(lambda: flatten_step(_make_step(scale=2.0), _args()), id="constant"),
        pytest.param(lambda: flatten_step(_make_step(act=jnp.sin), _args()), id="primitive"),
        pytest.param(lambda: flatten_step(_make_step(inner=jnp.sin), _args()), id="in-scan"),
        pytest.param(lambda: flatten_step(_make_step(out="dict"), _args()), id="out-dict"),
        pytest.param(lambda: flatten_step(_make_step(out="list"), _args()), id="out-list"),
    ],
)
def test_fingerprint_changes_with_the_program(changed):
    assert program_fingerprint(changed()) != program_fingerprint(
        flatten_step(_make_step(), _args())
    )


def test_a_list_output_has_the_paths_of_a_tuple_output():
    # so out-list above is told apart by the tree structure alone
    as_list = flatten_step(_make_step(out="list"), _args())
    as_tuple = flatten_step(_make_step(), _args())
    assert as_list.out_paths == as_tuple.out_paths
    assert str(as_list.out_tree) != str(as_tuple.out_tree)


def test_fingerprint_sees_weak_type_and_masks_addresses():
    program = flatten_step(_make_step(), _args())
    base = program_fingerprint(program)
    vid = program.in_ids[0]
    weak = dataclasses.replace(
        program, avals={**program.avals, vid: program.avals[vid].update(weak_type=True)}
    )
    assert program_fingerprint(weak) != base

    def with_param(value):
        eqn = dataclasses.replace(program.eqns[0], params={**program.eqns[0].params, "p": value})
        return dataclasses.replace(program, eqns=[eqn, *program.eqns[1:]])

    # two distinct objects whose reprs differ only by address (as across processes)
    assert "0x" in repr(object())
    assert program_fingerprint(with_param(object())) == program_fingerprint(with_param(object()))
    assert program_fingerprint(with_param(object())) != base
    # a dict param hashes the same whatever its insertion order
    assert program_fingerprint(with_param({"a": 1, "b": 2})) == program_fingerprint(
        with_param({"b": 2, "a": 1}))
    assert program_fingerprint(with_param({"a": 1})) != program_fingerprint(with_param({"a": 2}))
    # numpy integers in params (broadcast_dimensions) mean what ints mean
    assert program_fingerprint(with_param((np.int64(0), np.int64(2)))) == program_fingerprint(
        with_param((0, 2)))
    # a nested closed jaxpr prints its constants as names: their values must count too
    bodies = [jax.make_jaxpr(lambda x, c=c: x * c)(jnp.ones(3))
              for c in (jnp.arange(3.0), jnp.arange(3.0), jnp.arange(3.0) * 2)]
    assert str(bodies[0]) == str(bodies[2])
    prints = [program_fingerprint(with_param(b)) for b in bodies]
    assert prints[0] == prints[1] != prints[2]


def test_fingerprint_is_equal_in_another_process():
    code = "import test_plan_cache as t; print('FP=' + t.reference_fingerprint())"
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        PYTHONHASHSEED="12345",  # a different string-hash order than this process (random)
        PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(__file__).resolve().parent),
                                    str(repo_paths.SUPPORT)]),
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("FP=")]
    assert lines == ["FP=" + reference_fingerprint()]


# ------------------------------------------------------------------ keys -------------------


def _key(**changes):
    args = dict(method=autopar.DataParallel(), cluster=local_cluster(), batch_argnums=(1,),
                devices=jax.devices(), extra=None)
    fingerprint = changes.pop("fingerprint", "a" * 64)
    args.update(changes)
    return cache_key(fingerprint, **args)


def test_equal_inputs_give_equal_keys():
    assert _key() == _key()
    assert _key(method=autopar.ShardParallel(time_limit_s=5.0)) == _key(
        method=autopar.ShardParallel(time_limit_s=5.0))
    assert len(_key()) == 64 and int(_key(), 16) >= 0


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({"fingerprint": "b" * 64}, id="fingerprint"),
        pytest.param({"method": autopar.ShardParallel()}, id="method"),
        pytest.param({"method": autopar.DataParallel(mesh_shape=(2, 4))}, id="method-option"),
        pytest.param({"cluster": load_cluster("cpu-sim").with_devices(2, 4)}, id="cluster"),
        pytest.param({"batch_argnums": (0, 1)}, id="batch-argnums"),
        pytest.param({"devices": jax.devices()[:4]}, id="devices"),
        pytest.param({"devices": None}, id="no-devices"),
        pytest.param({"extra": {"num_microbatches": 2}}, id="extra"),
    ],
)
def test_keys_differ_when_an_input_differs(changes):
    assert _key(**changes) != _key()


def test_key_depends_on_option_values_and_the_autopar_version(monkeypatch):
    assert _key(method=autopar.ShardParallel(time_limit_s=5.0)) != _key(
        method=autopar.ShardParallel(time_limit_s=6.0))
    before = _key()
    monkeypatch.setattr(plan_cache, "__version__", "0.0.0-other")
    assert _key() != before


# ------------------------------------------------------------------ entries ----------------


def test_put_then_get_round_trips(tmp_path, plan):
    cache = PlanCache(tmp_path / "plans")
    key = _key()
    assert cache.get(key) is None  # a miss is silent (no warning: errors would fail it below)
    cache.put(key, plan)
    entry = json.loads((tmp_path / "plans" / f"{key}.json").read_text())
    assert entry["key"] == key and entry["format_version"] == FORMAT_VERSION
    assert entry["autopar_version"] == autopar.__version__ and entry["created"]
    # a fresh instance (another process) reads what this one wrote
    got = PlanCache(tmp_path / "plans").get(key)
    assert got is not None and got.to_dict() == plan.to_dict()
    assert sorted(p.name for p in (tmp_path / "plans").iterdir()) == [f"{key}.json"]


def _valid_entry(key, plan):
    return {"key": key, "autopar_version": autopar.__version__,
            "format_version": FORMAT_VERSION, "created": "x", "plan": plan.to_dict()}


CORRUPTIONS = {
    "garbage-bytes": lambda key, plan: b"\xff\xfe\x00\x81 not json",
    "truncated": lambda key, plan: json.dumps(_valid_entry(key, plan)).encode()[:200],
    "wrong-shape": lambda key, plan: b"[1, 2, 3]",
    "plan-not-object": lambda key, plan: json.dumps(
        _valid_entry(key, plan) | {"plan": "P()"}).encode(),
    "other-key": lambda key, plan: json.dumps(_valid_entry("0" * 64, plan)).encode(),
    "other-version": lambda key, plan: json.dumps(
        _valid_entry(key, plan) | {"autopar_version": "0.0.0-old"}).encode(),
    "other-format": lambda key, plan: json.dumps(
        _valid_entry(key, plan) | {"format_version": FORMAT_VERSION + 1}).encode(),
    "bad-plan": lambda key, plan: json.dumps(
        _valid_entry(key, plan) | {"plan": plan.to_dict() | {"stages": [{"index": 0}]}}).encode(),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_bad_entry_is_ignored_with_a_warning_and_removed(tmp_path, plan, kind):
    cache = PlanCache(tmp_path)
    key = _key()
    entry = tmp_path / f"{key}.json"
    entry.write_bytes(CORRUPTIONS[kind](key, plan))
    with pytest.warns(PlanCacheWarning) as record:
        assert cache.get(key) is None
    assert len(record) == 1
    message = str(record[0].message)
    assert "\n" not in message and str(entry) in message
    assert not entry.exists()
    # and the next put / get work again
    cache.put(key, plan)
    assert cache.get(key).to_dict() == plan.to_dict()


def _unwritable_dir(tmp_path: Path) -> tuple[Path, Path | None]:
    """A directory puts cannot write, and the directory to chmod back (None: none chmodded):
    an existing read-only one, or as root (chmod does not stop root) a path under a file."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        (locked / "probe").touch()
    except OSError:
        return locked, locked
    locked.chmod(0o700)
    (tmp_path / "file.txt").write_text("a file, not a directory")
    return tmp_path / "file.txt" / "sub", None


def test_put_into_an_unwritable_directory_warns_once_and_does_not_raise(tmp_path, plan):
    target, locked = _unwritable_dir(tmp_path)
    try:
        cache = PlanCache(target)
        with pytest.warns(PlanCacheWarning) as record:
            assert cache.get(_key()) is None
            cache.put(_key(), plan)
            cache.put(_key(fingerprint="c" * 64), plan)
            assert cache.get(_key()) is None
        assert len(record) == 1  # one problem, one line: not one per step
        message = str(record[0].message)
        assert "\n" not in message and str(target) in message
        with pytest.raises(InvalidOptionError, match="cache=False"):
            check_cache_dir(target)
    finally:
        if locked is not None:
            locked.chmod(0o700)


def test_a_failed_write_leaves_no_temporary_file(tmp_path, plan, monkeypatch):
    cache = PlanCache(tmp_path)
    cache.put(_key(), plan)  # an entry to overwrite

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.warns(PlanCacheWarning, match="No space left on device"):
        cache.put(_key(), plan)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{_key()}.json"]
    assert cache.get(_key()).to_dict() == plan.to_dict()  # the old entry is intact


def test_put_leaves_only_entries_behind(tmp_path, plan):
    cache = PlanCache(tmp_path / "a" / "b")  # created on demand
    keys = [_key(fingerprint=c * 64) for c in "def"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on the happy path
        for key in keys:
            cache.put(key, plan)
        cache.put(keys[0], plan)  # overwriting is fine too
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == sorted(
        f"{k}.json" for k in keys)


def test_keys_that_are_not_file_names_are_refused(tmp_path, plan):
    cache = PlanCache(tmp_path)
    for bad in ("../escape", "a/b", "", "x" * 200):
        with pytest.raises(ValueError, match="invalid plan cache key"):
            cache.get(bad)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ directories -----------


def test_check_cache_dir_refuses_a_path_under_a_file(tmp_path):
    afile = tmp_path / "file.txt"
    afile.write_text("x")
    for bad in (afile / "sub", afile):
        with pytest.raises(InvalidOptionError) as info:
            check_cache_dir(bad)
        message = str(info.value)
        assert "\n" not in message and f"'{bad}'" in message and "cache=False" in message
    good = check_cache_dir(tmp_path / "new" / "dir")
    assert good == tmp_path / "new" / "dir" and good.is_dir()
    assert list(good.iterdir()) == []  # the write probe is cleaned up


def test_check_cache_dir_tries_a_real_write(tmp_path, monkeypatch):
    # an existing directory that refuses files (what chmod 0o500 is to a non-root user)
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    with pytest.raises(InvalidOptionError, match=r"is not usable: Permission denied; pass"):
        check_cache_dir(tmp_path)


def test_default_cache_dir_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    assert PlanCache().directory == tmp_path / "explicit"
    monkeypatch.delenv("AUTOPAR_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "autopar" / "plans"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = (Path("Library/Caches") if sys.platform == "darwin" else Path(".cache"))
    assert default_cache_dir() == tmp_path / "home" / expected / "autopar" / "plans"
