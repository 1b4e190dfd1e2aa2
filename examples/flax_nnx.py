"""Gradient accumulation for a Flax NNX model, on 8 emulated CPU devices.

    python examples/flax_nnx.py

The model's kernels carry their sharding (`nnx.with_partitioning`), `nnx.split` gives the
parameter State and `nnx.get_partition_spec` its specs; `accumulate_gradients` runs the loss
over 4 strided minibatches of a (data=2, fsdp=4) mesh and the result is checked against
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from trn_accum import accumulate_gradients, build_mesh  # noqa: E402

B, S, D, H, C, K = 32, 8, 16, 64, 8, 4  # rows, tokens per row, features, hidden, classes, k


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            D, H, kernel_init=nnx.with_partitioning(init, (None, "fsdp")), rngs=rngs
        )
        self.down = nnx.Linear(
            H, C, kernel_init=nnx.with_partitioning(init, ("fsdp", None)), rngs=rngs
        )

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def make_loss(graphdef):
    def loss_fn(params, batch):
        """Mean cross-entropy over the real tokens (mask 1), with aux outputs."""
        logits = nnx.merge(graphdef, params)(batch["x"])  # [b, S, C]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][..., None], -1)[..., 0]
        mask = batch["mask"]
        loss = (nll * mask).sum() / mask.sum()
        aux = {
            "tokens": mask.sum(),  # a count: summed over minibatches
            "accuracy": ((logits.argmax(-1) == batch["y"]) * mask).sum() / mask.sum(),
            "per_example": (nll * mask).sum(-1),  # [b]: stitched back in row order (default)
        }
        return loss, aux

    return loss_fn


def max_relative_error(actual, expected) -> float:
    errs = [
        float(jnp.max(jnp.abs(a - e)) / jnp.maximum(jnp.max(jnp.abs(e)), 1e-30))
        for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    ]
    return max(errs)


def main() -> int:
    mesh = build_mesh({"data": 2, "fsdp": 4})
    with jax.set_mesh(mesh):  # NNX shards the annotated kernels as it creates them
        model = nnx.jit(lambda: MLP(nnx.Rngs(0)))()  # one compiled init, not op by op
    graphdef, params = nnx.split(model, nnx.Param)
    param_specs = nnx.get_partition_spec(params)  # a State of PartitionSpecs, like params

    rng = np.random.default_rng(0)
    batch_spec = P(("data", "fsdp"))  # rows over all 8 devices
    batch = {
        "x": rng.standard_normal((B, S, D)).astype(np.float32),
        "y": rng.integers(0, C, (B, S)).astype(np.int32),
        "mask": (rng.uniform(size=(B, S)) < np.linspace(0.2, 1.0, B)[:, None]).astype(np.float32),
    }
    batch = jax.device_put(batch, NamedSharding(mesh, batch_spec))

    loss_fn = make_loss(graphdef)
    grad_fn = accumulate_gradients(
        loss_fn,
        steps=K,
        mesh=mesh,
        batch_spec=batch_spec,
        param_specs=param_specs,
        weight_fn=lambda mb: mb["mask"].sum(),  # exact for a token mean: Σ w·L / Σ w
        has_aux=True,
        aux_reduction={"tokens": "sum", "accuracy": "mean"},  # per_example: the default
    )
    (loss, aux), grads = jax.jit(grad_fn)(params, batch)
    (ref_loss, ref_aux), ref_grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        params, batch
    )

    err = max_relative_error((loss, aux, grads), (ref_loss, ref_aux, ref_grads))
    print(f"flax nnx: k={K} loss {float(loss):.6f} (full batch {float(ref_loss):.6f})")
    print(f"max relative error vs the full batch (loss, aux, gradients): {err:.2e}")
    return 0 if err <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
