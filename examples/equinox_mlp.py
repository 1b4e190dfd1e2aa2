"""Gradient accumulation for an Equinox model with a frozen layer, on 8 emulated CPU devices.

    python examples/equinox_mlp.py

`eqx.partition` splits the model into trainable parameters (with None holes where the frozen
first layer and the non-array fields are) and the rest; the parameter specs have the same
holes. `accumulate_gradients` runs the loss over 4 strided minibatches of a (data=2, fsdp=4)
mesh, gradients come back with the same holes, and the result is checked against
`jax.value_and_grad` on the full batch. Exit status 1 if they differ.
"""

import os

# Before JAX starts: 8 CPU devices (kept if XLA_FLAGS already sets a count), and XLA:CPU's
# concurrency-optimized scheduler off (it can deadlock emulated-device collectives).
_flags = os.environ.get("XLA_FLAGS", "")
for _flag in (
    "--xla_force_host_platform_device_count=8",
    "--xla_cpu_enable_concurrency_optimized_scheduler=false",
):
    if _flag.split("=")[0] not in _flags:
        _flags += " " + _flag
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import sys  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from trn_accum import accumulate_gradients, build_mesh  # noqa: E402

B, S, D, H, C, K = 32, 8, 16, 64, 8, 4  # rows, tokens per row, features, hidden, classes, k


def fsdp_spec(p) -> P:
    """Shard a matrix's larger dimension over "fsdp"; replicate vectors."""
    if p.ndim < 2:
        return P()
    big = int(np.argmax(p.shape))
    return P(*("fsdp" if i == big else None for i in range(p.ndim)))


def make_loss(static):
    def loss_fn(params, batch):
        """Mean cross-entropy over the real tokens (mask 1), with aux outputs."""
        model = eqx.combine(params, static)
        logits = jax.vmap(jax.vmap(model))(batch["x"])  # [b, S, C]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][..., None], -1)[..., 0]
        mask = batch["mask"]
        return (nll * mask).sum() / mask.sum(), {"tokens": mask.sum(), "max_nll": nll.max()}

    return loss_fn


def max_relative_error(actual, expected) -> float:
    errs = [
        float(jnp.max(jnp.abs(a - e)) / jnp.maximum(jnp.max(jnp.abs(e)), 1e-30))
        for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    ]
    return max(errs)


def main() -> int:
    mesh = build_mesh({"data": 2, "fsdp": 4})
    model = eqx.filter_jit(eqx.nn.MLP)(D, C, H, depth=2, key=jax.random.key(0))
    trainable = jax.tree.map(eqx.is_array, model)
    trainable = eqx.tree_at(lambda m: m.layers[0], trainable, replace=False)  # freeze layer 0
    params, static = eqx.partition(model, trainable)  # params: None where frozen / static

    param_specs = jax.tree.map(fsdp_spec, params)  # the same None holes as params
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs))

    rng = np.random.default_rng(0)
    batch_spec = P(("data", "fsdp"))
    batch = {
        "x": rng.standard_normal((B, S, D)).astype(np.float32),
        "y": rng.integers(0, C, (B, S)).astype(np.int32),
        "mask": (rng.uniform(size=(B, S)) < np.linspace(0.2, 1.0, B)[:, None]).astype(np.float32),
    }
    batch = jax.device_put(batch, NamedSharding(mesh, batch_spec))

    loss_fn = make_loss(static)
    grad_fn = accumulate_gradients(
        loss_fn,
        steps=K,
        mesh=mesh,
        batch_spec=batch_spec,
        param_specs=param_specs,
        weight_fn=lambda mb: mb["mask"].sum(),  # exact for a token mean: Σ w·L / Σ w
        has_aux=True,
        aux_reduction={"tokens": "sum", "max_nll": "max"},
    )
    (loss, aux), grads = eqx.filter_jit(grad_fn)(params, batch)
    (ref_loss, ref_aux), ref_grads = eqx.filter_jit(jax.value_and_grad(loss_fn, has_aux=True))(
        params, batch
    )

    same_holes = jax.tree.structure(grads) == jax.tree.structure(params)
    err = max_relative_error((loss, aux, grads), (ref_loss, ref_aux, ref_grads))
    print(f"equinox: k={K} loss {float(loss):.6f} (full batch {float(ref_loss):.6f})")
    print(f"gradients have the parameters' None holes: {same_holes}")
    print(f"max relative error vs the full batch (loss, aux, gradients): {err:.2e}")
    return 0 if err <= 1e-5 and same_holes else 1


if __name__ == "__main__":
    sys.exit(main())
