"""The Fuji loss run per device over the batch axes, each FSDP weight gathered where it is used.

Under XLA's partitioner alone (the loss in an automatic region) an FSDP step all-gathers each
weight (the embedding in float32, twice) and all-reduces each weight gradient at full size
over the batch axes before slicing it to the shard (the partitioned module has no
reduce-scatter); under reduce="once" (manual over "data") it also gathers the [B, S, D]
embedding cotangent across "fsdp" in every minibatch. `sharded_loss` makes the batch axes
("data", "fsdp") manual (`jax.shard_map`), so each device computes its own rows; under
reduce="once" the accumulation makes them manual itself and gives the loss the shards
(`Strategy(gather="in_loss")`, `given_shards`), and the loss does the same inside that loop:

    per layer (inside its jax.checkpoint, so the backward pass gathers again instead of
    keeping every layer's weights): w = all_gather(w_shard.astype(bf16), fsdp)
        its gradient: psum_scatter(g_bf16, fsdp)          # a reduce-scatter per fused matrix
        (unrolled layers: before the previous layer's backward, `gather_once.tie_backward`)
    the tied table, once for the lookup and the LM head: all_gather(embed_shard.astype(bf16))
    loss = psum(sum of token losses) / psum(token count)   # over the manual axes
    the shards' gradients summed over the manual axes not sharding them ("data": float32,
    at the shard's size), by shard_map's transpose
    (given the shards: the loss and token count of the device's own rows, unsummed; the
    accumulation sums them, and the gradients over "data", once after its loop)

Numbers: the same per-token arithmetic; the gradient sums run in another order (bf16
reduce-scatters of the bf16 weight cotangents, as the partitioner's bf16 all-reduces did).
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from trn_accum.core import gather_once
from trn_accum.model import fuji
from trn_accum.model.sharding import BATCH_AXES


def manual_axes(kind=AxisType.Auto) -> tuple[str, ...]:
    """The batch axes of the current mesh of type `kind`, of size > 1 (a size-1 one would only
    add trivial all-reduces to the transpose; none without a mesh). Auto: the axes the loss
    makes manual itself, () inside another shard_map (reduce="once"'s loop: nested there,
    Shardy refuses the batch dimension sharded ("data", "fsdp") with "data" manual outside and
    "fsdp" manual inside: "manual axes must come before free axes"). Manual: the axes the
    caller made manual (reduce="once" with gather="in_loss"). The other axes ("model") stay
    automatic around the layers and manual in each weight's gather
    (`gather_once.gather_manual`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if kind == AxisType.Auto and AxisType.Manual in types.values():
        return ()
    return tuple(a for a in BATCH_AXES if types.get(a) == kind and mesh.shape[a] > 1)


def gather_plans(specs, manual: tuple[str, ...]):
    """Per parameter (a tree like `specs`, PartitionSpecs), its gather plan: the dimensions
    its spec shards over the axes `manual`, ((dim, (axes...)), ...); () = whole."""

    def plan(spec: P):
        out = []
        for d, entry in enumerate(spec):
            axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()))
            axes = tuple(a for a in axes if a in manual)
            if axes:
                out.append((d, axes))
        return tuple(out)

    return jax.tree.map(plan, specs, is_leaf=lambda s: isinstance(s, P))


def sharded_loss(cfg: fuji.ModelConfig, specs, given_shards: bool = False):
    """`loss(params, batch) -> (loss, aux)`, the same function as `fuji.loss_fn(params, batch,
    cfg)`, run per device over the batch axes that are automatic where it is called. `specs`:
    the parameters' PartitionSpecs (`fuji.param_specs`). Without such axes: `fuji.loss_fn`.
    Batch leaves [B, ...] must be sharded on B over those axes (the strided minibatches are).

    `given_shards` (the loss of `Strategy(reduce="once", gather="in_loss")`): called where
    batch axes are manual already (that loop), `params` are each device's shards over them
    and `batch` its rows; the loss gathers each weight in its layer and returns the mean over
    those rows, its aux their own (the accumulation sums the devices after its loop)."""

    def loss(params, batch):
        given = manual_axes(AxisType.Manual) if given_shards else ()
        if given:
            plans = gather_plans(specs, given)
            total, count, per_example = fuji.loss_sums(params, batch, cfg, plans)
            aux = {"per_example_loss": per_example, "num_target_tokens": count}
            return fuji.mean_loss(total, count), aux
        manual = manual_axes()
        if not manual:
            return fuji.loss_fn(params, batch, cfg)
        plans = gather_plans(specs, manual)
        p_specs = jax.tree.map(
            lambda p, x: gather_once.shard_spec(p, x.ndim),
            plans,
            params,
            is_leaf=lambda p: isinstance(p, tuple),
        )
        rows = P(manual if len(manual) > 1 else manual[0])

        def local(params, batch):
            # varying over every manual axis before use: each gradient stays a per-device
            # partial (reduce-scattered in the layer) until shard_map's transpose sums the shard
            params = jax.tree.map(lambda x: gather_once.to_varying(x, manual), params)
            total, count, per_example = fuji.loss_sums(params, batch, cfg, plans)
            total, count = jax.lax.psum((total, count), manual)
            aux = {"per_example_loss": per_example, "num_target_tokens": count}
            return fuji.mean_loss(total, count), aux

        out_specs = (P(), {"per_example_loss": rows, "num_target_tokens": P()})
        return jax.shard_map(
            local,
            in_specs=(p_specs, jax.tree.map(lambda _: rows, batch)),
            out_specs=out_specs,
            axis_names=set(manual),
        )(params, batch)

    return loss
