"""Typed config: the reference and tiny configs, overrides, and a battery of bad configs."""

import dataclasses
import json
from pathlib import Path

import pytest

from trn_accum.config import load as C
from trn_accum.config.load import ConfigError, config_from_dict, config_to_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "configs" / "fuji-3b-trn2.toml"
TINY = ROOT / "configs" / "fuji-tiny.toml"


def test_reference_config_is_fuji_3b_recipe():
    cfg = load_config(REF)
    m = cfg.model
    assert (m.vocab_size, m.num_layers, m.hidden_dim, m.ffn_dim) == (131072, 28, 3072, 8192)
    assert (m.num_heads, m.num_kv_heads, m.head_dim) == (24, 8, 128)
    assert (m.rope_theta, m.norm_eps, m.max_seq_len) == (500000.0, 1e-5, 8192)
    assert (m.compute_dtype, m.layer_loop, m.remat) == ("bfloat16", "unroll", "save_attention")
    # the settings search's pick (benchmarks/resolutions.json, tests/test_resolutions.py)
    assert (m.attention, m.attention_block, m.loss_chunk) == ("flash", 512, 1024)
    assert (m.init, m.rope) == ("fan_in", "interleaved")  # the reference recipe
    assert cfg.mesh == C.MeshConfig(data=-1, fsdp=32, model=2, rules="trn2", nodes=32)
    assert (cfg.data.global_batch, cfg.data.seq_len) == (2048, 8192)
    # k: the least memory per device at 32 nodes (the config's comment: the compiled fit check)
    assert (cfg.trainer.accum_steps, cfg.trainer.loop, cfg.trainer.reduce) == (
        2, "scan", "per_minibatch",
    )  # fmt: skip
    o = cfg.optimizer
    assert (o.kind, o.peak_lr, o.weight_decay, o.b1, o.b2, o.eps) == (
        "reference", 3e-4, 0.1, 0.9, 0.95, 1e-8,
    )  # fmt: skip
    assert (o.clip_norm, o.warmup_steps, o.decay_steps, o.final_lr_fraction) == (
        1.0, 2000, 983040, 0.1,
    )  # fmt: skip
    # 32 nodes x 64 devices, model 2: 1024 batch shards x 2 minibatches x 1 sequence = 2048.
    batch_shards = cfg.mesh.nodes * 64 // cfg.mesh.model
    assert cfg.data.global_batch == batch_shards * cfg.trainer.accum_steps * 1


def test_tiny_config_fits_8_devices():
    cfg = load_config(TINY)
    assert cfg.model.num_kv_heads < cfg.model.num_heads  # GQA kept
    assert cfg.mesh.rules == "fsdp" and cfg.mesh.model == 1
    assert cfg.data.global_batch % (8 * cfg.trainer.accum_steps) == 0


def test_overrides_parse_as_toml_values():
    cfg = load_config(
        REF,
        [
            "trainer.accum_steps=8",
            "model.vocab_size = 128256",
            "model.rope_theta=10000",  # an integer where a float is expected
            "optimizer.kind=adamw",  # bare word
            'data.kind="tokens"',
            "data.path=/data/fuji tokens",  # bare string with a slash and a space
            "mesh.nodes=64",
        ],
    )
    assert cfg.trainer.accum_steps == 8 and cfg.model.vocab_size == 128256
    assert cfg.model.rope_theta == 10000.0 and isinstance(cfg.model.rope_theta, float)
    assert cfg.optimizer.kind == "adamw"
    assert (cfg.data.kind, cfg.data.path, cfg.mesh.nodes) == ("tokens", "/data/fuji tokens", 64)
    assert load_config(TINY, ["trainer.accum_steps=auto"]).trainer.accum_steps == "auto"


def test_config_dict_round_trip():
    cfg = load_config(TINY, ["trainer.accum_steps=auto"])
    d = config_to_dict(cfg)
    assert json.loads(json.dumps(d)) == d
    assert config_from_dict(d) == cfg
    assert set(d) == set(C.SECTIONS) and d["model"]["num_kv_heads"] == 2


def test_missing_keys_take_defaults(tmp_path):
    p = tmp_path / "c.toml"
    others = "".join(f"[{name}]\n" for name in ("mesh", "data", "optimizer", "checkpoint"))
    p.write_text(f"[model]\nnum_layers = 2\n[trainer]\nsteps = 5\n{others}")
    cfg = load_config(p)
    assert cfg.model == dataclasses.replace(C.ModelConfig(), num_layers=2)
    assert cfg.trainer.steps == 5 and cfg.checkpoint == C.CheckpointConfig()


# (override, text every message must contain: the key and the value)
BAD_OVERRIDES = [
    ("model.hidden=64", ["model.hidden", "64", "allowed keys"]),
    ("modle.num_layers=2", ["modle", "allowed"]),
    ("model.num_layers=2.5", ["model.num_layers", "2.5", "integer"]),
    ("model.num_layers=true", ["model.num_layers", "True", "integer"]),
    ("trainer.steps=ten", ["trainer.steps", "'ten'", "integer"]),
    ("model.num_heads=5", ["model.num_heads", "5", "model.hidden_dim (64)"]),
    ("model.num_kv_heads=3", ["model.num_kv_heads", "3", "model.num_heads (4)"]),
    ("model.head_dim=15", ["model.head_dim", "15", "even"]),
    ("model.num_layers=0", ["model.num_layers", "0", ">= 1"]),
    ("model.attention=flash2", ["model.attention", "'flash2'", "'blockwise'", "'neuron_flash'"]),
    ("model.compute_dtype=float16", ["model.compute_dtype", "float16", "'bfloat16'"]),
    ("model.remat=dots", ["model.remat", "'dots'", "'save_qkvo'"]),
    ("model.layer_loop=while", ["model.layer_loop", "'while'", "'scan'"]),
    ("model.loss_chunk=-1", ["model.loss_chunk", "-1", ">= 0"]),
    ("mesh.fsdp=-1", ["mesh.fsdp", "-1", "only one mesh axis", "mesh.data"]),
    ("mesh.model=0", ["mesh.model", "0", "-1"]),
    ("mesh.rules=tp", ["mesh.rules", "'tp'", "'trn2'", "'fsdp'"]),
    ("mesh.model=2", ["mesh.model", "2", "rules"]),
    ("data.seq_len=4096", ["data.seq_len", "4096", "model.max_seq_len (128)"]),
    ("trainer.stop_after_nonfinite=-1", ["trainer.stop_after_nonfinite", "-1", ">= 0"]),
    ("data.kind=tokens", ["data.path", "tokens"]),
    ("data.kind=text", ["data.kind", "'text'", "'synthetic'"]),
    ("trainer.accum_steps=0", ["trainer.accum_steps", "0", '"auto"']),
    ("trainer.accum_steps=some", ["trainer.accum_steps", "'some'", '"auto"']),
    ("trainer.reduce=never", ["trainer.reduce", "'never'", "'once'"]),
    ("optimizer.kind=sgd", ["optimizer.kind", "'sgd'", "'reference'"]),
    ("optimizer.b2=1.0", ["optimizer.b2", "1.0", "[0, 1)"]),
    ("optimizer.decay_steps=5", ["optimizer.decay_steps", "5", "warmup_steps (10)"]),
    ("optimizer.final_lr_fraction=2", ["optimizer.final_lr_fraction", "2.0", "[0, 1]"]),
    ("optimizer.peak_lr=nan", ["optimizer.peak_lr", "nan", "number"]),
    ("checkpoint.keep=0", ["checkpoint.keep", "0", ">= 1"]),
    ("trainer.accum_steps", ["trainer.accum_steps", "section.key=value"]),
    ("accum_steps=4", ["accum_steps=4", "section.key=value"]),
    ("trainer.steps=", ["trainer.steps", "empty"]),
]


@pytest.mark.parametrize("override,needles", BAD_OVERRIDES, ids=[o for o, _ in BAD_OVERRIDES])
def test_bad_config_is_a_one_line_error(override, needles):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    msg = str(err.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_trn2_rules_check_tensor_parallel_divisibility():
    with pytest.raises(ConfigError, match=r"model\.num_kv_heads = 8: .*mesh\.model \(3\)"):
        load_config(REF, ["mesh.model=3"])
    with pytest.raises(ConfigError, match=r"model\.hidden_dim = 3072: .*mesh\.fsdp \(5\)"):
        load_config(REF, ["mesh.fsdp=5", "data.global_batch=2000"])


@pytest.mark.parametrize(
    "text,needles",
    [
        ("[model]\nnum_layers = 2\n[extra]\nx = 1\n", ["[extra]", "allowed"]),
        ("[model]\nnum_layers = \n", ["not valid TOML"]),
        ("model = 3\n", ["[model]", "table"]),
        ("[model]\nnum_heads = 24\nnum_heads = 8\n", ["not valid TOML"]),
    ],
)
def test_bad_config_file(tmp_path, text, needles):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert "\n" not in str(err.value) and all(n in str(err.value) for n in needles), err.value


def test_binary_config_file_is_a_one_line_error(tmp_path):
    p = tmp_path / "bin.toml"
    p.write_bytes(b"\x8a\xff\x00" + bytes(range(256)))
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert "not UTF-8" in str(err.value) and "\n" not in str(err.value)


def test_batch_rule_waits_for_the_mesh():
    """global batch vs accum_steps x batch shards needs the mesh on the devices (an axis of -1,
    a mesh larger than the devices): load_config leaves it to trn_accum.train.step.check_batch,
    so that a mesh problem is reported as one."""
    cfg = load_config(TINY, ["data.global_batch=20", "mesh.data=4", "mesh.fsdp=4"])
    assert cfg.data.global_batch == 20


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
