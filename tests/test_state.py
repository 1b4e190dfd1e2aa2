"""Issue 21: non-parameter state threaded through the minibatches in order (`state_argnum`):
batch statistics on a mesh and without one, both loops; Flax NNX `Rngs` counters; with
`skip_nonfinite`; errors (reduce="once" is refused: each device would update its own state)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum import Strategy, accumulate_gradients
from trn_accum.core.mesh import build_mesh

D, B, K = 4, 32, 4
MESH_AXES = {"data": 4, "fsdp": 2}
BATCH_SPEC = P(("data", "fsdp"))


def bn_loss(params, batch, stats):
    """A batch-norm-like loss: rows normalised by the running mean of the state *before* this
    minibatch; the new state moves it toward this minibatch's mean and counts the update."""
    x = batch["x"]  # [b, D]
    centred = x - stats["mean"]
    loss = jnp.mean((centred @ params - batch["t"]) ** 2)
    new = {"mean": 0.9 * stats["mean"] + 0.1 * x.mean(0), "count": stats["count"] + 1}
    return loss, ({"rows": x.shape[0]}, new)


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    params = rng.standard_normal(D).astype(np.float32)
    batch = {
        "x": (rng.standard_normal((B, D)) + 3.0).astype(np.float32),
        "t": rng.standard_normal(B).astype(np.float32),
    }
    stats = {"mean": np.zeros(D, np.float32), "count": np.int32(0)}
    return params, batch, stats


def sequential(loss_fn, params, batch, state, k=K, extra=()):
    """The reference: minibatch i (rows i::k, the strided split) in order, each getting the
    state the previous one returned; loss and grads averaged (equal rows per minibatch)."""
    vg = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    losses, grads = [], []
    for i in range(k):
        mb = jax.tree.map(lambda v, i=i: v[i::k], batch)
        (loss, (_, state)), g = vg(params, mb, state, *extra)
        losses.append(loss)
        grads.append(g)
    mean = functools.partial(jax.tree.map, lambda *xs: sum(xs) / k)
    return mean(*losses), mean(*grads), state


@pytest.mark.parametrize("on_mesh", [False, True])
@pytest.mark.parametrize("loop", ["scan", "unroll"])
def test_batch_stats_threaded_in_order(on_mesh, loop):
    params, batch, stats = inputs()
    opts = dict(steps=K, has_aux=True, state_argnum=2, aux_reduction={"rows": "sum"})
    opts["strategy"] = Strategy(loop=loop)
    if on_mesh:
        mesh = build_mesh(MESH_AXES)
        batch = jax.device_put(batch, NamedSharding(mesh, BATCH_SPEC))
        opts.update(mesh=mesh, batch_spec=BATCH_SPEC)
    (loss, (aux, new)), grads = jax.jit(accumulate_gradients(bn_loss, **opts))(params, batch, stats)
    ref_loss, ref_grads, ref_state = sequential(bn_loss, params, jax.device_get(batch), stats)
    assert int(new["count"]) == K and new["count"].dtype == jnp.int32
    assert int(aux["rows"]) == B
    assert_close((loss, grads, new["mean"]), (ref_loss, ref_grads, ref_state["mean"]), rtol=1e-5)
    # Control: every minibatch getting the initial state (no threading) gives other numbers.
    vg = jax.value_and_grad(bn_loss, has_aux=True)
    mbs = [{n: v[i::K] for n, v in inputs()[1].items()} for i in range(K)]
    unthreaded = np.mean([float(vg(params, mb, stats)[0][0]) for mb in mbs])
    assert abs(unthreaded - float(loss)) > 1e-3


def test_nnx_rngs_counters_threaded():
    """Flax NNX: the `Rngs` state (`nnx.RngState`) as the threaded argument: each minibatch
    draws its dropout mask from the counter the previous one advanced (all masks differ), and
    the final state is the sequential run's (counter advanced by k)."""

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(D, 1, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.lin(self.drop(x))[:, 0]

    model = Model(nnx.Rngs(0, dropout=1))
    graphdef, params, rng_state = nnx.split(model, nnx.Param, nnx.RngState)

    def loss_fn(params, batch, rng_state):
        m = nnx.merge(graphdef, params, rng_state, copy=True)  # new Variables in this trace
        pred = m(batch["x"])
        _, _, new_state = nnx.split(m, nnx.Param, nnx.RngState)
        return jnp.mean((pred - batch["t"]) ** 2), ({"pred": pred}, new_state)

    _, batch, _ = inputs()
    fn = accumulate_gradients(loss_fn, steps=K, has_aux=True, state_argnum=2)
    (loss, (aux, new_state)), grads = jax.jit(fn)(params, batch, rng_state)
    ref_loss, ref_grads, ref_state = sequential(loss_fn, params, batch, rng_state)
    assert_close((loss, grads), (ref_loss, ref_grads), rtol=1e-5)
    counts = [leaf for leaf in jax.tree.leaves(new_state) if leaf.dtype == jnp.uint32]
    ref_counts = [leaf for leaf in jax.tree.leaves(ref_state) if leaf.dtype == jnp.uint32]
    start = [leaf for leaf in jax.tree.leaves(rng_state) if leaf.dtype == jnp.uint32]
    assert counts and [int(c) for c in counts] == [int(c) for c in ref_counts]
    assert any(int(c) == int(s) + K for c, s in zip(counts, start, strict=True))
    # Minibatch 1 drew its dropout mask from the advanced counter: with the initial state its
    # predictions differ; with the state minibatch 0 returned they are the same.
    mb0, mb1 = ({n: v[i::K] for n, v in batch.items()} for i in (0, 1))
    state1 = jax.jit(loss_fn)(params, mb0, rng_state)[1][1]
    pred1 = np.asarray(aux["pred"])[1::K]
    np.testing.assert_allclose(
        pred1, jax.jit(loss_fn)(params, mb1, state1)[1][0]["pred"], rtol=1e-6
    )
    assert not np.allclose(pred1, jax.jit(loss_fn)(params, mb1, rng_state)[1][0]["pred"])


@pytest.mark.parametrize("loop", ["scan", "unroll"])
def test_state_with_skip_nonfinite_keeps_the_state_before_a_dropped_minibatch(loop):
    """Minibatch 1 is non-finite: dropped, and its new state discarded; the result is the
    sequential run over minibatches 0, 2, 3 in that order."""
    params, batch, stats = inputs()
    batch["t"][1::K] = np.nan
    fn = accumulate_gradients(
        bn_loss,
        steps=K,
        has_aux=True,
        state_argnum=2,
        aux_reduction={"rows": "sum"},
        strategy=Strategy(loop=loop, skip_nonfinite=True),
    )
    ((loss, (_, new)), grads), counts = jax.jit(fn.with_stats)(params, batch, stats)
    assert int(counts.dropped) == 1 and int(new["count"]) == K - 1
    state, losses, gs = stats, [], []
    for i in (0, 2, 3):
        mb = {n: v[i::K] for n, v in batch.items()}
        (loss_i, (_, state)), g = jax.value_and_grad(bn_loss, has_aux=True)(params, mb, state)
        losses.append(loss_i)
        gs.append(g)
    assert_close((loss, grads, new["mean"]), (np.mean(losses), np.mean(gs, 0), state["mean"]))


def test_state_errors():
    params, batch, stats = inputs()
    mesh = build_mesh(MESH_AXES)
    with pytest.raises(ValueError, match='state_argnum needs reduce="per_minibatch"'):
        accumulate_gradients(
            bn_loss,
            steps=K,
            mesh=mesh,
            batch_spec=BATCH_SPEC,
            has_aux=True,
            state_argnum=2,
            weight_fn=lambda mb: mb["x"].shape[0],
            strategy=Strategy(reduce="once"),
        )
    with pytest.raises(ValueError, match="state_argnum needs has_aux=True"):
        accumulate_gradients(bn_loss, steps=K, state_argnum=2)
    with pytest.raises(ValueError, match="also in rng_argnum"):
        accumulate_gradients(bn_loss, steps=K, has_aux=True, state_argnum=2, rng_argnum=2)
    with pytest.raises(ValueError, match="state_argnum=1 must be an int >= 2"):
        accumulate_gradients(bn_loss, steps=K, has_aux=True, state_argnum=1)
    with pytest.raises(ValueError, match="state_argnum=3 but grad_fn got 3"):
        accumulate_gradients(bn_loss, steps=K, has_aux=True, state_argnum=3)(params, batch, stats)

    def grows(params, batch, stats):  # a state whose dtype changes cannot be carried
        loss, (aux, new) = bn_loss(params, batch, stats)
        return loss, (aux, dict(new, count=new["count"].astype(jnp.float32)))

    with pytest.raises(ValueError, match="new state must have the structure, shapes and dtypes"):
        accumulate_gradients(grows, steps=K, has_aux=True, state_argnum=2)(params, batch, stats)

    def no_pair(params, batch, stats):
        return bn_loss(params, batch, stats)[0], {"rows": 1}

    with pytest.raises(ValueError, match=r"aux is not an \(aux, new_state\) pair"):
        accumulate_gradients(no_pair, steps=K, has_aux=True, state_argnum=2)(params, batch, stats)
