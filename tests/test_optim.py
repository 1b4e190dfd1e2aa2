"""Optimizer: decoupled AdamW vs optax.adamw, schedule shape, non-finite skip without cond."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trn_accum.train.optim import all_finite, guarded_update, lr_multiplier, make_optimizer

ALPHA, LAMBDA = 3e-4, 0.1


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(k1, (4, 3), jnp.float32),
        "b": jax.random.normal(k2, (3,), jnp.float32),
    }


def _opt(kind, **kw):
    base = dict(
        kind=kind,
        learning_rate=ALPHA,
        weight_decay=LAMBDA,
        warmup_steps=2,
        total_steps=10,
        end_fraction=0.1,
        clip_norm=1.0,
    )
    base.update(kw)
    return make_optimizer(**base)


def test_schedule_warmup_then_cosine_to_end_fraction():
    eta = lr_multiplier(warmup_steps=4, total_steps=20, end_fraction=0.1)
    vals = [float(eta(count)) for count in range(20)]  # the update after `count` updates
    # 1-based like the reference: the first update gets eta(1) = 1/4, the 4th the peak.
    np.testing.assert_allclose(vals[:5], [0.25, 0.5, 0.75, 1.0, vals[4]], rtol=1e-6)
    assert 0.99 < vals[4] < 1.0
    # cosine half-way between the end of warmup (t=4) and the end (t=20): (1 + 0.1) / 2
    np.testing.assert_allclose(vals[11], 0.55, rtol=1e-6)
    np.testing.assert_allclose(vals[19], 0.1, rtol=1e-6)
    assert all(a >= b for a, b in zip(vals[3:], vals[4:], strict=False))


def test_decay_alone_decoupled_is_one_over_alpha_stronger_than_optax_adamw():
    """Zero gradients: Adam's direction is 0, so the update is the weight decay alone."""
    params = _params()
    zeros = jax.tree.map(jnp.zeros_like, params)
    out = {}
    for kind in ("reference", "adamw"):
        tx, _ = _opt(kind, warmup_steps=0)
        upd, _ = tx.update(zeros, tx.init(params), params)
        out[kind] = upd
    # no warmup: the first update gets eta(1), one step into the cosine (just under 1)
    eta0 = float(lr_multiplier(warmup_steps=0, total_steps=10, end_fraction=0.1)(0))
    assert 0.97 < eta0 < 1.0
    for name, p in params.items():
        np.testing.assert_allclose(out["reference"][name], -eta0 * LAMBDA * p, rtol=1e-6)
        np.testing.assert_allclose(out["adamw"][name], -eta0 * ALPHA * LAMBDA * p, rtol=1e-6)
        ratio = np.asarray(out["reference"][name]) / np.asarray(out["adamw"][name])
        np.testing.assert_allclose(ratio, 1.0 / ALPHA, rtol=1e-5)  # 3,333x


def _reference_algorithm2(params, grads_seq, *, b1=0.9, b2=0.95, eps=1e-8, clip=1.0, eta):
    """Loshchilov & Hutter Algorithm 2 with global-norm clipping, in numpy float64."""
    theta = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in theta.items()}
    v = {k: np.zeros_like(x) for k, x in theta.items()}
    for t, g in enumerate(grads_seq):
        g = {k: np.asarray(x, np.float64) for k, x in g.items()}
        norm = np.sqrt(sum(np.sum(x**2) for x in g.values()))
        g = {k: x * min(1.0, clip / norm) for k, x in g.items()}
        for k in theta:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            mhat = m[k] / (1 - b1 ** (t + 1))
            vhat = v[k] / (1 - b2 ** (t + 1))
            theta[k] = theta[k] - eta(t) * (
                ALPHA * mhat / (np.sqrt(vhat) + eps) + LAMBDA * theta[k]
            )
    return theta


@pytest.mark.parametrize("kind", ["reference", "adamw"])
def test_chain_matches_reference_over_steps(kind):
    params = _params()
    keys = jax.random.split(jax.random.key(1), 6)
    grads_seq = [
        jax.tree.map(lambda p, k=k: 3.0 * jax.random.normal(k, p.shape), params) for k in keys
    ]
    tx, _ = _opt(kind)
    state = tx.init(params)
    p = params
    for g in grads_seq:
        upd, state = tx.update(g, state, p)
        p = optax.apply_updates(p, upd)
    eta = lr_multiplier(warmup_steps=2, total_steps=10, end_fraction=0.1)
    ref = _reference_algorithm2(params, grads_seq, eta=lambda t: float(eta(t)))
    for k in params:
        if kind == "reference":
            np.testing.assert_allclose(p[k], ref[k], rtol=2e-6, atol=1e-7)
        else:
            # optax.adamw decays by alpha * eta * lambda: a different trajectory.
            assert np.max(np.abs(np.asarray(p[k]) - ref[k])) > 1e-4


def test_lr_fn_is_alpha_times_eta():
    _, lr_fn = _opt("reference", warmup_steps=4, total_steps=20)
    np.testing.assert_allclose(float(lr_fn(3)), ALPHA, rtol=1e-6)  # the 4th update: t = 4
    np.testing.assert_allclose(float(lr_fn(1)), ALPHA / 2, rtol=1e-6)  # t = 2
    np.testing.assert_allclose(float(lr_fn(0)), ALPHA / 4, rtol=1e-6)  # the first: t = 1


def test_nonfinite_step_is_skipped_without_conditional():
    params = _params()
    tx, _ = _opt("reference", warmup_steps=0)
    state = tx.init(params)
    good = jax.tree.map(jnp.ones_like, params)
    bad = dict(good, b=good["b"].at[1].set(jnp.nan))

    step = jax.jit(lambda g, s, p: guarded_update(tx, g, s, p))
    p1, s1, ok = step(bad, state, params)
    assert not bool(ok)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), (p1, s1), (params, state))
    p2, s2, ok = step(good, state, params)
    assert bool(ok)
    assert not np.array_equal(p2["w"], params["w"])
    counts = [int(c) for c in jax.tree.leaves(s2) if c.dtype == jnp.int32]
    assert counts and all(c == 1 for c in counts)

    inf = dict(good, w=good["w"].at[0, 0].set(jnp.inf))
    assert not bool(all_finite(inf)) and bool(all_finite(good))

    hlo = step.lower(bad, state, params).compile().as_text()
    assert not re.search(r"\sconditional\(", hlo)  # the HLO op, not metadata
    assert "stablehlo.case" not in step.lower(bad, state, params).as_text()
