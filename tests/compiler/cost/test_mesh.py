"""Cluster descriptions and logical meshes (autopar.compiler.cost.mesh)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from autopar.cluster import (
    ClusterSpec,
    DeviceSpec,
    LinkSpec,
    available_clusters,
    format_mesh_shape,
    load_cluster,
    parse_mesh_shape,
)
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.errors import InvalidOptionError, MeshError

SHIPPED = ("a100-80gb-x8", "aws-p3.16xlarge", "aws-p3.16xlarge-8nodes", "cpu-sim",
           "h100-80gb-x8")
GiB = 2**30


def test_available_clusters_lists_the_shipped_files():
    assert available_clusters() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_clusters_load_and_round_trip(name):
    cluster = load_cluster(name)
    assert cluster.name == name
    assert cluster.source and cluster.notes and cluster.description
    assert 0 < cluster.compute_efficiency <= 1
    assert cluster.device.flops_for("float32") > 0
    assert cluster.intra_host.bandwidth_bytes_per_s >= cluster.inter_host.bandwidth_bytes_per_s
    assert ClusterSpec.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster


def test_shipped_numbers_from_spec_sheets():
    p3 = load_cluster("aws-p3.16xlarge")
    assert (p3.num_hosts, p3.devices_per_host, p3.num_devices) == (1, 8, 8)
    assert p3.device.memory_bytes == 16 * GiB
    assert p3.device.flops_for("float32") == 15.7e12
    assert p3.device.flops_for("float16") == 125e12
    assert p3.inter_host.bandwidth_bytes_per_s == 25e9 / 8 / 8  # 25 Gbps NIC shared by 8 GPUs
    p3x8 = load_cluster("aws-p3.16xlarge-8nodes")
    assert (p3x8.num_hosts, p3x8.num_devices) == (8, 64)
    assert p3x8.device == p3.device
    a100 = load_cluster("a100-80gb-x8")
    assert a100.device.memory_bytes == 80 * GiB
    assert a100.device.flops_for("bfloat16") == 312e12
    assert a100.device.flops_for("tf32") == 156e12
    assert a100.inter_host.bandwidth_bytes_per_s == 200e9 / 8
    h100 = load_cluster("h100-80gb-x8")
    assert h100.device.flops_for("bfloat16") == 989.5e12
    assert h100.inter_host.bandwidth_bytes_per_s == 400e9 / 8
    assert h100.intra_host.bandwidth_bytes_per_s > a100.intra_host.bandwidth_bytes_per_s
    sim = load_cluster("cpu-sim")
    assert sim.device.memory_bytes == 4 * GiB
    assert sim.device.flops_for("float32") == 5e10
    assert sim.intra_host.latency_s == 1e-5


def test_flops_for_falls_back_to_float32():
    dev = DeviceSpec("d", {"float32": 2.0, "bfloat16": 8.0}, 10)
    assert dev.flops_for("bfloat16") == 8.0
    assert dev.flops_for("int8") == 2.0
    assert dev.flops_for(np.dtype("float32")) == 2.0
    assert hash(dev) == hash(DeviceSpec("d", {"bfloat16": 8.0, "float32": 2.0}, 10))


def test_link_beta_is_inverse_bandwidth():
    link = LinkSpec(bandwidth_bytes_per_s=4e9, latency_s=2e-6)
    assert link.beta == 0.25e-9
    assert link.alpha == 2e-6


def test_with_hosts_with_devices_and_host_of():
    p3 = load_cluster("aws-p3.16xlarge")
    four = p3.with_hosts(4)
    assert four.num_devices == 32 and p3.num_devices == 8
    assert four.host_of(0) == 0 and four.host_of(7) == 0 and four.host_of(8) == 1
    assert four.host_of(31) == 3
    small = p3.with_devices(2, 2)
    assert (small.num_hosts, small.devices_per_host, small.host_of(3)) == (2, 2, 1)
    with pytest.raises(MeshError, match="device 32 is not in cluster"):
        four.host_of(32)
    with pytest.raises(InvalidOptionError, match="num_hosts must be a positive integer"):
        p3.with_hosts(0)


def test_unknown_cluster_name_lists_choices():
    with pytest.raises(InvalidOptionError) as err:
        load_cluster("x")
    assert str(err.value) == (
        "unknown cluster 'x'; valid clusters: " + ", ".join(SHIPPED)
        + " (or a path to a cluster JSON file)")


def test_cluster_from_a_json_file(tmp_path):
    data = load_cluster("cpu-sim").with_hosts(2).to_dict()
    data["name"] = "mine"
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    cluster = load_cluster(str(path))
    assert cluster.name == "mine" and cluster.num_devices == 16


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("num_hosts"), "missing field 'num_hosts'"),
        (lambda d: d["device"].pop("memory_bytes"), "missing field 'device.memory_bytes'"),
        (lambda d: d["inter_host"].pop("latency_s"), "missing field 'inter_host.latency_s'"),
        (lambda d: d.__setitem__("devices_per_host", "eight"), "bad field 'devices_per_host'"),
        (lambda d: d["intra_host"].__setitem__("bandwidth_bytes_per_s", -1),
         "bad field 'intra_host.bandwidth_bytes_per_s'"),
        (lambda d: d["device"].__setitem__("peak_flops", {"bfloat16": 1.0}),
         "bad field 'device.peak_flops'"),
    ],
)
def test_malformed_cluster_file_names_the_field(tmp_path, edit, message):
    data = load_cluster("cpu-sim").to_dict()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidOptionError, match=message) as err:
        load_cluster(str(path))
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_bad_json_and_missing_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(InvalidOptionError, match="is not valid JSON"):
        load_cluster(str(path))
    with pytest.raises(InvalidOptionError, match="does not exist"):
        load_cluster(str(tmp_path / "nope.json"))


@pytest.mark.parametrize(("text", "shape"), [("8", (8,)), ("2x4", (2, 4)), ("1x8", (1, 8)),
                                             (" 4X2 ", (4, 2))])
def test_parse_mesh_shape(text, shape):
    assert parse_mesh_shape(text) == shape
    assert format_mesh_shape(shape) == "x".join(map(str, shape))


@pytest.mark.parametrize("text", ["abc", "", "2x", "x4", "2*4", "-2x4", "2.5"])
def test_parse_mesh_shape_rejects_garbage(text):
    with pytest.raises(MeshError) as err:
        parse_mesh_shape(text)
    assert str(err.value) == f"invalid mesh shape '{text}'; expected AxB such as 2x4, or N"


def test_parse_mesh_shape_rejects_zero():
    with pytest.raises(MeshError, match="invalid mesh shape '0x4'"):
        parse_mesh_shape("0x4")


def test_logical_mesh_inside_one_host_uses_intra_links():
    p3 = load_cluster("aws-p3.16xlarge")
    mesh = LogicalMesh.from_cluster(p3, (2, 4))
    assert mesh.axis_names == ("x", "y")
    assert mesh.num_devices == 8 and mesh.ndim == 2
    assert mesh.alpha == (5e-6, 5e-6)
    assert mesh.beta == (1 / 150e9, 1 / 150e9)
    assert mesh.device == p3.device and mesh.compute_efficiency == p3.compute_efficiency
    np.testing.assert_array_equal(mesh.device_grid(), [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert mesh.axis_size(1) == 4 and mesh.axis_size("x") == 2 and mesh.axis_index("y") == 1
    one_d = LogicalMesh.from_cluster(p3, "4")
    assert one_d.axis_names == ("x",) and one_d.device_ids == (0, 1, 2, 3)


def test_logical_mesh_across_hosts_uses_inter_link_on_that_axis():
    cluster = load_cluster("aws-p3.16xlarge-8nodes")
    intra, inter = cluster.intra_host, cluster.inter_host
    mesh = LogicalMesh.from_cluster(cluster, (8, 8), axis_names=("host", "gpu"))
    assert mesh.alpha == (inter.alpha, intra.alpha)
    assert mesh.beta == (inter.beta, intra.beta)
    flat = LogicalMesh.from_cluster(cluster, (64,))
    assert flat.beta == (inter.beta,)
    # 2 hosts x 4 GPUs each, picked explicitly: axis 0 spans hosts, axis 1 does not.
    ids = [0, 1, 2, 3, 8, 9, 10, 11]
    picked = LogicalMesh.from_cluster(cluster, (2, 4), device_ids=ids)
    assert picked.beta == (inter.beta, intra.beta)
    # Transposed picking: now axis 1 spans hosts.
    swapped = LogicalMesh.from_cluster(cluster, (4, 2), device_ids=[0, 8, 1, 9, 2, 10, 3, 11])
    assert swapped.beta == (intra.beta, inter.beta)
    # A 1-D axis of 16 devices spans two hosts.
    assert LogicalMesh.from_cluster(cluster, (16,)).beta == (inter.beta,)
    # A size-1 axis never crosses a host.
    assert LogicalMesh.from_cluster(cluster, (1, 8)).beta == (intra.beta, intra.beta)


@pytest.mark.parametrize(
    ("shape", "ids", "message"),
    [
        ((2, 4), [0, 1, 2], "mesh shape 2x4 needs 8 devices but 3 device ids were given"),
        ((4, 4), None, "mesh shape 4x4 needs 16 devices but cluster 'aws-p3.16xlarge' has 8"),
        ((0, 4), None, "mesh shape 0x4 has a non-positive dimension"),
        ((2, 2, 2), None, "mesh shape 2x2x2 has 3 dimensions"),
        ((2,), [0, 9], "device ids [9] are outside cluster 'aws-p3.16xlarge'"),
        ((2,), [1, 1], "contain duplicates"),
    ],
)
def test_logical_mesh_errors(shape, ids, message):
    with pytest.raises(MeshError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        LogicalMesh.from_cluster(load_cluster("aws-p3.16xlarge"), shape, device_ids=ids)
    assert "\n" not in str(err.value)


def test_logical_mesh_round_trip_and_hash():
    mesh = LogicalMesh.from_cluster(load_cluster("cpu-sim"), (2, 2), device_ids=[4, 5, 6, 7],
                                    axis_names=("data", "model"))
    again = LogicalMesh.from_dict(json.loads(json.dumps(mesh.to_dict())))
    assert again == mesh and hash(again) == hash(mesh)
    with pytest.raises(MeshError, match="unknown mesh axis 'z'; valid axes: data, model"):
        mesh.axis_index("z")


def test_logical_mesh_direct_construction_defaults_axis_names():
    dev = DeviceSpec("d", {"float32": 1e12}, GiB)
    mesh = LogicalMesh((4,), (), (0, 1, 2, 3), (1e-5,), (1e-9,), dev, 0.5)
    assert mesh.axis_names == ("x",)
    with pytest.raises(MeshError, match="one alpha and one beta per axis"):
        LogicalMesh((2, 2), (), (0, 1, 2, 3), (1e-5,), (1e-9,), dev, 0.5)
