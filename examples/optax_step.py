"""A plain-JAX + optax training step with gradient accumulation, on 8 emulated CPU devices.

    python examples/optax_step.py

Parameters are a dict of arrays sharded over "fsdp"; the batch over ("data", "fsdp"). The
jitted step accumulates the gradient over 4 strided minibatches and applies AdamW. Before
training, the step's gradients (and those of reduce="once", which reduces over "data" once
after the loop) are checked against `jax.value_and_grad` on the full batch. Exit status 1 if
they differ.
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

import functools  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from trn_accum import Strategy, accumulate_gradients, build_mesh, constrain  # noqa: E402

B, S, D, H, C, K = 32, 8, 16, 64, 8, 4  # rows, tokens per row, features, hidden, classes, k
BATCH_SPEC = P(("data", "fsdp"))
PARAM_SPECS = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None)}


def make_loss(mesh):
    def loss_fn(params, batch):
        """Mean cross-entropy over the real tokens (mask 1)."""
        # Activations sharded like the batch; `constrain` also works inside reduce="once".
        h = constrain(jax.nn.gelu(batch["x"] @ params["w1"] + params["b1"]), mesh, BATCH_SPEC)
        logits = h @ params["w2"]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][..., None], -1)[..., 0]
        return (nll * batch["mask"]).sum() / batch["mask"].sum()

    return loss_fn


def max_relative_error(actual, expected) -> float:
    errs = [
        float(jnp.max(jnp.abs(a - e)) / jnp.maximum(jnp.max(jnp.abs(e)), 1e-30))
        for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    ]
    return max(errs)


def main() -> int:
    mesh = build_mesh({"data": 2, "fsdp": 4})
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.standard_normal((D, H)).astype(np.float32) / np.sqrt(D),
        "b1": np.zeros(H, np.float32),
        "w2": rng.standard_normal((H, C)).astype(np.float32) / np.sqrt(H),
    }
    params = {n: jax.device_put(p, NamedSharding(mesh, PARAM_SPECS[n])) for n, p in params.items()}

    def make_batch(seed):
        r = np.random.default_rng(seed)
        mask = r.uniform(size=(B, S)) < np.linspace(0.2, 1.0, B)[:, None]  # uneven padding
        batch = {
            "x": r.standard_normal((B, S, D)).astype(np.float32),
            "y": r.integers(0, C, (B, S)).astype(np.int32),
            "mask": mask.astype(np.float32),
        }
        return jax.device_put(batch, NamedSharding(mesh, BATCH_SPEC))

    loss_fn = make_loss(mesh)
    accumulate = functools.partial(
        accumulate_gradients,
        loss_fn,
        steps=K,
        mesh=mesh,
        batch_spec=BATCH_SPEC,
        param_specs=PARAM_SPECS,
        weight_fn=lambda mb: mb["mask"].sum(),  # additive over rows: exact in both reduce modes
    )
    grad_fn = accumulate()
    opt = optax.adamw(1e-2)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
        loss, grads = grad_fn(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    batch = make_batch(0)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    once_loss, once_grads = jax.jit(accumulate(strategy=Strategy(reduce="once")))(params, batch)
    err_once = max_relative_error((once_loss, once_grads), (ref_loss, ref_grads))

    opt_state = opt.init(params)
    params, opt_state, loss, grads = train_step(params, opt_state, batch)
    err = max_relative_error((loss, grads), (ref_loss, ref_grads))
    losses = [float(loss)]
    for seed in (1, 2):
        params, opt_state, loss, _ = train_step(params, opt_state, make_batch(seed))
        losses.append(float(loss))

    print(f"optax: k={K} losses over 3 steps {', '.join(f'{x:.4f}' for x in losses)}")
    print(f"max relative error vs the full batch (loss, gradients): {err:.2e}")
    print(f'max relative error of reduce="once" vs the full batch: {err_once:.2e}')
    return 0 if max(err, err_once) <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
