"""trn_accum.sharding: the strided split, its inverse, validation and mesh building."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.analysis import collectives as coll
from trn_accum.core.batch_rules import nearest_valid_steps, validate_batch
from trn_accum.core.mesh import build_mesh
from trn_accum.core.specs import leaf_specs
from trn_accum.core.split import merge_minibatches, minibatch_specs, split_minibatches

BATCH = ("data", "fsdp")

# (mesh axes, batch spec): the meshes of the issue.
MESHES = {
    "data8": ({"data": 8}, P("data")),
    "data2_fsdp4": ({"data": 2, "fsdp": 4}, P(BATCH)),
    "fsdp8": ({"fsdp": 8}, P("fsdp")),
    "data2_seq2_model2": ({"data": 2, "seq": 2, "model": 2}, P("data", "seq")),
}


def _batch(b=32, s=4, d=3):
    x = jnp.arange(b * s * d, dtype=jnp.float32).reshape(b, s, d)
    return {
        "tokens": jnp.arange(b * s, dtype=jnp.int32).reshape(b, s),
        "x": x,
        "row": jnp.arange(b, dtype=jnp.int32),
    }


# ----------------------------------------------------------------------------- pure parts


def test_minibatch_specs_pure():
    assert minibatch_specs(P(BATCH), 4) == (P(None, BATCH), P(BATCH))
    assert minibatch_specs(P("data", "seq"), 1) == (P(None, "data", "seq"), P("data", "seq"))
    assert minibatch_specs(None, 2) == (P(None), P())
    stacked, mini = minibatch_specs({"a": P("data"), "b": None}, 8)
    assert stacked == {"a": P(None, "data"), "b": P(None)}
    assert mini == {"a": P("data"), "b": P()}
    with pytest.raises(ValueError, match="steps=0"):
        minibatch_specs(P("data"), 0)


def test_leaf_specs_cut_to_rank_and_tree():
    batch = _batch()
    # Leaves in jax.tree.leaves order: row [B], tokens [B,S], x [B,S,D].
    assert leaf_specs(batch, P("data", "seq")) == [P("data"), P("data", "seq"), P("data", "seq")]
    tree = {"tokens": P("data", "seq"), "x": P("data"), "row": None}
    assert leaf_specs(batch, tree) == [P(), P("data", "seq"), P("data")]
    with pytest.raises(ValueError, match="prefix"):
        leaf_specs(batch, {"tokens": P("data")})


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_split_is_strided_and_merge_is_exact_inverse(k):
    batch = _batch()
    stacked = split_minibatches(batch, k)
    assert stacked["x"].shape == (k, 32 // k, 4, 3)
    for i in range(k):
        for name in batch:
            np.testing.assert_array_equal(stacked[name][i], batch[name][i::k])
    merged = merge_minibatches(stacked)
    jax.tree.map(np.testing.assert_array_equal, merged, batch)
    assert merged["tokens"].dtype == jnp.int32


def test_nearest_valid_steps():
    assert nearest_valid_steps(48, 8, 4) == 3  # B/shards = 6: divisors 1, 2, 3, 6
    assert nearest_valid_steps(64, 8, 3) == 4  # 2 and 4 tie: the larger
    assert nearest_valid_steps(64, 8, 100) == 8
    assert nearest_valid_steps(60, 8, 1) is None


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_numbers():
    mesh = build_mesh({"data": 2, "fsdp": 4})
    batch = _batch(b=48)
    with pytest.raises(ValueError) as e:
        split_minibatches(batch, 4, mesh=mesh, batch_spec=P(BATCH))
    msg = str(e.value)
    for part in ("B=48", "k=4", "8 batch shards", "= 32", "nearest valid steps: k=3", "['row']"):
        assert part in msg, msg
    with pytest.raises(ValueError, match="no k works"):
        split_minibatches(_batch(b=36), 1, mesh=mesh, batch_spec=P(BATCH))
    with pytest.raises(ValueError, match=r"steps=0 must be >= 1"):
        split_minibatches(batch, 0)
    with pytest.raises(ValueError, match=r"steps=2.0 must be a Python int"):
        split_minibatches(batch, 2.0)
    bad = dict(batch, extra=jnp.zeros((40, 2)))
    with pytest.raises(ValueError, match=r"disagree on the batch size.*B=40: \['extra'\].*B=48"):
        split_minibatches(bad, 2)
    with pytest.raises(ValueError, match=r"names mesh axis 'seq'.*data=2, fsdp=4"):
        split_minibatches(batch, 2, mesh=mesh, batch_spec=P("data", "seq"))
    with pytest.raises(ValueError, match="scalar"):
        split_minibatches({"a": jnp.zeros(8), "s": jnp.float32(1)}, 2)
    explicit = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
    with pytest.raises(ValueError, match="Auto axes"):
        split_minibatches(batch, 2, mesh=explicit, batch_spec=P(BATCH))
    # Valid: B=48 with k=3 on 8 shards.
    assert validate_batch(batch, 3, mesh=mesh, batch_spec=P(BATCH))[0] == 48


# ----------------------------------------------------------------------------- compiled


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_compiled_split_has_no_collectives(mesh_name, partitioner):
    axes, spec = MESHES[mesh_name]
    mesh = build_mesh(axes)
    batch = _batch(b=64)
    shardings = [NamedSharding(mesh, s) for s in leaf_specs(batch, spec)]
    leaves, treedef = jax.tree.flatten(batch)
    batch = jax.tree.unflatten(
        treedef, [jax.device_put(x, s) for x, s in zip(leaves, shardings, strict=True)]
    )
    k = 4
    f = jax.jit(lambda b: split_minibatches(b, k, mesh=mesh, batch_spec=spec))
    counts = coll.count_collectives(f.lower(batch).compile().as_text())
    assert sum(counts["total"].values()) == 0, counts
    out = f(batch)
    tokens_spec = leaf_specs(batch, spec)[1]  # cut to rank 2
    expected = NamedSharding(mesh, minibatch_specs(tokens_spec, k)[0])
    assert out["tokens"].sharding.is_equivalent_to(expected, 3), out["tokens"].sharding
    np.testing.assert_array_equal(out["x"][2], batch["x"][2::k])
    # Every device already holds its rows: its shard of the stack is a slice of its input.
    for shard in out["row"].addressable_shards:
        local_rows = np.asarray(shard.data).ravel()
        held = {
            int(r)
            for s in batch["row"].addressable_shards
            if s.device == shard.device
            for r in np.asarray(s.data)
        }
        assert set(local_rows.tolist()) <= held
    g = jax.jit(lambda s: merge_minibatches(s, mesh=mesh, batch_spec=spec))
    counts = coll.count_collectives(g.lower(out).compile().as_text())
    assert sum(counts["total"].values()) == 0, counts
    jax.tree.map(np.testing.assert_array_equal, g(out), batch)


def _contiguous_split(x, k, mesh, spec):
    y = x.reshape(k, x.shape[0] // k, *x.shape[1:])
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, *spec)))


def test_contiguous_split_moves_data(partitioner):
    """For contrast: the contiguous split reshards (all-to-all + collective-permute)."""
    mesh = build_mesh({"data": 2, "fsdp": 4})
    x = jax.device_put(jnp.ones((64, 16)), NamedSharding(mesh, P(BATCH)))
    f = jax.jit(lambda x: _contiguous_split(x, 4, mesh, P(BATCH)))
    counts = coll.count_collectives(f.lower(x).compile().as_text())["total"]
    assert counts["all-to-all"] >= 1 and counts["collective-permute"] >= 1, counts


# ----------------------------------------------------------------------------- mesh


def test_build_mesh():
    mesh = build_mesh({"data": 2, "fsdp": -1, "model": 2})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "model": 2}
    assert mesh.axis_names == ("data", "fsdp", "model")
    assert mesh.axis_types == (AxisType.Auto,) * 3
    assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()]
    mesh = build_mesh({"fsdp": 4, "data": 2})  # order kept as given
    assert mesh.axis_names == ("fsdp", "data") and mesh.devices.shape == (4, 2)
    mesh = build_mesh({"data": -1}, devices=jax.devices()[:4])
    assert dict(mesh.shape) == {"data": 4}
    with pytest.raises(ValueError, match=r"needs 6 devices but 8 are available"):
        build_mesh({"data": 3, "fsdp": 2})
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        build_mesh({"data": -1, "fsdp": -1})
    with pytest.raises(ValueError, match=r"use 3 devices, which does not divide the 8"):
        build_mesh({"data": -1, "model": 3})
    with pytest.raises(ValueError, match="must be >= 1"):
        build_mesh({"data": 0, "fsdp": 8})
    with pytest.raises(ValueError, match="must be an int"):
        build_mesh({"data": "8"})
    with pytest.raises(ValueError, match="non-empty mapping"):
        build_mesh({})
