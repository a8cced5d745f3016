"""Collectives counted from HLO text (autopar.runtime.hlo): synthetic snippets and real programs."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autopar import errors
from autopar.plan import CollectiveKind
from autopar.runtime.hlo import HloParseError, count_collectives, parse_collectives
from autopar.runtime.hlo_calls import computation_runs
from autopar.runtime.hlo_replica_groups import infer_mesh_axes, parse_replica_groups

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

K = CollectiveKind

# ---------------------------------------------------------------- synthetic HLO
SYNTHETIC = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[1024]{0})->f32[1024]{0}}, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%fused_all_reduce_computation (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %neg = f32[8]{0} negate(%p), metadata={op_name="jit(f)/all-reduce/psum"}
}

ENTRY %main (param: f32[1024]) -> f32[1024] {
  %param = f32[1024]{0} parameter(0), sharding={replicated}
  %all-reduce-start = f32[1024]{0} all-reduce-start(f32[1024]{0} %param), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %all-reduce-done = f32[1024]{0} all-reduce-done(f32[1024]{0} %all-reduce-start)
  %all-gather-start = (f32[256]{0}, f32[1024]{0}) all-gather-start(f32[256]{0} %s), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %all-gather-done = f32[1024]{0} all-gather-done((f32[256]{0}, f32[1024]{0}) %all-gather-start)
  %ag2-start = ((f32[4]{0}, bf16[8]{0}), (f32[16]{0}, bf16[32]{0})) all-gather-start(%a, %b), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  %ag2-done = (f32[16]{0}, bf16[32]{0}) all-gather-done(%ag2-start)
  %collective-permute-start = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(f32[64]{0} %p), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %collective-permute-done = f32[64]{0} collective-permute-done((f32[64]{0}, f32[64]{0}, u32[], u32[]) %collective-permute-start)
  %reduce-scatter-start = ((f32[1024]{0}), f32[256]{0}) reduce-scatter-start(f32[1024]{0} %param), channel_id=5, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %reduce-scatter-done = f32[256]{0} reduce-scatter-done(((f32[1024]{0}), f32[256]{0}) %reduce-scatter-start)
  %all-to-all-start = ((bf16[8,64]{1,0}), bf16[8,64]{1,0}, s32[]) all-to-all-start(bf16[8,64]{1,0} %q), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %all-to-all-done = bf16[8,64]{1,0} all-to-all-done(%all-to-all-start)
  %all-reduce.3 = (f32[128,128]{1,0}, /*index=1*/bf16[64]{0}) all-reduce(%d0, %d1), channel_id=7, replica_groups={}, to_apply=%add, metadata={op_name="jit(f)/psum" source_file="all-gather.py"}
  %gte = f32[128,128]{1,0} get-tuple-element(%all-reduce.3), index=0, metadata={op_name="all-reduce"}
  %fusion.7 = f32[8]{0} fusion(%gte), kind=kLoop, calls=%fused_all_reduce_computation, metadata={op_name="jit(f)/all-reduce/psum"}
  %all-gather.9 = f32[8]{0} add(%fusion.7, %fusion.7), metadata={op_name="jit(f)/all-gather"}
  %rs = f32[2,16]{1,0} reduce-scatter(f32[16,16]{1,0} %z), channel_id=8, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}, to_apply=%add
  ROOT %a2a = (f32[2,4]{1,0}, f32[2,4]{1,0}) all-to-all(%u, %v), channel_id=9, replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_1':(2)2}
}
"""  # noqa: E501 (HLO lines are long)


@pytest.fixture(scope="module")
def synthetic():
    return {c.name: c for c in parse_collectives(SYNTHETIC)}


def test_synthetic_counts_each_start_once_and_ignores_names_and_metadata(synthetic):
    assert list(synthetic) == [
        "all-reduce-start", "all-gather-start", "ag2-start", "collective-permute-start",
        "reduce-scatter-start", "all-to-all-start", "all-reduce.3", "rs", "a2a"]
    summary = count_collectives(SYNTHETIC)
    assert summary.total_count == 9
    assert summary.count(K.ALL_REDUCE) == 2
    assert summary.count("all-gather") == 2
    assert summary.count(K.REDUCE_SCATTER) == 2
    assert summary.count(K.ALL_TO_ALL) == 2
    assert summary.count(K.COLLECTIVE_PERMUTE) == 1


def test_synthetic_async_all_reduce(synthetic):
    c = synthetic["all-reduce-start"]
    assert (c.kind, c.is_async, c.nbytes, c.group_size) == ("all-reduce", True, 4096, 4)
    assert c.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert c.computation == "main"


def test_synthetic_async_all_gather_takes_the_result_part(synthetic):
    c = synthetic["all-gather-start"]
    assert c.result_shapes == (("f32", (1024,)),)
    assert (c.nbytes, c.group_size) == (4096, 4)
    assert c.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    combined = synthetic["ag2-start"]  # ((operands), (results)) -> 16 * 4 + 32 * 2 bytes
    assert combined.result_shapes == (("f32", (16,)), ("bf16", (32,)))
    assert combined.nbytes == 128
    assert combined.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_synthetic_async_permute_reduce_scatter_all_to_all(synthetic):
    cp = synthetic["collective-permute-start"]
    assert (cp.nbytes, cp.group_size, cp.replica_groups) == (256, 2, None)
    assert cp.source_target_pairs == ((0, 1), (1, 2), (2, 3), (3, 0))
    rs = synthetic["reduce-scatter-start"]  # result 256 floats x group 4 = full 1024 floats
    assert (rs.result_bytes, rs.nbytes, rs.group_size) == (1024, 4096, 4)
    a2a = synthetic["all-to-all-start"]  # result bf16[8,64] = 1024 B per device, group of 8
    assert (a2a.result_bytes, a2a.nbytes, a2a.group_size) == (1024, 8192, 8)


def test_synthetic_tuple_all_reduce_with_empty_groups(synthetic):
    c = synthetic["all-reduce.3"]
    assert not c.is_async
    assert c.result_shapes == (("f32", (128, 128)), ("bf16", (64,)))
    assert c.nbytes == 128 * 128 * 4 + 64 * 2
    assert c.replica_groups is None and c.group_size == 8  # num_partitions=8 in the header
    assert parse_collectives(SYNTHETIC, num_devices=4)[6].group_size == 4


def test_synthetic_mesh_axes_replica_groups(synthetic):
    rs = synthetic["rs"]
    assert rs.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert (rs.group_size, rs.nbytes) == (4, 2 * 16 * 4 * 4)
    a2a = synthetic["a2a"]
    assert a2a.replica_groups == ((0, 1), (4, 5), (2, 3), (6, 7))
    assert (a2a.group_size, a2a.result_bytes, a2a.nbytes) == (2, 64, 128)


@pytest.mark.parametrize(
    ("text", "groups"),
    [
        ("{{0,1},{2,3}}, channel_id=1", ((0, 1), (2, 3))),
        ("{}", None),
        ("[2,4]<=[8], dimensions={0}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("[4,2]<=[2,2,2]T(0,2,1)", ((0, 2), (1, 3), (4, 6), (5, 7))),
        ("[1,8]<=[8]", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("mesh[a=2,b=4] {b}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("mesh['a'=2,'b'=4] {'a','b'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("mesh['x'=8] {'x':(1)2,'x':(4)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),
        ("mesh['x'=8] {'x':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
        ("mesh['a'=2,'b'=2], device_ids=(0,2,1,3) {'b'}", ((0, 2), (1, 3))),
    ],
)
def test_parse_replica_group_forms(text, groups):
    assert parse_replica_groups(text) == groups


def test_unknown_replica_group_form_raises():
    with pytest.raises(HloParseError, match="unknown replica_groups form"):
        parse_replica_groups("<<0,1>>")


def test_summary_by_kind_and_json():
    summary = count_collectives(SYNTHETIC)
    by_kind = summary.by_kind()
    assert list(by_kind) == [k.value for k in K]
    assert by_kind["all-reduce"] == {"count": 2, "bytes": 4096 + 128 * 128 * 4 + 128}
    assert by_kind["collective-permute"] == {"count": 1, "bytes": 256}
    data = json.loads(json.dumps(summary.to_dict()))
    assert data["total_count"] == 9 and len(data["collectives"]) == 9
    assert summary.bytes(K.ALL_GATHER) == 4096 + 128
    assert count_collectives("HloModule empty\n").total_count == 0


def test_infer_mesh_axes():
    grid = np.arange(8).reshape(2, 4)
    assert infer_mesh_axes(((0, 1, 2, 3), (4, 5, 6, 7)), grid) == (1,)
    assert infer_mesh_axes(((0, 4), (1, 5), (2, 6), (3, 7)), grid) == (0,)
    assert infer_mesh_axes((tuple(range(8)),), grid) == (0, 1)
    assert infer_mesh_axes(None, grid) == (0, 1)
    assert infer_mesh_axes(((0, 1), (2, 3), (4, 5), (6, 7)), grid) is None


# ---------------------------------------------------------------- real compiled programs
@pytest.fixture(scope="module")
def mesh1():
    return Mesh(np.array(jax.devices()[:8]), ("x",))


@pytest.fixture(scope="module")
def mesh2():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))


def compiled_hlo(fn, *args, **jit_kwargs) -> str:
    return jax.jit(fn, **jit_kwargs).lower(*args).compile().as_text()


def smap(fn, mesh, in_specs, out_specs):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def only(hlo_text: str, kind: CollectiveKind):
    summary = count_collectives(hlo_text)
    assert summary.total_count == 1, summary.by_kind()
    (c,) = summary.collectives
    assert c.kind == kind.value
    return c


ALL8 = ((0, 1, 2, 3, 4, 5, 6, 7),)


def test_real_psum(mesh1):
    x = jnp.ones((8, 16), jnp.float32)  # per device f32[1,16] = 64 bytes
    c = only(compiled_hlo(smap(lambda a: jax.lax.psum(a, "x"), mesh1, P("x"), P()), x),
             K.ALL_REDUCE)
    assert (c.nbytes, c.group_size, c.replica_groups) == (64, 8, ALL8)
    assert c.result_shapes == (("f32", (1, 16)),)


def test_real_combined_psum_counts_once(mesh1):
    x, y = jnp.ones((8, 16), jnp.float32), jnp.ones((8, 4), jnp.float32)
    fn = smap(lambda a, b: jax.lax.psum((a, b), "x"), mesh1, (P("x"), P("x")), (P(), P()))
    c = only(compiled_hlo(fn, x, y), K.ALL_REDUCE)
    assert c.nbytes == 16 * 4 + 4 * 4 and len(c.result_shapes) == 2


def test_real_all_gather(mesh1):
    x = jnp.ones((8, 16), jnp.float32)
    fn = smap(lambda a: jax.lax.all_gather(a, "x", tiled=True), mesh1, P("x"), P())
    c = only(compiled_hlo(fn, x), K.ALL_GATHER)
    assert (c.nbytes, c.group_size, c.replica_groups) == (8 * 16 * 4, 8, ALL8)


def test_real_psum_scatter(mesh1):
    x = jnp.ones((64, 16), jnp.float32)  # replicated input: 4096 bytes per device
    fn = smap(lambda a: jax.lax.psum_scatter(a, "x", scatter_dimension=0, tiled=True),
              mesh1, P(), P("x"))
    c = only(compiled_hlo(fn, x), K.REDUCE_SCATTER)
    assert (c.result_bytes, c.nbytes, c.group_size) == (8 * 16 * 4, 64 * 16 * 4, 8)


def test_real_all_to_all(mesh1):
    x = jnp.ones((64, 16), jnp.float32)  # per device f32[8,16] = 512 bytes
    fn = smap(lambda a: jax.lax.all_to_all(a, "x", 0, 0, tiled=True), mesh1, P("x"), P("x"))
    c = only(compiled_hlo(fn, x), K.ALL_TO_ALL)
    # The CPU backend splits into a tuple of 8 f32[1,16] pieces; still one collective.
    assert c.result_bytes == 512
    assert (c.nbytes, c.group_size, c.replica_groups) == (64 * 16 * 4, 8, ALL8)


def test_real_ppermute(mesh1):
    x = jnp.ones((8, 16), jnp.float32)
    perm = [(i, (i + 1) % 8) for i in range(8)]
    fn = smap(lambda a: jax.lax.ppermute(a, "x", perm), mesh1, P("x"), P("x"))
    c = only(compiled_hlo(fn, x), K.COLLECTIVE_PERMUTE)
    assert (c.nbytes, c.group_size) == (64, 2)
    assert c.source_target_pairs == tuple(perm)


@pytest.mark.parametrize(
    ("axis", "groups", "mesh_axes"),
    [("b", ((0, 1, 2, 3), (4, 5, 6, 7)), (1,)), ("a", ((0, 4), (1, 5), (2, 6), (3, 7)), (0,))],
)
def test_real_2d_psum_over_one_axis(mesh2, axis, groups, mesh_axes):
    x = jnp.ones((8, 16), jnp.float32)  # per device f32[4,4] = 64 bytes
    fn = smap(lambda a: jax.lax.psum(a, axis), mesh2, P("a", "b"), P())
    c = only(compiled_hlo(fn, x), K.ALL_REDUCE)
    assert (c.nbytes, c.group_size, c.replica_groups) == (64, len(groups[0]), groups)
    assert infer_mesh_axes(c.replica_groups, mesh2.device_ids) == mesh_axes


def test_real_partitioner_collectives(mesh2):
    """Collectives XLA's SPMD partitioner inserts (iota and mesh-axes replica groups)."""
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh2, P("a", "b")))
    w = jax.ShapeDtypeStruct((128, 32), jnp.float32, sharding=NamedSharding(mesh2, P("b")))
    # Contracting dimension split over b: one all-reduce of the f32[32,32] partial over b.
    c = only(compiled_hlo(lambda x, w: x @ w, x, w,
                          out_shardings=NamedSharding(mesh2, P("a"))), K.ALL_REDUCE)
    assert (c.nbytes, c.group_size) == (32 * 32 * 4, 4)
    assert infer_mesh_axes(c.replica_groups, mesh2.device_ids) == (1,)
    # Un-sharding dimension 0 over a: one all-gather of f32[64,32] over a.
    c = only(compiled_hlo(lambda x: x + 1, x, out_shardings=NamedSharding(mesh2, P(None, "b"))),
             K.ALL_GATHER)
    assert (c.nbytes, c.group_size) == (64 * 32 * 4, 2)
    assert infer_mesh_axes(c.replica_groups, mesh2.device_ids) == (0,)


def test_real_loop_body_collective_counts_once(mesh1):
    def step(carry, _):
        return jax.lax.psum(carry, "x") * 0.5, None

    fn = smap(lambda a: jax.lax.scan(step, a, None, length=3)[0], mesh1, P("x"), P("x"))
    c = only(compiled_hlo(fn, jnp.ones((64, 16), jnp.float32)), K.ALL_REDUCE)
    assert c.nbytes == 8 * 16 * 4 and c.computation != "" and "main" not in c.computation


def test_per_run_a_loop_body_collective_counts_once_per_iteration(mesh1):
    """A scan of 3 psums, inside a scan of 2: static, the inner body's psum counts once; per
    run of the program, 2 x 3 times, and the one after the loops once."""
    def inner(carry, _):
        return jax.lax.psum(carry, "x") * 0.5, None

    def outer(carry, _):
        return jax.lax.scan(inner, carry, None, length=3)[0], None

    def body(a):
        return jax.lax.psum(jax.lax.scan(outer, a, None, length=2)[0] * 2.0, "x")

    hlo = compiled_hlo(smap(body, mesh1, P("x"), P("x")), jnp.ones((64, 16), jnp.float32))
    assert count_collectives(hlo).total_count == 2
    per_run = count_collectives(hlo, per_run=True)
    assert per_run.total_count == 7 and per_run.by_kind()["all-reduce"]["count"] == 7
    runs = computation_runs(hlo)
    loop_bodies = {c.computation for c in count_collectives(hlo).collectives} - {
        name for name, n in runs.items() if n == 1}
    assert [runs[name] for name in loop_bodies] == [6]


def test_real_single_device_program_has_no_collectives():
    hlo = compiled_hlo(lambda a: jnp.sin(a) @ a.T, jnp.ones((8, 8)))
    assert count_collectives(hlo).total_count == 0


# ---------------------------------------------------------------- parse misses raise
HEADER = "HloModule m, num_partitions=8\n\nENTRY %main (p: f32[8]) -> f32[8] {\n"


@pytest.mark.parametrize(
    "line",
    [
        "%ag = f32<64> all-gather(f32[8]{0} %p), replica_groups={}, dimensions={0}",
        "%ar = (f32[8]{0}, bf16[4]{0} all-reduce(%p, %q), replica_groups={}, to_apply=%add",
        "%a2a = f32[8]{0}!! all-to-all(%p), replica_groups={}, dimensions={0}",
        "%rs-start = ((f32[64]{0}), ?[8]{0}) reduce-scatter-start(%p), replica_groups={}",
        "%cp = token collective-permute(%p), source_target_pairs={{0,1}}",
        "ROOT all-reduce(%p), replica_groups={}, to_apply=%add",
    ],
)
def test_a_collective_whose_instruction_cannot_be_read_raises(line):
    with pytest.raises(HloParseError, match=r"^collective in compiled HLO with .*: \S") as info:
        parse_collectives(HEADER + "  " + line + "\n}\n")
    assert "\n" not in str(info.value)
    assert line.split("(")[0].split()[-1] in str(info.value)  # names the line


def test_the_error_is_an_autopar_error_and_its_line_is_truncated():
    assert HloParseError is errors.HloParseError and issubclass(HloParseError, errors.AutoparError)
    long_line = "%ag = f32<64> all-gather(%p), replica_groups={}, " + "x=1, " * 200
    with pytest.raises(HloParseError) as info:
        count_collectives(HEADER + "  " + long_line + "\n}\n")
    message = str(info.value)
    assert "%ag = f32<64> all-gather(%p)" in message and message.endswith("...")
    assert len(message) < 250


def test_done_halves_and_mere_mentions_are_not_errors():
    text = HEADER + "\n".join([
        # -done halves: never counted, never an error even when their shape is odd
        "  %ag-start = (f32[8]{0}, f32[64]{0}) all-gather-start(%p), replica_groups={}, "
        "dimensions={0}",
        "  %ag-done = f32<64> all-gather-done(%ag-start)",
        "  %ar-done = ?? all-reduce-done(%ar-start)",
        # a collective named only in a string, or in an instruction's name
        '  %cc = weird<> custom-call(%p), custom_call_target="all-gather(", '
        'metadata={op_name="jit(f)/all-reduce(x)"}',
        "  %all-reduce.1 = weird<> fusion(%p), kind=kLoop, calls=%fused",
        "  ROOT %r = f32[8]{0} copy(%p)",
    ]) + "\n}\n"
    summary = count_collectives(text)
    assert summary.total_count == 1 and summary.count(K.ALL_GATHER) == 1
    assert summary.collectives[0].nbytes == 64 * 4


def test_real_mixed_types_tuples_and_layouts_all_parse(mesh1):
    """Every collective line XLA prints for a program of bf16/f32/s32/pred operands, a tuple
    (combined) all-reduce, a tuple-shaped all-to-all and 2-D/3-D layouts is read and counted."""

    def f(a, b, c, d):
        s = jax.lax.psum((a, b), "x")
        g = jax.lax.all_gather(c, "x", tiled=True)  # pred
        h = jax.lax.all_gather(d, "x", tiled=True)  # f32[1,16,2]{2,1,0}
        p = jax.lax.ppermute(a, "x", [(i, (i + 1) % 8) for i in range(8)])
        t = jax.lax.all_to_all(b, "x", 0, 0, tiled=True)  # s32, a tuple of 8 pieces
        return s, g, h, p, t

    args = (jnp.ones((8, 16), jnp.bfloat16), jnp.ones((64, 16), jnp.int32),
            jnp.ones((8, 4), jnp.bool_), jnp.ones((8, 16, 2), jnp.float32))
    fn = smap(f, mesh1, (P("x"),) * 4, ((P(), P()), P(), P(), P("x"), P("x")))
    hlo = compiled_hlo(fn, *args)
    opcode = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|"
                        r"collective-permute)(-start)?\(")
    lines = [line for line in hlo.splitlines() if opcode.search(line.split("metadata=")[0])]
    summary = count_collectives(hlo)
    assert summary.total_count == len(lines) >= 5
    types = {dtype for c in summary.collectives for dtype, _ in c.result_shapes}
    assert {"s32", "pred", "f32"} <= types
    assert summary.count(K.ALL_GATHER) == 2 and summary.count(K.ALL_TO_ALL) == 1
    assert summary.count(K.COLLECTIVE_PERMUTE) == 1
    (a2a,) = [c for c in summary.collectives if c.kind == K.ALL_TO_ALL.value]
    assert len(a2a.result_shapes) == 8 and a2a.result_bytes == 8 * 16 * 4
