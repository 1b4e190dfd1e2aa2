"""What trn_accum lowers differently for the Neuron compiler: remat's identity reduce-precision.

`jax.checkpoint` (remat, every policy) rounds each residual it saves to its own type: the saving
side computes ``reduce_precision(x, exponent_bits=finfo(x.dtype).nexp,
mantissa_bits=finfo(x.dtype).nmant)`` (JAX's ``ad_checkpoint._insert_reduce_precision``,
jax-ml/jax#22244), so that a backend that keeps excess precision (a bf16 value held in float32)
saves what the recomputation will see. On a value of that type the op is the identity: rounding
a bf16 number to bf16's 8 exponent and 7 mantissa bits returns it unchanged, NaN and infinities
included, and the same holds for float32's 8 and 23. The Neuron documentation lists
`jax.lax.reduce_precision` as not supported (JAX NeuronX known issues), and a remat'd Fuji layer
hands the compiler six of these per layer (the 3B step: 168).

`drop_identity_reduce_precision(platform)` registers, for `platform` only, a lowering of
`reduce_precision_p` that emits nothing for those identity calls (the operand is the result) and
the StableHLO op for every other call, which then still reaches the compiler (and the preflight
still warns of it). `trn_accum.train.trainer.Trainer.build` calls it for "neuron" when its
mesh is on Neuron devices (the platform is known to JAX once its plugin has loaded), and so does
`trn-accum neuron-check`'s remat row; a JAX user running the accumulation wrapper on Neuron
without the trainer calls it once after the backend is up (`jax.devices()`). Other platforms
keep JAX's rule (the rounding matters there when XLA keeps excess precision; it does not change
a value that is already of its type).

`is_identity(dtype, exponent_bits, mantissa_bits)` is the one rule, read by the lowering and by
the preflight (`trn_accum.neuron.preflight`), which does not count such an op as a finding.
"""

from __future__ import annotations

#: Exponent and mantissa bits of the float types HLO names, as `jnp.finfo` gives them.
HLO_FLOAT_BITS = {
    "bf16": (8, 7),
    "f16": (5, 10),
    "f32": (8, 23),
    "f64": (11, 52),
}


def is_identity(dtype, exponent_bits: int, mantissa_bits: int) -> bool:
    """Whether reduce_precision(x: `dtype`, exponent_bits, mantissa_bits) returns x unchanged:
    the bits are at least `dtype`'s own. `dtype`: a NumPy/JAX dtype or an HLO type name (one
    this module does not know, an integer or an 8-bit float named the HLO way, is not: False)."""
    if isinstance(dtype, str) and dtype in HLO_FLOAT_BITS:
        own = HLO_FLOAT_BITS[dtype]
    else:
        import jax.numpy as jnp

        try:
            info = jnp.finfo(dtype)
        except (TypeError, ValueError):  # not a float type, or a name NumPy does not know
            return False
        own = (int(info.nexp), int(info.nmant))
    return exponent_bits >= own[0] and mantissa_bits >= own[1]


def _lower(ctx, operand, *, exponent_bits: int, mantissa_bits: int):
    """reduce_precision_p for the platform: the operand itself when the call is the identity,
    else the StableHLO op as JAX's own rule emits it."""
    from jax.extend.mlir.dialects import stablehlo
    from jax.interpreters import mlir

    (aval,) = ctx.avals_in
    if is_identity(aval.dtype, exponent_bits, mantissa_bits):
        return [operand]
    return [
        stablehlo.reduce_precision(
            operand, mlir.i32_attr(exponent_bits), mlir.i32_attr(mantissa_bits)
        )
    ]


def drop_identity_reduce_precision(platform: str = "neuron") -> bool:
    """Register `_lower` for `platform`; False (nothing registered) when JAX knows no such
    platform (no Neuron plugin installed)."""
    from jax import lax
    from jax.interpreters import mlir

    try:
        mlir.register_lowering(lax.reduce_precision_p, _lower, platform=platform)
    except NotImplementedError:  # "an unknown platform": the plugin is not there
        return False
    return True
