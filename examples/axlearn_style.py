"""An AXLearn-style loss: `WeightedScalar` summaries and a per-example summary, accumulated.

    python examples/axlearn_style.py

AXLearn models return `(loss, summaries)` where a metric carries its own weight
(`WeightedScalar(mean, weight)`): here the token-weighted loss (weight = number of target
tokens) and the row accuracy over the rows that have a label (weight = their number, which
differs between minibatches, and is 0 in one of them). `trn_accum.WeightedScalar` combines
such summaries over minibatches as AXLearn does (Σ mean·weight / Σ weight, Σ weight) without
being named in `aux_reduction`; the per-example loss [B] is stitched back in row order.

Checked against `jax.value_and_grad` on the full batch (loss, gradients, summaries), then with
`Strategy(skip_nonfinite=True)` on a batch whose minibatch 1 has a NaN input: against the full
batch over the other rows. Exit status 1 if anything differs.
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
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from trn_accum import Strategy, WeightedScalar, accumulate_gradients, build_mesh, constrain  # noqa: E402

B, S, D, H, C, K = 32, 8, 16, 32, 8, 4  # rows, tokens per row, features, hidden, classes, k
BATCH_SPEC = P(("data", "fsdp"))
PARAM_SPECS = {"w1": P(None, "fsdp"), "w2": P("fsdp", None)}


def make_loss(mesh):
    def loss_fn(params, batch):
        """(mean NLL over target tokens, summaries), as an AXLearn model's forward returns."""
        h = constrain(jnp.tanh(batch["x"] @ params["w1"]), mesh, BATCH_SPEC)
        logits = h @ params["w2"]  # [b, S, C]
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, batch["y"][..., None], -1)[..., 0]  # [b, S]
        mask = batch["mask"]
        num_tokens = mask.sum()
        loss = (nll * mask).sum() / num_tokens
        has_label = batch["has_label"]  # [b] 0/1: rows with a row-level label
        correct = (logits.mean(1).argmax(-1) == batch["label"]).astype(jnp.float32)
        num_labelled = has_label.sum()  # 0 in some minibatch: its own mean is 0/0, dropped
        summaries = {
            "loss": WeightedScalar(loss, num_tokens),
            "accuracy": WeightedScalar((correct * has_label).sum() / num_labelled, num_labelled),
            "per_example_loss": (nll * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0),  # [b]
        }
        return loss, summaries

    return loss_fn


def make_inputs():
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.standard_normal((D, H)).astype(np.float32) / np.sqrt(D),
        "w2": rng.standard_normal((H, C)).astype(np.float32),
    }
    has_label = np.zeros(B, np.float32)
    for i, n in enumerate((5, 1, 0, 3)):  # labelled rows of minibatch i (rows i::K)
        has_label[np.arange(i, B, K)[:n]] = 1.0
    mask = (rng.uniform(size=(B, S)) < np.linspace(0.2, 1.0, B)[:, None]).astype(np.float32)
    mask[:, 0] = 1.0
    batch = {
        "x": rng.standard_normal((B, S, D)).astype(np.float32),
        "y": rng.integers(0, C, (B, S)).astype(np.int32),
        "mask": mask,
        "has_label": has_label,
    }
    # Row labels: the initial model's prediction on every other row, so accuracy is not 0.
    pred = (np.tanh(batch["x"] @ params["w1"]) @ params["w2"]).mean(1).argmax(-1)
    batch["label"] = np.where(np.arange(B) % 2 == 0, pred, (pred + 1) % C).astype(np.int32)
    return params, batch


def max_relative_error(actual, expected) -> float:
    errs = [
        float(np.max(np.abs(np.asarray(a) - e)) / max(float(np.max(np.abs(e))), 1e-30))
        for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    ]
    return max(errs)


def main() -> int:
    mesh = build_mesh({"data": 2, "fsdp": 4})
    params, batch = make_inputs()
    on_mesh = {n: jax.device_put(p, NamedSharding(mesh, PARAM_SPECS[n])) for n, p in params.items()}
    sharded = on_mesh, jax.device_put(batch, NamedSharding(mesh, BATCH_SPEC))
    ref = jax.jit(jax.value_and_grad(make_loss(None), has_aux=True))(params, batch)
    grad_fn = accumulate_gradients(
        make_loss(mesh),
        steps=K,
        mesh=mesh,
        batch_spec=BATCH_SPEC,
        param_specs=PARAM_SPECS,
        weight_fn=lambda mb: mb["mask"].sum(),
        has_aux=True,
        aux_reduction={"per_example_loss": "concat"},  # the WeightedScalars need no name
    )
    (loss, summaries), grads = jax.jit(grad_fn)(*sharded)
    err = max_relative_error(((loss, summaries), grads), ref)
    acc = summaries["accuracy"]
    full_acc = ref[0][1]["accuracy"]
    print(
        f"accuracy {float(acc.mean):.4f} over {int(acc.weight)} labelled rows (full batch "
        f"{float(full_acc.mean):.4f} over {int(full_acc.weight)})"
    )

    # skip_nonfinite: minibatch 1 (rows 1::K) gets a NaN input; the rest is the full batch over
    # the other rows, and grad_fn.with_stats gives the dropped count beside value_and_grad's.
    bad = dict(batch, x=batch["x"].copy())
    bad["x"][1::K, 0, 0] = np.nan
    rows = np.setdiff1d(np.arange(B), np.arange(1, B, K))
    ref_rest = jax.jit(jax.value_and_grad(make_loss(None), has_aux=True))(
        params, {n: v[rows] for n, v in bad.items()}
    )
    skip_fn = accumulate_gradients(
        make_loss(mesh),
        steps=K,
        mesh=mesh,
        batch_spec=BATCH_SPEC,
        param_specs=PARAM_SPECS,
        weight_fn=lambda mb: mb["mask"].sum(),
        has_aux=True,
        aux_reduction={"per_example_loss": "concat"},
        strategy=Strategy(skip_nonfinite=True),
    )
    ((loss, summaries), grads), stats = jax.jit(skip_fn.with_stats)(
        on_mesh, jax.device_put(bad, NamedSharding(mesh, BATCH_SPEC))
    )
    summaries = dict(summaries, per_example_loss=np.asarray(summaries["per_example_loss"])[rows])
    err_skip = max_relative_error(((loss, summaries), grads), ref_rest)

    print(f"max relative error vs the full batch (loss, summaries, gradients): {err:.2e}")
    print(
        f"skip_nonfinite: dropped {int(stats.dropped)} minibatch, "
        f"error vs the other rows {err_skip:.2e}"
    )
    return 0 if max(err, err_skip) <= 1e-5 and int(stats.dropped) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
