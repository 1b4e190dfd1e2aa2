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
from trn_accum.analysis.hlo.partitioned import compile_partitioned
from trn_accum.config.load import load_config
from trn_accum.model import fsdp, fuji
from trn_accum.train import step

SETS = [
    "mesh.data=2", "mesh.fsdp=4", "mesh.model=1", 'mesh.rules="fsdp"', 'model.layer_loop="unroll"',
    "trainer.accum_steps=2", "data.global_batch=16", "model.loss_chunk=16",
]  # fmt: skip
# the 3B config's mesh kind: fsdp x model 2, the trn2 rules (heads, FFN, vocabulary over model)
TP = ["mesh.data=1", "mesh.model=2", 'mesh.rules="trn2"']


def _cfg(*more):
    return load_config("configs/fuji-tiny.toml", SETS + list(more))


def _collectives(cfg):
    mesh = step.make_mesh(cfg)
    _, text = compile_partitioned(step.build_step(cfg, mesh).lowered)
    return collectives(text), dict(mesh.shape)


def _model_sizes(found, shape, kind=None):
    """Element counts of the operands of the collectives spanning "model" (of `kind`)."""
    return {
        math.prod(a.dims)
        for c in found
        if "model" in (group_axes(c.replica_groups, shape) or ("model",)) and kind in (None, c.kind)
        for a in c.instruction.shapes
    }


def _weight_shapes(cfg, shape) -> set[tuple[int, ...]]:
    """Each parameter's shape as one layer uses it, whole along fsdp and split over model as
    its spec says (a layer's slice of a stacked leaf): what an FSDP gather of it gives."""
    specs = fuji.param_specs(cfg.model, cfg.mesh.rules, shape)
    out = set()
    for path, s in jax.tree_util.tree_flatten_with_path(fuji.param_shapes(cfg.model))[0]:
        spec = specs
        for key in path:
            spec = spec[key.key]
        dims = zip(s.shape, tuple(spec) + (None,) * len(s.shape), strict=False)
        full = tuple(n // shape[e] if e == "model" else n for n, e in dims)
        out.add(full[1:] if path[0].key == "layers" else full)
    return out


@pytest.mark.parametrize("mesh", [[], TP], ids=["data2_fsdp4", "fsdp4_model2"])
def test_step_reduce_scatters_every_layer_and_all_reduces_no_full_fsdp_gradient(mesh, monkeypatch):
    cfg = _cfg(*mesh)
    found, shape = _collectives(cfg)
    # the smallest per-layer weight matrix: its gradient's size before a scatter
    smallest = min(math.prod(d) for d in _weight_shapes(cfg, shape) if len(d) > 1)
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
    if shape["model"] > 1:
        # over "model" only the partitioner's own tensor-parallel all-reduces, no gather of a
        # weight or a gradient: the same operand sizes as the previous program's (the loss
        # left to the partitioner)
        monkeypatch.setattr(fsdp, "manual_axes", lambda: ())
        previous, _ = _collectives(cfg)
        assert _model_sizes(found, shape) <= _model_sizes(previous, shape, "all-reduce")


@pytest.mark.parametrize("mesh", [[], TP], ids=["data2_fsdp4", "fsdp4_model2"])
def test_once_gathers_weights_in_the_loop_and_reduces_shards_after_it(mesh):
    """reduce="once" (trainer.gather "per_minibatch": the loss is given the shards, Strategy
    gather "in_loss"): inside the minibatch loop it all-gathers exactly what the per_minibatch
    step's loss does, each layer's weights (no activation or cotangent crosses fsdp), and
    reduce-scatters each layer's gradients; after it, the gradients are all-reduced at their
    shards' size, over fsdp nothing larger than a norm."""
    cfg = _cfg('trainer.reduce="once"', *mesh)
    assert step.strategy(cfg).gather == "in_loss"
    found, shape = _collectives(cfg)
    weights = _weight_shapes(cfg, shape)
    smallest = min(math.prod(d) for d in weights if len(d) > 1)

    def gathered(collectives):
        return sorted(
            (a.dtype, a.dims)
            for c in collectives
            if c.kind == "all-gather"
            for a in c.instruction.shapes
        )

    assert all(c.in_loop for c in found if c.kind == "all-gather")
    assert gathered(found) == gathered(_collectives(_cfg(*mesh))[0])
    scatters = [c for c in found if c.kind == "reduce-scatter" and c.in_loop]
    assert len(scatters) >= cfg.model.num_layers
    after = [c for c in found if c.kind == "all-reduce" and not c.in_loop]
    over_fsdp = [c for c in after if "fsdp" in group_axes(c.replica_groups, shape)]
    assert all(a.size < smallest for c in over_fsdp for a in c.instruction.shapes)
    if shape["data"] > 1:  # the one gradient reduction: over data, at the shard's size
        grads = [c for c in after if group_axes(c.replica_groups, shape) == ("data",)]
        assert grads and max(a.size for c in grads for a in c.instruction.shapes) < max(
            math.prod(d) for d in weights
        )


@pytest.mark.parametrize(
    "layer_loop,mesh",
    [("unroll", []), ("scan", []), ("scan", TP), ("unroll", TP)],
    ids=["unroll", "scan", "tp", "tp_unroll"],
)
def test_per_device_loss_and_gradients_equal_the_partitioners(layer_loop, mesh):
    cfg = _cfg(f'model.layer_loop="{layer_loop}"', 'model.compute_dtype="float32"', *mesh)
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
    # on the host: an eager op on g1 read its sharding with the mesh of an earlier test
    assert float(optax.tree.norm(jax.device_get(g1))) > 0


def test_tensor_parallel_meshes_run_the_loss_per_device_over_their_batch_axes():
    with jax.set_mesh(step.make_mesh(_cfg(*TP))):
        assert fsdp.manual_axes() == ("fsdp",)
    with jax.set_mesh(step.make_mesh(_cfg())):
        assert fsdp.manual_axes() == ("data", "fsdp")
