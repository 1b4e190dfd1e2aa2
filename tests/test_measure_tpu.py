"""The calibration configs and the row arithmetic of benchmarks/measure_tpu.py (no JAX run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from trn_accum.config.load import load_config
from trn_accum.model import fuji

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs" / "calibration").glob("tpu-v5e-*.toml"))


def _script():
    spec = importlib.util.spec_from_file_location("measure_tpu", ROOT / "benchmarks/measure_tpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_calibration_config_is_fuji_shaped_on_one_chip(path):
    cfg = load_config(path)
    ref = load_config(ROOT / "configs" / "fuji-3b-trn2.toml")
    keep = ("vocab_size", "hidden_dim", "num_heads", "num_kv_heads", "head_dim", "ffn_dim")
    keep += ("rope", "compute_dtype", "layer_loop", "init", "attention_block")
    assert {k: getattr(cfg.model, k) for k in keep} == {k: getattr(ref.model, k) for k in keep}
    # measured with the reference's remat (the 3B now keeps the attention's residuals too)
    assert cfg.model.remat == "save_qkvo"
    assert cfg.mesh.axes() == {"data": 1, "fsdp": 1, "model": 1}
    assert cfg.data.global_batch == cfg.trainer.accum_steps  # one sequence per minibatch
    # float32 parameters + Adam state: 12 B per parameter within one TPU v5e chip's 15.7 GiB
    assert 12 * fuji.num_params(cfg.model) < 0.75 * 15.7 * 2**30


def test_calibration_set_varies_k_attention_and_loss_chunk():
    cfgs = [load_config(p) for p in CONFIGS]
    assert len(cfgs) >= 8
    assert {c.trainer.accum_steps for c in cfgs} >= {1, 2, 4}
    assert {c.model.attention for c in cfgs} == {"plain", "blockwise"}
    assert {c.model.loss_chunk for c in cfgs} == {0, 128}


def test_steady_stats_drops_the_warmup_steps():
    stats = _script().steady_stats([9.0, 5.0, 1.0, 3.0, 2.0], warmup=2)
    assert (stats["median_step_s"], stats["min_step_s"], stats["max_step_s"]) == (2.0, 1.0, 3.0)
    assert (stats["steps_counted"], stats["steps_dropped"]) == (3, 2)
    with pytest.raises(ValueError, match="none left"):
        _script().steady_stats([9.0, 5.0], warmup=2)


def test_merge_replaces_rows_of_the_same_config():
    old = {"warmup_steps": 2, "rows": [{"config": "b", "v": 1}, {"config": "a", "v": 1}]}
    merged = _script().merge(old, [{"config": "b", "v": 2}, {"config": "c", "v": 2}])
    assert merged["rows"] == [
        {"config": "a", "v": 1},
        {"config": "b", "v": 2},
        {"config": "c", "v": 2},
    ]
    assert merged["warmup_steps"] == 2
