"""trn_accum.hlo on real compiled programs (8 emulated CPU devices) and on printed forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.analysis import collectives as coll
from trn_accum.analysis.hlo import module as hlo


def _mesh(shape, names, devices=None):
    devs = np.array(jax.devices() if devices is None else devices).reshape(shape)
    return Mesh(devs, names, axis_types=(AxisType.Auto,) * len(names))


def _compiled(f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


# ----------------------------------------------------------------------------- printed forms


@pytest.mark.parametrize(
    "text, groups",
    [
        ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
        ("{{0,2,4,6},{1,3,5,7}}", ((0, 2, 4, 6), (1, 3, 5, 7))),
        ("{}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("[1,8]<=[8]", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("[2,4]<=[2,2,2]T(1,0,2)", ((0, 1, 4, 5), (2, 3, 6, 7))),
        ("mesh['a'=8] {'a'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("mesh[a=2,b=4] {b}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("mesh['a'=2,'b'=4] {'a'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        (
            "mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_2'}",
            ((0, 4), (1, 5), (2, 6), (3, 7)),
        ),
        (
            "mesh['axis_0'=1,'axis_1'=2,'axis_2'=4,'axis_3'=1], device_ids=([4,2]T(1,0)) "
            "{'axis_2'}",
            ((0, 2, 4, 6), (1, 3, 5, 7)),
        ),
        # Sub-axis: the major half of an axis of 8 (pre-size 1, size 2).
        ("mesh['a'=8] {'a':(1)2}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("mesh['a'=8] {'a':(4)2}", ((0, 1), (2, 3), (4, 5), (6, 7))),
        ("mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'b'}", ((3, 2), (1, 0))),
        ("mesh['a'=2,'b'=2,'c'=2] {'c','a'}", ((0, 4, 1, 5), (2, 6, 3, 7))),
    ],
)
def test_parse_replica_group_forms(text, groups):
    assert coll.parse_replica_groups(text, num_devices=8) == groups


def test_group_axes():
    sizes = {"data": 2, "fsdp": 4}
    assert coll.group_axes(((0, 4), (1, 5), (2, 6), (3, 7)), sizes) == ("data",)
    assert coll.group_axes(((0, 1, 2, 3), (4, 5, 6, 7)), sizes) == ("fsdp",)
    assert coll.group_axes((tuple(range(8)),), sizes) == ("data", "fsdp")
    assert coll.group_axes(tuple((i,) for i in range(8)), sizes) == ()
    assert coll.group_axes(((0, 2), (1, 3), (4, 6), (5, 7)), sizes) is None  # sub-axis of fsdp


_HANDWRITTEN = """\
HloModule handwritten, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%inner_fusion (p: f32[16]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  ROOT %ar = f32[16]{0} all-reduce(%p), channel_id=3, replica_groups=[2,4]<=[8], to_apply=%add
}

%body (t: T6) -> T6 {
  %t = T6 parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[16]{0} get-tuple-element(%t), index=1
  %f = f32[16]{0} fusion(%v), kind=kLoop, calls=%inner_fusion
  %ags = (f32[16]{0}, f32[128]{0}) all-gather-start(%f), replica_groups=ALL8, dimensions={0}
  %agd = f32[128]{0} all-gather-done(%ags)
  ROOT %r = T6 tuple(%i, %f, %v, %v, %v, %v)
}

%cond (t: T6) -> pred[] {
  %t = T6 parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[16], b: bf16[2,8]) -> f32[16] {
  %a = f32[16]{0} parameter(0)
  %b = bf16[2,8]{1,0} parameter(1)
  %ars = f32[16]{0} all-reduce-start(%a), channel_id=1, replica_groups=PAIRS, to_apply=%add
  %ard = f32[16]{0} all-reduce-done(%ars)
  %cp = bf16[2,8]{1,0} collective-permute(%b), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %z = s32[] constant(0)
  %init = T6 tuple(%z, %ard, %ard, %ard, %ard, %ard)
  %w = T6 while(%init), condition=%cond, body=%body, backend_config=TRIP4
  ROOT %out = f32[16]{0} get-tuple-element(%w), index=1
}
"""
_HANDWRITTEN = (
    _HANDWRITTEN.replace(
        "T6", "(s32[], f32[16]{0}, f32[16]{0}, f32[16]{0}, f32[16]{0}, /*index=5*/f32[16]{0})"
    )
    .replace("ALL8", "{{0,1,2,3,4,5,6,7}}")
    .replace("PAIRS", "{{0,1},{2,3},{4,5},{6,7}}")
    .replace("TRIP4", '{"known_trip_count":{"n":"4"}}')
)


def test_handwritten_module():
    m = hlo.parse_hlo(_HANDWRITTEN)
    assert m.entry == "main" and m.num_partitions == 8
    assert m.loop_computations == {"body", "cond", "inner_fusion", "add"}
    w = m.instruction("w")
    assert w.opcode == "while" and w.trip_count == 4
    assert set(w.called_computations) == {"cond", "body"}
    assert [a.dtype for a in w.shapes] == ["s32"] + ["f32"] * 5
    by_kind = {c.kind: c for c in coll.collectives(m)}
    assert len(coll.collectives(m)) == 4  # the async pairs count once
    ar_outside = [c for c in coll.collectives(m) if c.kind == "all-reduce" and not c.in_loop]
    assert len(ar_outside) == 1 and ar_outside[0].bytes == 64
    assert ar_outside[0].replica_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert by_kind["all-gather"].in_loop and by_kind["all-gather"].bytes == 128 * 4
    assert by_kind["all-gather"].trip_multiplier == 4
    assert by_kind["collective-permute"].source_target_pairs == ((0, 1), (1, 0))
    assert by_kind["collective-permute"].bytes == 2 * 8 * 2
    counts = coll.count_collectives(_HANDWRITTEN)
    assert counts["outside_loops"]["all-reduce"] == 1
    assert counts["inside_loops"]["all-reduce"] == 1  # in a fusion called from the body
    assert counts["inside_loops"]["all-gather"] == 1
    assert counts["outside_loops"]["collective-permute"] == 1
    assert counts["total"]["all-to-all"] == 0
    assert counts["bytes_inside_loops"]["all-reduce"] == 64


def test_tuple_element_operands_of_newer_xla():
    """jaxlib 0.11's XLA prints a tuple element read as the operand `%t#i`: read like the
    get-tuple-element older XLA printed (here in an unannotated loop: counted trips)."""
    text = _HANDWRITTEN.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
    text = text.replace("  %i = s32[] get-tuple-element(%t), index=0\n  %n", "  %n")
    text = text.replace("compare(%i, %n)", "compare(%t#0, %n)").replace("(%w), index=1", "(%w#1)")
    text = text.replace("ROOT %out = f32[16]{0} get-tuple-element", "ROOT %out = f32[16]{0} copy")
    assert "%t#0" in text and "%w#1" in text and "known_trip_count" not in text
    m, old = hlo.parse_hlo(text), hlo.parse_hlo(_HANDWRITTEN)
    loop = m.instruction("w")
    assert loop.trip_count is None and m.counted_trips(loop) == 4 == old.instruction("w").trip_count
    read = m.operand_instructions(m.instruction("out"))[0]
    assert (read.opcode, read.attrs["index"], read.operands) == ("get-tuple-element", "1", ("w",))
    assert read.shapes == old.instruction("out").shapes and read.result_bytes == 64
    # printed instructions only (the condition's get-tuple-element is gone, nothing added)
    assert len(list(m.instructions())) == len(list(old.instructions())) - 1


# ----------------------------------------------------------------------------- real programs


@pytest.mark.parametrize("axes", [("data",), ("fsdp",), ("data", "fsdp")])
@pytest.mark.parametrize("reverse", [False, True])
def test_psum_groups_map_to_mesh_axes(axes, reverse, partitioner):
    devices = jax.devices()[::-1] if reverse else jax.devices()
    mesh = _mesh((2, 4), ("data", "fsdp"), devices)

    def f(x):
        return jax.lax.psum(x * 2.0, axes)

    out_spec = P(tuple(a for a in ("data", "fsdp") if a not in axes) or None)
    g = jax.shard_map(f, mesh=mesh, in_specs=P(("data", "fsdp")), out_specs=out_spec)
    x = jax.device_put(jnp.arange(8.0 * 3).reshape(8, 3), NamedSharding(mesh, P(("data", "fsdp"))))
    cs = coll.collectives(_compiled(g, x))
    assert [c.kind for c in cs] == ["all-reduce"]
    assert not cs[0].in_loop
    assert coll.group_axes(cs[0].replica_groups, mesh.shape) == axes
    assert cs[0].bytes == 3 * 4


def test_three_axis_mesh_groups(partitioner):
    mesh = _mesh((2, 2, 2), ("data", "seq", "model"))

    def f(x):
        return jax.lax.psum(x, ("data", "model"))

    g = jax.shard_map(f, mesh=mesh, in_specs=P(("data", "seq", "model")), out_specs=P("seq"))
    x = jnp.arange(8.0)
    (c,) = coll.collectives(_compiled(g, x))
    assert coll.group_axes(c.replica_groups, mesh.shape) == ("data", "model")
    np.testing.assert_allclose(jax.jit(g)(x), [0 + 1 + 4 + 5, 2 + 3 + 6 + 7])


def test_unoptimised_hlo_parses():
    """`lowered.as_text(dialect="hlo")` prints computation headers without a signature
    (`region_0.1 {`): the collectives JAX wrote, before XLA's passes (a bf16 psum stays bf16)."""
    mesh = _mesh((2, 4), ("data", "fsdp"))

    def f(x):
        return jax.lax.psum(x.astype(jnp.bfloat16), "data").astype(jnp.float32)

    g = jax.shard_map(f, mesh=mesh, in_specs=P(("data", "fsdp")), out_specs=P("fsdp"))
    text = jax.jit(g).lower(jnp.ones((8, 3))).as_text(dialect="hlo")
    module = hlo.parse_hlo(text)
    assert module.entry is not None and len(module.computations) >= 2
    (c,) = coll.collectives(module)
    assert c.kind == "all-reduce" and c.instruction.dtypes == {"bf16"}
    assert coll.group_axes(c.replica_groups, mesh.shape) == ("data",)


def test_collective_kinds_and_bytes():
    mesh = _mesh((8,), ("data",))

    def f(x):
        a = jax.lax.all_gather(x, "data", tiled=True)  # [8, 8]
        b = jax.lax.all_to_all(x.reshape(8, 1), "data", 0, 0, tiled=True)
        c = jax.lax.ppermute(x, "data", [(i, (i + 1) % 8) for i in range(8)])
        d = jax.lax.psum_scatter(jnp.tile(x, (8, 1)), "data", tiled=True)
        return (a.sum() + b.sum() + c.sum() + d.sum()).reshape(1)

    g = jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    x = jnp.ones((8, 8), jnp.float32)  # local [1, 8]
    counts = coll.count_collectives(_compiled(g, x))
    total = counts["total"]
    assert total["all-gather"] == 1 and total["all-to-all"] == 1
    assert total["collective-permute"] == 1
    # XLA:CPU writes psum_scatter as reduce-scatter or all-reduce + dynamic-slice.
    assert total["reduce-scatter"] + total["all-reduce"] >= 1
    assert counts["bytes_outside_loops"]["all-gather"] == 8 * 8 * 4


def test_loop_membership_not_names():
    mesh = _mesh((8,), ("data",))

    def f(x):
        def body(c, xi):
            return c + jax.lax.psum(xi, "data"), None

        c, _ = jax.lax.scan(body, jnp.zeros(x.shape[1:]), x)
        return jax.lax.pmax(c, "data")

    g = jax.shard_map(f, mesh=mesh, in_specs=P(None, "data"), out_specs=P())
    x = jnp.ones((4, 8, 3))
    text = _compiled(g, x)
    m = hlo.parse_hlo(text)
    counts = coll.count_collectives(m)
    assert counts["inside_loops"]["all-reduce"] == 1
    assert counts["outside_loops"]["all-reduce"] == 1
    (loop,) = m.while_loops()
    assert loop.trip_count == 4
    inside = next(c for c in coll.collectives(m) if c.in_loop)
    assert inside.trip_multiplier == 4
    assert inside.computation in m.loop_computations
    # Every computation reached from the loop body is a loop computation, and only those.
    body, cond = m.loop_parts(loop)
    assert m.loop_computations == m.reachable_from(body.name, cond.name)
    assert m.entry not in m.loop_computations


def test_iteration_for_preflight():
    def f(x, i, n):
        jax.debug.print("x={x}", x=x)
        y = jax.lax.cond(i > 0, lambda: x * 2.0, lambda: x + 1.0)

        def body(c, xi):
            return c + xi, c * xi  # stacked output: dynamic-update-slice in the loop

        _, ys = jax.lax.scan(body, 0.0, y)
        k = n @ n  # integer dot
        return ys.astype(jnp.complex64), y.astype(jnp.float32), k

    m = hlo.parse_hlo(_compiled(f, jnp.ones(4), 1, jnp.ones((4, 4), jnp.int32)))
    ops = {(i.opcode, m.in_loop(i)) for i in m.instructions()}
    assert ("conditional", False) in ops and ("while", False) in ops
    assert ("dynamic-update-slice", True) in ops
    cc = [i for i in m.instructions() if i.opcode == "custom-call"]
    assert any("callback" in i.attr("custom_call_target") for i in cc)
    cond = next(i for i in m.instructions() if i.opcode == "conditional")
    assert len(cond.called_computations) == 2
    assert all(c in m.computations for c in cond.called_computations)
    assert any("c64" in i.dtypes for i in m.instructions())
    dots = [i for i in m.instructions() if i.opcode == "dot"]
    assert any(all(o.dtypes <= {"s32"} for o in m.operand_instructions(d)) for d in dots), (
        "integer dot not found"
    )
    for ins in m.instructions():  # every instruction knows its computation
        assert ins in m.computations[ins.computation].instructions


def test_a_computation_shared_by_call_sites_runs_once_per_site():
    """JAX lowers a remat'd function called from several scans to one computation with a
    `call` per site; each site runs it, so its work counts once per run of every site (the sum
    over callers, not the largest). The unoptimised module then counts what XLA:CPU's inlined
    one does."""
    from trn_accum.analysis.pricing import op_features

    inner = jax.checkpoint(lambda c, x: jnp.tanh(c @ x))

    @jax.checkpoint
    def layer(c, xs):
        return jax.lax.scan(lambda c, x: (inner(c, x), None), c, xs)[0]

    def f(w, xs):
        for _ in range(4):
            w = layer(w, xs)
        return w.sum()

    lowered = jax.jit(jax.grad(f)).lower(jnp.ones((8, 8)), jnp.ones((5, 8, 8)))
    before = hlo.parse_hlo(lowered.as_text(dialect="hlo"))
    after = hlo.parse_hlo(lowered.compile().as_text())
    sites: dict[str, list[str]] = {}
    for ins in before.instructions():
        if ins.opcode == "call":
            for c in ins.called_computations:
                sites.setdefault(c, []).append(ins.computation)
    shared = {c: callers for c, callers in sites.items() if len(callers) > 1}
    assert shared, "the program no longer shares a computation among call sites"
    for c, callers in shared.items():
        assert before.trip_multiplier(c) == sum(before.trip_multiplier(k) for k in callers)
    # (newer XLA:CPU fuses these dots: the compiled module's are counted inside its fusions)
    flops = [
        op_features(before, tile=1)["dot_flops"] / (2 * 8**3),
        hlo.dot_flops(before)["with_trips"] / (2 * 8**3),
        hlo.dot_flops(after)["with_trips"] / (2 * 8**3),
    ]
    # Each of the 20 steps runs its dot at least three times (forward, recomputed, transposed);
    # the largest-caller count read 20 in all.
    assert flops[0] == flops[1] == flops[2] > 3 * 4 * 5


def test_an_async_pair_runs_its_computation_once():
    """async-start, -update and -done name one computation (`calls=`); it runs once per start."""
    text = """HloModule m, num_partitions=2

%wrapped (p: f32[4]) -> f32[8] {
  %p = f32[4]{0} parameter(0)
  ROOT %ag = f32[8]{0} all-gather(%p), channel_id=1, replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (a: f32[4]) -> f32[8] {
  %a = f32[4]{0} parameter(0)
  %s = ((f32[4]{0}), f32[8]{0}) async-start(%a), calls=%wrapped
  %u = ((f32[4]{0}), f32[8]{0}) async-update(%s), calls=%wrapped
  ROOT %d = f32[8]{0} async-done(%u), calls=%wrapped
}
"""
    m = hlo.parse_hlo(text)
    assert m.instruction("d").called_computations == ("wrapped",)
    assert m.trip_multiplier("wrapped") == 1
