"""What `import-hf` refuses in a Hugging Face checkpoint: weights that are not float weights.

A checkpoint converts only when every tensor holds float weights that the model computes with
as they are:

- a `quantization_config` in config.json (bitsandbytes, GPTQ, AWQ, FP8, compressed-tensors...)
  or a tensor stored in any dtype but F16 / BF16 / F32 / F64 (the int8 codes of an 8-bit
  checkpoint, GPTQ's packed int32, FP8's F8_E4M3 / F8_E5M2) is a quantized checkpoint: its
  stored numbers are codes that mean something only with their scales. The dtype is read from
  the safetensors header, so no tensor of a dtype NumPy lacks is ever converted;
- a tensor holding NaN or Inf (checked as it is read: one float64 sum, no copy);
- a config that ties the LM head to the embedding (`tie_word_embeddings` true) while holding an
  `lm_head.weight` that differs from `model.embed_tokens.weight`: transformers computes with
  that head, ours is always the embedding, so the same files would be two models.

Each refusal is one `InteropError` line naming the tensor, dtype or method, and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from trn_accum.interop.llama import InteropError

# safetensors' dtype names of float weights (a header's "dtype")
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
LM_HEAD = "lm_head.weight"
DEQUANTIZE = (
    "dequantize it to bfloat16 first (e.g. load it with transformers, call "
    "model.dequantize(), and save_pretrained with dtype=torch.bfloat16)"
)


def refuse_quantized_config(hf: Mapping, where: str) -> None:
    """InteropError when the HF config dict `hf` (config.json of `where`) declares a
    quantization (a `quantization_config`, transformers' key for every method)."""
    quant = hf.get("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method", "unnamed") if isinstance(quant, Mapping) else quant
    raise InteropError(
        f"checkpoint {where} is quantized (config.json quantization_config, quant_method "
        f"{method!r}): only float weights import; {DEQUANTIZE}"
    )


def refuse_quantized_tensors(dtypes: Mapping[str, str], where: str) -> None:
    """InteropError naming the tensors of `dtypes` (name -> safetensors dtype, e.g. "I8",
    "F8_E4M3") whose dtype is not a float weight dtype (`FLOAT_DTYPES`); `where` names the
    checkpoint or file."""
    bad = [f"{name} {dtype}" for name, dtype in sorted(dtypes.items()) if dtype not in FLOAT_DTYPES]
    if not bad:
        return
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    raise InteropError(
        f"checkpoint {where} holds tensors that are not float weights ({', '.join(bad[:3])}"
        f"{more}; float weights are {'/'.join(FLOAT_DTYPES)}): a quantized checkpoint does not "
        f"import; {DEQUANTIZE}"
    )


def refuse_nonfinite(name: str, value: np.ndarray, where: str) -> None:
    """InteropError when the float array `value` (tensor `name` of the file `where`) holds NaN
    or Inf, naming how many and the first index. One float64 sum when all are finite (a sum of
    finite float32/float16 values cannot overflow float64)."""
    if np.isfinite(np.sum(value, dtype=np.float64)):
        return
    bad = ~np.isfinite(value)
    first = [int(i) for i in np.argwhere(bad)[0]]
    raise InteropError(
        f"tensor {name} in {where} holds {int(bad.sum())} NaN/Inf value(s) (first at {first}): "
        f"the checkpoint is damaged or was saved from a diverged run; import another checkpoint"
    )


def refuse_untied_head(equal_to_embedding: bool, where: str) -> None:
    """InteropError unless the `lm_head.weight` of the checkpoint `where` (whose config ties
    the LM head to the embedding: `llama.model_fields` refuses an untied one) equals
    `model.embed_tokens.weight` in shape and values (`equal_to_embedding`)."""
    if equal_to_embedding:
        return
    raise InteropError(
        f"checkpoint {where} says tie_word_embeddings = true but holds an {LM_HEAD} that differs "
        f"from model.embed_tokens.weight: transformers computes with that head and ours is "
        f"always the embedding, so the files are two models; delete {LM_HEAD} if the embedding "
        f"is the intended head (an untied head does not convert)"
    )
