"""Hugging Face Llama checkpoints in and out (`trn-accum import-hf`, `export-hf`, `eval`),
checked against an independent implementation: transformers' own `LlamaForCausalLM` (PyTorch,
CPU), a small random one with grouped-query attention, the llama3 RoPE scaling and a tied
embedding, on a batch with right padding (its attention_mask; ours: target mask 0)."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from conftest import run_cli, user_error_line
from safetensors.numpy import load_file, save_file

from trn_accum.interop import convert, evaluate, hf_io, llama
from trn_accum.model import fuji
from trn_accum.model.rope import inverse_frequencies

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "fuji-tiny.toml")
# fuji-tiny's shapes in f32, with the llama3 scaling over an original context of 16 positions
# (so it changes the frequencies the 33-token rows use)
SETS = (
    "model.compute_dtype=float32",
    "model.rope_scaling=llama3",
    "model.rope_original_max_len=16",
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
TOL = 1e-4


cli = run_cli


def sets(*extra):
    return [a for s in (*SETS, *extra) for a in ("--set", s)]


def hf_logits(model_dir, tokens):
    """transformers' logits [N, S, V] for int tokens [N, S] (negative = right padding)."""
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(np.where(tokens < 0, 0, tokens))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.tensor(tokens >= 0).long())
    return out.logits.numpy()


def our_logits(run_dir, tokens, **model_changes):
    cfg, mesh, params, _ = convert.restore_params(str(run_dir))
    m = dataclasses.replace(cfg.model, **model_changes)
    with jax.set_mesh(mesh):
        out = jax.jit(fuji.forward, static_argnums=2)(params, np.where(tokens < 0, 0, tokens), m)
    return np.asarray(out)


def mean_loss(logits, tokens):
    """Mean next-token cross-entropy over the targets that are not padding, and their count."""
    lp = logits[:, :-1] - np.log(np.exp(logits[:, :-1]).sum(-1, keepdims=True))
    on = tokens[:, 1:] >= 0
    picked = np.take_along_axis(lp, np.where(on, tokens[:, 1:], 0)[..., None], -1)[..., 0]
    return float(-(picked * on).sum() / on.sum()), int(on.sum())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A random transformers Llama (fuji-tiny's shapes) saved with save_pretrained, a padded
    batch of tokens (.npy) and transformers' logits of it."""
    base = tmp_path_factory.mktemp("hf")
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rope_scaling=LLAMA3,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # larger than the default init: logits that vary
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    model.save_pretrained(base / "model", safe_serialization=True)
    tokens = np.random.default_rng(0).integers(0, 512, (4, 33))
    tokens[1, 20:] = -1  # right padding
    tokens[3, 5:] = -1
    np.save(base / "tokens.npy", tokens)
    return {
        "dir": base / "model",
        "tokens": tokens,
        "tokens_file": base / "tokens.npy",
        "logits": hf_logits(base / "model", tokens),
    }


@pytest.mark.parametrize("rope", ["interleaved", "halves"])
def test_import_matches_transformers(reference, tmp_path, rope):
    run = tmp_path / "run"
    r = cli(
        "import-hf",
        reference["dir"],
        "--config",
        TINY,
        "--run-dir",
        run,
        *sets(f"model.rope={rope}"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    tokens, ref = reference["tokens"], reference["logits"]
    on = tokens >= 0

    ours = our_logits(run, tokens)
    delta = np.abs(ours - ref)[on].max()
    print(f"\nimport-hf (rope {rope}): max |logits - transformers'| = {delta:.2e}")
    assert delta <= TOL
    # the llama3 scaling is in play: without it the logits move
    assert np.abs(our_logits(run, tokens, rope_scaling="none") - ref)[on].max() > 100 * TOL

    r = cli("eval", "--run-dir", run, "--tokens", reference["tokens_file"], "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    want, count = mean_loss(ref.astype(np.float64), tokens)
    print(f"eval --tokens loss {got['loss']:.7f}, transformers' {want:.7f} ({count} targets)")
    assert got["tokens"] == count == 87
    assert abs(got["loss"] - want) <= TOL

    # exporting the import gives back the checkpoint's tensors, bit for bit
    r = cli("export-hf", run, tmp_path / "out", "--dtype", "float32")
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = (
        load_file(reference["dir"] / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype == np.float32
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_imported_run_trains_from_step_0(reference, tmp_path):
    run = tmp_path / "run"
    r = cli("import-hf", reference["dir"], "--config", TINY, "--run-dir", run, *sets())
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli(
        "train",
        "--config",
        TINY,
        "--run-dir",
        run,
        *sets("trainer.steps=1", "trainer.eval_every=0"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(step 0)" in r.stdout and "steps 1..1" in r.stdout, r.stdout
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0", "1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """fuji-tiny (f32, interleaved RoPE, llama3 scaling) trained 2 steps on token data, with
    the trainer's evaluation after step 2."""
    base = tmp_path_factory.mktemp("trained")
    text = base / "corpus.txt"
    text.write_text(("the quick brown fox jumps over the lazy dog. " * 40 + "\n") * 10)
    r = cli("prepare-data", text, "--out", base / "tok")
    assert r.returncode == 0, r.stderr
    extra = ("model.rope=interleaved", "trainer.steps=2", "trainer.eval_every=2")
    extra += ("data.kind=tokens", f"data.path={base / 'tok'}")
    r = cli("train", "--config", TINY, "--run-dir", base / "run", *sets(*extra))
    assert r.returncode == 0, r.stderr[-3000:]
    return base


@pytest.mark.slow
def test_trained_run_exports_to_transformers_and_back(trained, reference, tmp_path):
    run, tokens = trained / "run", reference["tokens"]
    r = cli("export-hf", run, tmp_path / "f32", "--dtype", "float32")
    assert r.returncode == 0, r.stderr[-3000:]
    # a trained run has no token ids: no generation_config.json, and export-hf says so
    assert not (tmp_path / "f32" / "generation_config.json").exists()
    assert "no generation_config.json: the run holds no bos/eos/pad token ids" in r.stderr
    ours = our_logits(run, tokens)
    theirs = hf_logits(tmp_path / "f32", tokens)
    delta = np.abs(ours - theirs)[tokens >= 0].max()
    print(f"\nexport-hf of a trained run: max |transformers' logits - ours| = {delta:.2e}")
    assert delta <= TOL

    # export -> import: the trained parameters again, bit for bit
    r = cli(
        "import-hf",
        tmp_path / "f32",
        "--config",
        TINY,
        "--run-dir",
        tmp_path / "back",
        *sets("model.rope=interleaved"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    _, _, before, _ = convert.restore_params(str(run))
    _, _, after, _ = convert.restore_params(str(tmp_path / "back"))
    for (path, a), b in zip(jax.tree.leaves_with_path(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))

    # bfloat16: the f32 tensors rounded once, and transformers loads it
    r = cli("export-hf", run, tmp_path / "bf16")
    assert r.returncode == 0, r.stderr[-3000:]
    f32, bf16 = (
        load_file(tmp_path / "f32" / "model.safetensors"),
        load_file(tmp_path / "bf16" / "model.safetensors"),
    )
    for name, value in f32.items():
        assert bf16[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(bf16[name], value.astype(ml_dtypes.bfloat16), err_msg=name)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16")
    assert model.dtype == torch.bfloat16 and model.config.tie_word_embeddings


def test_eval_data_is_the_trainers_eval(trained):
    r = cli("eval", "--run-dir", trained / "run", "--data", trained / "tok", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    logged = [
        json.loads(line) for line in (trained / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    (eval_loss,) = [m["eval_loss"] for m in logged if m["kind"] == "eval"]
    assert got["tokens"] > 0
    assert abs(got["loss"] - eval_loss) <= 1e-6


def test_refused_import_names_every_field_and_writes_nothing(reference, tmp_path):
    run = tmp_path / "run"
    r = cli(
        "import-hf",
        reference["dir"],
        "--config",
        TINY,
        "--run-dir",
        run,
        *sets("model.num_kv_heads=4", "model.ffn_dim=128"),
    )
    line = user_error_line(
        r, 2, "num_kv_heads: checkpoint 2, config 4", "ffn_dim: checkpoint 192, config 128"
    )
    assert "(--set model.num_kv_heads=2 --set model.ffn_dim=192)" in line
    assert not run.exists()

    untied = tmp_path / "untied"
    shutil.copytree(reference["dir"], untied)
    cfg = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    r = cli("import-hf", untied, "--config", TINY, "--run-dir", run, *sets())
    user_error_line(r, 2, "tie_word_embeddings = False")
    assert not run.exists()


def test_sharded_checkpoints_in_and_out(reference, tmp_path):
    """A checkpoint sharded by save_pretrained reads as the single file does; one we write in
    shards (with its index) loads in transformers and computes the reference's logits."""
    model = transformers.LlamaForCausalLM.from_pretrained(reference["dir"], dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="200KB")
    assert (tmp_path / "sharded" / hf_io.INDEX).exists()
    cfg = fuji.ModelConfig(
        vocab_size=512, num_layers=2, hidden_dim=64, num_heads=4, num_kv_heads=2, head_dim=16,
        ffn_dim=192, rope_theta=10000.0, rope_scaling="llama3", rope_original_max_len=16,
    )  # fmt: skip
    single = convert.check_checkpoint(str(reference["dir"]), cfg)
    sharded = convert.check_checkpoint(str(tmp_path / "sharded"), cfg)
    assert len(set(sharded.values())) > 1
    for path in ("embed", "layers/q", "layers/down", "final_norm"):
        want = convert.read_param(single, path, cfg)
        np.testing.assert_array_equal(convert.read_param(sharded, path, cfg), want)

    sizes = {n: 4 * int(np.prod(s)) for n, s in convert.hf_shapes(cfg).items()}
    written = hf_io.write_checkpoint(
        str(tmp_path / "out"),
        llama.hf_config(cfg, "float32"),
        sizes,
        lambda name: hf_io.read_tensor(single, name),
        max_bytes=100_000,
    )
    assert hf_io.INDEX in written and len(written) > 3
    tokens = reference["tokens"]
    np.testing.assert_array_equal(hf_logits(tmp_path / "out", tokens), reference["logits"])


def test_eval_tokens_refuses_bad_rows(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.asarray([[1, 2, 3], [4, -1, -1]]))
    assert evaluate.read_tokens(str(path), 8).shape == (2, 3)
    for bad, needle in (
        ([[1, -1, 3]], "row 0 has padding (a negative id) at column 1 before a token"),
        ([[1, 9, 3]], "id 9 at row 0, column 1 is >= the model's vocabulary (8)"),
        ([1, 2, 3], "an integer array [N, S] with S >= 2 is needed"),
        ([[7, -1, -1], [-1, -1, -1]], "no row has a target (2 rows, each empty, all padding"),
        (np.zeros((0, 5), np.int64), "no row has a target (0 rows"),
    ):
        np.save(path, np.asarray(bad))
        with pytest.raises(llama.InteropError, match=re.escape(needle)):
            evaluate.read_tokens(str(path), 8)


# ---------------------------------------------------------------------------------------------
# Llama 3.2 3B's shapes (the Fuji 3B "tiktoken" variant): no 3B arrays in memory

LLAMA_32_3B = {  # the values of meta-llama/Llama-3.2-3B's config.json
    "vocab_size": 128256,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True,
}
FUJI_3B_TIKTOKEN = fuji.ModelConfig(vocab_size=128256, rope_scaling="llama3")


def test_llama_3b_names_and_shapes_match_transformers():
    hf = transformers.LlamaConfig(**LLAMA_32_3B)
    with torch.device("meta"):  # shapes only
        model = transformers.LlamaForCausalLM(hf)
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert convert.hf_shapes(FUJI_3B_TIKTOKEN) == theirs
    fields = llama.model_fields({"model_type": "llama", **hf.to_dict()})
    assert llama.mismatches(fields, FUJI_3B_TIKTOKEN) == []
    assert llama.mismatches(fields, fuji.ModelConfig()) == [
        "vocab_size: checkpoint 128256, config 131072",
        "rope_scaling: checkpoint 'llama3', config 'none'",
    ]


def test_llama3_frequencies_of_the_3b_equal_transformers():
    """Llama 3.2 3B's RoPE frequencies (theta 500000, Dh 128, factor 32 over 8192 positions),
    ours against transformers' own llama3 initialisation."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theirs, scale = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**LLAMA_32_3B))
    ours = np.asarray(inverse_frequencies(FUJI_3B_TIKTOKEN))
    assert scale == 1.0
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
    plain = np.asarray(inverse_frequencies(fuji.ModelConfig()))
    assert (ours < plain).sum() > 20 and (ours == plain).sum() > 20  # scaled, and kept


def test_3b_wide_layer_materialized(tmp_path):
    """One layer of 3B width (bf16, as Llama 3.2 ships) through the name map and layout both
    ways: every tensor back bit for bit, q / k rows permuted for the interleaved pairs."""
    cfg = fuji.ModelConfig(vocab_size=256, num_layers=1, rope_scaling="llama3")
    rng = np.random.default_rng(0)
    shapes = convert.hf_shapes(cfg)
    tensors = {
        n: rng.standard_normal(s, np.float32).astype(ml_dtypes.bfloat16) for n, s in shapes.items()
    }
    save_file(tensors, tmp_path / "model.safetensors", {"format": "pt"})
    hf_cfg = {**LLAMA_32_3B, "model_type": "llama", "vocab_size": 256, "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    files = convert.check_checkpoint(str(tmp_path), cfg)
    for name, (path, layer) in llama.tensor_names(1).items():
        ours = convert.read_param(files, path, cfg)
        one = ours if layer is None else ours[layer]
        back = llama.to_hf(path, one, cfg.rope).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(back, tensors[name], err_msg=name)
    q = convert.read_param(files, "layers/q", cfg)[0]  # [D, H, Dh], interleaved pairs
    hf_q = tensors["model.layers.0.self_attn.q_proj.weight"].astype(np.float32)  # [H*Dh, D]
    np.testing.assert_array_equal(q[:, 5, 2], hf_q[5 * 128 + 1])  # pair 1, first: x[1]
    np.testing.assert_array_equal(q[:, 5, 3], hf_q[5 * 128 + 64 + 1])  # its partner x[65]


# ---------------------------------------------------------------------------------------------
# What generation needs: import-hf keeps it, export-hf writes it back


def greedy(model, prompt, steps):
    """transformers' greedy continuation of `prompt` ([1, P]), `steps` tokens, by argmax of
    the forward pass (no eos involved)."""
    ids = prompt
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, prompt.shape[1] :].tolist()


def first_new(tokens, at_least):
    """The first position k >= at_least whose token did not occur before it."""
    return next(k for k in range(at_least, len(tokens)) if tokens[k] not in tokens[:k])


def test_generation_stops_at_the_imported_eos(reference, tmp_path):
    """The eos ids (a list, from generation_config.json, over config.json's) and the original
    max_position_embeddings survive import-hf -> export-hf; transformers' generate on the
    export stops at the eos the greedy continuation reaches, not at max_new_tokens; export's
    --eos-token-id replaces it."""
    model = transformers.LlamaForCausalLM.from_pretrained(reference["dir"], dtype=torch.float32)
    prompt = torch.tensor([[5, 17, 300, 42]])
    cont = greedy(model.eval(), prompt, 12)
    k, j = first_new(cont, 4), first_new(cont, 1)
    unused = next(t for t in range(512) if t not in cont)
    hf = tmp_path / "hf"
    shutil.copytree(reference["dir"], hf)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4096}))
    gen = {"bos_token_id": 1, "eos_token_id": [cont[k], unused]}
    (hf / "generation_config.json").write_text(json.dumps(gen))

    convert.import_hf(str(hf), TINY, list(SETS), str(tmp_path / "run"))
    out = tmp_path / "out"

    def generate(**tokens):
        convert.export_hf(str(tmp_path / "run"), str(out), "float32", tokens)
        back = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        ids = back.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        return ids[0, prompt.shape[1] :].tolist()

    assert generate() == cont[: k + 1]  # stopped at cont[k], k + 1 < 12 tokens
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == [cont[k], unused] and config["bos_token_id"] == 1
    assert config["max_position_embeddings"] == 4096
    assert json.loads((out / "generation_config.json").read_text()) == gen
    assert generate(eos_token_id=cont[j]) == cont[: j + 1]
    print(f"\ngenerate stops at eos: {cont[: k + 1]} of {cont}; with --eos-token-id: {j + 1}")


def test_export_token_flags_parse():
    from trn_accum.cli import build_parser

    args = build_parser().parse_args(["export-hf", "r", "o", "--eos-token-id", "5,6"])
    assert (args.eos_token_id, args.bos_token_id, args.pad_token_id) == ([5, 6], None, None)
    args = build_parser().parse_args(["export-hf", "r", "o", "--bos-token-id", "1"])
    assert args.bos_token_id == 1
