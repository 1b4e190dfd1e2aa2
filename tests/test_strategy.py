"""Issue 36, the API: `Strategy` (its rules, checked when it is made), grad_fn's return pytree
(that of `jax.value_and_grad`, whatever the strategy), `grad_fn.with_stats`, and the shim for
the old keywords (a DeprecationWarning naming the Strategy field; the old 3-tuple under the old
skip_nonfinite=True; a TypeError beside strategy=)."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum import AccumulationStats, Strategy, accumulate_gradients, build_mesh

K = 2
AXES = {"data": 4, "fsdp": 2}
BATCH_SPEC = P(("data", "fsdp"))
PARAM_SPECS = {"w": P("fsdp", None), "b": P()}
STRATEGIES = [
    Strategy(),
    Strategy(loop="unroll"),
    Strategy(skip_nonfinite=True),
    Strategy(grad_dtype="float32"),
    Strategy(reduce="once"),
    Strategy(reduce="once", loop="unroll", skip_nonfinite=True),
    Strategy(reduce="once", gather="once", gather_dtype="bfloat16"),
    Strategy(reduce="once", gather="once_unsharded", reduce_dtype="bfloat16"),
]


def loss_fn(params, batch):
    """Masked mean squared error; aux: the token count and per-row errors."""
    err = ((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2).sum(-1)
    mask = batch["m"]
    return (err * mask).sum() / mask.sum(), {"tokens": mask.sum(), "rows": err}


def plain_loss(params, batch):
    return loss_fn(params, batch)[0]


def weight_fn(mb):
    return mb["m"].sum()


def inputs(mesh=None):
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(4, 2)).astype(np.float32), "b": np.zeros(2, np.float32)}
    batch = {
        "x": rng.normal(size=(16, 4)).astype(np.float32),
        "y": rng.normal(size=(16, 2)).astype(np.float32),
        "m": (np.arange(16) % 3 != 0).astype(np.float32),
    }
    if mesh is not None:
        params = {
            n: jax.device_put(v, NamedSharding(mesh, PARAM_SPECS[n])) for n, v in params.items()
        }
        batch = jax.device_put(batch, NamedSharding(mesh, BATCH_SPEC))
    return params, batch


def grad_fn_for(strategy, has_aux, mesh):
    return accumulate_gradients(
        loss_fn if has_aux else plain_loss,
        steps=K,
        mesh=mesh,
        batch_spec=BATCH_SPEC,
        param_specs=PARAM_SPECS,
        weight_fn=weight_fn,
        has_aux=has_aux,
        aux_reduction={"tokens": "sum"} if has_aux else None,
        strategy=strategy,
    )


@pytest.mark.parametrize("has_aux", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_same_pytree_as_value_and_grad_for_every_strategy(strategy, has_aux):
    mesh = build_mesh(AXES)
    params, batch = inputs(mesh)
    ref = jax.value_and_grad(loss_fn if has_aux else plain_loss, has_aux=has_aux)(params, batch)
    fn = grad_fn_for(strategy, has_aux, mesh)
    out = fn(params, batch)
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    assert [np.shape(x) for x in jax.tree.leaves(out)] == [
        np.shape(x) for x in jax.tree.leaves(ref)
    ]
    loose = strategy.gather_dtype or strategy.reduce_dtype != "float32"
    np.testing.assert_allclose(
        np.asarray(out[1]["w"]), np.asarray(ref[1]["w"]), rtol=2e-2 if loose else 1e-5
    )
    value, stats = jax.jit(fn.with_stats)(params, batch)
    assert isinstance(stats, AccumulationStats)
    assert jax.tree.structure(value) == jax.tree.structure(ref)
    assert stats.dropped.dtype == jnp.int32 and int(stats.dropped) == 0
    # loss_fn calls: one per minibatch and device along the manual axes (reduce="once": data;
    # gather="once...": fsdp too)
    devices = AXES["data"] if strategy.reduce == "once" else 1
    devices *= AXES["fsdp"] if strategy.gather != "per_minibatch" else 1
    assert int(stats.calls) == K * devices


@pytest.mark.parametrize("strategy", [Strategy(skip_nonfinite=True), Strategy()], ids=repr)
def test_with_stats_counts_what_skip_nonfinite_drops(strategy):
    params, batch = inputs()
    batch["x"][1, 0] = np.nan  # row 1: minibatch 1 of K = 2
    fn = accumulate_gradients(
        loss_fn, steps=K, has_aux=True, aux_reduction={"tokens": "sum"}, strategy=strategy
    )
    ((loss, _), grads), stats = fn.with_stats(params, batch)
    plain = fn(params, batch)
    assert jax.tree.structure(plain) == jax.tree.structure(((loss, _), grads))
    if strategy.skip_nonfinite:
        rows = {n: v[0::K] for n, v in batch.items()}  # minibatch 0 alone
        ref_loss, ref_grads = jax.value_and_grad(plain_loss)(params, rows)
        assert int(stats.dropped) == 1
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
        np.testing.assert_allclose(grads["w"], ref_grads["w"], rtol=1e-5)
    else:
        assert int(stats.dropped) == 0 and np.isnan(float(loss))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"loop": "while"}, r"Strategy\(loop='while'\): loop must be one of \('scan', 'unroll'\)"),
        ({"reduce": "twice"}, r"Strategy\(reduce='twice'\): reduce must be one of"),
        ({"gather": "once"}, r"Strategy\(gather='once'\) needs reduce=\"once\".*pass reduce"),
        (
            {"reduce": "once", "gather_dtype": "bfloat16"},
            r"Strategy\(gather_dtype='bfloat16'\) needs gather='once' or 'once_unsharded'.*drop",
        ),
        (
            {"reduce_dtype": "bfloat16"},
            r"Strategy\(reduce_dtype='bfloat16'\) needs reduce=\"once\".*reduce_dtype=\"float32\"",
        ),
        ({"reduce": "once", "reduce_dtype": "float16"}, r"reduce_dtype must be one of"),
        ({"skip_nonfinite": 1}, r"Strategy\(skip_nonfinite=1\): must be True or False"),
        ({"grad_dtype": "floatish"}, r"Strategy\(grad_dtype='floatish'\): not a dtype"),
    ],
)
def test_strategy_refuses_combinations_naming_value_rule_and_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        Strategy(**fields)


def test_strategy_is_frozen_hashable_and_normalises_dtypes():
    s = Strategy(reduce="once", gather="once", gather_dtype=jnp.bfloat16, grad_dtype=np.float32)
    assert (s.gather_dtype, s.grad_dtype) == ("bfloat16", "float32")
    assert s == Strategy(
        reduce="once", gather="once", gather_dtype="bfloat16", grad_dtype="float32"
    )
    assert hash(s) == hash(dataclasses.replace(s))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.reduce = "per_minibatch"
    with pytest.raises(TypeError, match="must be a trn_accum.Strategy"):
        accumulate_gradients(plain_loss, steps=K, strategy={"reduce": "once"})


def test_old_keywords_warn_naming_the_strategy_and_keep_the_old_returns():
    params, batch = inputs()
    batch["x"][1, 0] = np.nan
    with pytest.warns(
        DeprecationWarning, match=r"pass strategy=trn_accum.Strategy\(loop='unroll'\)"
    ):
        fn = accumulate_gradients(plain_loss, steps=K, loop="unroll")
    assert jax.tree.structure(fn(params, batch)) == jax.tree.structure(
        jax.value_and_grad(plain_loss)(params, batch)
    )
    with pytest.warns(DeprecationWarning) as record:
        old = accumulate_gradients(plain_loss, steps=K, skip_nonfinite=True, grad_dtype="float32")
    (message,) = [str(w.message) for w in record]
    assert "Strategy(skip_nonfinite=True, grad_dtype='float32')" in message
    assert "still returns (value, grads, dropped)" in message and "with_stats" in message
    loss, grads, dropped = old(params, batch)  # the old 3-tuple, for old callers
    new = accumulate_gradients(
        plain_loss, steps=K, strategy=Strategy(skip_nonfinite=True, grad_dtype="float32")
    )
    (new_loss, new_grads), stats = new.with_stats(params, batch)
    assert int(dropped) == int(stats.dropped) == 1
    np.testing.assert_array_equal(loss, new_loss)
    np.testing.assert_array_equal(grads["w"], new_grads["w"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # strategy= alone: no warning
        accumulate_gradients(plain_loss, steps=K, strategy=Strategy(loop="unroll"))


def test_old_keywords_beside_strategy_or_unknown_are_type_errors():
    with pytest.raises(TypeError, match=r"both strategy= and the old keywords reduce=, loop="):
        accumulate_gradients(
            plain_loss, steps=K, strategy=Strategy(), reduce="per_minibatch", loop="scan"
        )
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['reduction'\]"):
        accumulate_gradients(plain_loss, steps=K, reduction="once")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="gather='once'"):
        accumulate_gradients(plain_loss, steps=K, gather="once")  # the Strategy's own rules
