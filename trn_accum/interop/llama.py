"""The Hugging Face Llama format and ours: config fields, tensor names, and the layout of each.

Hugging Face transformers' `LlamaForCausalLM` (config.json + safetensors) and our Fuji model
(`trn_accum.model.fuji`) compute the same function when the config fields of `CONFIG_FIELDS`
agree, the embedding is tied (our LM head is always the embedding), and the weights are
converted as follows, per layer l (HF tensors are PyTorch `nn.Linear` weights, [out, in]):

    HF name (model.layers.{l}.)        HF shape        ours (layers/..., index l)
    input_layernorm.weight             [D]             attn_norm [D]
    self_attn.q_proj.weight            [H*Dh, D]       q [D, H, Dh]      transposed, RoPE pairs
    self_attn.k_proj.weight            [KV*Dh, D]      k [D, KV, Dh]     transposed, RoPE pairs
    self_attn.v_proj.weight            [KV*Dh, D]      v [D, KV, Dh]     transposed
    self_attn.o_proj.weight            [D, H*Dh]       o [H, Dh, D]      transposed
    post_attention_layernorm.weight    [D]             ffn_norm [D]
    mlp.gate_proj / up_proj.weight     [F, D]          gate / up [D, F]  transposed
    mlp.down_proj.weight               [D, F]          down [F, D]       transposed
    model.embed_tokens.weight [V, D] = embed [V, D];  model.norm.weight [D] = final_norm [D]

RoPE pairs: HF rotates halves (x[i], x[i + Dh/2]); with `model.rope = "interleaved"` (pairs
x[2i], x[2i+1]) each head's Dh output rows of q and k are permuted (`rope_permutation`), which
leaves every attention score unchanged. With `model.rope = "halves"` they are copied as they are.
Everything here is NumPy; no arrays of the whole model are built.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trn_accum.errors import UserError


class InteropError(UserError):
    """A checkpoint or config that cannot be converted: one line naming what and why."""


# Our ModelConfig field <- the HF config.json key it must equal.
CONFIG_FIELDS = {
    "vocab_size": "vocab_size",
    "num_layers": "num_hidden_layers",
    "hidden_dim": "hidden_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "ffn_dim": "intermediate_size",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "rope_scaling": "rope_type",
}
# Ours <- the keys of HF's llama3 "rope_scaling" / "rope_parameters" (compared when llama3).
LLAMA3_FIELDS = {
    "rope_scaling_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_len": "original_max_position_embeddings",
}
_ROPE_TYPES = {"default": "none", "llama3": "llama3"}

# Our layer parameter -> (HF name under model.layers.{l}., input dims of ours in HF's `in`).
LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", 0),
    "q": ("self_attn.q_proj.weight", 1),
    "k": ("self_attn.k_proj.weight", 1),
    "v": ("self_attn.v_proj.weight", 1),
    "o": ("self_attn.o_proj.weight", 2),
    "ffn_norm": ("post_attention_layernorm.weight", 0),
    "gate": ("mlp.gate_proj.weight", 1),
    "up": ("mlp.up_proj.weight", 1),
    "down": ("mlp.down_proj.weight", 1),
}
TOP_TENSORS = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight"}
ROPE_ROTATED = ("q", "k")


def _rope_params(hf: dict) -> dict:
    """The RoPE settings of an HF config as transformers 5 reads them
    (`PreTrainedConfig.convert_rope_params_to_dict`): a set "rope_scaling" (not null, not
    empty) wins over "rope_parameters"; the top-level "rope_theta" and "partial_rotary_factor"
    fill in what the dict lacks; "type" is the older spelling of "rope_type" ("default" when
    neither is set). InteropError (one line) when either key holds something other than a
    JSON object or null, or settings per layer type (one dict per attention kind)."""
    for key in ("rope_scaling", "rope_parameters"):
        value = hf.get(key)
        if value is not None and not isinstance(value, dict):
            raise InteropError(
                f"config.json {key} = {value!r} ({type(value).__name__}): RoPE settings are a "
                f'JSON object (e.g. {{"rope_type": "llama3", "factor": 32.0, ...}}) or null; '
                f"fix config.json"
            )
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    nested = sorted(k for k, v in params.items() if isinstance(v, dict))
    if nested:
        raise InteropError(
            f"config.json RoPE settings are per layer type ({', '.join(nested)}): ours applies "
            f"one RoPE to every layer; only Llama checkpoints with one RoPE setting convert"
        )
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if hf.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _not_numbers(values: dict[str, Any], keys) -> list[str]:
    """'key = value' for each of `keys` whose value in `values` is set and not a number."""
    return [
        f"{k} = {values[k]!r}"
        for k in keys
        if values.get(k) is not None
        and (isinstance(values[k], bool) or not isinstance(values[k], int | float))
    ]


def model_fields(hf: dict) -> dict[str, Any]:
    """Our ModelConfig field values that an HF Llama config.json (a dict) fixes.
    InteropError for what our model cannot represent (another architecture, biases, an
    activation other than SiLU, an untied LM head, a RoPE type other than default/llama3)."""
    if hf.get("model_type") != "llama":
        raise InteropError(
            f"config.json model_type {hf.get('model_type')!r}: only 'llama' (LlamaForCausalLM) "
            f"checkpoints convert; convert the checkpoint to the Llama format first"
        )
    unsupported = {
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
        "attention_bias": (bool(hf.get("attention_bias", False)), False),
        "mlp_bias": (bool(hf.get("mlp_bias", False)), False),
        # transformers' LlamaConfig default is untied; our LM head is always the embedding
        "tie_word_embeddings": (bool(hf.get("tie_word_embeddings", False)), True),
    }
    bad = [f"{k} = {v!r} (ours: {want!r})" for k, (v, want) in unsupported.items() if v != want]
    rope = _rope_params(hf)
    if not isinstance(rope["rope_type"], str) or rope["rope_type"] not in _ROPE_TYPES:
        bad.append(f"rope type {rope['rope_type']!r} (ours: one of {sorted(_ROPE_TYPES)})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        bad.append(f"partial_rotary_factor = {rope['partial_rotary_factor']!r} (ours: 1.0)")
    if bad:
        raise InteropError(
            f"config.json describes a model ours cannot represent: {', '.join(bad)}: only "
            f"tied-embedding Llama checkpoints without biases, with SiLU and default or llama3 "
            f"RoPE, convert"
        )
    flat = {**hf, **rope, "rope_type": _ROPE_TYPES[rope["rope_type"]]}
    wanted = dict(CONFIG_FIELDS)
    if flat["rope_type"] == "llama3":
        wanted.update(LLAMA3_FIELDS)
    numeric = [theirs for theirs in wanted.values() if theirs != "rope_type"]
    not_numbers = _not_numbers(flat, numeric)
    if not_numbers:
        raise InteropError(
            f"config.json holds values that are not numbers: {', '.join(not_numbers)}: fix "
            f"config.json (transformers writes them as JSON numbers)"
        )
    if flat.get("head_dim") is None and flat.get("hidden_size") and flat.get("num_attention_heads"):
        flat["head_dim"] = flat["hidden_size"] // flat["num_attention_heads"]  # transformers' rule
    missing = [theirs for theirs in wanted.values() if flat.get(theirs) is None]
    if missing:
        raise InteropError(
            f"config.json lacks {', '.join(missing)}: a Llama config.json written by "
            f"transformers has them; add them from the model's card"
        )
    return {ours: flat[theirs] for ours, theirs in wanted.items()}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def mismatches(fields: dict[str, Any], model_cfg) -> list[str]:
    """'name: checkpoint A, config B' for every field of `fields` (`model_fields`) that the
    ModelConfig `model_cfg` sets otherwise, in CONFIG_FIELDS order."""
    return [
        f"{k}: checkpoint {v!r}, config {getattr(model_cfg, k)!r}"
        for k, v in fields.items()
        if not _same(v, getattr(model_cfg, k))
    ]


def hf_config(model_cfg, dtype: str) -> dict[str, Any]:
    """The config.json of a `LlamaForCausalLM` equal to the ModelConfig `model_cfg`, its
    tensors stored in `dtype` ("bfloat16" or "float32")."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model_cfg.rope_theta}
    if model_cfg.rope_scaling == "llama3":
        rope["rope_type"] = "llama3"
        rope.update({theirs: getattr(model_cfg, o) for o, theirs in LLAMA3_FIELDS.items()})
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "max_position_embeddings": model_cfg.max_seq_len,
        "rope_parameters": rope,  # transformers >= 5
        "rope_theta": model_cfg.rope_theta,  # transformers 4 reads these two
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    for ours, theirs in CONFIG_FIELDS.items():
        if ours not in ("rope_theta", "rope_scaling"):
            cfg[theirs] = getattr(model_cfg, ours)
    return cfg


# ---------------------------------------------------------------------------------------------
# Tensors


def tensor_names(num_layers: int) -> dict[str, tuple[str, int | None]]:
    """HF tensor name -> (our parameter path "embed" / "layers/q" / ..., layer index or None),
    in HF's order (embedding, layers, final norm)."""
    out: dict[str, tuple[str, int | None]] = {TOP_TENSORS["embed"]: ("embed", None)}
    for layer in range(num_layers):
        for ours, (theirs, _) in LAYER_TENSORS.items():
            out[f"model.layers.{layer}.{theirs}"] = (f"layers/{ours}", layer)
    out[TOP_TENSORS["final_norm"]] = ("final_norm", None)
    return out


def _in_dims(path: str) -> int:
    return LAYER_TENSORS[path.split("/")[1]][1] if path.startswith("layers/") else 0


def hf_shape(path: str, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of one layer (or top-level tensor) of our parameter `path` whose shape
    (one layer's, without the `layers` axis) is `ours`."""
    n = _in_dims(path)
    if n == 0:
        return tuple(ours)
    return (math.prod(ours[n:]), math.prod(ours[:n]))


def rope_permutation(head_dim: int) -> np.ndarray:
    """int [Dh]: interleaved[j] = halves[perm[j]] (pair i: halves (i, i + Dh/2) -> interleaved
    (2i, 2i + 1)); its inverse is `np.argsort(perm)`."""
    return np.arange(head_dim).reshape(2, head_dim // 2).T.reshape(-1)


def to_ours(path: str, hf: np.ndarray, shape: tuple[int, ...], rope: str) -> np.ndarray:
    """One HF tensor -> our layout `shape` (one layer's, or the top-level tensor's)."""
    n = _in_dims(path)
    out = hf if n == 0 else hf.T.reshape(shape)
    if rope == "interleaved" and path.split("/")[-1] in ROPE_ROTATED:
        out = out[..., rope_permutation(shape[-1])]
    return out


def to_hf(path: str, ours: np.ndarray, rope: str) -> np.ndarray:
    """One layer (or top-level tensor) of our parameter `path` -> the HF tensor."""
    n = _in_dims(path)
    if rope == "interleaved" and path.split("/")[-1] in ROPE_ROTATED:
        ours = ours[..., np.argsort(rope_permutation(ours.shape[-1]))]
    if n == 0:
        return ours
    return ours.reshape(math.prod(ours.shape[:n]), -1).T
