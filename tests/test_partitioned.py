"""analysis.hlo.partitioned: the module after the SPMD partitioner, before XLA:CPU's own passes."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import xla_flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.analysis.collectives import collectives
from trn_accum.analysis.hlo.partitioned import compile_partitioned


def _grad_of_sharded_weight():
    """d/dw sum((x @ w)^2) in bf16: w [256, 128] sharded over fsdp, x batch-sharded, the
    gradient returned fsdp-sharded (a reduction over both batch axes)."""
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    w = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    x = jax.ShapeDtypeStruct(
        (64, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P(("data", "fsdp")))
    )

    def loss(w, x):
        return jnp.sum(jnp.square((x @ w).astype(jnp.float32)))

    f = jax.jit(jax.grad(loss), out_shardings=NamedSharding(mesh, P("fsdp")))
    return (w, x), f.lower(w, x)


def test_partitioned_module_keeps_the_programs_dtypes_where_xla_cpu_widens_them():
    args, lowered = _grad_of_sharded_weight()
    compiled, text = compile_partitioned(lowered)
    assert "num_partitions=8" in text.split("\n", 1)[0]
    reductions = [c for c in collectives(text) if c.kind == "all-reduce"]
    assert reductions and all(c.instruction.dtypes == {"bf16"} for c in reductions), [
        c.instruction.type_text for c in reductions
    ]
    # XLA:CPU's final program reduces the same gradient in float32 (its bf16 normalization):
    # the reason this module, not `as_text()`, is what gets counted and priced.
    final = [c for c in collectives(compiled.as_text()) if c.kind == "all-reduce"]
    assert final and any("f32" in c.instruction.dtypes for c in final)
    # The executable is the ordinary one: bit-equal to `lowered.compile()`'s.
    w, x = (
        jax.device_put((jnp.arange(a.size) % m / m).reshape(a.shape).astype(a.dtype), a.sharding)
        for a, m in zip(args, (7, 5), strict=True)
    )
    np.testing.assert_array_equal(
        np.asarray(compiled(w, x), np.float32), np.asarray(lowered.compile()(w, x), np.float32)
    )


def test_one_device_program_is_its_module_before_optimizations():
    lowered = jax.jit(lambda x: jnp.sum(x * 2)).lower(jnp.ones((8, 8)))
    compiled, text = compile_partitioned(lowered)
    assert text.startswith("HloModule") and "multiply" in text
    assert not collectives(text)
    assert float(compiled(jnp.ones((8, 8)))) == 128.0


CACHED = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from trn_accum.analysis.hlo.partitioned import compile_partitioned
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
import os, sys
f = jax.jit(jax.grad(lambda w: jnp.sum(jnp.square(w @ w.T))))
f.lower(w).compile()  # a plain compile first: this process now uses the cache (JAX keeps that)
for _ in range(2):  # the second process finds the program in the cache
    _, text = compile_partitioned(f.lower(w))
    assert "num_partitions=8" in text.split(chr(10), 1)[0]
entries = len(os.listdir(sys.argv[1]))
jax.jit(lambda w: w * int(sys.argv[2])).lower(w).compile()  # new after: written to the cache
print("ok", jax.config.jax_enable_compilation_cache, len(os.listdir(sys.argv[1])) > entries)
"""


def test_a_persistent_compilation_cache_does_not_hide_the_partitioned_module(tmp_path):
    """With `JAX_COMPILATION_CACHE_DIR` set (the trn2 environment sets it), a second process
    compiling the same program still gets the module, also after a plain compile of it in the
    same process (JAX fixes at a process's first compile whether the cache is used): the cache
    is off for that compile and back on after it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")}
    env["XLA_FLAGS"] = xla_flags(8)
    for run in range(2):
        out = subprocess.run(
            [sys.executable, "-c", CACHED, str(tmp_path / "cache"), str(3 + run)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,  # make test runs this pass at nice 19 beside the suite
        )
        assert out.returncode == 0 and out.stdout.split() == ["ok", "True", "True"], out.stderr[
            -2000:
        ]
