"""The module a backend receives after XLA's SPMD partitioner: what to count and price.

`compiled.as_text()` on the CPU fallback is XLA:CPU's final program. By then the CPU backend
has rewritten what the partitioner produced: its float normalization widens bf16 arithmetic
(and may merge bf16 and f32 collectives into one f32 tuple), its combiners merge collectives,
and it never forms a reduce-scatter. A Neuron (or GPU, TPU) compile starts from the same
partitioned module and runs its own passes instead. So the collectives of a program, their
dtypes and their bytes are read here, right after the pass named `spmd-partitioning` (the
SPMD partitioner, Shardy's and GSPMD's alike), before any backend pass.

How: the one compile also dumps that pass's output (XLA's `xla_dump_to` and
`xla_dump_hlo_pass_re` debug options, passed as `compile(compiler_options=...)`, so no
environment variable is touched) into a temporary directory that is removed afterwards. A
persistent compilation cache (`JAX_COMPILATION_CACHE_DIR`, which the trn2 environment sets) is
off for that one compile: an executable loaded from the cache runs no pass and dumps nothing.

Imports JAX only.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import tempfile

import jax
from jax.experimental.compilation_cache import compilation_cache

# XLA:CPU flags of a process that compiles steps only to read their partitioned modules (the
# dry-run, the settings search, the step-time model): its own code generation is not what is
# read, so its expensive optimizations buy nothing, and they leave the module after the SPMD
# partitioner, which is what is priced and measured, as it is (tests/conftest.py's
# FAST_COMPILE_FLAGS, measured there)
PRICING_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

__all__ = ["PASS", "compile_partitioned"]

#: The XLA pass whose output is the partitioned module (the file `*.after_<PASS>.*.txt`).
PASS = "spmd-partitioning"


def compile_partitioned(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, str]:
    """(compiled, HLO text of the module right after the SPMD partitioner).

    One compile of `lowered`, the executable the same as `lowered.compile()`'s. The text is
    per device (shapes are shard shapes, collectives explicit) and in the dtypes the program
    wrote. A program of one partition skips the partitioner: its module before XLA's
    optimizations is the same thing. RuntimeError if a partitioned program left no such module
    (the pass was renamed: read `PASS`).
    """
    with tempfile.TemporaryDirectory(prefix="trn-accum-hlo-") as tmp, _no_persistent_cache():
        compiled = lowered.compile(
            compiler_options={"xla_dump_to": tmp, "xla_dump_hlo_pass_re": PASS}
        )
        found = sorted(pathlib.Path(tmp).glob(f"*.after_{PASS}.*.txt"))
        before = sorted(pathlib.Path(tmp).glob("*.before_optimizations.txt"))
        if not found and before and _partitions(before[-1].read_text()) == 1:
            found = before
        if not found:
            raise RuntimeError(
                f"XLA dumped no module after pass {PASS!r} into {tmp}: "
                f"{sorted(p.name for p in pathlib.Path(tmp).iterdir())[:8]}"
            )
        # One module per compile; a later file (a recompile of the same program) has the same text.
        return compiled, found[-1].read_text()


@contextlib.contextmanager
def _no_persistent_cache():
    """JAX's persistent compilation cache off inside, restored after (a hit compiles nothing).

    JAX decides once per process whether the cache is used (at the first compile) and keeps
    that answer: the switch alone is read again only after `reset_cache()`, so the cache is
    reset on the way in (the switch off takes effect) and on the way out (it is opened again
    at the next compile)."""
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def _partitions(module_text: str) -> int:
    """`num_partitions` of an HLO module's header line (1 when the header does not say)."""
    m = re.search(r"num_partitions=(\d+)", module_text.split("\n", 1)[0])
    return int(m.group(1)) if m else 1
