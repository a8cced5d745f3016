"""Multi-process runs on jax.distributed: the cluster learned from the processes, values moved
between processes, ShardParallel and PipeshardParallel across 2 processes x 4 simulated CPU
devices on 127.0.0.1 (the same losses and parameters as the serial step), and a dead process,
an unreachable coordinator or a run that takes too long ending with one clear line. Each
multi-process run goes through ``autopar launch`` in a subprocess with a generous timeout, a
guard against hangs only (no test compares wall-clock times: a busy machine is slow, not wrong);
its processes die with it (the launcher's children get SIGKILL when it goes)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import optax
import pytest
import repo_paths
from tanh_mlp import tanh_mlp_step

import autopar
from autopar.compiler.planners.pipeshard import plan_pipeshard
from autopar.errors import DistributedError
from autopar.ir.pieces import cut_pieces
from autopar.ir.pipeline_pieces import piece_roles
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.runtime import process_start
from autopar.runtime.distributed import host_layout, put_all
from autopar.runtime.local_cluster import local_cluster
from autopar.runtime.process_start import _local_cpu_devices, _size_cpu_thread_pool

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

REPO = repo_paths.REPO
SCRIPTS = repo_paths.DISTRIBUTED_SCRIPTS
LAUNCH = "import sys; from autopar.cli.main import main; sys.exit(main(sys.argv[1:]))"
RUN_TIMEOUT_S = 300  # per launched run; a passing one takes seconds (a minute when loaded)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(args: list[str], timeout: float = RUN_TIMEOUT_S) -> tuple[int, str]:
    """Run a command in its own session; kill the whole session if it outlives ``timeout``.
    Returns (exit status, stdout + stderr)."""
    proc = subprocess.Popen(args, env=_env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = ""
        pytest.fail(f"{args} ran past {timeout} s")
    finally:
        if proc.poll() is None:  # SIGTERM: the launcher stops its children; then SIGKILL
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return proc.returncode, out


def _launch(*command: str, processes: int = 2, timeout_s: float = 240) -> tuple[int, str]:
    # one multi-process run at a time across the suite's workers: two at once on 2 cores
    # starve each other's processes past their heartbeats
    with open(Path(tempfile.gettempdir()) / "autopar-test-launch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _run([sys.executable, "-c", LAUNCH, "launch", "--processes", str(processes),
                     "--cpu-devices", "4", "--timeout", str(timeout_s), "--", *command])


def _results(out_dir: Path, prefix: str, log: str) -> list[dict]:
    files = sorted(out_dir.glob(f"{prefix}-*.json"))
    assert len(files) == 2, log[-3000:]
    return [json.loads(f.read_text()) for f in files]


# -- the cluster the planner sees ---------------------------------------------------------------


@dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    platform: str = "cpu"


def two_hosts() -> list[FakeDevice]:
    """jax.devices() of 2 processes x 4 CPU devices, host-major (ids as JAX numbers them)."""
    return [FakeDevice(p * 2048 + i, p) for p in range(2) for i in range(4)]


def test_cluster_has_one_host_per_process_and_rejects_uneven_devices():
    cluster = local_cluster(two_hosts())
    assert (cluster.num_hosts, cluster.devices_per_host) == (2, 4)
    assert [cluster.host_of(d) for d in range(8)] == [0] * 4 + [1] * 4
    assert cluster.inter_host.bandwidth_bytes_per_s < cluster.intra_host.bandwidth_bytes_per_s
    single = local_cluster([FakeDevice(i, 0) for i in range(8)])
    assert (single.num_hosts, single.devices_per_host) == (1, 8)
    with pytest.raises(DistributedError, match="host-major"):
        host_layout(two_hosts()[:6])
    with pytest.raises(DistributedError, match="host-major"):
        host_layout(two_hosts()[::-1])


def test_stage_dp_keeps_stages_inside_hosts_and_cuts_between_them_at_the_bottleneck():
    widths, batch, micro = (64, 64, 64, 4, 64, 64, 64), 64, 4
    opt = optax.sgd(0.1)
    rng = np.random.default_rng(0)
    params = [rng.standard_normal((a, b)).astype(np.float32)
              for a, b in zip(widths[:-1], widths[1:], strict=True)]
    data = {"x": np.ones((batch, widths[0]), np.float32),
            "y": np.ones((batch, widths[-1]), np.float32)}

    step = tanh_mlp_step(opt)

    state = {"params": params, "opt": opt.init(params)}
    pp = build_pipeline_program(step, (state, data), (1,), micro)
    cluster = local_cluster(two_hosts())
    plan = plan_pipeshard(pp, autopar.PipeshardParallel(num_microbatches=micro, num_stages=2,
                                                            replicas="none"),
                          cluster)
    hosts = [{cluster.host_of(d) for d in st.device_ids} for st in plan.stages]
    assert hosts == [{0}, {1}]  # each stage inside one host, one host each

    def crossing(position: int) -> float:  # activation bytes into the second piece
        _, second = cut_pieces(pp.forward, [position])
        roles = piece_roles(pp, second)
        return sum(np.prod(pp.forward.avals[v].shape) * 4 for v in roles.acts)

    (cut,) = plan.pipeline.piece_positions
    narrow = batch // micro * 4 * 4  # a microbatch of the width-4 activation, float32
    assert crossing(cut) == narrow
    assert max(crossing(p) for p in range(1, len(pp.forward.eqns) - 1)) > 10 * narrow


def test_initialize_gives_the_cpu_client_a_spare_thread_per_local_device(monkeypatch):
    """A collective across processes holds one CPU client thread per local device while it
    waits; sends need threads too (see test_values_move_between_processes)."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                    "--xla_force_host_platform_device_count=4")  # the last counts
    # wins when set, as in JAX
    configured = process_start.jax.config.jax_num_cpu_devices
    assert _local_cpu_devices() == (configured if configured > 0 else 4)
    monkeypatch.setattr(process_start, "_local_cpu_devices", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # 2 cores
    monkeypatch.setenv("NPROC", "")
    monkeypatch.delenv("NPROC")  # restored (unset) after the test, whatever the code sets
    _size_cpu_thread_pool()
    assert os.environ["NPROC"] == "8"
    monkeypatch.setenv("NPROC", "3")  # too few, e.g. a CI's own setting
    _size_cpu_thread_pool()
    assert os.environ["NPROC"] == "8"
    monkeypatch.setenv("NPROC", "32")  # enough: kept
    _size_cpu_thread_pool()
    assert os.environ["NPROC"] == "32"
    monkeypatch.delenv("NPROC")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    _size_cpu_thread_pool()  # cores to spare: left to XLA
    assert "NPROC" not in os.environ


# -- runs across 2 processes ------------------------------------------------------------------


def test_values_move_between_processes(tmp_path):
    # also a transfer whose receiver waits for it before joining a collective the sender has
    # started: it hung on machines with no more cores than local devices until
    # autopar.runtime.distributed.initialize gave the CPU client spare threads
    rc, log = _launch(sys.executable, str(SCRIPTS / "put_check.py"), str(tmp_path))
    assert rc == 0, log[-3000:]
    for result in _results(tmp_path, "put", log):
        assert all(result.values()), result


@pytest.mark.parametrize("method", ["shard", "pipeshard"])
def test_parallel_step_across_processes_equals_serial(tmp_path, method):
    rc, log = _launch(sys.executable, str(SCRIPTS / "train_check.py"), method, str(tmp_path))
    assert rc == 0, log[-3000:]
    results = _results(tmp_path, "result", log)
    assert [r["process_id"] for r in results] == [0, 1]
    for r in results:
        assert (r["process_count"], r["devices"], r["local_devices"]) == (2, 8, 4)
        assert r["method"] == method
        # every process read the loss and the metrics with float(): they are on all devices
        assert r["metric_devices"] == [8]
        assert len(r["metrics"]) == 3
        for got, want in zip(r["metrics"], r["serial_metrics"], strict=True):
            assert set(got) == ({"loss", "grad_norm", "mean_abs_out"} if method == "pipeshard"
                                else {"loss"})
            for name in got:
                assert got[name] == pytest.approx(want[name], rel=1e-5), name
        assert r["max_param_rel_diff"] < 1e-5
    assert results[0]["metrics"] == results[1]["metrics"]
    stages = results[0]["stage_processes"]
    if method == "shard":
        assert stages == [[0, 1]]  # one global mesh over both processes
        assert results[0]["cross_process_axes_used"], "nothing split across the processes"
    else:
        assert stages == [[0], [1]]  # a stage on each process


# -- failures end the run, quickly and clearly ----------------------------------------------------


def test_a_dying_process_stops_the_run_with_one_line(tmp_path):
    rc, log = _launch(sys.executable, str(SCRIPTS / "die_check.py"))
    assert rc == 1, log[-3000:]
    assert "autopar: error: process 1 of 2 exited with code 7; stopped the other processes" \
        in log


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_coordinator_and_missing_peers_fail_fast():
    code = "import autopar; autopar.runtime.distributed.initialize(initialization_timeout=3)"
    env = _env()
    procs = {}
    for rank in (1, 0):  # process 1 finds no coordinator; process 0 waits for a peer in vain
        env.update(AUTOPAR_COORDINATOR=f"127.0.0.1:{_free_port()}", AUTOPAR_NUM_PROCESSES="2",
                   AUTOPAR_PROCESS_ID=str(rank), JAX_PLATFORMS="cpu")
        procs[rank] = subprocess.Popen([sys.executable, "-c", code], env=dict(env), cwd=REPO,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, start_new_session=True)
    try:  # a hang guard: each gives up by itself after its 3 s initialization_timeout
        outs = {rank: p.communicate(timeout=RUN_TIMEOUT_S)[0] for rank, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert procs[1].returncode != 0
    assert "DistributedError: process 1 could not reach the coordinator at 127.0.0.1:" \
        in outs[1]
    assert procs[0].returncode == 3
    assert outs[0].strip().splitlines()[-1].startswith(
        "autopar: error: process 0 of 2: the run did not start within 3 s")


def test_launch_timeout_and_usage_errors():
    rc, log = _launch(sys.executable, "-c", "import time; time.sleep(120)", timeout_s=2)
    assert rc == 124
    assert "autopar: error: the run exceeded --timeout 2 s; stopped process(es) 0, 1 of 2" in log
    rc, log = _run([sys.executable, "-c", LAUNCH, "launch", "--processes", "2"])
    assert rc == 2
    assert log.strip() == ("autopar: error: launch needs a command after '--', e.g. 'autopar "
                           "launch --processes 2 -- python train.py'")
    with pytest.raises(DistributedError, match="HOST:PORT"):
        autopar.runtime.distributed.initialize("nohost", 2, 0)
    with pytest.raises(DistributedError, match="process_id=2 is not in 0..1"):
        autopar.runtime.distributed.initialize("127.0.0.1:1234", 2, 2)


def test_put_all_moves_what_is_not_in_place_and_keeps_what_is():
    """One process: the values not where they belong are placed (one device_put of the list),
    a value already in its sharding is returned as it is, and a ``None`` sharding leaves a
    value alone (a Python scalar of the step)."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    whole, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    placed = jax.device_put(np.ones(4, np.float32), whole)
    host = np.arange(4, dtype=np.float32)
    elsewhere = jax.device_put(np.arange(4, dtype=np.float32), jax.devices()[3])
    out = put_all([placed, host, elsewhere, 3], [whole, split, whole, None])
    assert out[0] is placed and out[3] == 3
    assert out[1].sharding == split and out[2].sharding == whole
    np.testing.assert_array_equal(np.asarray(out[1]), host)
    np.testing.assert_array_equal(np.asarray(out[2]), host)

