"""model/fsdp.py: the per-device loss reduce-scatters the FSDP gradients (issue 35, part 4),
read on the module after XLA's SPMD partitioner, with the previous program's numbers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.analysis.collectives import collectives, group_axes
from trn_accum.analysis.partitioned import compile_partitioned
from trn_accum.model import fsdp, fuji
from trn_accum.train import step
from trn_accum.train.config import load_config

SETS = [
    "mesh.data=2", "mesh.fsdp=4", "mesh.model=1", 'mesh.rules="fsdp"', 'model.layer_loop="unroll"',
    "trainer.accum_steps=2", "data.global_batch=16", "model.loss_chunk=16",
]  # fmt: skip


def _cfg(*more):
    return load_config("configs/fuji-tiny.toml", SETS + list(more))


def test_step_reduce_scatters_every_layer_and_all_reduces_no_full_fsdp_gradient():
    cfg = _cfg()
    mesh = step.make_mesh(cfg)
    _, text = compile_partitioned(step.build_step(cfg, mesh).lowered)
    shape = dict(mesh.shape)
    # the smallest per-layer weight whole along fsdp: its gradient's size before a scatter
    smallest = min(
        math.prod(s.shape[1:])
        for s in jax.tree.leaves(fuji.param_shapes(cfg.model)["layers"])
        if len(s.shape) > 2
    )
    found = collectives(text)
    scatters = [c for c in found if c.kind == "reduce-scatter"]
    full = [
        c
        for c in found
        if c.kind == "all-reduce"
        and "fsdp" in group_axes(c.replica_groups, shape)
        and any(math.prod(a.dims) >= smallest for a in c.instruction.shapes)
    ]
    assert len(scatters) >= cfg.model.num_layers, [c.instruction.type_text for c in found]
    assert not full, [c.instruction.type_text for c in full]


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_per_device_loss_and_gradients_equal_the_partitioners(layer_loop):
    cfg = _cfg(f'model.layer_loop="{layer_loop}"', 'model.compute_dtype="float32"')
    mesh = step.make_mesh(cfg)
    specs = step.param_specs(cfg, mesh)
    params = jax.device_put(fuji.init_params(cfg.model, jax.random.key(0)), step.named(mesh, specs))
    keys = jax.random.split(jax.random.key(1), 2)
    shape = (16, cfg.data.seq_len)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    batch = jax.device_put(
        {
            "input_ids": jax.random.randint(keys[0], shape, 0, cfg.model.vocab_size),
            "target_labels": jax.random.randint(keys[1], shape, 0, cfg.model.vocab_size),
            "target_mask": (jnp.arange(shape[1]) < 40).astype(jnp.float32) * jnp.ones(shape),
        },
        rows,
    )
    previous = jax.value_and_grad(lambda p, b: fuji.loss_fn(p, b, cfg.model), has_aux=True)
    per_device = jax.value_and_grad(fsdp.sharded_loss(cfg.model, specs), has_aux=True)
    with jax.set_mesh(mesh):
        (loss0, aux0), g0 = jax.jit(previous)(params, batch)
        (loss1, aux1), g1 = jax.jit(per_device)(params, batch)
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-6)
    assert_close(aux1, aux0, rtol=1e-6)
    assert_close(g1, g0, rtol=2e-5, scaled_atol=True)
    assert float(optax.tree.norm(g1)) > 0
