"""`import-hf` reads every tensor of a checkpoint or names what it would drop; reads RoPE
settings as transformers 5 does; and reads only files inside the checkpoint directory.

Checkpoints are written by transformers' `save_pretrained` (a third layer that config.json
does not count, a `q_proj.bias` under `attention_bias: false`) and by safetensors directly
(an index that leaves a stored tensor out, index values that point elsewhere). transformers
is the reference for how `rope_scaling` / `rope_parameters` are read."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import run_cli, user_error_line
from safetensors.numpy import save_file

from trn_accum.config.load import load_config
from trn_accum.interop import convert, hf_io, llama
from trn_accum.interop.llama import InteropError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "fuji-tiny.toml")
MODEL = load_config(TINY, []).model
Q0_BIAS = "model.layers.0.self_attn.q_proj.bias"


def saved_by_transformers(directory: Path, **changes) -> Path:
    """A random fuji-tiny-shaped LlamaForCausalLM (with `changes` to its config) written by
    save_pretrained into `directory`."""
    hf = {**llama.hf_config(MODEL, "float32"), **changes}
    config = transformers.LlamaConfig.from_dict(hf)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def edit_config(directory: Path, **changes) -> None:
    path = directory / hf_io.CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


cli = run_cli


@pytest.fixture(scope="module")
def extra_layer(tmp_path_factory) -> Path:
    """Three layers stored, config.json saying two (as a truncated edit of a config would)."""
    d = saved_by_transformers(tmp_path_factory.mktemp("hf") / "three", num_hidden_layers=3)
    edit_config(d, num_hidden_layers=2)
    return d


def test_a_layer_config_json_does_not_count_is_named(extra_layer):
    with pytest.raises(InteropError) as e:
        convert.check_checkpoint(str(extra_layer), MODEL)
    line = str(e.value)
    assert "holds 9 tensor(s) the model does not use" in line
    assert "model.layers.2.input_layernorm.weight" in line and "--allow-unused-tensors" in line
    assert "\n" not in line
    said = []
    files = convert.check_checkpoint(str(extra_layer), MODEL, allow_unused=True, say=said.append)
    assert len(said) == 1
    for name in convert.unused_tensors(files, MODEL):
        assert name.startswith("model.layers.2.") and name in said[0]


def test_a_bias_attention_bias_false_does_not_use_is_named(tmp_path):
    d = saved_by_transformers(tmp_path / "bias", attention_bias=True)
    edit_config(d, attention_bias=False)
    with pytest.raises(InteropError, match=r"holds 8 tensor\(s\) .*model.layers.0.self_attn.k"):
        convert.check_checkpoint(str(d), MODEL)
    files = convert.check_checkpoint(str(d), MODEL, allow_unused=True)
    assert Q0_BIAS in convert.unused_tensors(files, MODEL)


def test_cli_refuses_then_imports_with_the_flag_and_logs_the_drop(extra_layer, tmp_path):
    run = tmp_path / "run"
    r = cli("import-hf", extra_layer, "--config", TINY, "--run-dir", run)
    user_error_line(r, 2, "model.layers.2.", "--allow-unused-tensors")
    assert not run.exists()
    said = []
    n = convert.import_hf(str(extra_layer), TINY, [], str(run), allow_unused=True, say=said.append)
    assert n > 0 and (run / "checkpoints" / "0").is_dir()
    assert len(said) == 1 and "dropping 9 tensor(s)" in said[0]
    assert "model.layers.2.mlp.down_proj.weight" in said[0]


def test_a_stored_tensor_the_index_leaves_out_is_named(tmp_path):
    shapes = convert.hf_shapes(MODEL)
    tensors = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
    d = tmp_path / "sharded"
    d.mkdir()
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(d / "a.safetensors"))
    save_file(
        {**{n: tensors[n] for n in names[half:]}, "extra.weight": np.ones(3, np.float32)},
        str(d / "b.safetensors"),
    )
    weight_map = {n: "a.safetensors" if i < half else "b.safetensors" for i, n in enumerate(names)}
    (d / hf_io.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    (d / hf_io.CONFIG).write_text(json.dumps(llama.hf_config(MODEL, "float32")))
    with pytest.raises(InteropError, match=r"holds 1 tensor\(s\) .* \(extra\.weight\)"):
        convert.check_checkpoint(str(d), MODEL)


@pytest.mark.parametrize(
    "value",
    [None, 5, "../outside.safetensors", "/etc/passwd", "", ".", ["a"], "sub/../../x"],
)
def test_index_values_must_name_files_inside_the_directory(tmp_path, value):
    shapes = convert.hf_shapes(MODEL)
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({n: np.zeros(s, np.float32) for n, s in shapes.items()}, str(d / "m.safetensors"))
    # what "../outside.safetensors" would read: a valid file, outside the checkpoint
    save_file({"x": np.zeros(1, np.float32)}, str(tmp_path / "outside.safetensors"))
    weight_map = dict.fromkeys(shapes, "m.safetensors")
    weight_map["model.norm.weight"] = value
    (d / hf_io.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(InteropError, match=r"weight_map maps tensors to what is not a file"):
        hf_io.tensor_files(str(d))
    weight_map["model.norm.weight"] = "./m.safetensors"  # inside: read
    (d / hf_io.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    files = hf_io.tensor_files(str(d))
    assert hf_io.tensor_headers(files)["model.norm.weight"] == ("F32", shapes["model.norm.weight"])


# ---------------------------------------------------------------------------------------------
# RoPE settings, as transformers 5 reads them

BASE = {
    k: v
    for k, v in llama.hf_config(MODEL, "float32").items()
    if k not in ("rope_scaling", "rope_parameters", "rope_theta")
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
ROPE_CASES = {
    "parameters default, scaling yarn": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_scaling": YARN,
    },
    "parameters llama3, scaling null": {"rope_parameters": LLAMA3, "rope_scaling": None},
    "scaling linear with 'type'": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "parameters default, scaling empty": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
        "rope_scaling": {},
    },
    "top-level theta only": {"rope_theta": 500000.0},
    "theta in both": {"rope_parameters": {**LLAMA3, "rope_theta": 7.0}, "rope_theta": 9.0},
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_settings_are_read_as_transformers_reads_them(case):
    hf = {**BASE, **ROPE_CASES[case]}
    theirs = transformers.LlamaConfig.from_dict(json.loads(json.dumps(hf))).rope_parameters
    assert llama._rope_params(json.loads(json.dumps(hf))) == theirs


def test_yarn_behind_a_default_rope_parameters_is_refused():
    hf = {**BASE, **ROPE_CASES["parameters default, scaling yarn"]}
    with pytest.raises(InteropError, match="rope type 'yarn'"):
        llama.model_fields(hf)
    fields = llama.model_fields({**BASE, **ROPE_CASES["parameters llama3, scaling null"]})
    assert fields["rope_scaling"] == "llama3" and fields["rope_scaling_factor"] == 8.0


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("rope_scaling", "linear", "rope_scaling = 'linear' (str)"),
        ("rope_scaling", [1, 2], "rope_scaling = [1, 2] (list)"),
        ("rope_scaling", 2.0, "rope_scaling = 2.0 (float)"),
        ("rope_parameters", True, "rope_parameters = True (bool)"),
        ("rope_parameters", {"full_attention": LLAMA3}, "per layer type (full_attention)"),
        ("rope_scaling", {"rope_type": ["llama3"]}, "rope type ['llama3']"),
        ("rope_scaling", {**LLAMA3, "factor": "8"}, "not numbers: factor = '8'"),
        ("rope_theta", "big", "not numbers: rope_theta = 'big'"),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor = 0.5 (ours: 1.0)"),
    ],
)
def test_rope_settings_ours_cannot_read_are_one_line(key, value, needle):
    with pytest.raises(InteropError) as e:
        llama.model_fields({**BASE, key: value})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_cli_rope_scaling_string_is_one_line(tmp_path):
    d = saved_by_transformers(tmp_path / "hf")
    edit_config(d, rope_scaling="linear")
    r = cli("import-hf", d, "--config", TINY, "--run-dir", tmp_path / "run")
    user_error_line(r, 2, "rope_scaling = 'linear' (str)")
