"""Op rates measured on a chip (trn_accum.analysis.rates), the prices that use them
(trn_accum.analysis.pricing) and the kernel-by-kernel roofline (trn_accum.analysis.roofline)."""

import json
import pathlib

import pytest

from trn_accum.analysis import platforms, pricing, rates, roofline
from trn_accum.analysis.hlo.module import parse_hlo

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A dot of a [256, 512] x [512, 2048] bf16 product whose left operand is a convert of a
# parameter (fused into the dot) and whose f32 result is added to a parameter and written; a
# dynamic-update-slice (a kernel no backend fuses), a slice and a transpose (fused into the
# add that reads them), and a sharding name (no work).
TEXT = """HloModule m, num_partitions=1

ENTRY %main {
  %a = f32[256,512]{1,0} parameter(0)
  %b = bf16[512,2048]{1,0} parameter(1)
  %c = f32[256,2048]{1,0} parameter(2)
  %u = f32[8,2048]{1,0} parameter(3)
  %ab = bf16[256,512]{1,0} convert(%a)
  %named = bf16[256,512]{1,0} custom-call(%ab), custom_call_target="Sharding", sharding={replicated}
  %d = f32[256,2048]{1,0} dot(%named, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ct = f32[2048,256]{1,0} transpose(%c), dimensions={1,0}
  %back = f32[256,2048]{1,0} transpose(%ct), dimensions={1,0}
  %s = f32[256,2048]{1,0} add(%d, %back)
  %zero = s32[] constant(0)
  %up = f32[256,2048]{1,0} dynamic-update-slice(%c, %u, %zero, %zero)
  ROOT %out = (f32[256,2048]{1,0}, f32[256,2048]{1,0}) tuple(%s, %up)
}
"""


def test_the_tpu_rates_are_the_measured_file():
    """platforms.TPU_V5E_RATES holds what benchmarks/op-rates-tpu-v5e.json measured."""
    doc = json.loads((ROOT / "benchmarks" / "op-rates-tpu-v5e.json").read_text())
    r = platforms.TPU_V5E_RATES
    grid = r.dot_grid
    eff = {
        (x["m"], x["n"], x["k"]): x["efficiency"]
        for x in doc["rows"]
        if x["op"] == "dot" and x["batch"] == 1
    }
    for i, m in enumerate(grid):
        for j, n in enumerate(grid):
            for k_, k in enumerate(grid):
                assert r.dot_table[i][j][k_] == pytest.approx(eff[(m, n, k)], abs=5e-4)
    (stream,) = [x for x in doc["rows"] if x["op"] == "stream"]
    (loop,) = [x for x in doc["rows"] if x["op"] == "loop"]
    assert r.bandwidth == pytest.approx(stream["bandwidth_share"], abs=5e-4)
    assert r.loop_iter_s == pytest.approx(loop["seconds"], rel=1e-3)
    assert doc["device"].startswith("TPU v5")


def test_dot_efficiency_is_the_table_at_its_points_and_between_them_elsewhere():
    r = platforms.TPU_V5E_RATES
    t = r.dot_table
    assert rates.dot_efficiency(r, 1, 2048, 512, 8192) == pytest.approx(t[2][1][3])
    # halfway in log2 between K 512 and 2048 is the mean of the two
    mid = rates.dot_efficiency(r, 1, 2048, 2048, 1024)
    assert mid == pytest.approx((t[2][2][1] + t[2][2][2]) / 2)
    # clamped outside the grid; the batch folds into M
    assert rates.dot_efficiency(r, 1, 64, 64, 64) == pytest.approx(t[0][0][0])
    assert rates.dot_efficiency(r, 1, 10**6, 8192, 8192) == pytest.approx(t[3][3][3])
    assert rates.dot_efficiency(r, 4, 128, 512, 512) == pytest.approx(t[1][1][1])


def test_a_table_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="4 x 4 x 4"):
        rates.Rates(
            dot_grid=(128, 512, 2048, 8192), dot_table=((1.0,),), bandwidth=1, loop_iter_s=0
        )


def test_with_rates_dots_are_priced_by_shape_and_unfused_kernels_at_the_bandwidth():
    module = parse_hlo(TEXT)
    r = platforms.TPU_V5E_RATES
    f = pricing.op_features(module, tile=128, rates=r)
    flops = 2 * 256 * 2048 * 512
    assert f["dot_flops"] == flops
    assert f["dot_shaped_flops"] == pytest.approx(
        flops / rates.dot_efficiency(r, 1, 256, 2048, 512)
    )
    # the update [8, 2048] f32 read and written; the transposes are fused moves, not unfused
    assert f["unfused_kernel_bytes"] == 2 * 8 * 2048 * 4
    assert f["kernel_bytes"] == 2 * 8 * 2048 * 4 + 2 * 2 * 256 * 2048 * 4  # + the transposes
    eff = platforms.TPU_V5E.efficiency
    got = pricing.price(f, 197e12, 819e9, eff)
    assert got["dot_flops_s"] == 0 and got["kernel_bytes_s"] == 0
    assert got["dot_shaped_flops_s"] == pytest.approx(f["dot_shaped_flops"] / 197e12)
    assert got["unfused_kernel_bytes_s"] == pytest.approx(2 * 8 * 2048 * 4 / (819e9 * r.bandwidth))
    # without rates (trn2) the old features price and the new ones are 0
    plain = pricing.op_features(module, tile=128)
    assert plain["dot_shaped_flops"] == 0
    trn2 = pricing.price(plain, 1e15, 1e12, platforms.TRN2.efficiency)
    assert trn2["dot_flops_s"] > 0 and trn2["unfused_kernel_bytes_s"] == 0


def test_the_roofline_fuses_producers_into_their_kernels_and_takes_the_larger_bound():
    module = parse_hlo(TEXT)
    groups = {g.kind: g for g in roofline.fusions(module)}
    assert set(groups) == {"dot", "fused", "kernel"}
    dot = groups["dot"]
    # reads the convert's f32 source through the sharding name, and b; writes its f32 result
    assert dot.bytes == 256 * 512 * 4 + 512 * 2048 * 2 + 256 * 2048 * 4
    assert dot.shape == (1, 256, 2048, 512) and dot.flops == 2 * 256 * 2048 * 512
    # the add reads the dot's result and c through both transposes, writes its own
    assert groups["fused"].bytes == 3 * 256 * 2048 * 4
    assert groups["kernel"].bytes == 2 * 8 * 2048 * 4
    r = platforms.TPU_V5E_RATES
    s = roofline.seconds(roofline.fusions(module), 10, 197e12, 819e9, r)
    bw = 819e9 * r.bandwidth
    t_dot = max(dot.flops / (197e12 * rates.dot_efficiency(r, *dot.shape)), dot.bytes / bw)
    assert s["dot_s"] == pytest.approx(t_dot)
    assert s["fused_s"] == pytest.approx(3 * 256 * 2048 * 4 / bw)
    assert s["loop_s"] == pytest.approx(10 * r.loop_iter_s)
    back = roofline.from_rows(roofline.aggregate(roofline.fusions(module)))
    assert roofline.seconds(back, 10, 197e12, 819e9, r) == pytest.approx(s)


@pytest.mark.slow
def test_a_lowered_one_device_step_has_the_features_of_the_compiled_one():
    """benchmarks/calibrate.py --features prices the lowered module of a one-device row; the
    dry-run prices the compiled one's (`compile_partitioned`). They must agree."""
    import jax

    from benchmarks import calibrate
    from trn_accum.analysis.hlo.partitioned import compile_partitioned
    from trn_accum.config.load import load_config
    from trn_accum.train import step as step_lib

    row = {
        "name": "tiny",
        "predict_command": "trn-accum dry-run --config configs/calibration/"
        "tpu-v5e-k2-plain-lc0.toml --platform tpu-v5e --devices 1 --json "
        "--set model.num_layers=1 --set data.seq_len=256",
    }
    r = platforms.TPU_V5E_RATES
    lowered = pricing.op_features(calibrate.lowered_module(row), rates=r)
    cfg = load_config(
        str(ROOT / "configs/calibration/tpu-v5e-k2-plain-lc0.toml"),
        ["model.num_layers=1", "data.seq_len=256"],
    )
    mesh = step_lib.make_mesh(cfg, jax.devices()[:1])
    with jax.set_mesh(mesh):
        program = step_lib.build_step(cfg, mesh, batch_rows=cfg.data.global_batch)
        _, text = compile_partitioned(program.lowered)
    compiled = pricing.op_features(parse_hlo(text), rates=r)
    for k in pricing.FEATURES:
        assert lowered[k] == pytest.approx(compiled[k], rel=1e-9), k


def test_the_op_rates_benchmark_writes_its_rows(tmp_path):
    """benchmarks/op_rates.py --quick on this CPU: the rows and fields the rates are read from."""
    from benchmarks import op_rates

    out = tmp_path / "rates.json"
    assert op_rates.main(["--quick", "--runs", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    ops = [r["op"] for r in doc["rows"]]
    assert ops[:2] == ["stream", "loop"] and ops.count("dot") == len(op_rates.QUICK)
    for r in doc["rows"]:
        assert r["seconds"] > 0
        if r["op"] == "dot":
            flops = 2 * r["batch"] * r["m"] * r["n"] * r["k"]
            assert r["efficiency"] == pytest.approx(flops / (r["seconds"] * 197e12))


FUSED = """HloModule f, num_partitions=1

%fused_dot (p0: bf16[64,128], p1: bf16[128,256]) -> bf16[64,256] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,256]{1,0} parameter(1)
  %c = f32[64,256]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf
  ROOT %r = bf16[64,256]{1,0} convert(%c)
}

%fused_add (q0: bf16[64,256]) -> bf16[64,256] {
  %q0 = bf16[64,256]{1,0} parameter(0)
  ROOT %a = bf16[64,256]{1,0} add(%q0, %q0)
}

ENTRY %main {
  %x = bf16[64,128]{1,0} parameter(0)
  %w = bf16[128,256]{1,0} parameter(1)
  %d = bf16[64,256]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %e = bf16[64,256]{1,0} fusion(%d), kind=kLoop, calls=%fused_add
  %cs = (bf16[64,256]{1,0}, bf16[64,256]{1,0}, u32[]) copy-start(%e)
  ROOT %cd = bf16[64,256]{1,0} copy-done(%cs)
}
"""


def test_the_compilers_kernels_are_summed_by_kind():
    """benchmarks/tpu_fusions.py: a fusion's bytes are its operands and result, its body is
    not counted again, asynchronous moves apart."""
    from benchmarks import tpu_fusions

    got = tpu_fusions.bytes_by_kind(parse_hlo(FUSED))
    out = 64 * 256 * 2
    assert got["kOutput"] == 64 * 128 * 2 + 128 * 256 * 2 + out
    assert got["kLoop"] == 2 * out
    assert got["async"] == (out + 2 * out + 4) + (2 * out + 4 + out)


IN_PLACE = """HloModule u, num_partitions=1

%fused_upd (b: f32[1024,128], u: f32[64,128], i: s32[]) -> f32[1024,128] {
  %b = f32[1024,128]{1,0} parameter(0)
  %u = f32[64,128]{1,0} parameter(1)
  %e = f32[64,128]{1,0} exponential(%u)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %r = f32[1024,128]{1,0} dynamic-update-slice(%b, %e, %i, %z)
}

ENTRY %main {
  %buf = f32[1024,128]{1,0} parameter(0)
  %upd = f32[64,128]{1,0:T(8,128)S(1)} parameter(1)
  %i = s32[] parameter(2)
  %f = f32[1024,128]{1,0} fusion(%buf, %upd, %i), kind=kLoop, calls=%fused_upd
  %z = s32[] constant(0)
  ROOT %d = f32[1024,128]{1,0} dynamic-update-slice(%f, %upd, %i, %z)
}
"""


def test_a_dynamic_update_moves_its_update_and_bytes_are_placed_by_memory_space():
    """benchmarks/tpu_fusions.py: a dynamic update, bare or a fusion's root, is done in place
    (the 512 KiB buffer is neither read nor written whole); an array laid out in S(1) is in
    the core's vector memory."""
    from benchmarks import tpu_fusions

    module = parse_hlo(IN_PLACE)
    upd = 64 * 128 * 4
    assert tpu_fusions.space_bytes("f32[64,128]{1,0:T(8,128)S(1)}") == (0, upd)
    assert tpu_fusions.space_bytes("(f32[64,128]{1,0}, s32[])") == (upd + 4, 0)
    fused, bare = (module.instruction(n) for n in ("f", "d"))
    # the fusion reads the update (VMEM) and the index, writes its exp'd update (HBM)
    assert tpu_fusions.moved_bytes(module, fused) == (4 + upd, upd)
    # the bare update reads the update (VMEM) and two indices, writes the update's bytes into
    # its buffer (HBM)
    assert tpu_fusions.moved_bytes(module, bare) == (8 + upd, upd)
    got = tpu_fusions.bytes_by_kind(module)
    assert got["kLoop"] == 4 + 2 * upd and got["kLoop vmem"] == upd
    assert got["dynamic-update-slice"] == 8 + 2 * upd
