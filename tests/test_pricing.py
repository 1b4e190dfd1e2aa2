"""Op pricing of a partitioned module (trn_accum.analysis.pricing) and the platform table."""

import dataclasses

import pytest

from trn_accum.analysis import platforms, pricing
from trn_accum.analysis.hlo.module import parse_hlo
from trn_accum.neuron import platform as neuron

# A loop of 3 trips (no known_trip_count: the trip count is read off the condition, as in a
# module right after the SPMD partitioner) around a [100, 200] x [200, 300] bf16 dot, an add
# of its f32 [100, 300] result and a reduce of it to [100].
TEXT = """HloModule m, num_partitions=1

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (p: (s32[], f32[100])) -> pred[] {
  %p = (s32[], f32[100]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (q: (s32[], f32[100])) -> (s32[], f32[100]) {
  %q = (s32[], f32[100]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %one = s32[] constant(1)
  %j1 = s32[] add(%j, %one)
  %x = bf16[100,200]{1,0} constant({...})
  %w = bf16[200,300]{1,0} constant({...})
  %d = f32[100,300]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %e = f32[100,300]{1,0} add(%d, %d)
  %z = f32[] constant(0)
  %r = f32[100]{0} reduce(%e, %z), dimensions={1}, to_apply=%sum
  ROOT %t = (s32[], f32[100]{0}) tuple(%j1, %r)
}

ENTRY %main (v: f32[100]) -> (s32[], f32[100]) {
  %v = f32[100]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[100]{0}) tuple(%zero, %v)
  ROOT %loop = (s32[], f32[100]{0}) while(%init), condition=%cond, body=%body
}
"""


def test_features_of_a_loop_read_its_trip_count_from_the_condition():
    module = parse_hlo(TEXT)
    (loop,) = module.while_loops()
    assert loop.trip_count is None and module.counted_trips(loop) == 3
    f = pricing.op_features(module, tile=128)
    # M 100 -> 128, N 300 -> 384, K 200 -> 256; 3 trips
    assert f["dot_flops"] == 3 * 2 * 128 * 384 * 256
    # reduce: operand 100 x 300 f32 and its f32 init read + 100 f32 written; 3 trips
    assert f["kernel_bytes"] == 3 * (100 * 300 * 4 + 4 + 100 * 4)
    # elementwise in the loop: the f32 [100, 300] add, the s32 counter add and the condition's
    # compare (pred, 1 byte), each trip; the reducer's scalar add is the reduce's; none outside
    assert f["loop_elementwise_bytes"] == 3 * (100 * 300 * 4 + 4 + 1)
    assert f["elementwise_bytes"] == 0
    assert f["kernels"] == 3 * 2  # the dot and the reduce
    assert f["loop_iterations"] == 3 and f["unknown_trips"] == 0
    # no on-chip size stated: no result counts as off chip
    assert f["offchip_elementwise_bytes"] == 0


def test_offchip_bytes_are_the_elementwise_results_too_large_for_the_on_chip_memory():
    """Of the loop's elementwise results (the f32 [100, 300] add, 120,000 B; the s32 counter
    add and the compare), only those at least as large as the on-chip memory count, as many
    times as they run; the dot and the reduce are no elementwise ops however large."""
    module = parse_hlo(TEXT)
    add = 100 * 300 * 4
    for onchip, offchip in ((add + 1, 0), (add, 3 * add), (4, 3 * (add + 4)), (1, 3 * (add + 5))):
        f = pricing.op_features(module, tile=128, onchip_bytes=onchip)
        assert f["offchip_elementwise_bytes"] == offchip, onchip
        assert f["loop_elementwise_bytes"] == 3 * (add + 4 + 1)  # the others unchanged


def test_the_tpu_prices_offchip_bytes_and_trainium_states_no_on_chip_size():
    """The TPU v5e's off-chip extra is fitted at its 128 MiB of VMEM (platforms.py); trn2 and
    trn1 state no on-chip size, so their steps carry no off-chip bytes and no extra price."""
    v5e = platforms.get("tpu-v5e").efficiency
    assert v5e.onchip_bytes == 128 * 2**20
    assert 0 < v5e.coefficients(197e12, 819e9)["offchip_elementwise_bytes"] < 1
    for name in ("trn2", "trn1"):
        plat = platforms.get(name)
        eff = plat.efficiency
        assert eff.onchip_bytes == float("inf")
        assert eff.coefficients(plat.peak_flops, plat.hbm_bytes_s)["offchip_elementwise_bytes"] == 0
        assert (
            pricing.op_features(parse_hlo(TEXT), onchip_bytes=eff.onchip_bytes)[
                "offchip_elementwise_bytes"
            ]
            == 0
        )


def test_price_is_linear_in_the_inverse_efficiencies():
    feats = {
        "dot_flops": 2e12,
        "kernel_bytes": 1e9,
        "elementwise_bytes": 4e9,
        "loop_elementwise_bytes": 2e9,
        "kernels": 100,
        "loop_iterations": 10,
    }
    eff = pricing.Efficiency(
        dot=0.5, memory=0.5, elementwise=0.25, loop_elementwise=2.0, kernel_s=1e-5, loop_iter_s=1e-4
    )
    got = pricing.price(feats, peak_flops=1e12, hbm_bytes_s=1e9, eff=eff)
    assert got["dot_flops_s"] == pytest.approx(4.0)
    assert got["kernel_bytes_s"] == pytest.approx(2.0)
    assert got["elementwise_bytes_s"] == pytest.approx(16.0)
    assert got["loop_elementwise_bytes_s"] == pytest.approx(1.0)
    assert got["total_s"] == pytest.approx(4 + 2 + 16 + 1 + 1e-3 + 1e-3)
    back = pricing.Efficiency.from_coefficients(eff.coefficients(1e12, 1e9), 1e12, 1e9)
    assert back.dot == pytest.approx(0.5) and back.elementwise == pytest.approx(0.25)
    # the off-chip extra: free by default, priced and recovered when stated
    feats["offchip_elementwise_bytes"] = 1e9
    assert pricing.price(feats, 1e12, 1e9, eff)["offchip_elementwise_bytes_s"] == 0
    eff = dataclasses.replace(eff, offchip_elementwise=0.5)
    assert pricing.price(feats, 1e12, 1e9, eff)["offchip_elementwise_bytes_s"] == pytest.approx(2)
    back = pricing.Efficiency.from_coefficients(eff.coefficients(1e12, 1e9), 1e12, 1e9)
    assert back.offchip_elementwise == pytest.approx(0.5)


def test_platform_table():
    trn2 = platforms.get("trn2")
    assert trn2.peak_flops == neuron.device_peak_flops() == 166.75e12
    assert trn2.devices_per_node == 64 and trn2.memory_gib == 24.0
    for lk, link in trn2.achieved_links.items():  # achieved never beats the peak link
        assert link["bytes_per_s"] <= trn2.links[lk]["bytes_per_s"]
        assert link["fixed_s"] > 0
    v5e = platforms.get("tpu-v5e")
    assert (v5e.peak_flops, v5e.hbm_bytes_s, v5e.devices_per_chip) == (197e12, 819e9, 1)
    assert v5e.budget_gib(24.0) == v5e.memory_gib and v5e.budget_gib(1.0) == 1.0
    assert platforms.get("trn1").devices_per_node == 32
    with pytest.raises(ValueError, match="known platforms are trn2, trn1, tpu-v5e"):
        platforms.get("h100")


COPIES = """HloModule c, num_partitions=2

ENTRY %main (v: f32[64,32]) -> (f32[64,32], f32[64,32]) {
  %v = f32[64,32]{1,0} parameter(0)
  %e = f32[64,32]{1,0} exponential(%v)
  %same = f32[64,32]{1,0} copy(%e)
  %relaid = f32[64,32]{0,1} copy(%e)
  ROOT %t = (f32[64,32]{1,0}, f32[64,32]{0,1}) tuple(%same, %relaid)
}
"""


def test_a_copy_to_its_operands_own_layout_is_free_a_relayout_is_not():
    """The partitioner's copy that keeps type and layout (XLA's algebraic simplifier removes it
    in every backend) costs nothing; a copy to another layout reads and writes its bytes."""
    f = pricing.op_features(parse_hlo(COPIES), tile=128)
    assert f["kernel_bytes"] == 2 * 64 * 32 * 4  # the relayout alone
    assert f["elementwise_bytes"] == 64 * 32 * 4  # the exponential
