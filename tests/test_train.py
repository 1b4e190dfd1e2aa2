"""Trainer: accumulation is exact (k = 1 vs 4), non-finite steps are skipped, the compiled step
has no conditional and donates its state, user errors are TrainErrors, metrics logging.
(The tiny run end to end, resume and preemption: tests/test_cli.py.)"""

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trn_accum.analysis.hlo import module as hlo
from trn_accum.config.load import load_config
from trn_accum.train import loop, step
from trn_accum.train.flops import flops_per_step
from trn_accum.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "fuji-tiny.toml")
F32 = ['model.compute_dtype="float32"']


def _losses(trainer, steps):
    state = trainer.init()
    out = []
    for s in range(steps):
        state, m = trainer.step(state, trainer.batch(s))
        out.append({k: float(v) for k, v in jax.device_get(m).items()})
    return state, out


@pytest.mark.slow
def test_accum_1_vs_4_same_loss_curve_nonfinite_skip_compiled_step():
    """Same global batch, k = 1 vs 4, float32: the same trajectory over 10 steps. Then, with
    the k = 4 step already compiled: a non-finite step is skipped and counted, and the compiled
    step has no conditional, donates the state and shards the optimizer like the params."""
    tiny_k4 = loop.Trainer.build(load_config(TINY, F32 + ["trainer.accum_steps=4"]))
    k1 = loop.Trainer.build(load_config(TINY, F32 + ["trainer.accum_steps=1"]))
    state1, m1 = _losses(k1, 10)
    state4, m4 = _losses(tiny_k4, 10)
    for a, b in zip(m1, m4, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a[key], b[key])
        # the same float32 schedule, in two programs that XLA may fuse differently: one
        # rounding apart at most (2**-23 relative)
        assert a["lr"] == pytest.approx(b["lr"], rel=2**-22, abs=0)
        assert a["target_tokens"] == b["target_tokens"]
    assert m1[-1]["loss"] < m1[0]["loss"] - 0.5  # it really trained
    flat1 = jax.tree.leaves(jax.device_get(state1["params"]))
    flat4 = jax.tree.leaves(jax.device_get(state4["params"]))
    for a, b in zip(flat1, flat4, strict=True):
        # atol: Adam normalises each update (lr * m / (sqrt(v) + eps)); where a gradient entry is
        # ~eps (a rare token's embedding row) the summation order of k=1 vs k=4 moves that update
        # by a few % of the step's lr (3e-4 at step 1 of the 1-based warmup): 2e-5 is 7% of it.
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
    _check_nonfinite_step_is_skipped_and_counted(tiny_k4)
    _check_compiled_step_no_conditional_donated_and_sharded(tiny_k4)


def _check_nonfinite_step_is_skipped_and_counted(tiny_k4):
    state = tiny_k4.init()
    bad_params = dict(state["params"], final_norm=state["params"]["final_norm"].at[0].set(jnp.nan))
    state = dict(state, params=bad_params)
    before = jax.device_get(state)
    new, m = tiny_k4.step(state, tiny_k4.batch(0))
    m, new = jax.device_get(m), jax.device_get(new)
    assert not math.isfinite(float(m["loss"]))
    assert int(new["step"]) == 1 and int(new["skipped"]) == 1 and int(m["skipped_steps"]) == 1
    for a, b in zip(jax.tree.leaves(new["params"]), jax.tree.leaves(before["params"]), strict=True):
        np.testing.assert_array_equal(a, b)  # NaN == NaN in assert_array_equal
    for a, b in zip(
        jax.tree.leaves(new["opt_state"]), jax.tree.leaves(before["opt_state"]), strict=True
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("reduce", ["per_minibatch", "once"])
def test_nonfinite_minibatch_is_dropped_not_the_step(reduce):
    """k = 4: a NaN target mask on minibatch 1's rows (1::4; its loss and weight NaN) drops that
    minibatch only: the step is applied (not skipped), counts 1 in `dropped_minibatches` (8 =
    every loss_fn call of it under "once": manual over data x fsdp, the loss given the shards
    (gather "in_loss"), 8 devices) and equals the step with those
    rows' mask 0 (which weight_fn drops as zero weight), loss, gradient norm and parameters.
    Off (the default), the same batch skips the whole step."""
    sets = ["trainer.accum_steps=4", f"trainer.reduce={reduce}", "trainer.skip_nonfinite=true"]
    trainer = loop.Trainer.build(load_config(TINY, F32 + sets))
    batch = jax.device_get(trainer.batch(0))
    out = {}
    for name, value in (("nan", np.nan), ("zero", 0.0)):
        mask = np.array(batch["target_mask"])
        mask[1::4] = value
        new, m = trainer.step(trainer.init(), dict(batch, target_mask=mask))
        out[name] = jax.device_get((new, m))
    (new_nan, m_nan), (new_zero, m_zero) = out["nan"], out["zero"]
    assert int(m_nan["dropped_minibatches"]) == (8 if reduce == "once" else 1)
    assert int(m_zero["dropped_minibatches"]) == 0
    assert int(new_nan["skipped"]) == int(new_zero["skipped"]) == 0
    for key in ("loss", "grad_norm", "target_tokens"):
        assert math.isfinite(float(m_nan[key])), key
        np.testing.assert_allclose(float(m_nan[key]), float(m_zero[key]), rtol=1e-6, err_msg=key)
    nan_params, zero_params = (jax.tree.leaves(n["params"]) for n in (new_nan, new_zero))
    for a, b in zip(nan_params, zero_params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    off = loop.Trainer.build(load_config(TINY, F32 + sets[:2]))
    mask = np.array(batch["target_mask"])
    mask[1::4] = np.nan
    new_off, m_off = jax.device_get(off.step(off.init(), dict(batch, target_mask=mask)))
    assert int(new_off["skipped"]) == 1 and int(m_off["dropped_minibatches"]) == 0


def _check_compiled_step_no_conditional_donated_and_sharded(tiny_k4):
    text = tiny_k4.program.compiled.as_text()
    assert not hlo.parse_hlo(text).find("conditional")
    # Every state leaf is donated (aliased to an output).
    n_state = len(jax.tree.leaves(tiny_k4.program.abstract))
    assert text.count("may-alias") + text.count("must-alias") >= n_state
    # Optimizer moments take the parameters' sharding; counts are replicated.
    sh = tiny_k4.state_shardings
    adam = [s for s in sh["opt_state"] if hasattr(s, "mu")][0]
    P = jax.sharding.PartitionSpec
    assert adam.mu["embed"].spec == sh["params"]["embed"].spec == P(None, "fsdp")
    assert adam.count.spec == P()


def test_flops_per_step_formula():
    cfg = load_config(str(ROOT / "configs" / "fuji-3b-trn2.toml"))
    f = flops_per_step(cfg)
    tokens = 2048 * 8192
    assert f["params"] == 3_221_400_576
    assert f["dense"] == 6 * 3_221_400_576 * tokens
    assert f["attention"] == 6 * 28 * 24 * 128 * 8192 * tokens


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["mesh.data=1", "mesh.fsdp=16", "trainer.accum_steps=1"], "needs 16 devices but 8"),
        (["mesh.data=2", "mesh.fsdp=2"], "needs 4 devices but 8"),
        # a mesh that does not fit the devices is a mesh problem, whatever the batch
        (["mesh.data=4", "mesh.fsdp=4"], r"mesh \(data=4, fsdp=4, model=1\) needs 16"),
        (["trainer.accum_steps=8"], r"not divisible by accum_steps \(8\) x batch shards"),
        # -1 resolved on the devices: 8 shards, not the 2 of the fixed axes
        (
            ["data.global_batch=12"],
            r"data 4 \(mesh.data = -1: all devices left\) x fsdp 2 = 8 on 8 devices\) = 32: "
            r"no accum_steps works: make data.global_batch a multiple of 32",
        ),
        (
            ["data.global_batch=16", "trainer.accum_steps=4"],
            r"valid accum_steps on this mesh: \[1, 2\]",
        ),
    ],
)
def test_mesh_and_batch_errors(overrides, match):
    cfg = load_config(TINY, overrides)
    with pytest.raises(step.TrainError, match=match):
        mesh = step.make_mesh(cfg)
        step.check_batch(cfg, mesh)


def test_metrics_logger_console_modes_and_truncation(tmp_path):
    import io

    from trn_accum.train.metrics import MetricsLogger, format_line, truncate_metrics

    plain = io.StringIO()
    with MetricsLogger(tmp_path, total_steps=25, log_every=10, console=plain) as log:
        assert not log.progress  # StringIO is not a terminal: plain lines
        for s in range(1, 26):
            log.log_train(s, {"loss": 1.0 / s, "grad_norm": 0.5, "lr": 1e-3, "extra": 2})
        log.log_eval(20, {"eval_loss": 0.25})
    lines = plain.getvalue().splitlines()
    assert [ln.split()[1] for ln in lines if ln.startswith("step")] == [
        "1/25", "10/25", "20/25", "25/25"]  # fmt: skip
    assert "eval at step 20: eval_loss 0.2500" in lines
    assert "loss 0.1000" in format_line(10, 25, {"loss": 0.1})

    bar = io.StringIO()
    with MetricsLogger(tmp_path / "b", total_steps=3, console=bar, progress=True) as log:
        for s in (1, 2, 3):
            log.log_train(s, {"loss": float("nan")})
    assert bar.getvalue().count("\r[") == 3 and bar.getvalue().endswith("\n")
    assert read_metrics(tmp_path / "b")[0]["loss"] == "nan"  # JSON has no NaN literal

    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 26, "kind": "tr')  # a torn last line (killed mid-write)
    assert len(read_metrics(tmp_path)) == 26
    truncate_metrics(tmp_path, 12)
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 13))
    silent = io.StringIO()
    with MetricsLogger(tmp_path / "c", total_steps=1, enabled=False, console=silent) as log:
        log.log_train(1, {"loss": 1.0})
    assert silent.getvalue() == "" and not (tmp_path / "c").exists()
