"""``autopar profile``: the fit recovers known links, a real profile on the 8 simulated devices
gives a cluster file that loads and plans, and the command's errors are one line."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.calibration_samples import (
    CALIBRATED_KINDS,
    CollectiveSample,
    MatmulSample,
    RuntimeSample,
)
from autopar.cli.main import main
from autopar.cli.profile import calibrate_profile
from autopar.cluster import ClusterSpec, load_cluster
from autopar.compiler.cost.calibration_fit import (
    FitOptions,
    calibrate_cluster,
    fit_all,
    fit_in_program_latency,
    fit_link,
    fit_memory_bandwidth,
    model_time,
)
from autopar.compiler.cost.collectives import allreduce_time, collective_time
from autopar.compiler.cost.estimate import roofline_time_s
from autopar.compiler.cost.gemm import described_gemm_time_s, fit_gemm_flops
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.errors import InvalidOptionError
from autopar.frontend.planning import plan_train_step
from autopar.runtime.calibrate import (
    ALL_REDUCE_CHAINS,
    BUFFER_COUNTS,
    ProfileOptions,
    default_mesh_shapes,
    profile_devices,
    size_range,
)

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

ALPHA, BETA, DISPATCH = 20e-6, 1e-10, 500e-6  # 20 us per round, 10 GB/s, 0.5 ms per call
AXES = (("2x4", "x", 2), ("2x4", "y", 4), ("8", "x", 8))
SIZES = size_range(4 << 10, 16 << 20)


def synthetic(kinds=CALIBRATED_KINDS, noise=0.02, seed=0, alpha=ALPHA, beta=BETA):
    """Samples timed by the cost model's own formulas, plus dispatch and relative noise."""
    rng = np.random.default_rng(seed)
    return [CollectiveSample(kind, mesh, axis, n, float(m),
                             (DISPATCH + model_time(kind, m, n, alpha, beta))
                             * (1 + noise * rng.standard_normal()))
            for kind in kinds for mesh, axis, n in AXES for m in SIZES]


MATMULS = [MatmulSample("float32", 256, 256, 256, 2 * 256**3 / 4e9, concurrent=True),
           MatmulSample("float32", 256, 256, 256, 2 * 256**3 / 30e9, concurrent=False),
           MatmulSample("bfloat16", 256, 256, 256, 2 * 256**3 / 2e9, concurrent=True)]


# ---- (a) the fit, on samples the model itself generated ----

@pytest.mark.parametrize("kind", CALIBRATED_KINDS)
def test_fit_recovers_alpha_and_beta_of_each_kind(kind):
    fit = fit_link(synthetic([kind]), kind)
    # an all-to-all on 8 devices moves 7/64 of its bytes per device: beta is the least sure
    assert fit.alpha == pytest.approx(ALPHA, rel=0.15)
    assert fit.beta == pytest.approx(BETA, rel=0.1)
    assert fit.dispatch_s == pytest.approx(DISPATCH, rel=0.1) and fit.dispatch_fitted
    assert fit.group_sizes == (2, 4, 8) and fit.num_samples == len(AXES) * len(SIZES)
    assert fit.rms_rel_error < 0.04  # the 2 % noise, not a misfit


def test_fit_is_exact_without_noise_and_all_reduce_switches_algorithm():
    # alpha large enough that small all-reduces go butterfly and large ones ring: the fit must
    # re-pick the cheapest algorithm per sample to come out exact
    samples = synthetic(["all-reduce"], noise=0.0, alpha=100e-6)
    fit = fit_link(samples, "all-reduce")
    assert fit.alpha == pytest.approx(100e-6, rel=1e-6)
    assert fit.beta == pytest.approx(BETA, rel=1e-6)
    assert fit.rms_rel_error < 1e-9


def test_joint_fit_over_every_kind_and_per_axis_fits():
    samples = synthetic()
    fits = fit_all(samples)
    joint = fits[-1]
    assert (joint.kind, joint.axis, joint.num_samples) == ("all", "all", len(samples))
    assert joint.alpha == pytest.approx(ALPHA, rel=0.15)
    assert joint.beta == pytest.approx(BETA, rel=0.05)
    # per kind: the fit over all axes, then one per axis, which takes that kind's dispatch
    # (within one axis every sample has the same rounds: alpha and a constant are one column)
    assert len(fits) == len(CALIBRATED_KINDS) * (1 + len(AXES)) + 1
    for fit in fits[:-1]:
        if fit.axis != "all":
            assert not fit.dispatch_fitted and fit.group_sizes in ((2,), (4,), (8,))
            assert fit.beta == pytest.approx(BETA, rel=0.2)


def test_relative_errors_keep_alpha_when_large_messages_dominate():
    # at 100 MB/s (CPU-like) a 16 MiB sample takes ~100x a 4 KiB one: fitted in seconds, its
    # 2 % noise swamps alpha and the dispatch; fitted in relative errors, both survive
    relative, seconds = [], []
    for seed in range(5):
        samples = synthetic(beta=1e-8, seed=seed)
        relative.append(abs(fit_link(samples).alpha / ALPHA - 1))
        seconds.append(abs(fit_link(samples, relative=False).alpha / ALPHA - 1))
    assert max(relative) < 0.25
    assert max(seconds) > 0.5


def test_fit_stays_non_negative():
    # pure latency (beta ~ 0) and pure bandwidth (alpha = 0): neither comes out negative
    for alpha, beta in ((0.0, BETA), (ALPHA, 1e-18)):
        fit = fit_link(synthetic(alpha=alpha, beta=beta, seed=3))
        assert fit.alpha >= 0 and fit.beta > 0 and fit.dispatch_s >= 0
    assert fit_link(synthetic(alpha=0.0, seed=3)).alpha < 2e-6


def test_calibrated_cluster_plugs_straight_back_into_the_cost_model():
    samples = synthetic(noise=0.0)
    cal = calibrate_cluster(samples, MATMULS, load_cluster("cpu-sim"), num_devices=8,
                            name="calibrated-test-8", device_name="test", source="test")
    cluster = cal.cluster
    assert (cluster.num_hosts, cluster.devices_per_host) == (1, 8)
    assert cluster.intra_host == cluster.inter_host
    assert cluster.compute_efficiency == 1.0
    # the concurrent float32 rate (not the single-device one); bfloat16 as measured; float64
    # keeps cpu-sim's ratio to float32 (25/50)
    rates = cluster.device.peak_flops
    assert rates["float32"] == pytest.approx(4e9) and rates["bfloat16"] == pytest.approx(2e9)
    assert rates["float64"] == pytest.approx(2e9)
    assert cluster.device.memory_bytes == load_cluster("cpu-sim").device.memory_bytes
    mesh = LogicalMesh.from_cluster(cluster, (2, 4))
    for s in samples:
        axis = 0 if (s.mesh, s.axis) == ("2x4", "x") else 1
        one_d = LogicalMesh.from_cluster(cluster, (8,))
        m, a = (one_d, 0) if s.mesh == "8" else (mesh, axis)
        predicted = collective_time(s.kind, s.nbytes, m, a)
        assert predicted == pytest.approx(s.seconds - DISPATCH, rel=1e-6, abs=1e-12)


def test_a_cpu_calibration_gives_its_matmul_rate_to_gemms_alone():
    """On a CPU the matmul rate is a GEMM's (``gemm_flops``): every other op keeps the base's
    rate and efficiency, and a GEMM is priced at the measured rate."""
    base = load_cluster("cpu-sim")
    cal = calibrate_cluster(synthetic(noise=0.0), MATMULS, base, num_devices=8,
                            name="calibrated-test-8", device_name="test", source="test",
                            gemm_only=True)
    device = cal.cluster.device
    assert device.gemm_flops["float32"] == pytest.approx(4e9)
    assert device.gemm_flops["bfloat16"] == pytest.approx(2e9)
    assert device.peak_flops == base.device.peak_flops
    assert cal.cluster.compute_efficiency == base.compute_efficiency
    assert described_gemm_time_s(4e9, device, "float32") == pytest.approx(
        1.0 + base.device.gemm_threading_s)
    assert "gemm_flops: best matmul rate" in cal.cluster.notes
    # written and read back as the same description
    assert ClusterSpec.from_dict(cal.cluster.to_dict()) == cal.cluster


def test_a_cpus_gemm_rate_is_the_median_of_its_dense_layers():
    """Where the profile timed dense layers (three GEMMs each, every device busy), a CPU's
    GEMM rate is their median over sizes: not the best square's, which a step's GEMMs reach
    only at the largest sizes; the notes say which."""
    def layer(m, rate):
        flops = 3 * 2.0 * m * m // 4 * m
        return MatmulSample("float32", m, m, m // 4, flops / rate, concurrent=True, gemms=3)

    matmuls = MATMULS + [layer(128, 1e9), layer(256, 3e9), layer(512, 5e9)]
    assert fit_gemm_flops(matmuls)["float32"] == pytest.approx(3e9)
    assert fit_gemm_flops(matmuls)["bfloat16"] == pytest.approx(2e9)  # no layers: the best
    assert fit_gemm_flops(MATMULS)["float32"] == pytest.approx(4e9)
    cal = calibrate_cluster(synthetic(noise=0.0), matmuls, load_cluster("cpu-sim"),
                            num_devices=8, name="calibrated-test-8", device_name="test",
                            source="test", gemm_only=True)
    assert cal.cluster.device.gemm_flops["float32"] == pytest.approx(3e9)
    assert "median rate of a dense layer's three GEMMs" in cal.cluster.notes
    assert "128x32x128, 256x64x256, 512x128x512" in cal.cluster.notes


def test_the_memory_bandwidth_is_the_slope_between_two_element_wise_kernels():
    # 300 us of call and kernel overhead, then 2 GB/s per device
    streams = [RuntimeSample("stream", 8, b, 3e-4 + b / 2e9) for b in (5e5, 8e6)]
    assert fit_memory_bandwidth(streams) == pytest.approx(2e9)
    assert fit_memory_bandwidth(streams[:1]) is None
    assert fit_memory_bandwidth([RuntimeSample("stream", 8, 5e5, 1e-3),
                                 RuntimeSample("stream", 8, 8e6, 1e-3)]) is None
    base = load_cluster("cpu-sim")
    with_streams = calibrate_cluster(synthetic(noise=0.0), MATMULS, base, num_devices=8,
                                     name="a", device_name="d", source="s", runtime=streams)
    without = calibrate_cluster(synthetic(noise=0.0), MATMULS, base, num_devices=8,
                                name="a", device_name="d", source="s")
    assert with_streams.cluster.device.memory_bandwidth_bytes_per_s == pytest.approx(2e9)
    assert without.cluster.device.memory_bandwidth_bytes_per_s == \
        base.device.memory_bandwidth_bytes_per_s
    # an element-wise op is then priced by its bytes, which its flops alone underprice
    mesh = LogicalMesh.from_cluster(with_streams.cluster, (8,))
    flops_only = LogicalMesh.from_cluster(without.cluster, (8,))
    nbytes, flops = 8e6, 1e6
    assert roofline_time_s(flops, nbytes, mesh, "float32") == pytest.approx(nbytes / 2e9)
    assert roofline_time_s(flops, nbytes, flops_only, "float32") == pytest.approx(flops / 4e9)


def test_the_in_program_latency_is_the_all_reduce_chains_slope():
    """Programs of 17 and of 9 small all-reduces over 8 devices (300 us of call, 40 us each):
    the alpha under which the model prices one such all-reduce at 40 us goes into the
    cluster; the per-call fit's alpha (the dispatch taken out) does not."""
    reduces = [RuntimeSample("all-reduces", 8, 64.0, 3e-4 + k * 40e-6, count=k)
               for k in (9, 17)]
    alpha = fit_in_program_latency(reduces, BETA)
    assert alpha is not None and alpha > 0
    assert allreduce_time(64.0, 8, alpha, BETA) == pytest.approx(40e-6, rel=1e-9)
    assert fit_in_program_latency(reduces[:1], BETA) is None
    flat = [RuntimeSample("all-reduces", 8, 64.0, 1e-4, count=k) for k in (9, 17)]
    assert fit_in_program_latency(flat, BETA) is None  # no slope: not measured
    # each link's matmul (12 us), timed without its all-reduce, is taken off the slope
    working = [RuntimeSample("all-reduces", 8, 64.0, 3e-4 + k * 52e-6, count=k)
               for k in (9, 17)]
    links = [RuntimeSample("links", 8, 64.0, 3e-4 + k * 12e-6, count=k) for k in (9, 17)]
    assert fit_in_program_latency(working + links, BETA) == pytest.approx(alpha, rel=1e-9)
    assert fit_in_program_latency(working, BETA) > alpha
    base = load_cluster("cpu-sim")
    fitted = calibrate_cluster(synthetic(noise=0.0), MATMULS, base, num_devices=8, name="a",
                               device_name="d", source="s", runtime=reduces)
    plain = calibrate_cluster(synthetic(noise=0.0), MATMULS, base, num_devices=8, name="a",
                              device_name="d", source="s")
    assert fitted.cluster.intra_host.latency_s == pytest.approx(alpha)
    assert plain.cluster.intra_host.latency_s == pytest.approx(plain.link.alpha)
    assert "latency_s: the alpha" in fitted.cluster.notes
    # a step's small all-reduce on the fitted cluster costs what the chain measured
    mesh = LogicalMesh.from_cluster(fitted.cluster, (8,))
    assert collective_time("all-reduce", 64.0, mesh, 0) == pytest.approx(40e-6, rel=1e-6)


def test_link_from_one_kind_and_bad_options():
    samples = synthetic(seed=1) + [
        CollectiveSample("all-to-all", "2x4", "y", 4, float(m), 1e-3 + m * 1e-8)
        for m in SIZES]
    joint = calibrate_cluster(samples, MATMULS, load_cluster("cpu-sim"), num_devices=8,
                              name="a", device_name="d", source="s")
    reduce_only = calibrate_cluster(samples, MATMULS, load_cluster("cpu-sim"), num_devices=8,
                                    name="a", device_name="d", source="s",
                                    options=FitOptions(link_from="all-reduce"))
    assert reduce_only.link.kind == "all-reduce" and reduce_only.link.axis == "all"
    assert reduce_only.link.beta == pytest.approx(BETA, rel=0.05)
    assert joint.link.kind == "all" and joint.link.beta != reduce_only.link.beta
    with pytest.raises(InvalidOptionError, match="unknown link fit"):
        FitOptions(link_from="broadcast")
    with pytest.raises(InvalidOptionError, match="float32"):
        calibrate_cluster(samples, MATMULS[2:], load_cluster("cpu-sim"), num_devices=8,
                          name="a", device_name="d", source="s")
    with pytest.raises(InvalidOptionError, match="nothing to time"):
        fit_link([CollectiveSample("all-reduce", "1", "x", 1, 4096.0, 1e-3)])


# ---- (b) a real profile of the 8 simulated devices ----

PROFILE_SIZES = (16 << 10, 4 << 20)


@pytest.fixture(scope="module")
def profiled():
    options = ProfileOptions(sizes=PROFILE_SIZES, repeats=3, matmul_sizes=(64, 128),
                             matmul_dtypes=("float32",), dense_layers=((64, 16, 32),))
    result = profile_devices(options)
    return result, calibrate_profile(result)


def test_default_meshes():
    assert default_mesh_shapes(8) == ((2, 4), (8,))
    assert default_mesh_shapes(4) == ((2, 2), (4,))
    assert default_mesh_shapes(2) == ((2,),)
    assert size_range(4 << 10, 16 << 20) == tuple(4096 * 4**i for i in range(7))


def test_profile_times_every_kind_on_every_axis(profiled):
    result, _ = profiled
    assert result.num_devices == 8 and result.platform == "cpu"
    assert result.mesh_shapes == ((2, 4), (8,))
    seen = {(s.kind, s.label, s.group_size) for s in result.collectives}
    assert seen == {(k, label, n) for k in CALIBRATED_KINDS
                    for label, n in (("2x4:x", 2), ("2x4:y", 4), ("8:x", 8))}
    assert len(result.collectives) == len(seen) * len(PROFILE_SIZES)
    for s in result.collectives:
        # rounded to whole blocks, but still the size asked for (full-tensor convention)
        assert min(abs(s.nbytes - m) / m for m in PROFILE_SIZES) < 0.01
        # measured seconds: structure only (present, positive, finite); which size took
        # longer depends on the machine's load and belongs in the benchmark, not here
        assert math.isfinite(s.seconds) and s.seconds > 0
    assert {(m.m, m.concurrent, m.gemms) for m in result.matmuls} == {
        (64, False, 1), (64, True, 1), (128, False, 1), (128, True, 1), (64, True, 3)}
    layer = next(m for m in result.matmuls if m.gemms == 3)  # a dense layer's three GEMMs
    assert (layer.k, layer.n) == (16, 32) and layer.flops == 3 * 2 * 64 * 16 * 32
    assert all(math.isfinite(t) and t > 0 for t in result.empty_program_s.values())


def test_profile_writes_a_cluster_file_that_loads(profiled, tmp_path):
    _, cal = profiled
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cal.to_dict(), indent=2))
    cluster = load_cluster(str(path))
    assert cluster == cal.cluster
    assert cluster.name == "calibrated-cpu-8"
    assert (cluster.num_hosts, cluster.devices_per_host, cluster.num_devices) == (1, 8, 8)
    numbers = [cluster.intra_host.bandwidth_bytes_per_s, cluster.inter_host.bandwidth_bytes_per_s,
               cluster.compute_efficiency, cluster.device.memory_bytes,
               *cluster.device.peak_flops.values()]
    assert all(math.isfinite(x) and x > 0 for x in numbers)
    assert math.isfinite(cluster.intra_host.latency_s) and cluster.intra_host.latency_s >= 0
    data = json.loads(path.read_text())["calibration"]
    streams = [r for r in data["runtime_samples"] if r["kind"] == "stream"]
    assert len({r["nbytes"] for r in streams}) == 2  # the bandwidth's two sizes were timed
    for kind in ("all-reduces", "links"):  # with and without the all-reduces
        chains = [r for r in data["runtime_samples"] if r["kind"] == kind]
        # both chain lengths, one sample each (the median of their interleaved rounds)
        assert sorted(r["count"] for r in chains) == sorted(ALL_REDUCE_CHAINS)
    chains = [r for r in data["runtime_samples"] if r["kind"] == "all-reduces"]
    assert len({r["count"] for r in chains}) == 2  # the in-program latency's two lengths
    # the buffers a call passes: few and many arrays, over every device
    for kind in ("buffers", "feeds", "placed"):  # passed through; fed, and read in place
        passing = [r for r in data["runtime_samples"] if r["kind"] == kind]
        assert sorted(r["count"] for r in passing) == sorted(BUFFER_COUNTS)
        assert {r["devices"] for r in passing} == {8}
    assert data["link"]["kind"] == "all" and len(data["collective_samples"]) == 24
    assert {f["kind"] for f in data["fits"]} == {*CALIBRATED_KINDS, "all"}


# ---- (c) planning with the calibrated cluster ----

def _mlp_step():
    def loss(params, batch):
        h = jax.nn.relu(batch["x"] @ params["w1"])
        return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)

    def step(params, batch):
        grads = jax.grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    f32 = jnp.float32
    params = {"w1": jax.ShapeDtypeStruct((64, 256), f32),
              "w2": jax.ShapeDtypeStruct((256, 64), f32)}
    batch = {"x": jax.ShapeDtypeStruct((32, 64), f32), "y": jax.ShapeDtypeStruct((32, 64), f32)}
    return step, (params, batch)


def test_plans_with_the_calibrated_cluster(profiled):
    _, cal = profiled
    step, args = _mlp_step()
    method = autopar.ShardParallel(mesh_shape=(2, 4))
    planned = plan_train_step(step, args, method, cal.cluster, batch_argnums=(1,))
    plan = planned.plan
    assert plan.cluster == "calibrated-cpu-8" and plan.mesh_shape == (2, 4)
    assert math.isfinite(plan.est_step_time_s) and plan.est_step_time_s > 0
    # the calibrated numbers are what the estimate uses: a 100x faster device and link predict
    # a shorter step
    faster = ClusterSpec.from_dict(cal.to_dict() | {
        "device": cal.cluster.device.to_dict() | {"peak_flops": {
            d: r * 100 for d, r in cal.cluster.device.peak_flops.items()}},
        "intra_host": {"bandwidth_bytes_per_s": cal.cluster.intra_host.bandwidth_bytes_per_s
                       * 100, "latency_s": cal.cluster.intra_host.latency_s / 100},
    })
    quick = plan_train_step(step, args, method, faster, batch_argnums=(1,)).plan
    assert quick.est_step_time_s < plan.est_step_time_s


# ---- (d) the command ----

def test_profile_command_writes_the_file(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    argv = ["profile", "--out", str(path), "--devices", "8", "--meshes", "8",
            "--sizes", "4K-16K", "--repeats", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "all-reduce" in out and "cluster link" in out and f"wrote {path}" in out
    cluster = load_cluster(str(path))
    assert (cluster.num_hosts, cluster.devices_per_host) == (1, 8)


@pytest.mark.parametrize("extra, message", [
    (["--sizes", "16M-4K"], "runs backwards"),
    (["--sizes", "4Q"], "bad size '4Q'"),
    (["--meshes", "3x3"], "does not cover the 8 device(s)"),
    (["--meshes", "2x2x2"], "1-D or 2-D meshes"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--devices", "4"], "--devices 4 asked for after JAX started with 8 devices"),
    (["--base-cluster", "nope"], "unknown cluster 'nope'"),
])
def test_profile_bad_input_is_one_line(tmp_path, capsys, extra, message):
    assert main(["profile", "--out", str(tmp_path / "c.json"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: error: ") and message in err
    assert err.count("\n") == 1
    assert not (tmp_path / "c.json").exists()


def test_profile_unwritable_out_fails_before_timing(tmp_path, capsys):
    for out, message in ((tmp_path / "missing" / "c.json", "no directory"),
                         (tmp_path, "is a directory")):
        assert main(["profile", "--out", str(out), "--sizes", "4K"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("autopar: error: cannot write --out file") and message in err
        assert err.count("\n") == 1


def test_what_a_cpu_profile_does_not_measure_is_the_shared_devices_default(profiled):
    """A kernel's launch is not profiled: the calibrated description takes it from the
    description the local devices get without calibration (``cpu-sim`` as the devices run it
    together), as every figure it measures is timed with all the devices busy."""
    result, cal = profiled
    alone = load_cluster("cpu-sim").device.kernel_launch_s
    assert cal.cluster.device.kernel_launch_s == pytest.approx(alone * result.num_devices)
    assert "sharing the host" in cal.cluster.notes
