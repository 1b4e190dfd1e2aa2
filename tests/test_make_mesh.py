"""accumulate_gradients on meshes from `jax.make_mesh` of every axis type (core/mesh_types.py):
the full batch's loss and gradients, or a one-line refusal naming the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum import accumulate_gradients

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


def test_traced_on_explicit_axes_is_refused_naming_the_fix(data):
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"))  # Explicit by default
    params, batch, _ = data
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    grad_fn = accumulate_gradients(loss_fn, steps=2, mesh=mesh, batch_spec=P("data"))
    with pytest.raises(ValueError) as e:
        jax.jit(grad_fn)(params, batch)
    message = str(e.value)
    assert "\n" not in message
    assert "Explicit" in message and "outside jax.jit" in message
    assert "jax.sharding.AxisType.Auto" in message and "trn_accum.build_mesh" in message
    # The fix it names works: the same call on an Auto mesh of the same devices.
    auto = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    auto_fn = accumulate_gradients(loss_fn, steps=2, mesh=auto, batch_spec=P("data"))
    batch = jax.device_put(batch, NamedSharding(auto, P("data")))
    np.testing.assert_allclose(jax.jit(auto_fn)(params, batch)[0], data[2][0], rtol=1e-5)
