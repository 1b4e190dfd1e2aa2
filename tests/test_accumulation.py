"""accumulate_gradients on 8 emulated CPU devices: exactness, aux, collectives, carry sharding,
errors, compile-once, PRNG."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum import Strategy, accumulate_gradients
from trn_accum.analysis import collectives as coll
from trn_accum.analysis.hlo import module as hlo
from trn_accum.analysis.hlo.partitioned import compile_partitioned
from trn_accum.core.constraints import constrain as constrain_sharding
from trn_accum.core.mesh import build_mesh
from trn_accum.core.specs import leaf_specs

D, H, C, S, B = 16, 32, 8, 4, 64  # features, hidden, classes, sequence, global batch
FSDP_PARAMS = {"w1": P("fsdp", None), "b1": P(), "w2": P(None, "fsdp")}

# name -> (mesh axes, batch spec, param specs)
MESHES = {
    "data8": ({"data": 8}, P("data"), {"w1": P(), "b1": P(), "w2": P()}),
    "data2_fsdp4": ({"data": 2, "fsdp": 4}, P(("data", "fsdp")), FSDP_PARAMS),
    "fsdp8": ({"fsdp": 8}, P("fsdp"), FSDP_PARAMS),
    "data4_fsdp2": ({"data": 4, "fsdp": 2}, P(("data", "fsdp")), FSDP_PARAMS),
    "data2_seq2_model2": (
        {"data": 2, "seq": 2, "model": 2},
        P("data", "seq"),
        {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)},
    ),
}
AUX_REDUCTION = {"per_example": None, "tokens": "sum", "accuracy": None}  # None = default


def make_loss(mesh=None, batch_spec=None):
    """Token-weighted softmax regression over an MLP; activations constrained to the batch
    sharding (as an FSDP model's are). aux: per-example loss [B], token count, accuracy."""

    def constrain(h):  # drops manual axes inside reduce="once"'s shard_map
        return constrain_sharding(h, mesh, batch_spec)

    def loss_fn(params, batch):
        h = constrain(jnp.tanh(batch["x"] @ params["w1"] + params["b1"]))  # [b, S, H]
        logits = constrain(h @ params["w2"])  # [b, S, C]
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, batch["y"][..., None], axis=-1)[..., 0]  # [b, S]
        mask = batch["mask"]
        tokens = mask.sum()
        loss = (nll * mask).sum() / tokens  # NaN for an all-padding minibatch
        correct = (logits.argmax(-1) == batch["y"]) * mask
        aux = {
            "per_example": (nll * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0),
            "tokens": tokens.astype(jnp.int32),
            "accuracy": correct.sum() / tokens,
        }
        return loss, aux

    return loss_fn


def weight_fn(minibatch):
    return minibatch["mask"].sum()


def make_inputs(k, seed=0):
    """(params, batch) as numpy arrays (no JAX dispatch: fast on a busy machine)."""
    rng = np.random.default_rng(seed)
    params = {
        "w1": (rng.standard_normal((D, H)) * 0.5).astype(np.float32),
        "b1": (rng.standard_normal(H) * 0.1).astype(np.float32),
        "w2": (rng.standard_normal((H, C)) * 0.5).astype(np.float32),
    }
    # Uneven padding: rows keep 20%..90% of their tokens at random, and (k > 1) minibatch k-1
    # of the strided split (rows k-1, 2k-1, ...) is all padding.
    mask = (rng.uniform(size=(B, S)) < np.linspace(0.2, 0.9, B)[:, None]).astype(np.float32)
    mask[0] = 1.0
    if k > 1:
        mask[k - 1 :: k] = 0.0
    batch = {
        "x": rng.standard_normal((B, S, D)).astype(np.float32),
        "y": rng.integers(0, C, (B, S)).astype(np.int32),
        "mask": mask,
    }
    return params, batch


def place(mesh_name, params, batch):
    axes, spec, pspecs = MESHES[mesh_name]
    mesh = build_mesh(axes)
    params = {n: jax.device_put(v, NamedSharding(mesh, pspecs[n])) for n, v in params.items()}
    leaves, treedef = jax.tree.flatten(batch)
    specs = leaf_specs(batch, spec)
    batch = jax.tree.unflatten(
        treedef,
        [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(leaves, specs, strict=True)],
    )
    return mesh, params, batch


def grad_fn_for(mesh_name, k, loop="scan", reduce="per_minibatch"):
    _, spec, pspecs = MESHES[mesh_name]
    mesh = build_mesh(MESHES[mesh_name][0])
    return accumulate_gradients(
        make_loss(mesh, spec),
        steps=k,
        mesh=mesh,
        batch_spec=spec,
        param_specs=pspecs,
        weight_fn=weight_fn,
        aux_reduction=AUX_REDUCTION,
        has_aux=True,
        strategy=Strategy(loop=loop, reduce=reduce),
    )


@functools.cache
def compiled_full(mesh_name):
    """The full-batch value_and_grad of the same loss (inputs differ per k only in values)."""
    _, spec, _ = MESHES[mesh_name]
    mesh, params, batch = place(mesh_name, *make_inputs(1))
    loss_fn = make_loss(mesh, spec)
    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True)).lower(params, batch).compile()


@functools.cache
def compiled_step(mesh_name, k, loop, reduce="per_minibatch"):
    """(compiled accumulated step, compiled full-batch step, params, batch) for a mesh."""
    _, params, batch = place(mesh_name, *make_inputs(k))
    acc = jax.jit(grad_fn_for(mesh_name, k, loop, reduce)).lower(params, batch).compile()
    return acc, compiled_full(mesh_name), params, batch


assert_tree_close = functools.partial(assert_close, rtol=1e-5, atol=1e-6, dtypes=True)


# ----------------------------------------------------------------------------- exactness


# Every mesh × every k with scan; unroll on every mesh at k=4 and at k=2, 8 on the hybrid mesh
# (compiles dominate the run time on 2 shared cores).
ISSUE_MESHES = ["data8", "data2_fsdp4", "fsdp8", "data2_seq2_model2"]
CASES = [(m, k, "scan") for m in ISSUE_MESHES for k in (1, 2, 4, 8)]
CASES += [(m, 4, "unroll") for m in ISSUE_MESHES]
CASES += [("data2_fsdp4", k, "unroll") for k in (2, 8)]


@pytest.mark.parametrize("mesh_name, k, loop", CASES)
def test_equals_full_batch(mesh_name, k, loop):
    acc, full, params, batch = compiled_step(mesh_name, k, loop)
    (loss, aux), grads = acc(params, batch)
    (ref_loss, ref_aux), ref_grads = full(params, batch)
    assert np.isfinite(loss) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    assert_tree_close(loss, ref_loss)
    assert_tree_close(grads, ref_grads)
    # Per-example aux in the original row order; the count summed; accuracy token-weighted.
    assert_tree_close(aux, ref_aux)
    assert int(aux["tokens"]) == int(batch["mask"].sum())
    if k > 1:  # the all-padding minibatch really is one (and its own loss is NaN)
        assert float(batch["mask"][k - 1 :: k].sum()) == 0.0


@pytest.mark.parametrize("reduce", ["per_minibatch", "once"])
def test_equals_full_batch_gspmd(reduce):
    """The same under the GSPMD partitioner (Shardy is the default)."""
    old = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        mesh_name = "data4_fsdp2"
        _, spec, _ = MESHES[mesh_name]
        mesh, params, batch = place(mesh_name, *make_inputs(4))
        out = jax.jit(grad_fn_for(mesh_name, 4, "scan", reduce))(params, batch)
        ref = jax.jit(jax.value_and_grad(make_loss(mesh, spec), has_aux=True))(params, batch)
    finally:
        jax.config.update("jax_use_shardy_partitioner", old)
    assert_tree_close(out, ref)


def test_mean_of_means_would_be_wrong():
    """Control: equal weighting differs from the full batch under this padding."""
    params, batch = make_inputs(4)
    batch["mask"][3::4] = 1.0  # no all-padding minibatch: finite minibatch means
    loss_fn = make_loss()
    ref, ref_g = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch)
    fn = accumulate_gradients(loss_fn, steps=4, has_aux=True, aux_reduction=AUX_REDUCTION)
    (loss, _), g = jax.jit(fn)(params, batch)
    assert abs(float(loss) - float(ref[0])) > 1e-4
    fn = accumulate_gradients(
        loss_fn, steps=4, has_aux=True, aux_reduction=AUX_REDUCTION, weight_fn=weight_fn
    )
    (loss, _), g = jax.jit(fn)(params, batch)
    assert_tree_close((loss, g), (ref[0], ref_g))


def test_unweighted_mean_loss_without_mesh():
    def loss_fn(params, batch, scale):
        pred = batch["x"].reshape(batch["x"].shape[0], -1) @ params
        return scale * jnp.mean((pred - batch["t"]) ** 2)

    params = jax.random.normal(jax.random.key(1), (S * D, 3))
    batch = {
        "x": jax.random.normal(jax.random.key(2), (B, S, D)),
        "t": jax.random.normal(jax.random.key(3), (B, 3)),
    }
    ref = jax.value_and_grad(loss_fn)(params, batch, 2.0)
    for loop in ("scan", "unroll"):
        out = jax.jit(accumulate_gradients(loss_fn, steps=4, strategy=Strategy(loop=loop)))(
            params, batch, 2.0
        )
        assert_tree_close(out, ref)


def test_zero_total_weight_gives_zero():
    params, batch = make_inputs(2)
    batch["mask"][:] = 0.0
    fn = accumulate_gradients(
        make_loss(), steps=2, weight_fn=weight_fn, has_aux=True, aux_reduction=AUX_REDUCTION
    )
    (loss, aux), grads = jax.jit(fn)(params, batch)
    assert float(loss) == 0.0 and float(aux["accuracy"]) == 0.0 and int(aux["tokens"]) == 0
    for g in jax.tree.leaves(grads):
        np.testing.assert_array_equal(g, 0.0)


def test_aux_reductions():
    def loss_fn(params, batch):
        v = batch["v"] * params
        aux = {"m": v.mean(), "mx": v.max(), "mn": v.min(), "n": jnp.int32(v.shape[0])}
        aux["ex"] = v * 2.0
        aux["bucket"] = jnp.ones(3) * v.sum()  # shape [3]: needs an explicit reduction
        return v.mean(), aux

    batch = {"v": jnp.arange(16.0)}
    red = {"mx": "max", "mn": "min", "n": "sum", "bucket": "sum"}
    fn = accumulate_gradients(
        loss_fn, steps=4, has_aux=True, aux_reduction=lambda path: red.get(path[0].key)
    )
    (loss, aux), g = jax.jit(fn)(jnp.float32(1.5), batch)
    np.testing.assert_allclose(loss, 1.5 * 7.5)
    np.testing.assert_allclose(g, 7.5)
    assert float(aux["mx"]) == 1.5 * 15 and float(aux["mn"]) == 0.0 and int(aux["n"]) == 16
    np.testing.assert_allclose(aux["ex"], 3.0 * jnp.arange(16.0))  # original order
    np.testing.assert_allclose(aux["bucket"], 1.5 * 120.0)
    np.testing.assert_allclose(aux["m"], 1.5 * 7.5)
    with pytest.raises(ValueError, match=r"aux leaf \['bucket'\] has shape \(3,\).*explicit"):
        accumulate_gradients(loss_fn, steps=4, has_aux=True)(jnp.float32(1.5), batch)
    with pytest.raises(ValueError, match="'concat' needs axis 0"):
        accumulate_gradients(loss_fn, steps=4, has_aux=True, aux_reduction="concat")(
            jnp.float32(1.5), batch
        )
    with pytest.raises(ValueError, match="aux_reduction='median'"):
        accumulate_gradients(loss_fn, steps=4, aux_reduction="median")


# ----------------------------------------------------------------------------- compiled program


def test_split_and_step_emit_no_conditionals_or_callbacks():
    """In the module a backend receives (after the SPMD partitioner) and in XLA:CPU's final
    one: no conditional, callback or host transfer; the one loop is the k = 4 minibatch loop
    (read where Neuron would: XLA:CPU may add loops of its own, e.g. for a scatter)."""
    _, params, batch = place("data2_fsdp4", *make_inputs(4))
    lowered = jax.jit(grad_fn_for("data2_fsdp4", 4, "scan")).lower(params, batch)
    compiled, text = compile_partitioned(lowered)
    for module in (hlo.parse_hlo(text), hlo.parse_hlo(compiled.as_text())):
        ops = {i.opcode for i in module.instructions()}
        assert not ops & {"conditional", "custom-call", "send", "recv", "infeed", "outfeed"}, ops
    module = hlo.parse_hlo(text)  # no trip counts annotated yet: counted from the condition
    assert [module.counted_trips(w) for w in module.while_loops()] == [4]


@pytest.mark.parametrize("mesh_name", ISSUE_MESHES)
def test_no_more_data_movement_than_full_batch(mesh_name):
    """Collectives that move activations/inputs: accumulated (outside loops + inside while
    bodies, once each) <= the full-batch step of the same loss."""
    acc, full, _, _ = compiled_step(mesh_name, 4, "scan")
    a = coll.count_collectives(acc.as_text())
    f = coll.count_collectives(full.as_text())
    for kind in ("all-to-all", "collective-permute", "all-gather"):
        n_acc = a["outside_loops"][kind] + a["inside_loops"][kind]
        assert n_acc <= f["total"][kind], (kind, a, f)
    assert a["total"]["all-to-all"] == 0 and a["total"]["collective-permute"] == 0


def _contiguous_loss_step(mesh, spec, pspecs, k):
    """For contrast: the same accumulation over a contiguous split."""
    loss_fn = make_loss(mesh, spec)

    def step(params, batch):
        def split(x):
            y = x.reshape(k, x.shape[0] // k, *x.shape[1:])
            return jax.lax.with_sharding_constraint(
                y, NamedSharding(mesh, P(None, *tuple(spec)[: x.ndim]))
            )

        stacked = jax.tree.map(split, batch)

        def body(acc, mb):
            g = jax.grad(lambda p: loss_fn(p, mb)[0])(params)
            return jax.tree.map(jnp.add, acc, g), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        return jax.lax.scan(body, zeros, stacked)[0]

    return step


def test_contiguous_split_moves_data_in_the_step():
    axes, spec, pspecs = MESHES["data2_fsdp4"]
    mesh, params, batch = place("data2_fsdp4", *make_inputs(4))
    step = _contiguous_loss_step(mesh, spec, pspecs, 4)
    counts = coll.count_collectives(jax.jit(step).lower(params, batch).compile().as_text())
    moved = counts["outside_loops"]["all-to-all"] + counts["outside_loops"]["collective-permute"]
    moved += counts["inside_loops"]["all-to-all"] + counts["inside_loops"]["collective-permute"]
    assert moved >= 2, counts


def _modified_carry_shapes(m):
    """Shapes of the while-loop carry elements that the body changes (not pass-through)."""
    shapes = []
    for w in m.while_loops():
        body, _ = m.loop_parts(w)
        root = body.root
        param = next(i for i in body.instructions if i.opcode == "parameter")
        for idx, name in enumerate(root.operands):
            src = m.instruction(name)
            passthrough = (
                src.opcode == "get-tuple-element"
                and src.operands == (param.name,)
                and src.attrs.get("index") == str(idx)
            )
            if not passthrough:
                shapes.extend(tuple(a.dims) for a in src.shapes if a.dtype == "f32")
    return shapes


@pytest.mark.parametrize("mesh_name", ["data2_fsdp4", "fsdp8", "data2_seq2_model2"])
def test_accumulator_carry_sharded_like_params(mesh_name):
    acc, _, params, _ = compiled_step(mesh_name, 4, "scan")
    carried = _modified_carry_shapes(hlo.parse_hlo(acc.as_text()))
    for name, p in params.items():
        local = p.sharding.shard_shape(p.shape)
        assert local in carried, (name, local, carried)
        if local != p.shape:
            assert p.shape not in carried, (name, p.shape, carried)


# ----------------------------------------------------------------------------- errors


def test_errors():
    mesh = build_mesh({"data": 2, "fsdp": 4})
    spec = P(("data", "fsdp"))
    params, batch = make_inputs(1)
    loss_fn = make_loss()
    with pytest.raises(ValueError, match=r"B=64 is not divisible by steps k=3 × 8 batch"):
        accumulate_gradients(loss_fn, steps=3, mesh=mesh, batch_spec=spec, has_aux=True)(
            params, batch
        )
    with pytest.raises(ValueError, match="nearest valid steps: k=4"):
        accumulate_gradients(loss_fn, steps=5, mesh=mesh, batch_spec=spec)(params, batch)
    with pytest.raises(ValueError, match=r"steps=0 must be >= 1"):
        accumulate_gradients(loss_fn, steps=0)
    bad = dict(batch, mask=batch["mask"][:32])  # numpy leaves are fine
    with pytest.raises(ValueError, match=r"B=32: \['mask'\].*B=64"):
        accumulate_gradients(loss_fn, steps=2, has_aux=True)(params, bad)
    with pytest.raises(ValueError, match=r"names mesh axis 'seq'"):
        accumulate_gradients(loss_fn, steps=2, mesh=mesh, batch_spec=P("data", "seq"))
    with pytest.raises(ValueError, match=r"param_specs\['w1'\].*'model'"):
        accumulate_gradients(
            loss_fn,
            steps=2,
            mesh=mesh,
            batch_spec=spec,
            param_specs={"w1": P("model"), "b1": P(), "w2": P()},
            has_aux=True,
        )(params, batch)
    with pytest.raises(ValueError, match="loop='while'"):
        accumulate_gradients(loss_fn, steps=2, strategy=Strategy(loop="while"))
    with pytest.raises(ValueError, match="rng_argnum=1"):
        accumulate_gradients(loss_fn, steps=2, rng_argnum=1)
    with pytest.raises(ValueError, match="needs mesh"):
        accumulate_gradients(loss_fn, steps=2, param_specs=FSDP_PARAMS)


# ----------------------------------------------------------------------------- jit, PRNG, dtypes


def test_compiles_once_with_optimizer():
    mesh_name = "data2_fsdp4"
    _, spec, pspecs = MESHES[mesh_name]
    mesh, params, batch = place(mesh_name, *make_inputs(4))
    grad_fn = grad_fn_for(mesh_name, 4)
    opt = optax.adamw(1e-2)
    replicated = NamedSharding(mesh, P())
    opt_state = jax.tree.map(  # the step count on the mesh too, as the trainer places it
        lambda x: jax.device_put(x, replicated) if x.ndim == 0 else x, opt.init(params)
    )
    state_shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))

    @functools.partial(jax.jit, out_shardings=(*state_shardings, replicated))
    def train_step(params, opt_state, batch):
        (loss, _), grads = grad_fn(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for seed in range(3):
        _, b = place(mesh_name, *make_inputs(4, seed=seed))[1:]
        params, opt_state, loss = train_step(params, opt_state, b)
        losses.append(float(loss))
    assert train_step._cache_size() == 1
    assert all(np.isfinite(losses))
    assert params["w1"].sharding.is_equivalent_to(NamedSharding(mesh, pspecs["w1"]), 2)


@pytest.mark.parametrize("loop", ["scan", "unroll"])
def test_minibatch_keys_distinct_and_deterministic(loop):
    k = 4

    def loss_fn(params, batch, key):
        noise = jax.random.uniform(key, (batch["x"].shape[0],))
        return jnp.mean(batch["x"] * params), {"noise": noise}

    batch = {"x": jnp.arange(16.0)}
    fn = jax.jit(
        accumulate_gradients(
            loss_fn, steps=k, has_aux=True, rng_argnum=2, strategy=Strategy(loop=loop)
        )
    )
    key = jax.random.key(42)
    (_, aux1), _ = fn(jnp.float32(1.0), batch, key)
    (_, aux2), _ = fn(jnp.float32(1.0), batch, key)
    (_, aux3), _ = fn(jnp.float32(1.0), batch, jax.random.key(43))
    np.testing.assert_array_equal(aux1["noise"], aux2["noise"])  # deterministic
    assert not np.array_equal(aux1["noise"], aux3["noise"])
    noise = np.asarray(aux1["noise"])
    for i in range(k):  # minibatch i (rows i::k) used fold_in(key, i)
        expected = jax.random.uniform(jax.random.fold_in(key, i), (16 // k,))
        np.testing.assert_array_equal(noise[i::k], expected)
    per_mb = {tuple(noise[i::k].tolist()) for i in range(k)}
    assert len(per_mb) == k  # distinct


def test_grad_dtype():
    def loss_fn(params, batch):
        return jnp.mean((batch["x"].astype(params.dtype) * params).astype(jnp.float32) ** 2)

    batch = {"x": jnp.arange(8.0)}
    p16 = jnp.bfloat16(0.5)
    _, g = accumulate_gradients(loss_fn, steps=2)(p16, batch)  # default: value_and_grad's
    assert g.dtype == jnp.bfloat16 == jax.value_and_grad(loss_fn)(p16, batch)[1].dtype
    _, g = accumulate_gradients(loss_fn, steps=2, strategy=Strategy(grad_dtype=jnp.float32))(
        p16, batch
    )
    assert g.dtype == jnp.float32
    _, g = accumulate_gradients(loss_fn, steps=2, strategy=Strategy(grad_dtype=jnp.bfloat16))(
        jnp.float32(0.5), batch
    )
    assert g.dtype == jnp.bfloat16


# ----------------------------------------------------------------------------- reduce="once"


def _data_all_reduces(compiled, mesh_name):
    """All-reduces whose replica groups span the mesh's "data" axis."""
    axes = MESHES[mesh_name][0]
    return [
        c
        for c in coll.collectives(compiled.as_text())
        if c.kind == "all-reduce" and "data" in (coll.group_axes(c.replica_groups, axes) or ())
    ]


@pytest.mark.parametrize(
    "mesh_name, loop",
    [("data4_fsdp2", "scan"), ("data8", "scan"), ("data4_fsdp2", "unroll")],
)
def test_reduce_once_one_data_reduction_after_the_loop(mesh_name, loop):
    k = 4
    per, full, params, batch = compiled_step(mesh_name, k, loop)
    once = compiled_step(mesh_name, k, loop, "once")[0]
    out = once(params, batch)
    assert_tree_close(out, per(params, batch), rtol=1e-6)
    assert_tree_close(out, full(params, batch))
    data_per = _data_all_reduces(per, mesh_name)
    data_once = _data_all_reduces(once, mesh_name)
    assert not any(c.in_loop for c in data_once), data_once
    # The float32 sums (loss, weight, gradients, mean aux) go in one all-reduce; the int32
    # token count (aux "sum") in its own.
    assert len([c for c in data_once if c.instruction.dtypes == {"f32"}]) == 1, data_once
    assert len(data_once) <= 2
    per_step = sum(c.bytes * c.trip_multiplier for c in data_per)
    once_step = sum(c.bytes * c.trip_multiplier for c in data_once)
    if loop == "scan":
        assert any(c.in_loop for c in data_per)
        assert per_step >= 0.9 * k * once_step, (per_step, once_step)


def test_reduce_once_with_sequence_sharding():
    """(data=2, seq=2, model=2): data is manual, seq and model stay automatic."""
    per, full, params, batch = compiled_step("data2_seq2_model2", 4, "scan")
    once = compiled_step("data2_seq2_model2", 4, "scan", "once")[0]
    out = once(params, batch)
    assert_tree_close(out, per(params, batch), rtol=1e-6)
    assert_tree_close(out, full(params, batch))
    assert not any(c.in_loop for c in _data_all_reduces(once, "data2_seq2_model2"))


def test_reduce_once_keys_and_errors():
    mesh = build_mesh({"data": 8})

    def loss_fn(params, batch, key):
        noise = jax.random.uniform(key, (batch["x"].shape[0],))
        return jnp.mean(batch["x"] * params), {"noise": noise}

    batch = {"x": jnp.arange(64.0)}
    fn = accumulate_gradients(
        loss_fn,
        steps=4,
        mesh=mesh,
        batch_spec=P("data"),
        weight_fn=lambda mb: mb["x"].shape[0],  # a plain mean over rows: the row count
        has_aux=True,
        rng_argnum=2,
        strategy=Strategy(reduce="once"),
    )
    key = jax.random.key(0)
    (loss, aux), g = jax.jit(fn)(jnp.float32(2.0), batch, key)
    np.testing.assert_allclose(loss, 2.0 * 31.5, rtol=1e-6)
    np.testing.assert_allclose(g, 31.5, rtol=1e-6)
    noise = np.asarray(aux["noise"])
    assert len(set(noise.tolist())) == 64  # distinct over minibatches and data shards
    (_, aux2), _ = jax.jit(fn)(jnp.float32(2.0), batch, key)
    np.testing.assert_array_equal(noise, aux2["noise"])
    with pytest.raises(ValueError, match="reduce='twice'"):
        accumulate_gradients(loss_fn, steps=2, strategy=Strategy(reduce="twice"))


# ----------------------------------------------------------------------------- issue 21


def _number_aux_loss(params, batch):
    """The MLP loss with aux leaves that are a Python int, a Python float, a NumPy scalar."""
    loss, _ = make_loss()(params, batch)
    return loss, {"n": 1, "m": 2.0, "z": np.float32(3)}


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("loop", ["scan", "unroll"])
@pytest.mark.parametrize("reduce", ["per_minibatch", "once"])
def test_python_number_aux_leaves(k, loop, reduce):
    """Python numbers and NumPy scalars as aux leaves reduce like 0-d arrays: "mean" (the
    default) and "max" give the full batch's value, "sum" adds one per loss_fn call: k calls,
    or k × 2 under reduce="once" (one per device along the manual data axis of size 2)."""
    mesh_name = "data2_fsdp4"
    _, spec, pspecs = MESHES[mesh_name]
    mesh, params, batch = place(mesh_name, *make_inputs(k))
    ref = jax.jit(jax.value_and_grad(_number_aux_loss, has_aux=True))(params, batch)
    for red, factor in (
        (None, 1),
        ({"n": "sum", "m": "mean", "z": "max"}, {"n": k * (2 if reduce == "once" else 1)}),
    ):
        fn = accumulate_gradients(
            _number_aux_loss,
            steps=k,
            mesh=mesh,
            batch_spec=spec,
            param_specs=pspecs,
            weight_fn=weight_fn,
            has_aux=True,
            aux_reduction=red or {"n": None, "m": None, "z": None},
            strategy=Strategy(loop=loop, reduce=reduce),
        )
        (loss, aux), grads = jax.jit(fn)(params, batch)
        assert_close((loss, grads), (ref[0][0], ref[1]), rtol=1e-5, scaled_atol=True)
        scale = factor if isinstance(factor, dict) else {}
        expected = {n: v * scale.get(n, 1) for n, v in ref[0][1].items()}
        assert_close(aux, expected)
        assert {n: np.shape(v) for n, v in aux.items()} == {"n": (), "m": (), "z": ()}


@pytest.mark.parametrize("loop", ["scan", "unroll"])
def test_two_minibatch_keys(loop):
    """rng_argnum=(2, 4): both keys are folded per minibatch (fold_in(key, i) each), so both
    differ between minibatches; the argument between them passes through unchanged."""
    k = 4

    def loss_fn(params, batch, key_a, scale, key_b):
        rows = batch["x"].shape[0]
        aux = {"a": jax.random.uniform(key_a, (rows,)), "b": jax.random.uniform(key_b, (rows,))}
        return scale * jnp.mean(batch["x"] * params), aux

    batch = {"x": jnp.arange(16.0)}
    fn = accumulate_gradients(
        loss_fn, steps=k, has_aux=True, rng_argnum=(2, 4), strategy=Strategy(loop=loop)
    )
    key_a, key_b = jax.random.key(1), jax.random.key(2)
    (loss, aux), _ = jax.jit(fn)(jnp.float32(1.0), batch, key_a, 2.0, key_b)
    np.testing.assert_allclose(loss, 2.0 * 7.5)
    for name, key in (("a", key_a), ("b", key_b)):
        noise = np.asarray(aux[name])
        for i in range(k):  # minibatch i (rows i::k) used fold_in(key, i)
            expected = jax.random.uniform(jax.random.fold_in(key, i), (16 // k,))
            np.testing.assert_array_equal(noise[i::k], expected)
        assert len({tuple(noise[i::k].tolist()) for i in range(k)}) == k  # distinct
    assert not np.array_equal(aux["a"], aux["b"])
    for bad in ((2, 2), (2, 1), ()):
        with pytest.raises(ValueError, match="tuple of distinct"):
            accumulate_gradients(loss_fn, steps=k, rng_argnum=bad)
    with pytest.raises(ValueError, match="rng_argnum=5 but grad_fn got 5"):
        accumulate_gradients(loss_fn, steps=k, has_aux=True, rng_argnum=(2, 5))(
            jnp.float32(1.0), batch, key_a, 2.0, key_b
        )


@pytest.mark.parametrize("loop", ["scan", "unroll"])
def test_equal_weights_all_padding_is_the_full_batch(loop):
    """weight_fn=None: every w_i is 1, so Σ w_i = k is never 0 and there is nothing for a
    zero-total-weight guard to act on; an all-padding batch gives what the full batch gives
    (this masked mean's own 0/0 = NaN, not inf), and the explicit weight_fn (Σ w_i = 0) gives
    exactly 0. A loss that guards its own division gives 0 under both, like the full batch."""
    params, batch = make_inputs(4)
    batch["mask"][:] = 0.0
    opts = dict(steps=4, has_aux=True, aux_reduction=AUX_REDUCTION, strategy=Strategy(loop=loop))

    def guarded(params, batch):
        _, aux = make_loss()(params, batch)  # per_example × row tokens = Σ_row nll·mask
        total = jnp.sum(aux["per_example"] * batch["mask"].sum(-1))
        return total / jnp.maximum(batch["mask"].sum(), 1.0), aux["tokens"]

    ref = jax.jit(jax.value_and_grad(make_loss(), has_aux=True))(params, batch)
    (loss, aux), grads = jax.jit(accumulate_gradients(make_loss(), **opts))(params, batch)
    assert np.isnan(float(ref[0][0])) and np.isnan(float(loss))
    assert all(np.isnan(g).all() for g in jax.tree.leaves(grads))
    fn = accumulate_gradients(make_loss(), weight_fn=weight_fn, **opts)
    (loss, aux), grads = jax.jit(fn)(params, batch)
    assert float(loss) == 0.0 and all((g == 0).all() for g in jax.tree.leaves(grads))
    for wf in (None, weight_fn):
        opts["aux_reduction"] = "sum"
        out = jax.jit(accumulate_gradients(guarded, weight_fn=wf, **opts))(params, batch)
        ref = jax.jit(jax.value_and_grad(guarded, has_aux=True))(params, batch)
        assert float(out[0][0]) == float(ref[0][0]) == 0.0
        assert_close(out[1], ref[1])
