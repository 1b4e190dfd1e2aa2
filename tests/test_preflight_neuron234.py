"""The Neuron preflight's rules for the known issues Neuron SDK 2.34 lists, on the HLO of real
small JAX programs, in both texts a caller may hand it: the module right after the SPMD
partitioner (what `trn-accum dry-run` reads) and XLA:CPU's compiled module.

- a float -> integer convert: a warning naming the op path and the fix (jnp.trunc), none
  when the value is whole already (trunc, round, floor, an integer made float);
- a Philox PRNG: a blocker under JAX 0.11.x, a warning under others; rbg is not Philox;
- a sort whose comparator is not one LT/GT/LE/GE compare (a multi-key lax.sort): a blocker;
  jnp.sort / argsort of floats (JAX's NaN-canonicalising LT) are plain;
- a top_k: a warning naming NEURON_RUN_TRIVIAL_COMPUTATION_ON_CPU, not an unknown custom-call.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from trn_accum.analysis.hlo.partitioned import compile_partitioned
from trn_accum.neuron.preflight import BLOCKER, WARNING, preflight

X = jnp.linspace(-3.0, 3.0, 16, dtype=jnp.float32)
KEY = jnp.zeros(4, jnp.uint32)


def texts(f, *args) -> dict[str, str]:
    """{"partitioned": ..., "compiled": ...}: the two HLO texts of jit(f)(*args)."""
    compiled, partitioned = compile_partitioned(jax.jit(f).lower(*args))
    return {"partitioned": partitioned, "compiled": compiled.as_text()}


def findings(f, *args, rule=None, jax_version="0.11.2"):
    """{text kind: [finding, ...]} (of `rule` only, when given)."""
    out = {}
    for kind, text in texts(f, *args).items():
        found = preflight(text, prng_impl="rbg", jax_version=jax_version)
        out[kind] = [x for x in found if rule is None or x.rule == rule]
    return out


def test_float_to_int_convert_is_a_warning_naming_the_op_path_and_the_fix():
    def scaled_index(x):
        return (x * 3.7).astype(jnp.int32)

    for kind, found in findings(scaled_index, X).items():
        assert len(found) == 1, (kind, found)
        f = found[0]
        assert f.severity == WARNING and f.rule == "float-to-int"
        assert f.source == "jit(scaled_index)/convert_element_type", kind
        assert "f32 -> s32" in str(f) and "jnp.trunc" in str(f)


@pytest.mark.parametrize(
    "whole",
    [
        lambda x: jnp.trunc(x * 3.7).astype(jnp.int32),
        lambda x: jnp.round(x).astype(jnp.int32),
        lambda x: jnp.floor(x).astype(jnp.uint8),
        lambda x: jnp.ceil(x.astype(jnp.bfloat16)).astype(jnp.int16),
        lambda x: (x > 0).astype(jnp.float32).astype(jnp.int32),
        lambda x: jnp.argmax(x).astype(jnp.float32).astype(jnp.int32),
    ],
    ids=["trunc", "round", "floor", "ceil-bf16", "bool-made-float", "int-made-float"],
)
def test_a_whole_float_cast_to_int_is_no_finding(whole):
    assert findings(whole, X, rule="float-to-int") == {"partitioned": [], "compiled": []}


def test_philox_is_a_blocker_under_jax_011_and_rbg_is_not_philox():
    def philox_bits(key):
        return lax.rng_bit_generator(key, (8,), algorithm=lax.RandomAlgorithm.RNG_PHILOX)[1]

    def rbg_bits(key):
        return lax.rng_bit_generator(key, (8,))[1]  # rng_default: what the rbg PRNG uses

    found = findings(philox_bits, KEY, rule="philox")["partitioned"]
    assert [f.severity for f in found] == [BLOCKER]
    assert "rng_philox" in str(found[0]) and '"jax_default_prng_impl", "rbg"' in str(found[0])
    older = findings(philox_bits, KEY, rule="philox", jax_version="0.10.0")["partitioned"]
    assert [f.severity for f in older] == [WARNING]
    assert findings(rbg_bits, KEY, rule="philox") == {"partitioned": [], "compiled": []}
    key = jax.random.key(0, impl="rbg")
    rbg_uniform = findings(lambda k: jax.random.uniform(k, (8,)), key, rule="philox")
    assert rbg_uniform == {"partitioned": [], "compiled": []}


def test_philox_written_in_jax_ops_is_found_by_its_multiplier():
    def philox_round(counter, key):  # the low half of one Philox-4x32 product, in jnp
        return counter * jnp.uint32(0xD2511F53) ^ key

    counter = jnp.arange(4, dtype=jnp.uint32)
    for kind, found in findings(philox_round, counter, KEY, rule="philox").items():
        assert [f.severity for f in found] == [BLOCKER], kind
        assert "multiplier constant 0xd2511f53" in str(found[0])


@pytest.mark.parametrize(
    "plain",
    [jnp.sort, jnp.argsort, lambda x: lax.sort(x), lambda x: jnp.sort(x.astype(jnp.int32))],
    ids=["jnp.sort", "jnp.argsort", "lax.sort", "int-sort"],
)
def test_a_plain_sort_is_no_finding(plain):
    assert findings(plain, X, rule="sort-comparator") == {"partitioned": [], "compiled": []}


def test_a_multi_key_sort_is_a_blocker():
    def by_two_keys(a, b):
        return lax.sort((a, b), num_keys=2)

    for kind, found in findings(by_two_keys, X, -X, rule="sort-comparator").items():
        assert [f.severity for f in found] == [BLOCKER], kind
        assert "(returns or)" in str(found[0]) and found[0].source == "jit(by_two_keys)/sort"


def test_top_k_is_a_warning_naming_the_variable():
    def best(x):
        return lax.top_k(x, 3)[0]

    for kind, found in findings(best, X).items():
        assert [(f.severity, f.rule) for f in found] == [(WARNING, "top-k")], (kind, found)
        assert "NEURON_RUN_TRIVIAL_COMPUTATION_ON_CPU=1" in str(found[0])
        assert found[0].source == "jit(best)/top_k" and "k=3" in str(found[0])
