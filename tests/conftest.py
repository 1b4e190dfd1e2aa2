"""Test set-up: 8 emulated CPU devices, fixed before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    # XLA:CPU may deadlock emulated-device collectives without this (see trn_accum.cli).
    " --xla_cpu_enable_concurrency_optimized_scheduler=false"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 8, f"expected 8 emulated CPU devices, got {jax.device_count()}"
