"""`import-hf` refuses what is not float weights, and recovers from its own killed save.

Tiny Llama checkpoints (fuji-tiny's shapes) are written directly with safetensors.numpy and
ml_dtypes: int8 codes with their scales, FP8 (E4M3, E5M2), GPTQ's packed int32, a
`quantization_config`, NaN / Inf tensors, and a tied config holding a different `lm_head`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import subprocess_env, user_error_line
from safetensors.numpy import save_file

from trn_accum.config.load import load_config
from trn_accum.interop import convert, hf_io, llama, validate
from trn_accum.interop.llama import InteropError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "fuji-tiny.toml")
MODEL = load_config(TINY, []).model
Q0 = "model.layers.0.self_attn.q_proj.weight"
EMBED = llama.TOP_TENSORS["embed"]


def float_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor fuji-tiny needs, float32, HF names and shapes."""
    rng = np.random.default_rng(seed)
    return {
        n: (rng.standard_normal(s) * 0.05).astype(np.float32)
        for n, s in convert.hf_shapes(MODEL).items()
    }


def write_checkpoint(directory: Path, tensors: dict, **config) -> Path:
    """config.json (ours for fuji-tiny, plus `config`) and model.safetensors in `directory`."""
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / hf_io.SINGLE), {"format": "pt"})
    hf = {**llama.hf_config(MODEL, "float32"), **config}
    (directory / hf_io.CONFIG).write_text(json.dumps(hf))
    return directory


def test_quantized_checkpoints_are_refused_from_their_headers(tmp_path):
    base = float_tensors()
    gptq = {n: v for n, v in base.items() if n != Q0}
    gptq[Q0.replace("weight", "qweight")] = np.zeros((8, 64), np.int32)  # 4-bit codes, packed
    gptq[Q0.replace("weight", "scales")] = np.ones((1, 64), np.float16)
    cases = {
        "int8": ({Q0: base[Q0].astype(np.int8), Q0.replace("weight", "SCB"): np.ones(64)}, "I8"),
        "uint8": ({Q0: base[Q0].astype(np.uint8)}, "U8"),
        "e4m3": ({Q0: base[Q0].astype(ml_dtypes.float8_e4m3fn)}, "F8_E4M3"),
        "e5m2": ({Q0: base[Q0].astype(ml_dtypes.float8_e5m2)}, "F8_E5M2"),
    }
    for case, (changed, dtype) in cases.items():
        d = write_checkpoint(tmp_path / case, {**base, **changed})
        with pytest.raises(InteropError, match=f"{Q0} {dtype}.*dequantize it"):
            convert.check_checkpoint(str(d), MODEL)
        # read alone, the tensor is refused from its header: never converted through NumPy
        with pytest.raises(InteropError, match=f"{Q0} {dtype}"):
            hf_io.read_tensor(hf_io.tensor_files(str(d)), Q0)
    # GPTQ's tensors have other names: the dtype, not a missing tensor, is what is named
    d = write_checkpoint(tmp_path / "gptq", gptq)
    with pytest.raises(InteropError, match=r"q_proj\.qweight I32.*quantized checkpoint"):
        convert.check_checkpoint(str(d), MODEL)
    # float weights in every float dtype pass; a quantization_config is refused by itself
    floats = {n: v.astype(ml_dtypes.bfloat16) for n, v in base.items()}
    floats[Q0] = base[Q0].astype(np.float16)
    d = write_checkpoint(tmp_path / "floats", floats)
    assert sorted(convert.check_checkpoint(str(d), MODEL)) == sorted(base)
    quant = {"quant_method": "awq", "bits": 4}
    d = write_checkpoint(tmp_path / "awq", base, quantization_config=quant)
    with pytest.raises(InteropError, match="quantization_config, quant_method 'awq'"):
        convert.check_checkpoint(str(d), MODEL)


def test_nonfinite_tensor_is_named_as_it_is_read(tmp_path):
    tensors = float_tensors()
    q1 = "model.layers.1.self_attn.q_proj.weight"
    tensors[q1][7, 3] = np.nan
    tensors[q1][9, 0] = -np.inf
    tensors["model.norm.weight"][:] = 3e38  # finite, and their sum overflows float32
    d = write_checkpoint(tmp_path / "nan", tensors)
    files = convert.check_checkpoint(str(d), MODEL)  # headers only: not read yet
    np.testing.assert_array_equal(convert.read_param(files, "final_norm", MODEL), np.float32(3e38))
    with pytest.raises(InteropError, match=rf"tensor {q1} in .* holds 2 NaN/Inf .*\[7, 3\]"):
        convert.read_param(files, "layers/q", MODEL)


def test_tied_config_with_a_different_lm_head(tmp_path):
    tensors = float_tensors()
    embed = tensors[EMBED]
    same = write_checkpoint(
        tmp_path / "same", {**tensors, validate.LM_HEAD: embed.astype(ml_dtypes.bfloat16)}
    )
    with pytest.raises(InteropError, match="tie_word_embeddings = true but holds an lm_head"):
        convert.check_checkpoint(str(same), MODEL)  # bf16-rounded: not the same values
    exact = {**tensors, EMBED: embed.astype(ml_dtypes.bfloat16)}
    head = exact[EMBED].astype(np.float32)  # the same values, another dtype
    d = write_checkpoint(tmp_path / "exact", {**exact, validate.LM_HEAD: head})
    assert validate.LM_HEAD in convert.check_checkpoint(str(d), MODEL)  # equal: the tie holds
    files = hf_io.tensor_files(str(d))
    assert hf_io.tensors_equal(files, EMBED, validate.LM_HEAD, rows=3)
    last = embed.copy()
    last[-1, -1] += 1.0  # in the last, partial block of 3 rows (512 = 170 * 3 + 2)
    d = write_checkpoint(tmp_path / "last", {**tensors, validate.LM_HEAD: last})
    assert not hf_io.tensors_equal(hf_io.tensor_files(str(d)), EMBED, validate.LM_HEAD, rows=3)
    d = write_checkpoint(tmp_path / "shape", {**tensors, validate.LM_HEAD: embed[:-1]})
    with pytest.raises(InteropError, match="differs from model.embed_tokens.weight"):
        convert.check_checkpoint(str(d), MODEL)


def test_import_runs_again_over_its_killed_save(tmp_path):
    """A kill during import's save leaves `checkpoints/0.orbax-checkpoint-tmp` (the state
    half-written, no commit marker): the same import again replaces it and commits step 0;
    a committed step is still refused."""
    hf = write_checkpoint(tmp_path / "hf", float_tensors())
    run = tmp_path / "run"
    convert.import_hf(str(hf), TINY, [], str(run))
    ckpts = run / "checkpoints"
    os.rename(ckpts / "0", ckpts / "0.orbax-checkpoint-tmp")  # as a kill before the commit
    os.remove(ckpts / "0.orbax-checkpoint-tmp" / "commit_success.txt")
    os.remove(run / "config.json")

    assert convert.import_hf(str(hf), TINY, [], str(run)) > 0
    assert sorted(os.listdir(ckpts)) == ["0"]
    _, _, params, step = convert.restore_params(str(run))
    np.testing.assert_array_equal(
        np.asarray(jax.device_get(params["embed"])), float_tensors()[EMBED]
    )
    assert step == 0
    with pytest.raises(InteropError, match=r"already holds checkpoints \(steps 0\)"):
        convert.import_hf(str(hf), TINY, [], str(run))


def test_cli_refuses_fp8_in_one_line(tmp_path):
    tensors = float_tensors()
    tensors[Q0] = tensors[Q0].astype(ml_dtypes.float8_e4m3fn)
    hf = write_checkpoint(tmp_path / "fp8", tensors)
    run = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "trn_accum.cli", "import-hf", str(hf), "--config", TINY]
        + ["--run-dir", str(run)],
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    user_error_line(r, 2, f"{Q0} F8_E4M3", "quantized checkpoint does not import")
    assert not run.exists()
