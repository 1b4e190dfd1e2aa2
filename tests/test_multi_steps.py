"""`trn_accum.optax.multi_steps`: accumulation across calls, exact, without a conditional.

One problem throughout: a linear model y ≈ x·w + b scored by the mean squared error over the
real (mask = 1) tokens, a batch of 8 rows cut into 4 minibatches of 2 rows whose masks hold
different numbers of real tokens (padding), so the mean of minibatch means differs from the
full batch's mean.
"""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.optax import MultiStepsState, has_updated, multi_steps, with_k

K, ROWS, T, D, O = 4, 8, 6, 16, 8
DOC = Path(__file__).resolve().parents[1] / "docs" / "optax.md"


def loss_fn(params, batch):
    """Mean squared error over the real tokens: batch x [B, T, D], y [B, T, O], mask [B, T]."""
    err = jnp.sum((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2, axis=-1)
    return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])


def tokens(mb):
    return mb["mask"].sum()


grad_fn = jax.jit(jax.grad(loss_fn))


@pytest.fixture(scope="module")
def problem():
    """(params, full batch, its K minibatches): masks of 12, 2, 9 and 5 real tokens."""
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(D, O)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(O,)), jnp.float32),
    }
    real = [12, 2, 9, 5]  # per minibatch of 2 rows × T = 12 tokens
    mask = np.zeros((ROWS, T), np.float32)
    for i, n in enumerate(real):
        mask[2 * i : 2 * i + 2].reshape(-1)[:n] = 1.0
    batch = {
        "x": jnp.asarray(rng.normal(size=(ROWS, T, D)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(ROWS, T, O)), jnp.float32),
        "mask": jnp.asarray(mask),
    }
    minibatches = [jax.tree.map(lambda x, i=i: x[2 * i : 2 * i + 2], batch) for i in range(K)]
    return params, batch, minibatches


def run(tx, params, minibatches, extra=()):
    """Feed one gradient per minibatch through jit(tx.update), applying each update. `extra`
    names the extra args passed: "batch" (batch=mb), "weight" (weight=tokens(mb)).
    Returns (final params, final state, every call's updates)."""
    state, update, outs = tx.init(params), jax.jit(tx.update), []
    for mb in minibatches:
        extra_args = {name: (mb if name == "batch" else tokens(mb)) for name in extra}
        updates, state = update(grad_fn(params, mb), state, params, **extra_args)
        params = optax.apply_updates(params, updates)
        outs.append(updates)
    return params, state, outs


def rel_err(actual, expected) -> float:
    """max |a - e| / max |e| over all leaves."""
    pairs = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    num = max(float(jnp.max(jnp.abs(a - e))) for a, e in pairs)
    den = max(float(jnp.max(jnp.abs(e))) for e in jax.tree.leaves(expected))
    return num / den


def branches(text: str) -> int:
    """Conditionals in lowered StableHLO or compiled HLO text."""
    return len(re.findall(r"stablehlo\.(?:case|if)\b|\bconditional\(|\bcase\(", text))


def test_compiled_update_has_no_conditional(problem):
    """Ours lowers and compiles without a conditional; optax.MultiSteps' update has one (so
    the count would see ours)."""
    params, _, mbs = problem
    grads = grad_fn(params, mbs[0])
    ours = multi_steps(optax.adam(1e-2), K, weight_fn=tokens)
    lowered = jax.jit(ours.update).lower(grads, ours.init(params), params, batch=mbs[0])
    assert branches(lowered.as_text()) == 0
    assert branches(lowered.compile().as_text()) == 0
    theirs = optax.MultiSteps(optax.adam(1e-2), K)
    their_lowered = jax.jit(theirs.update).lower(grads, theirs.init(params), params)
    assert branches(their_lowered.as_text()) > 0


def test_equal_weights_equal_to_optax_multisteps(problem):
    """Without weights, two steps of adam over 2K calls: every call's updates and the final
    parameters equal optax.MultiSteps' (which averages minibatch gradients)."""
    params, _, mbs = problem
    ours = run(multi_steps(optax.adam(1e-2), K), params, mbs + mbs)
    theirs = run(optax.MultiSteps(optax.adam(1e-2), K).gradient_transformation(), params, mbs + mbs)
    for mine, other in zip(ours[2], theirs[2], strict=True):
        assert_close(mine, other, rtol=1e-5, atol=1e-7)
    assert_close(ours[0], theirs[0], rtol=1e-5)
    assert int(ours[1].gradient_step) == 2 == int(theirs[1].gradient_step)
    assert int(ours[1].mini_step) == 0 and bool(has_updated(ours[1]))


@pytest.mark.parametrize("how", ["batch", "weight"])
def test_exact_under_padding(problem, how):
    """Weighted by real tokens (weight_fn + batch=, or weight=), one SGD step over K calls is
    the full batch's step within 1e-5; optax.MultiSteps' mean of minibatch means is not."""
    params, batch, mbs = problem
    expected = jax.tree.map(jnp.negative, grad_fn(params, batch))
    tx = multi_steps(optax.sgd(1.0), K, weight_fn=tokens if how == "batch" else None)
    _, state, outs = run(tx, params, mbs, extra=(how,))
    assert all(float(jnp.max(jnp.abs(u["w"]))) == 0.0 for u in outs[:-1])
    assert rel_err(outs[-1], expected) <= 1e-5
    assert float(state.acc.weight) == 0.0 and int(state.mini_step) == 0  # reset for the next
    _, _, theirs = run(optax.MultiSteps(optax.sgd(1.0), K).gradient_transformation(), params, mbs)
    assert rel_err(theirs[-1], expected) > 1e-2


def test_nonfinite_minibatch_dropped(problem):
    """A minibatch with a NaN input is dropped and counted: the step equals the full-batch step
    over the other three. A step whose every minibatch is non-finite applies nothing."""
    params, _, mbs = problem
    bad = dict(mbs[1], x=mbs[1]["x"].at[0, 0, 0].set(jnp.nan))
    rest = jax.tree.map(lambda *xs: jnp.concatenate(xs), mbs[0], mbs[2], mbs[3])
    expected = jax.tree.map(jnp.negative, grad_fn(params, rest))
    tx = multi_steps(optax.adam(1.0), K, weight_fn=tokens)
    tx_sgd = multi_steps(optax.sgd(1.0), K, weight_fn=tokens)
    _, state, outs = run(tx_sgd, params, [mbs[0], bad, mbs[2], mbs[3]], extra=("batch",))
    assert int(state.dropped) == 1
    assert rel_err(outs[-1], expected) <= 1e-5
    _, state, outs = run(tx, params, [bad] * K, extra=("batch",))
    assert int(state.dropped) == K and int(state.gradient_step) == 1
    assert all(np.all(np.asarray(u["w"]) == 0) for u in outs)
    assert_close(state.inner_opt_state, tx.init(params).inner_opt_state, rtol=0)  # kept


def feed(tx, params, minibatches, weights):
    """jit(tx.update) over (minibatch, weight=w) pairs from `tx.init(params)`, params fixed.
    Returns (the state after each call, the updates of each call)."""
    state, update, states, outs = tx.init(params), jax.jit(tx.update), [], []
    for mb, w in zip(minibatches, weights, strict=True):
        updates, state = update(grad_fn(params, mb), state, params, weight=jnp.float32(w))
        states.append(state)
        outs.append(updates)
    return states, outs


def test_all_zero_weight_step_leaves_params_and_adam_untouched(problem):
    """After one real Adam step, a step whose every call has weight 0 (every minibatch all
    padding) returns exactly zero updates and leaves Adam's mu, nu and count bit for bit as
    they were, as a step of dropped calls does; the step still counts as a step."""
    params, _, mbs = problem
    tx = multi_steps(optax.adam(1e-1), K)
    states, outs = feed(tx, params, mbs + mbs, [1.0] * K + [0.0] * K)
    after_real = states[K - 1].inner_opt_state
    assert int(after_real[0].count) == 1 and float(jnp.max(jnp.abs(after_real[0].mu["w"]))) > 0
    for u in outs[K:]:
        assert all(np.array_equal(x, np.zeros_like(x)) for x in jax.tree.leaves(u))
    final = states[-1]
    pairs = zip(jax.tree.leaves(final.inner_opt_state), jax.tree.leaves(after_real), strict=True)
    assert all(np.array_equal(a, b) for a, b in pairs)
    assert int(final.gradient_step) == 2 and int(final.dropped) == 0


def test_negative_or_nonfinite_weight_dropped_and_counted(problem):
    """Weights (3, -1): the call of weight -1 is dropped and counted, so the step is the first
    minibatch's own descent step (weighting it by -1 would have stepped uphill); an infinite
    or NaN weight is dropped and counted the same way."""
    params, _, mbs = problem
    tx = multi_steps(optax.sgd(1e-2), 2)
    states, outs = feed(tx, params, [mbs[0], mbs[2]], [3.0, -1.0])
    expected = jax.tree.map(lambda g: -1e-2 * g, grad_fn(params, mbs[0]))
    assert int(states[-1].dropped) == 1
    assert rel_err(outs[-1], expected) <= 1e-5
    stepped = optax.apply_updates(params, outs[-1])
    assert float(loss_fn(stepped, mbs[0])) < float(loss_fn(params, mbs[0]))  # downhill
    states, outs = feed(tx, params, mbs, [jnp.inf, 2.0, jnp.nan, 1.0])  # two steps of 2
    assert int(states[-1].dropped) == 2
    for out, kept in ((outs[1], mbs[1]), (outs[3], mbs[3])):
        assert rel_err(out, jax.tree.map(lambda g: -1e-2 * g, grad_fn(params, kept))) <= 1e-5


def test_value_is_checked_and_passed_on_as_the_weighted_mean(problem):
    """update(..., value=loss_i): a non-finite value drops its minibatch, and the inner
    transformation receives the step's token-weighted mean loss, the full batch's loss."""
    params, _, mbs = problem

    def keep_value(updates, state, params=None, *, value, **extra):
        return updates, value  # the inner state is the value it was given

    inner = optax.GradientTransformationExtraArgs(lambda p: jnp.float32(0.0), keep_value)
    tx = multi_steps(inner, K, weight_fn=tokens)
    state, update = tx.init(params), jax.jit(tx.update)
    values = [loss_fn(params, mb) for mb in mbs]
    values[2] = jnp.float32(jnp.inf)  # its gradient is finite: the value alone drops it
    for mb, value in zip(mbs, values, strict=True):
        _, state = update(grad_fn(params, mb), state, params, batch=mb, value=value)
    kept = jax.tree.map(lambda *xs: jnp.concatenate(xs), mbs[0], mbs[1], mbs[3])
    assert int(state.dropped) == 1
    np.testing.assert_allclose(state.inner_opt_state, loss_fn(params, kept), rtol=1e-6)


def test_variable_k_without_recompile(problem):
    """k = 2 for one step, then 3 (`with_k`): the steps end at calls 2 and 5, each equals its
    minibatches' full-batch step, and the jitted update compiled once."""
    params, _, mbs = problem
    tx = multi_steps(optax.sgd(1.0), 2, weight_fn=tokens)
    update = jax.jit(tx.update)
    state, ended, outs = tx.init(params), [], []
    for i, mb in enumerate(mbs + mbs[:1]):
        if i == 2:
            state = with_k(state, 3)
        updates, state = update(grad_fn(params, mb), state, params, batch=mb)
        ended.append(bool(has_updated(state)))
        outs.append(updates)
    assert ended == [False, True, False, False, True]
    assert update._cache_size() == 1
    cat = lambda *xs: jnp.concatenate(xs)  # noqa: E731
    first = grad_fn(params, jax.tree.map(cat, mbs[0], mbs[1]))
    second = grad_fn(params, jax.tree.map(cat, mbs[2], mbs[3], mbs[0]))
    assert rel_err(outs[1], jax.tree.map(jnp.negative, first)) <= 1e-5
    assert rel_err(outs[4], jax.tree.map(jnp.negative, second)) <= 1e-5


def test_sharded_params(problem):
    """Parameters sharded over the 8 emulated devices: the accumulator and the updates keep the
    parameters' shardings, and the numbers equal the unsharded run's."""
    params, _, mbs = problem
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    shardings = {"w": NamedSharding(mesh, P("fsdp", None)), "b": NamedSharding(mesh, P())}
    sharded = jax.device_put(params, shardings)
    tx = multi_steps(optax.adamw(1e-2), K, weight_fn=tokens)
    state = tx.init(sharded)
    assert state.acc_grads["w"].sharding == shardings["w"]
    _, state, outs = run(tx, sharded, mbs, extra=("batch",))
    assert state.acc_grads["w"].sharding.is_equivalent_to(shardings["w"], 2)
    assert outs[-1]["w"].sharding.is_equivalent_to(shardings["w"], 2)
    _, _, plain = run(tx, params, mbs, extra=("batch",))
    assert_close(outs[-1], plain[-1], rtol=1e-5, atol=1e-7)


def test_user_errors():
    """k not a positive integer (a string, a list, 0, a float, a bool, an array) names k and
    the rule; batch= without weight_fn, weight_fn without batch=."""
    for k in ("4", [2, 2], 0, -3, 2.0, True, jnp.array([2, 2])):
        with pytest.raises(ValueError) as e:
            multi_steps(optax.sgd(1.0), k)
        assert f"k={k!r}" in str(e.value) and "must be a positive integer" in str(e.value)
    with pytest.raises(ValueError, match=r"k=\[3\] must be a positive integer"):
        with_k(multi_steps(optax.sgd(1.0), 2).init({"w": jnp.ones(3)}), [3])
    params, grads = {"w": jnp.ones(3)}, {"w": jnp.ones(3)}
    plain = multi_steps(optax.sgd(1.0), 2)
    with pytest.raises(ValueError, match="weight_fn"):
        plain.update(grads, plain.init(params), params, batch={"mask": jnp.ones(3)})
    weighted = multi_steps(optax.sgd(1.0), 2, weight_fn=tokens)
    with pytest.raises(ValueError, match="batch=mb"):
        weighted.update(grads, weighted.init(params), params, weight=3.0)
    assert isinstance(weighted.init(params), MultiStepsState)


def test_docs_example_runs(capsys):
    """docs/optax.md's example runs as written (it asserts its own result)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], str(DOC), "exec"), {"__name__": "docs_optax"})
    assert "= the full batch's step" in capsys.readouterr().out


def test_float0_gradient_leaf_is_named():
    """jax.grad(allow_int=True) over params with an integer leaf gives that leaf a float0
    gradient: update refuses it in one line naming the leaf (eager and under jit); the
    gradient of the float leaves alone, the fix the line gives, steps."""
    params = {"w": jnp.ones(3), "count": jnp.array([1, 2], jnp.int32)}

    def loss(p):
        return jnp.sum(p["w"] ** 2) * p["count"].sum()

    grads = jax.grad(loss, allow_int=True)(params)
    assert grads["count"].dtype == jax.dtypes.float0
    tx = multi_steps(optax.adam(0.1), 2)
    state = tx.init(params)
    for update in (tx.update, jax.jit(tx.update)):
        with pytest.raises(ValueError) as e:
            update(grads, state, params)
        line = str(e.value)
        assert "gradient leaf ['count'] has dtype float0" in line and "\n" not in line
    floats = {"w": params["w"]}
    w_grad = jax.grad(lambda w: loss({**params, "w": w}))(floats["w"])
    tx = multi_steps(optax.sgd(1.0), 1)
    updates, _ = tx.update({"w": w_grad}, tx.init(floats), floats)
    np.testing.assert_allclose(np.asarray(updates["w"]), -np.asarray(w_grad))
