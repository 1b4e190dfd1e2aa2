"""trn_accum.neuron.lowering: remat's identity reduce-precision is not lowered for Neuron, and the
preflight does not count it; any other reduce-precision stays and is still a warning."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from trn_accum.neuron import lowering
from trn_accum.neuron.preflight import WARNING, preflight


def _remat_grad_hlo(dtype=jnp.bfloat16) -> str:
    """The unoptimised module of a remat'd layer's gradient (what the dry-run's preflight reads)."""

    def layer(w, x):
        return jnp.tanh(x @ w) @ w

    saved = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    w, x = jnp.ones((8, 8), dtype), jnp.ones((4, 8), dtype)
    grad = jax.grad(lambda w, x: saved(w, x).astype(jnp.float32).sum())
    return jax.jit(grad).lower(w, x).as_text(dialect="hlo")


@pytest.mark.parametrize(
    ("dtype", "bits", "identity"),
    [
        ("bf16", (8, 7), True),
        ("f32", (8, 23), True),
        ("f32", (11, 52), True),  # more bits than the type has: nothing to round
        ("f32", (8, 7), False),  # float32 rounded to bf16's bits
        ("bf16", (5, 10), False),  # fewer exponent bits: overflows to inf
        (jnp.bfloat16, (8, 7), True),
        (jnp.float16, (5, 10), True),
        (jnp.int32, (8, 23), False),
        ("s32", (8, 23), False),  # HLO's names of types it does not round
        ("f8e4m3fn", (4, 3), False),
    ],
)
def test_is_identity(dtype, bits, identity):
    assert lowering.is_identity(dtype, *bits) is identity


def test_remats_rounding_is_not_a_finding_and_other_rounding_is():
    text = _remat_grad_hlo()
    assert "reduce-precision(" in text and "exponent_bits=8, mantissa_bits=7" in text
    assert [f.rule for f in preflight(text, prng_impl="rbg")] == []
    f32 = jnp.ones((4,), jnp.float32)
    to_bf16 = jax.jit(lambda x: lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7))
    (finding,) = preflight(to_bf16.lower(f32).as_text(dialect="hlo"), prng_impl="rbg")
    assert (finding.rule, finding.severity) == ("reduce-precision", WARNING)


def test_no_neuron_plugin_registers_nothing():
    assert lowering.drop_identity_reduce_precision("neuron") is False


_ON_CPU = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from trn_accum.neuron import lowering

    def layer(w, x):
        return jnp.tanh(x @ w) @ w

    saved = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    grad = jax.jit(jax.grad(lambda w, x: saved(w, x).astype(jnp.float32).sum()))
    w = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)), jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 8)), jnp.bfloat16)
    before = np.asarray(grad(w, x).astype(jnp.float32))
    assert "reduce-precision(" in grad.lower(w, x).as_text(dialect="hlo")
    assert lowering.drop_identity_reduce_precision("cpu") is True
    grad = jax.jit(jax.grad(lambda w, x: saved(w, x).astype(jnp.float32).sum()))
    assert "reduce-precision(" not in grad.lower(w, x).as_text(dialect="hlo")
    np.testing.assert_array_equal(np.asarray(grad(w, x).astype(jnp.float32)), before)
    to_bf16 = jax.jit(lambda x: lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7))
    f32 = jnp.asarray([1.0 + 2.0**-10, 3.0], jnp.float32)
    assert "reduce-precision(" in to_bf16.lower(f32).as_text(dialect="hlo")
    np.testing.assert_array_equal(np.asarray(to_bf16(f32)), [1.0, 3.0])
    print("ok")
    """
)


def test_the_rule_registered_for_a_platform_drops_only_the_identity():
    """Registered for the CPU here (in a process of its own: the registry is global), as
    `drop_identity_reduce_precision("neuron")` registers it for Neuron: remat's rounding is gone
    from the lowered module and the gradient is bit for bit what JAX's own rule gives; a
    rounding that changes values is still lowered and still rounds."""
    out = subprocess.run(
        [sys.executable, "-c", _ON_CPU], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
