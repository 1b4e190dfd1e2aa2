"""accumulate_gradients on meshes from `jax.make_mesh` of every axis type (core/mesh_types.py),
called directly or inside the caller's `jax.jit`: the full batch's loss and gradients, or a
one-line refusal naming the fix."""

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum import accumulate_gradients
from trn_accum.analysis.collectives import count_collectives
from trn_accum.analysis.hlo.partitioned import compile_partitioned

B, D, H = 16, 4, 2


def loss_fn(params, batch):
    """Mean squared error of a linear map: w [D, H], x [B, D], y [B, H]."""
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


@pytest.fixture(scope="module")
def data():
    kx, ky, kw = jax.random.split(jax.random.key(0), 3)
    batch = {"x": jax.random.normal(kx, (B, D)), "y": jax.random.normal(ky, (B, H))}
    params = {"w": jax.random.normal(kw, (D, H))}
    return params, batch, jax.value_and_grad(loss_fn)(params, batch)


MESHES = {
    "data8": ((8,), ("data",), P("data"), None),
    "data4_fsdp2": ((4, 2), ("data", "fsdp"), P("data"), {"w": P(None, "fsdp")}),
}


@pytest.mark.parametrize("axis_type", ["default", "Explicit", "Auto", "Manual"])
@pytest.mark.parametrize("name", list(MESHES))
def test_make_mesh_gives_full_batch_gradients(data, name, axis_type):
    shape, names, batch_spec, param_specs = MESHES[name]
    kw = {} if axis_type == "default" else {"axis_types": (AxisType[axis_type],) * len(names)}
    mesh = jax.make_mesh(shape, names, **kw)
    params, batch, (ref_loss, ref_grads) = data
    if axis_type != "Manual":  # arrays cannot be placed on Manual axes outside shard_map
        batch = jax.device_put(batch, NamedSharding(mesh, batch_spec))
    if param_specs is not None and axis_type != "Manual":
        params = jax.device_put(params, {"w": NamedSharding(mesh, param_specs["w"])})
    grad_fn = accumulate_gradients(
        loss_fn, steps=2, mesh=mesh, batch_spec=batch_spec, param_specs=param_specs
    )
    loss, grads = grad_fn(params, batch)
    assert_close(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads, rtol=1e-5, scaled_atol=True)
    if axis_type in ("default", "Explicit"):  # also with the Explicit mesh set around the call
        with jax.set_mesh(mesh):
            assert_close(grad_fn(params, batch)[1], ref_grads, rtol=1e-5, scaled_atol=True)


def _placed(data, mesh, name):
    """(params, batch) of `data` committed to `mesh` with MESHES[name]'s specs."""
    _, _, batch_spec, param_specs = MESHES[name]
    params, batch, _ = data
    w_spec = P() if param_specs is None else param_specs["w"]
    return (
        jax.device_put(params, {"w": NamedSharding(mesh, w_spec)}),
        jax.device_put(batch, NamedSharding(mesh, batch_spec)),
    )


def _grad_fn(mesh, name, **kw):
    _, _, batch_spec, param_specs = MESHES[name]
    return accumulate_gradients(
        loss_fn, steps=2, mesh=mesh, batch_spec=batch_spec, param_specs=param_specs, **kw
    )


def test_jit_on_explicit_mesh_gives_full_batch_gradients_and_moves_no_data(data):
    """A user's `jax.jit` around grad_fn on `jax.make_mesh`'s Explicit axes (the usual jitted
    train step): the full batch's loss and gradients, each gradient typed like its parameter.
    In the partitioned module no collective moves rows (no all-to-all, permute or all-gather:
    the strided split stays local) and the collectives are those of the same step on Auto
    axes: going to Auto axes and back adds none."""
    mesh = jax.make_mesh((8,), ("data",))
    assert mesh.axis_types == (AxisType.Explicit,)  # this JAX's default
    params, batch = _placed(data, mesh, "data8")
    compiled, text = compile_partitioned(jax.jit(_grad_fn(mesh, "data8")).lower(params, batch))
    loss, grads = compiled(params, batch)
    assert_close(loss, data[2][0], rtol=1e-5)
    assert_close(grads, data[2][1], rtol=1e-5, scaled_atol=True)
    assert grads["w"].sharding.is_equivalent_to(params["w"].sharding, 2)
    counts = count_collectives(text)["total"]
    assert counts["all-to-all"] == counts["collective-permute"] == counts["all-gather"] == 0
    auto = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    auto_lowered = jax.jit(_grad_fn(auto, "data8")).lower(*_placed(data, auto, "data8"))
    assert counts == count_collectives(compile_partitioned(auto_lowered)[1])["total"], counts


def loss_with_aux(params, batch):
    """loss_fn's loss, with aux: the per-example error [B] and the loss again (a scalar)."""
    per_example = jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2, axis=-1)  # [B]
    return jnp.mean(per_example), {"per_example": per_example, "loss": jnp.mean(per_example)}


def test_jit_on_explicit_fsdp_mesh_under_set_mesh(data):
    """data x fsdp Explicit axes, the parameters sharded over fsdp, the mesh also set around
    the jitted step (`jax.set_mesh`), aux returned: the full batch's loss, aux and gradients,
    the gradient typed P(None, "fsdp") like its parameter, the per-example aux like the rows."""
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"))
    params, batch = _placed(data, mesh, "data4_fsdp2")
    ref = jax.value_and_grad(loss_with_aux, has_aux=True)(*data[:2])
    grad_fn = accumulate_gradients(
        loss_with_aux,
        steps=2,
        mesh=mesh,
        batch_spec=P("data"),
        param_specs=MESHES["data4_fsdp2"][3],
        has_aux=True,
        aux_reduction={"loss": "mean"},
    )
    with jax.set_mesh(mesh):
        (loss, aux), grads = jax.jit(grad_fn)(params, batch)
    assert_close((loss, aux, grads), ref[0] + (ref[1],), rtol=1e-5, scaled_atol=True)
    assert grads["w"].sharding.spec == P(None, "fsdp")
    assert aux["per_example"].sharding.spec == P("data")


def test_traced_on_other_or_manual_axes_is_refused_naming_the_fix(data):
    """Arrays typed on a mesh other than accumulate_gradients' mesh, or grad_fn inside
    shard_map (Manual axes cannot become Auto): one line each, naming the axes and the fix."""
    mesh = jax.make_mesh((8,), ("data",))
    params, batch = _placed(data, mesh, "data8")
    other = jax.make_mesh((4, 2), ("data", "fsdp"))
    grad_fn = accumulate_gradients(loss_fn, steps=2, mesh=other, batch_spec=P("data"))
    with pytest.raises(ValueError) as e:
        jax.jit(grad_fn).trace(params, batch)
    assert "\n" not in str(e.value) and "{'data': 8}" in str(e.value)
    assert "{'data': 4, 'fsdp': 2}" in str(e.value) and "pass the mesh" in str(e.value)
    in_shard_map = jax.shard_map(
        _grad_fn(mesh, "data8"), mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
    )
    with pytest.raises(ValueError) as e:
        jax.jit(in_shard_map).trace(params, batch)
    assert "\n" not in str(e.value) and "('Manual',)" in str(e.value)
    assert "outside shard_map" in str(e.value) and "AxisType.Auto" in str(e.value)
