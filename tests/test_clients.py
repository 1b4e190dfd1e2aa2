"""accumulate_gradients with Flax NNX and Equinox models as clients (issue 12): None holes in
params and param_specs, partial aux_reduction dicts, value_and_grad's dtypes, specs checked
against shapes, batch_spec without mesh, eager calls compiled once, reduce="once"'s weight and
key rules, visible default aux reductions."""

import contextlib
import functools
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum import Strategy, accumulate_gradients, build_mesh
from trn_accum.core import AuxReductionWarning

B, S, D, H, C, K = 32, 4, 16, 64, 8, 4  # rows, tokens per row, features, hidden, classes, k
BATCH_SPEC = P(("data", "fsdp"))


@functools.cache
def mesh():
    return build_mesh({"data": 2, "fsdp": 4})


def make_batch(seed=0, place=True):
    """Uneven padding; minibatch K-1 of the strided split (rows K-1, 2K-1, ...) all padding."""
    rng = np.random.default_rng(seed)
    mask = (rng.uniform(size=(B, S)) < np.linspace(0.2, 1.0, B)[:, None]).astype(np.float32)
    mask[0], mask[K - 1 :: K] = 1.0, 0.0
    batch = {
        "x": rng.standard_normal((B, S, D)).astype(np.float32),
        "y": rng.integers(0, C, (B, S)).astype(np.int32),
        "mask": mask,
    }
    return jax.device_put(batch, NamedSharding(mesh(), BATCH_SPEC)) if place else batch


def token_loss(logits, batch):
    """(masked token mean of the cross-entropy, aux) for logits [b, S, C]."""
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][..., None], -1)[..., 0]
    mask = batch["mask"]
    aux = {
        "tokens": mask.sum(),
        "accuracy": ((logits.argmax(-1) == batch["y"]) * mask).sum() / mask.sum(),
        "per_example": (nll * mask).sum(-1),
    }
    return (nll * mask).sum() / mask.sum(), aux


def weight_fn(mb):
    return mb["mask"].sum()


def fsdp_spec(p):
    """The larger dimension of a matrix over "fsdp"; vectors replicated."""
    if np.ndim(p) < 2:
        return P()
    big = int(np.argmax(np.shape(p)))
    return P(*("fsdp" if i == big else None for i in range(np.ndim(p))))


@contextlib.contextmanager
def no_aux_warnings():
    """AuxReductionWarning raised as an error inside."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", AuxReductionWarning)
        yield


# ----------------------------------------------------------------------------- Equinox, holes


def equinox_problem():
    """An eqx MLP whose first layer is frozen: params have None holes there (and at every
    non-array field); param_specs have the same holes."""
    model = eqx.nn.MLP(D, C, H, depth=2, key=jax.random.key(0))
    trainable = eqx.tree_at(lambda m: m.layers[0], jax.tree.map(eqx.is_array, model), False)
    params, static = eqx.partition(model, trainable)
    specs = jax.tree.map(fsdp_spec, params)
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh(), s), specs))

    def loss_fn(params, batch):
        model = eqx.combine(params, static)
        return token_loss(jax.vmap(jax.vmap(model))(batch["x"]), batch)

    return params, specs, loss_fn


@pytest.mark.parametrize("loop", ["scan", "unroll"])
def test_equinox_none_holes_equal_full_batch(loop):
    params, specs, loss_fn = equinox_problem()
    assert params.layers[0].weight is None and specs.layers[0].weight is None  # real holes
    batch = make_batch()
    grad_fn = accumulate_gradients(
        loss_fn,
        steps=K,
        mesh=mesh(),
        batch_spec=BATCH_SPEC,
        param_specs=specs,
        weight_fn=weight_fn,
        has_aux=True,
        aux_reduction={"tokens": "sum", "accuracy": "mean"},  # per_example: the default
        strategy=Strategy(loop=loop),
    )
    with no_aux_warnings():
        out = eqx.filter_jit(grad_fn)(params, batch)
    ref = eqx.filter_jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch)
    assert jax.tree.structure(out[1]) == jax.tree.structure(params)  # holes kept
    assert_close(out, ref, rtol=1e-5, atol=1e-6, dtypes=True)
    for g, s in zip(jax.tree.leaves(out[1]), jax.tree.leaves(specs), strict=True):
        assert g.sharding.is_equivalent_to(NamedSharding(mesh(), s), g.ndim), (g.sharding, s)


def test_none_and_empty_subtrees_in_plain_params():
    """None leaves, empty dicts and a None spec over a subtree behave as in jax.tree functions:
    no gradient, no constraint, the structure kept."""
    rng = np.random.default_rng(3)
    params = {
        "w": rng.standard_normal((D, C)).astype(np.float32),
        "frozen": None,
        "empty": {},
        "head": {"b": np.zeros(C, np.float32), "skip": None},
    }
    specs = {"w": P("fsdp", None), "frozen": P("fsdp"), "empty": {}, "head": None}

    def loss_fn(params, batch):
        return token_loss(batch["x"] @ params["w"] + params["head"]["b"], batch)

    batch = make_batch(1)
    fn = accumulate_gradients(
        loss_fn,
        steps=K,
        mesh=mesh(),
        batch_spec=BATCH_SPEC,
        param_specs=specs,
        weight_fn=weight_fn,
        has_aux=True,
        aux_reduction={"tokens": "sum", "accuracy": "mean"},
    )
    (loss, aux), grads = jax.jit(fn)(params, batch)
    (ref_loss, ref_aux), ref_grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        params, batch
    )
    assert grads["frozen"] is None and grads["empty"] == {} and grads["head"]["skip"] is None
    assert_close((loss, aux, grads), (ref_loss, ref_aux, ref_grads), atol=1e-6, dtypes=True)


# ----------------------------------------------------------------------------- Flax NNX, aux


def nnx_problem(param_dtype=jnp.float32):
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(D, H, param_dtype=param_dtype, rngs=rngs)
            self.down = nnx.Linear(H, C, rngs=rngs)  # float32

        def __call__(self, x):
            return self.down(jax.nn.gelu(self.up(x)))

    graphdef, params = nnx.split(nnx.jit(lambda: MLP(nnx.Rngs(0)))(), nnx.Param)
    specs = jax.tree.map(fsdp_spec, params)
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh(), s), specs))

    def loss_fn(params, batch):
        return token_loss(nnx.merge(graphdef, params)(batch["x"]), batch)

    return params, specs, loss_fn


def nnx_grad_fn(loss_fn, specs, **kw):
    kw = {"weight_fn": weight_fn, "has_aux": True, **kw}
    return accumulate_gradients(
        loss_fn, steps=K, mesh=mesh(), batch_spec=BATCH_SPEC, param_specs=specs, **kw
    )


def test_flax_nnx_partial_aux_dict_equals_full_batch():
    params, specs, loss_fn = nnx_problem()
    batch = make_batch(2)
    ref = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch)
    # Only the count named: accuracy (a scalar) takes the default weighted mean, with a
    # warning naming it; per_example (axis 0 follows the batch) is stitched back silently.
    fn = nnx_grad_fn(loss_fn, specs, aux_reduction={"tokens": "sum"})
    with pytest.warns(AuxReductionWarning, match=r"\['accuracy'\].*\{'accuracy': 'mean'\}") as w:
        out = jax.jit(fn)(params, batch)
    assert len(w) == 1, [str(x.message) for x in w]
    assert_close(out, ref, rtol=1e-5, atol=1e-6, dtypes=True)
    assert int(out[0][1]["tokens"]) == int(batch["mask"].sum())
    # Naming it silences the warning; the numbers are the same.
    fn = nnx_grad_fn(loss_fn, specs, aux_reduction={"tokens": "sum", "accuracy": "mean"})
    with no_aux_warnings():
        assert_close(jax.jit(fn)(params, batch), ref, rtol=1e-5, atol=1e-6)


def test_aux_names_matching_no_leaf_is_one_line_error():
    params, specs, loss_fn = nnx_problem()
    fn = nnx_grad_fn(loss_fn, specs, aux_reduction={"tokenz": "sum", "accuracy": "mean"})
    keys = "aux leaves: ['accuracy'], ['per_example'], ['tokens']"
    with pytest.raises(ValueError, match=r"names \['tokenz'\], which matches no aux leaf; ") as e:
        jax.jit(fn)(params, make_batch())
    assert str(e.value).endswith(keys) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"aux_reduction='median' at \['tokens'\]"):
        nnx_grad_fn(loss_fn, specs, aux_reduction={"tokens": "median"})


def test_default_concat_checked_against_the_full_batch():
    """A leaf whose axis 0 equals B/k by coincidence is an error, not stitched."""

    def loss_fn(p, batch):
        loss, aux = token_loss(batch["x"] @ p, batch)
        return loss, {**aux, "bins": jnp.zeros(B // K) + loss}  # [B/k] at every batch size

    named = {"tokens": "sum", "accuracy": "mean"}
    fn = accumulate_gradients(
        loss_fn, steps=K, weight_fn=weight_fn, has_aux=True, aux_reduction=named
    )
    p, batch = np.ones((D, C), np.float32) / D, make_batch(place=False)
    with pytest.raises(ValueError, match=r"\['bins'\] has shape \(8,\) on a minibatch of 8 rows"):
        jax.jit(fn)(p, batch)
    fn = accumulate_gradients(
        loss_fn,
        steps=K,
        weight_fn=weight_fn,
        has_aux=True,
        aux_reduction={"tokens": "sum", "bins": "max", "accuracy": "mean"},
    )
    with no_aux_warnings():
        (_, aux), _ = jax.jit(fn)(p, batch)
    assert aux["bins"].shape == (B // K,) and aux["per_example"].shape == (B,)


def test_unverifiable_default_concat_warns():
    """A loss that only traces at the minibatch size: the default "concat" cannot be checked
    on the full batch, so it warns (naming the leaf) instead of failing."""

    def loss_fn(p, batch):
        assert batch["x"].shape[0] == B // K, "minibatch size only"
        return token_loss(batch["x"] @ p, batch)

    fn = accumulate_gradients(
        loss_fn,
        steps=K,
        weight_fn=weight_fn,
        has_aux=True,
        aux_reduction={"tokens": "sum", "accuracy": "mean"},
    )
    with pytest.warns(AuxReductionWarning, match=r"\['per_example'\].*unchecked.*full batch"):
        jax.jit(fn)(np.ones((D, C), np.float32), make_batch(place=False))


def test_no_warning_at_k1_or_when_named():
    fn = accumulate_gradients(lambda p, b: token_loss(b["x"] @ p, b), steps=1, has_aux=True)
    with no_aux_warnings():
        jax.jit(fn)(np.ones((D, C), np.float32), make_batch(place=False))


# ----------------------------------------------------------------------------- dtypes


def test_grad_dtypes_equal_value_and_grad():
    """bfloat16 and float32 parameters in one model: the default returns each parameter's
    dtype, as value_and_grad does; grad_dtype=float32 asks for float32 (what the trainer
    does)."""
    params, specs, loss_fn = nnx_problem(param_dtype=jnp.bfloat16)
    batch = make_batch(4)
    aux_reduction = {"tokens": "sum", "accuracy": "mean"}
    ref = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch)
    dtypes = {str(x.dtype) for x in jax.tree.leaves(ref[1])}
    assert dtypes == {"bfloat16", "float32"}, dtypes
    out = jax.jit(nnx_grad_fn(loss_fn, specs, aux_reduction=aux_reduction))(params, batch)
    assert_close(out, ref, rtol=2e-2, scaled_atol=True, dtypes=True)  # bf16 rounding
    out = jax.jit(
        nnx_grad_fn(
            loss_fn, specs, aux_reduction=aux_reduction, strategy=Strategy(grad_dtype=jnp.float32)
        )
    )(params, batch)
    assert {str(x.dtype) for x in jax.tree.leaves(out[1])} == {"float32"}


# ----------------------------------------------------------------------------- specs vs shapes


def test_param_spec_not_dividing_its_dimension_is_an_error_before_tracing():
    traced = []

    def loss_fn(p, batch):
        traced.append(1)
        return jnp.mean(batch["x"][:, 0, :6] @ p["w"])

    fn = accumulate_gradients(
        loss_fn, steps=2, mesh=mesh(), batch_spec=BATCH_SPEC, param_specs={"w": P("fsdp", None)}
    )
    p = {"w": np.ones((6, 4), np.float32)}
    msg = (
        r"param_specs\['w'\] = (P|PartitionSpec)\('fsdp', None\) does not fit shape \(6, 4\): "
        r"dimension 0 has size 6, not divisible by fsdp=4 = 4; replicate that dimension"
    )
    with pytest.raises(ValueError, match=msg) as e:
        fn(p, make_batch())
    assert "\n" not in str(e.value)
    assert not traced  # checked before the loss is traced
    with pytest.raises(ValueError):  # as jax.device_put does with the same spec
        jax.device_put(p["w"], NamedSharding(mesh(), P("fsdp", None)))
    bad_axis = accumulate_gradients(
        loss_fn, steps=2, mesh=mesh(), batch_spec=BATCH_SPEC, param_specs={"w": P("model")}
    )
    with pytest.raises(ValueError, match=r"param_specs\['w'\] (P|PartitionSpec)\('model',\) names"):
        bad_axis(p, make_batch())


def test_batch_spec_checks():
    def loss_fn(p, batch):
        return jnp.mean(batch["x"] * p)

    with pytest.raises(ValueError, match=r"batch_spec=(P|PartitionSpec)\('data',\) needs mesh="):
        accumulate_gradients(loss_fn, steps=2, batch_spec=P("data"))
    # A non-batch dimension: 6 columns over fsdp=4.
    fn = accumulate_gradients(loss_fn, steps=2, mesh=mesh(), batch_spec=P("data", "fsdp"))
    with pytest.raises(
        ValueError, match=r"leaf \['x'\] = .* dimension 1 has size 6, not divisible by fsdp=4"
    ):
        fn(jnp.float32(1.0), {"x": np.ones((16, 6), np.float32)})


# ----------------------------------------------------------------------------- eager calls


def test_eager_calls_compile_once_and_nest_without_recompiling():
    traces, compiles = [], []

    def on_event(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    def loss_fn(p, batch):
        traces.append(1)
        return jnp.mean((batch["x"] @ p) ** 2)

    rng = np.random.default_rng(0)
    p = rng.standard_normal((D, 3)).astype(np.float32)
    batches = [{"x": rng.standard_normal((B, D)).astype(np.float32)} for _ in range(3)]
    grad_fn = accumulate_gradients(loss_fn, steps=K)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        outs = [grad_fn(p, b) for b in batches]  # eager, same signature
        per_call = len(traces)
        assert len(compiles) == 1, compiles
        grad_fn(p, {"x": rng.standard_normal((2 * B, D)).astype(np.float32)})  # new shape
        assert len(compiles) == 2 and len(traces) == 2 * per_call
        jitted = jax.jit(lambda p, b: grad_fn(p, b))  # nested in the caller's jit: inline
        nested = [jitted(p, b) for b in batches]
        assert len(compiles) == 3 and len(traces) == 3 * per_call
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    for got, b in zip(nested, batches, strict=True):
        assert_close(got, jax.value_and_grad(loss_fn)(p, b), rtol=1e-5, atol=1e-6)
    assert_close(outs, nested, rtol=1e-6)


# ----------------------------------------------------------------------------- reduce="once"


def test_reduce_once_needs_an_additive_weight_fn():
    params, specs, loss_fn = nnx_problem()
    with pytest.raises(ValueError, match=r'reduce="once" needs an explicit weight_fn') as e:
        nnx_grad_fn(loss_fn, specs, weight_fn=None, strategy=Strategy(reduce="once"))
    assert "\n" not in str(e.value)
    batch = make_batch(5)
    aux_reduction = {"tokens": "sum", "accuracy": "mean"}
    once = jax.jit(
        nnx_grad_fn(loss_fn, specs, aux_reduction=aux_reduction, strategy=Strategy(reduce="once"))
    )
    per = jax.jit(nnx_grad_fn(loss_fn, specs, aux_reduction=aux_reduction))
    full = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    out = once(params, batch)
    assert_close(out, per(params, batch), rtol=1e-5, atol=1e-6)
    assert_close(out, full(params, batch), rtol=1e-5, atol=1e-6)


def test_dropout_key_rule_of_both_modes():
    """per_minibatch: minibatch i gets fold_in(key, i) and draws for its B/k rows; once: the
    device at index j of the manual axes gets fold_in(fold_in(key, i), j) for its rows."""
    data8 = build_mesh({"data": 8})

    def loss_fn(p, batch, key):
        return jnp.mean(batch["x"] * p), {"u": jax.random.uniform(key, batch["x"].shape[:1])}

    batch = {"x": jnp.arange(64.0)}
    key = jax.random.key(7)
    common = dict(steps=K, mesh=data8, batch_spec=P("data"), has_aux=True, rng_argnum=2)
    rows = lambda mb: mb["x"].shape[0]  # noqa: E731 (a plain mean: the row count)
    per = jax.jit(accumulate_gradients(loss_fn, weight_fn=rows, **common))
    once = jax.jit(
        accumulate_gradients(loss_fn, weight_fn=rows, **common, strategy=Strategy(reduce="once"))
    )
    u_per = np.asarray(per(jnp.float32(1.0), batch, key)[0][1]["u"])
    u_once = np.asarray(once(jnp.float32(1.0), batch, key)[0][1]["u"])
    for i in range(K):
        ki = jax.random.fold_in(key, i)
        np.testing.assert_array_equal(u_per[i::K], jax.random.uniform(ki, (64 // K,)))
        mb = u_once[i::K]  # minibatch i; device j holds its rows [2j, 2j + 2)
        for j in range(8):
            want = jax.random.uniform(jax.random.fold_in(ki, j), (2,))
            np.testing.assert_array_equal(mb[2 * j : 2 * j + 2], want)
    assert not np.array_equal(u_per, u_once)  # documented: the modes draw different bits
