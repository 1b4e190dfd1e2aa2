"""Issue 21: `WeightedScalar` aux (AXLearn's weighted summaries) and `skip_nonfinite`, against
the full batch (or the full batch over the remaining rows), on a mesh and without one, both
loops and both reduce modes (reduce="once" needs a mesh to differ from per_minibatch)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum import Strategy, WeightedScalar, accumulate_gradients
from trn_accum.core.constraints import constrain
from trn_accum.core.mesh import build_mesh
from trn_accum.core.specs import leaf_specs

D, H, C, S, B, K = 8, 16, 4, 4, 32, 4  # features, hidden, classes, sequence, batch, steps
AXES = {"data": 4, "fsdp": 2}  # reduce="once": manual over data (4), fsdp stays automatic
BATCH_SPEC = P(("data", "fsdp"))
PARAM_SPECS = {"w1": P("fsdp", None), "b1": P(), "w2": P(None, "fsdp")}
# (mesh?, loop, reduce)
CASES = [(False, "scan", "per_minibatch"), (False, "unroll", "per_minibatch")]
CASES += [(True, loop, red) for loop in ("scan", "unroll") for red in ("per_minibatch", "once")]
REDUCTION = {"tokens": "sum", "per_example": "concat"}  # "accuracy" is found, not named


def make_loss(mesh=None):
    """Token-weighted NLL of an MLP over tokens. aux: "accuracy", the row accuracy over the
    rows that have a label, as a WeightedScalar (its own 0/0 = NaN on a minibatch without a
    labelled row); "tokens", the token count; "per_example", the per-row loss [b]."""

    def loss_fn(params, batch):
        h = constrain(jnp.tanh(batch["x"] @ params["w1"] + params["b1"]), mesh, BATCH_SPEC)
        logits = constrain(h @ params["w2"], mesh, BATCH_SPEC)  # [b, S, C]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][..., None], -1)[..., 0]
        mask = batch["mask"]
        row_nll = (nll * mask).sum(-1)  # [b]
        labelled = batch["labelled"]  # [b] 0/1
        correct = (logits.mean(1).argmax(-1) == batch["row_label"]).astype(jnp.float32)
        aux = {
            "accuracy": WeightedScalar((correct * labelled).sum() / labelled.sum(), labelled.sum()),
            "tokens": mask.sum(),
            "per_example": row_nll,
        }
        return row_nll.sum() / mask.sum(), aux

    return loss_fn


def weight_fn(mb):
    return mb["mask"].sum()


def make_inputs(seed=0):
    """(params, batch) as numpy; the minibatches of the strided split (rows i::K) have 4, 2, 0
    and 1 labelled rows (different counts, one with none)."""
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.standard_normal((D, H)).astype(np.float32),
        "b1": (rng.standard_normal(H) * 0.1).astype(np.float32),
        "w2": rng.standard_normal((H, C)).astype(np.float32),
    }
    mask = (rng.uniform(size=(B, S)) < np.linspace(0.3, 1.0, B)[:, None]).astype(np.float32)
    mask[:, 0] = 1.0
    labelled = np.zeros(B, np.float32)
    for i, n in enumerate((4, 2, 0, 1)):
        labelled[np.arange(i, B, K)[:n]] = 1.0
    batch = {
        "x": rng.standard_normal((B, S, D)).astype(np.float32),
        "y": rng.integers(0, C, (B, S)).astype(np.int32),
        "mask": mask,
        "labelled": labelled,
        "row_label": rng.integers(0, C, B).astype(np.int32),
    }
    return params, batch


def place(params, batch):
    mesh = build_mesh(AXES)
    params = {n: jax.device_put(v, NamedSharding(mesh, PARAM_SPECS[n])) for n, v in params.items()}
    leaves, treedef = jax.tree.flatten(batch)
    specs = leaf_specs(batch, BATCH_SPEC)
    put = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(leaves, specs, strict=True)]
    return mesh, params, jax.tree.unflatten(treedef, put)


def run(on_mesh, loop, reduce, params, batch, skip_nonfinite=False):
    """jit(grad_fn.with_stats)(params, batch) of accumulate_gradients(...): (value_and_grad's
    output, AccumulationStats), placed on the mesh when `on_mesh`."""
    mesh = None
    opts = dict(steps=K, weight_fn=weight_fn, has_aux=True, aux_reduction=REDUCTION)
    strategy = Strategy(loop=loop, reduce=reduce, skip_nonfinite=skip_nonfinite)
    if on_mesh:
        mesh, params, batch = place(params, batch)
        opts.update(mesh=mesh, batch_spec=BATCH_SPEC, param_specs=PARAM_SPECS)
    fn = accumulate_gradients(make_loss(mesh), **opts, strategy=strategy)
    return jax.jit(fn.with_stats)(params, batch)


@functools.cache
def full_batch(rows: tuple | None = None, seed=0):
    """value_and_grad of the loss on the full batch (or on the given rows only), no mesh."""
    params, batch = make_inputs(seed)
    if rows is not None:
        batch = {n: v[list(rows)] for n, v in batch.items()}
    return jax.jit(jax.value_and_grad(make_loss(), has_aux=True))(params, batch)


close = functools.partial(assert_close, rtol=1e-5, atol=1e-6)

# ----------------------------------------------------------------------------- WeightedScalar


@pytest.mark.parametrize("on_mesh, loop, reduce", CASES)
def test_weighted_scalar_equals_the_full_batch(on_mesh, loop, reduce):
    """A metric that is a weighted mean over its rows (accuracy over the labelled rows; 4, 2,
    0 and 1 of them in the four minibatches) comes out as on the full batch, mean and weight,
    without naming it; the minibatch with no labelled row (mean 0/0 = NaN) does not leak."""
    params, batch = make_inputs()
    ((loss, aux), grads), _ = run(on_mesh, loop, reduce, params, batch)
    (ref_loss, ref_aux), ref_grads = full_batch()
    close((loss, grads), (ref_loss, ref_grads), scaled_atol=True)
    acc, ref_acc = aux["accuracy"], ref_aux["accuracy"]
    assert isinstance(acc, WeightedScalar) and float(acc.weight) == float(ref_acc.weight) == 7.0
    np.testing.assert_allclose(float(acc.mean), float(ref_acc.mean), rtol=1e-6)
    assert float(aux["tokens"]) == float(batch["mask"].sum())
    close(aux["per_example"], ref_aux["per_example"])
    # Control: the loss-weighted "mean" of the minibatch accuracies is not the full batch's.
    per_mb = [
        full_batch(tuple(range(i, B, K)))[0][1]["accuracy"] for i in range(K) if i != 2
    ]  # minibatch 2 has no labelled row
    naive = np.mean([float(a.mean) for a in per_mb])
    assert abs(naive - float(ref_acc.mean)) > 1e-3, (naive, float(ref_acc.mean))


@pytest.mark.parametrize("reduce", ["per_minibatch", "once"])
def test_weighted_scalar_zero_total_weight_is_zero_without_nan(reduce):
    """No labelled row anywhere: every minibatch's mean is 0/0 = NaN (the full batch's too),
    the accumulated WeightedScalar is mean 0, weight 0, in the dtypes of the loss's fields."""
    params, batch = make_inputs()
    batch["labelled"][:] = 0.0
    ((_, aux), grads), _ = run(True, "scan", reduce, params, batch)
    ref = jax.jit(jax.value_and_grad(make_loss(), has_aux=True))(params, batch)
    assert np.isnan(float(ref[0][1]["accuracy"].mean))
    acc = aux["accuracy"]
    assert float(acc.mean) == 0.0 and float(acc.weight) == 0.0
    assert acc.mean.dtype == acc.weight.dtype == jnp.float32
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_weighted_scalar_python_numbers_and_errors():
    """Fields may be Python numbers (AXLearn's WeightedScalar(loss, 1)): the weight sums to k
    (one per minibatch) in its own dtype; a non-scalar field or naming it is a ValueError."""

    def loss_fn(p, b):
        loss = jnp.mean(b["x"] * p)
        return loss, {"loss": WeightedScalar(loss, 1), "nested": [WeightedScalar(2.0, 0.5)]}

    batch = {"x": jnp.arange(16.0)}
    (loss, aux), g = jax.jit(accumulate_gradients(loss_fn, steps=K, has_aux=True))(2.0, batch)
    np.testing.assert_allclose(loss, 15.0)
    np.testing.assert_allclose(aux["loss"].mean, 15.0, rtol=1e-6)
    assert int(aux["loss"].weight) == K and aux["loss"].weight.dtype == jnp.int32
    assert float(aux["nested"][0].mean) == 2.0 and float(aux["nested"][0].weight) == 0.5 * K

    def bad(p, b):
        return jnp.mean(b["x"] * p), {"m": WeightedScalar(b["x"] * p, 1.0)}

    with pytest.raises(ValueError, match=r"\['m'\] is a WeightedScalar with mean shape \(4,\)"):
        accumulate_gradients(bad, steps=K, has_aux=True)(2.0, batch)
    with pytest.raises(ValueError, match=r"\['loss'\] is a WeightedScalar.*cannot name it"):
        accumulate_gradients(loss_fn, steps=K, has_aux=True, aux_reduction={"loss": "sum"})(
            2.0, batch
        )


# ----------------------------------------------------------------------------- skip_nonfinite


@pytest.mark.parametrize("on_mesh, loop, reduce", CASES)
def test_skip_nonfinite_equals_the_remaining_rows(on_mesh, loop, reduce):
    """Minibatch 1 (rows 1::K) has a NaN input and minibatch 3 an inf one: both are dropped and
    the step equals the full batch over rows 0::K and 2::K alone (loss, gradients, the
    WeightedScalar, the summed token count); their per-example aux stays in place. The count:
    2 minibatches, or 2 × 4 loss_fn calls under "once" (4 devices on its manual data axis)."""
    params, batch = make_inputs()
    batch["x"][1::K, 0, 0] = np.nan
    batch["x"][3::K, 1, 2] = np.inf
    ((loss, aux), grads), stats = run(on_mesh, loop, reduce, params, batch, skip_nonfinite=True)
    dropped = stats.dropped
    rows = tuple(sorted([*range(0, B, K), *range(2, B, K)]))
    (ref_loss, ref_aux), ref_grads = full_batch(rows)
    assert int(dropped) == (2 * AXES["data"] if on_mesh and reduce == "once" else 2)
    assert dropped.dtype == jnp.int32
    close((loss, grads), (ref_loss, ref_grads), scaled_atol=True)
    close(aux["accuracy"], ref_aux["accuracy"])
    assert float(aux["tokens"]) == float(batch["mask"][list(rows)].sum())
    close(np.asarray(aux["per_example"])[list(rows)], ref_aux["per_example"])
    # Control: without the option the step is NaN.
    ((loss, _), grads), _ = run(on_mesh, loop, reduce, params, batch)
    assert np.isnan(float(loss)) and any(np.isnan(g).any() for g in jax.tree.leaves(grads))


def test_skip_nonfinite_gradient_alone_and_no_drop():
    """A minibatch whose loss is finite but whose gradient is NaN (d sqrt(z p²)/dp at z = 0,
    times 0) is dropped too; a finite batch drops nothing and is the full batch."""

    def loss_fn(p, b):
        return jnp.mean(b["x"] * p) + 0.0 * jnp.mean(jnp.sqrt(b["z"] * p * p))

    x = jnp.arange(16.0)
    z = jnp.ones(16).at[1::K].set(0.0)  # minibatch 1: NaN gradient, finite loss
    fn = jax.jit(
        accumulate_gradients(loss_fn, steps=K, strategy=Strategy(skip_nonfinite=True)).with_stats
    )
    full = jax.value_and_grad(loss_fn)(3.0, {"x": x, "z": z})
    assert np.isfinite(float(full[0])) and np.isnan(float(full[1]))
    (loss, g), stats = fn(3.0, {"x": x, "z": z})
    rest = np.setdiff1d(np.arange(16), np.arange(1, 16, K))
    assert int(stats.dropped) == 1
    np.testing.assert_allclose([loss, g], [3.0 * x[rest].mean(), x[rest].mean()], rtol=1e-6)
    out = fn(3.0, {"x": x, "z": jnp.ones(16)})
    ref = jax.value_and_grad(loss_fn)(3.0, {"x": x, "z": jnp.ones(16)})
    assert int(out[1].dropped) == 0
    close(out[0], ref)


@pytest.mark.parametrize("reduce", ["per_minibatch", "once"])
def test_skip_nonfinite_all_dropped_is_nan(reduce):
    """Every minibatch non-finite: nothing remains, so loss and gradients are NaN (as the full
    batch's, and as without the option: a caller's apply_if_finite still skips the step), and
    the count is every loss_fn call."""
    params, batch = make_inputs()
    batch["x"][:, 0, 0] = np.nan
    ((loss, aux), grads), stats = run(True, "scan", reduce, params, batch, skip_nonfinite=True)
    assert int(stats.calls) == K * (AXES["data"] if reduce == "once" else 1)
    assert int(stats.dropped) == K * (AXES["data"] if reduce == "once" else 1)
    assert np.isnan(float(loss)) and all(np.isnan(g).all() for g in jax.tree.leaves(grads))
    assert float(aux["tokens"]) == 0.0 and float(aux["accuracy"].weight) == 0.0
