"""`trn-accum neuron-check`: the table on CPU (exit 0), and a broken piece named (exit 1)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from conftest import xla_flags

from trn_accum import cli
from trn_accum.config.load import load_config
from trn_accum.neuron import kernels
from trn_accum.plan import neuron_check

ROOT = Path(__file__).resolve().parents[1]
F3B = str(ROOT / "configs" / "fuji-3b-trn2.toml")
PIECES = ["root", *(name for name, _ in neuron_check.ROWS)]  # root first: before the backend


@pytest.mark.slow
def test_cpu_table_every_row_passes_exit_0(tmp_path):
    """The command as a user runs it (its own 8 emulated devices): one row per piece, every
    applicable row passes, the Neuron kernels marked as CPU stand-ins, exit 0."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = xla_flags()  # the command sets its devices itself
    r = subprocess.run(
        [sys.executable, "-m", "trn_accum.cli", "neuron-check", "--config", F3B,
         "--run-dir", str(tmp_path / "run"), "--json"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(r.stdout)
    rows = {row["piece"]: row for row in rep["rows"]}
    assert list(rows) == PIECES and rep["passed"] and rep["devices"] == 8
    assert {row["status"] for row in rep["rows"]} <= {"pass", "skip"}
    assert rows["psum-procs"]["status"] == "skip"  # one process
    assert "CPU stand-in" in rows["neuron-flash"]["detail"]
    assert "mesh data 2" in rows["reduce-once"]["detail"]  # the shard_map path, not a no-op
    gather = rows["gather-once"]  # both programs ran: the gathered-once step and the other
    assert gather["status"] == "pass" and "(gather once_unsharded) vs" in gather["detail"]
    assert "psum over 8 devices = 28 (exact 28)" in rows["psum"]["detail"]
    assert "127.0.0.1:41000 -> 127.0.0.1:41000" in rows["root"]["detail"]  # one process
    # 8 devices, model 2: 4 batch shards, 2048 / (4 x k=2) = 256 rows per minibatch, 24/2 heads
    kernel_pair = rows["kernel-pair"]
    assert kernel_pair["status"] == "skip" and "B=256 H=12 KV=4 S=8192" in kernel_pair["detail"]
    assert not list((tmp_path / "run").glob(".neuron-check-*"))  # the checkpoint row cleans up


def _run_rows(monkeypatch, capsys, pieces, *argv):
    """`trn-accum neuron-check` in this process (its 8 devices), limited to `pieces`."""
    rows = tuple(r for r in neuron_check.ROWS if r[0] in pieces)
    monkeypatch.setattr(neuron_check, "ROWS", rows)
    code = cli.main(["neuron-check", "--config", F3B, *argv])
    return code, capsys.readouterr().out


def test_lnc_pair_that_disagrees_fails_and_is_named(monkeypatch, capsys):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--target=trn2 --lnc=1")
    code, out = _run_rows(monkeypatch, capsys, {"lnc", "prng", "accumulate"})
    assert code == 1
    lnc = next(line for line in out.splitlines() if "  lnc  " in line)
    assert lnc.startswith("FAIL") and "NEURON_LOGICAL_NC_CONFIG=2" in lnc and "--lnc=1" in lnc
    assert out.splitlines()[-1].startswith("FAILED: lnc")
    assert any(line.startswith("pass") and "prng" in line for line in out.splitlines())
    # the model rows would compile for the wrong devices: skipped, the row to fix named
    accumulate = next(line for line in out.splitlines() if "  accumulate  " in line)
    assert accumulate.startswith("skip") and "not run: lnc failed" in accumulate


def test_attention_kernel_whose_outputs_differ_fails_and_is_named(monkeypatch, capsys):
    """An attention override 1% off: the neuron-flash row fails with the error it measured."""
    ref = kernels.reference_kernels()

    def off_by_one_percent(*args, **kwargs):
        out, neg_max, recip = ref["fwd"].fn(*args, **kwargs)
        return out * jnp.asarray(1.01, out.dtype), neg_max, recip

    broken = {"fwd": kernels.Launchable(off_by_one_percent, "broken"), "bwd": ref["bwd"]}
    with kernels.substitute(broken):
        code, out = _run_rows(monkeypatch, capsys, {"neuron-flash"}, "--json")
    rep = json.loads(out)
    assert code == 1 and not rep["passed"]
    assert [r["piece"] for r in rep["rows"]] == ["root", "neuron-flash"]  # root runs first
    row = rep["rows"][1]
    assert row["status"] == "FAIL"
    assert "substituted kernels" in row["detail"] and "max relative error" in row["detail"]
    assert broken["fwd"].grids == [2]  # launched on the LNC grid


def test_backward_with_nkilib_2_29_numerics_fails_the_sharp_bf16_case(monkeypatch, capsys):
    """nkilib 2.29's attention_bwd multiplied Q by the softmax scale in the input dtype at load
    (BWD:790 `scale_first`) and ran the exponential at scale 1; 2.30+ scales the float32
    scores. The neuron-flash row's bf16 case (head dim 96: a scale that bf16 rounds; scores of
    std 36) passes with the 2.30+ stand-ins and fails with the 2.29 arithmetic, named."""
    ref = kernels.reference_kernels()

    def prescaled_bwd(q, k, v, o, dy, lse, *args, softmax_scale=None, **kwargs):
        qs = (q.astype(jnp.float32) * softmax_scale).astype(q.dtype)  # rounded to bf16
        dq, dk, dv = ref["bwd"].fn(qs, k, v, o, dy, lse, *args, softmax_scale=1.0, **kwargs)
        return (dq.astype(jnp.float32) * softmax_scale).astype(dq.dtype), dk, dv

    old = {"fwd": ref["fwd"], "bwd": kernels.Launchable(prescaled_bwd, "2.29 numerics")}
    with kernels.substitute(old):
        code, out = _run_rows(monkeypatch, capsys, {"neuron-flash"}, "--json")
    row = json.loads(out)["rows"][1]
    assert code == 1 and row["status"] == "FAIL"
    sharp = row["detail"].split("; ")[1]
    assert sharp.startswith(neuron_check.SHARP)
    assert float(sharp.split("dv ")[1].split(" ")[0]) > 5e-2  # 1.0e-1 measured
    with kernels.substitute(kernels.reference_kernels()):
        code, out = _run_rows(monkeypatch, capsys, {"neuron-flash"}, "--json")
    row = json.loads(out)["rows"][1]
    assert code == 0 and row["status"] == "pass" and neuron_check.SHARP in row["detail"]


def test_row_that_raises_fails_with_one_line(monkeypatch, capsys):
    def boom(check):
        raise RuntimeError("compiler said no\nsecond line")

    monkeypatch.setattr(neuron_check, "row_blockwise", boom)
    rows = tuple((n, boom if n == "blockwise" else f) for n, f in neuron_check.ROWS)
    monkeypatch.setattr(neuron_check, "ROWS", rows)
    code, out = _run_rows(monkeypatch, capsys, {"blockwise", "psum"})
    line = next(x for x in out.splitlines() if "blockwise" in x and x.startswith("FAIL"))
    assert code == 1 and "RuntimeError: compiler said no" in line and "second line" not in out


def test_lnc_row_reads_the_documented_long_spelling(monkeypatch, capsys):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--target=trn2 --logical-nc-config=1")
    code, out = _run_rows(monkeypatch, capsys, {"lnc"})
    assert code == 1
    lnc = next(line for line in out.splitlines() if "  lnc  " in line)
    assert lnc.startswith("FAIL") and "--logical-nc-config=1" in lnc


@pytest.mark.slow
def test_reduce_once_row_takes_the_configs_reduce_dtype_and_resets_what_it_compares(
    monkeypatch, capsys
):
    """With the config's trainer.reduce = "once", gather = "once_unsharded" and reduce_dtype =
    "bfloat16": the reduce-once row runs "once" in bf16 (compared at bf16 rounding) against a
    plain per_minibatch program (the options per_minibatch refuses, gather and reduce_dtype,
    are reset in its probe, not an error)."""
    sets = ['trainer.reduce="once"', 'trainer.gather="once_unsharded"',
            'trainer.reduce_dtype="bfloat16"']  # fmt: skip
    argv = [a for s in sets for a in ("--set", s)]
    code, out = _run_rows(monkeypatch, capsys, {"reduce-once"}, "--json", *argv)
    rows = {row["piece"]: row for row in json.loads(out)["rows"]}
    assert code == 0, out
    assert {r["status"] for r in rows.values()} == {"pass"}
    assert "(once, bfloat16) vs" in rows["reduce-once"]["detail"]
    assert "mesh data 2" in rows["reduce-once"]["detail"]


def test_rows_that_compare_against_the_same_program_run_it_once(tmp_path, monkeypatch):
    """Check.train_step runs each config once: reduce-once's float32 "once" program is the
    reference of gather-once (the same config), so the table compiles 5 train steps, not 6."""
    from trn_accum.plan.probe import Check
    from trn_accum.train import trainer as trainer_lib

    builds = []
    real_build = trainer_lib.Trainer.build
    monkeypatch.setattr(
        trainer_lib.Trainer,
        "build",
        classmethod(lambda cls, cfg, *a, **kw: builds.append(cfg) or real_build(cfg, *a, **kw)),
    )
    c = Check(load_config(F3B), str(tmp_path))
    once = c.probe(data=2, accum_steps=4, reduce="once", reduce_dtype="float32")
    assert repr(once) == repr(c.probe(data=2, accum_steps=4, reduce="once"))
    first = c.train_step(once)
    assert c.train_step(c.probe(data=2, accum_steps=4, reduce="once")) == first
    assert len(builds) == 1 and first["loss"] > 0


def test_auto_settings_probe_as_concrete_ones(tmp_path):
    """A config whose remat and loss chunk are "auto" (chosen from memory when training) builds
    a probe model the rows can compile: no remat (its numerics row compares "full") and the
    whole loss; a set chunk is kept, cut to the probe's sequence."""
    from trn_accum.plan.probe import Check

    auto = Check(load_config(F3B, ["model.remat=auto", "model.loss_chunk=auto"]), str(tmp_path))
    assert (auto.probe().model.remat, auto.probe().model.loss_chunk) == ("none", 0)
    kept = Check(load_config(F3B, ["model.loss_chunk=128"]), str(tmp_path)).probe().model
    assert (kept.remat, kept.loss_chunk) == ("save_attention", 128)
