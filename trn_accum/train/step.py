"""The compiled train step, built once for the trainer, the dry-run and `accum_steps = "auto"`.

State (a dict, so checkpoints are plain trees)::

    {"step": int32[],        optimizer steps taken (applied or skipped); the next batch index
     "skipped": int32[],     steps whose gradients were not finite (params/opt state kept)
     "params": fuji params,  float32, sharded by `fuji.param_specs(cfg.model, cfg.mesh.rules)`
     "opt_state": optax,     mu/nu sharded like the params, counts replicated}

One step: the global batch [B, S] (sharded P(("data", "fsdp"), None)) goes through
`accumulate_gradients` (k = trainer.accum_steps strided minibatches, each weighted by its number
of target tokens, so the result equals the full-batch gradient; with trainer.skip_nonfinite,
a minibatch whose loss or gradient is not finite is dropped and counted in the metric
`dropped_minibatches`, 0 otherwise), then the optax update of `trn_accum.train.optim` behind a
non-finite guard (a `jnp.where` select, no conditional): a step is skipped when it is not
finite (with skip_nonfinite: when every minibatch was dropped). The
step is jitted with in/out shardings stated and the state donated, and traced under
`jax.set_mesh(mesh)` so the model's activation constraints apply.

`build_step(cfg, mesh)` is the one place that turns a config into that program (`StepProgram`:
optimizer, parameter and state shardings, abstract inputs, the jitted step). The trainer's
mesh and batch rules live in `trn_accum.config.mesh_rules` (re-exported here), the FLOP count
in `trn_accum.train.flops`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.config.load import Config
from trn_accum.config.mesh_rules import (
    BATCH_AXES,
    TrainError,
    batch_shards,
    check_attention,
    check_batch,
    check_split,
    check_start,
    make_mesh,
    mesh_shape,
)
from trn_accum.core.accumulate import accumulate_gradients
from trn_accum.core.split import split_minibatches
from trn_accum.core.strategy import Strategy
from trn_accum.model import fsdp, fuji
from trn_accum.train import optim

__all__ = [  # the mesh rules are re-exported: callers say step.make_mesh, step.TrainError
    "BATCH_AXES",
    "BATCH_SPEC",
    "StepProgram",
    "TrainError",
    "batch_shards",
    "batch_sharding",
    "build_step",
    "check_attention",
    "check_batch",
    "check_split",
    "check_start",
    "make_eval_step",
    "make_mesh",
    "mesh_shape",
]

FSDP_AXES = ("fsdp",)  # the batch axis the parameters are also sharded over (trainer.gather)
BATCH_SPEC = P(BATCH_AXES)  # leaves [B, S]: rows over the batch axes, sequence replicated
AUX_REDUCTION = {"per_example_loss": "concat", "num_target_tokens": "sum"}


# ---------------------------------------------------------------------------------------------
# Pieces of the program (pure functions of the config)


def make_optimizer(cfg: Config):
    """(tx, lr_fn) from cfg.optimizer; lr_fn(count) = peak_lr * eta(count)."""
    o = cfg.optimizer
    return optim.make_optimizer(
        kind=o.kind,
        learning_rate=o.peak_lr,
        weight_decay=o.weight_decay,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        clip_norm=o.clip_norm,
        warmup_steps=o.warmup_steps,
        total_steps=o.decay_steps,
        end_fraction=o.final_lr_fraction,
    )


def param_specs(cfg: Config, mesh: jax.sharding.Mesh):
    """PartitionSpecs of the parameters under `cfg.mesh.rules` (divisibility checked)."""
    try:
        return fuji.param_specs(cfg.model, cfg.mesh.rules, dict(mesh.shape))
    except ValueError as e:
        raise TrainError(str(e)) from None


def init_state(cfg: Config, tx: optax.GradientTransformation, key) -> dict:
    params = fuji.init_params(cfg.model, key)
    return {
        "step": jnp.zeros((), jnp.int32),
        "skipped": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": tx.init(params),
    }


def abstract_state(cfg: Config, tx: optax.GradientTransformation) -> dict:
    """The state as ShapeDtypeStructs (`jax.eval_shape`: no memory, works for 3B)."""
    return jax.eval_shape(lambda: init_state(cfg, tx, jax.random.key(cfg.trainer.seed)))


def state_specs(tx: optax.GradientTransformation, abstract: dict, specs) -> dict:
    """PartitionSpecs of the state: optimizer leaves shaped like params take the param's spec,
    the rest (counts) are replicated."""
    opt_specs = optax.tree_utils.tree_map_params(
        tx,
        lambda _, spec: spec,
        abstract["opt_state"],
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )
    return {"step": P(), "skipped": P(), "params": specs, "opt_state": opt_specs}


def named(mesh: jax.sharding.Mesh, specs):
    """NamedShardings on `mesh` for a tree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, None))


def abstract_batch(cfg: Config, mesh: jax.sharding.Mesh, global_batch: int | None = None):
    b = cfg.data.global_batch if global_batch is None else global_batch
    shape, sh = (b, cfg.data.seq_len), batch_sharding(mesh)
    return {
        "input_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh),
        "target_labels": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh),
        "target_mask": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh),
    }


def _loss(cfg: Config, specs):
    """The loss per device over the batch axes, each FSDP weight gathered in the layer that
    uses it (`trn_accum.model.fsdp`): its gradients are reduce-scattered. Under reduce "once"
    with trainer.gather "per_minibatch" it is given the shards (`Strategy(gather="in_loss")`)."""
    in_loss = strategy(cfg).gather == "in_loss"
    return fsdp.sharded_loss(cfg.model, specs, given_shards=in_loss)


def strategy(cfg: Config) -> Strategy:
    """The accumulation Strategy of `cfg.trainer` (gradients returned in float32). Under
    reduce "once", trainer.gather "per_minibatch" is gather "in_loss": the loop manual over
    the FSDP axes too and the loss gathering each layer's weights (not XLA, which would gather
    the [B, S, D] embedding cotangent in every minibatch)."""
    t = cfg.trainer
    gathered = t.gather != "per_minibatch"  # the model casts every matrix to compute dtype itself
    in_loss = t.reduce == "once" and not gathered
    return Strategy(
        loop=t.loop,
        reduce=t.reduce,
        gather="in_loss" if in_loss else t.gather,
        gather_dtype=cfg.model.compute_dtype if gathered else None,
        reduce_dtype=t.reduce_dtype,  # the one cross-replica gradient reduction
        skip_nonfinite=t.skip_nonfinite,  # all dropped: a NaN step, skipped
        grad_dtype="float32",
    )


def make_train_step(cfg: Config, mesh, tx, lr_fn, specs, state_shardings):
    """jit(step)(state, batch) -> (state, metrics); state donated, shardings explicit."""
    k = cfg.trainer.accum_steps
    grad_fn = accumulate_gradients(
        _loss(cfg, specs),
        steps=k,
        mesh=mesh,
        batch_spec=BATCH_SPEC,
        param_specs=specs,
        weight_fn=lambda mb: mb["target_mask"].sum(),
        has_aux=True,
        aux_reduction=AUX_REDUCTION,
        strategy=strategy(cfg),
    )

    def step(state, batch):
        ((loss, aux), grads), stats = grad_fn.with_stats(state["params"], batch)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        lr = lr_fn(state["step"] - state["skipped"])  # the schedule counts applied updates
        params, opt_state, applied = optim.guarded_update(
            tx, grads, state["opt_state"], state["params"], finite=finite
        )
        new = {
            "step": state["step"] + 1,
            "skipped": state["skipped"] + jnp.where(applied, 0, 1).astype(jnp.int32),
            "params": params,
            "opt_state": opt_state,
        }
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": jnp.asarray(lr, jnp.float32),
            "target_tokens": aux["num_target_tokens"],
            "skipped_steps": new["skipped"],
            "dropped_minibatches": stats.dropped,  # 0 without trainer.skip_nonfinite
        }
        return new, metrics

    replicated = NamedSharding(mesh, P())
    return jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding(mesh)),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )


def make_eval_step(cfg: Config, mesh, param_shardings):
    """jit(eval)(params, batch) -> (sum of per-token losses, number of target tokens), run over
    the same k minibatches as training (same memory), with a fixed-length scan."""
    k = cfg.trainer.accum_steps
    loss = _loss(cfg, jax.tree.map(lambda s: s.spec, param_shardings))

    def ev(params, batch):
        stacked = split_minibatches(batch, k, mesh=mesh, batch_spec=BATCH_SPEC)

        def body(carry, mb):
            value, aux = loss(params, mb)
            n = aux["num_target_tokens"]
            return (carry[0] + value * n, carry[1] + n), None

        zero = jnp.zeros((), jnp.float32)
        (total, count), _ = jax.lax.scan(body, (zero, zero), stacked)
        return total, count

    replicated = NamedSharding(mesh, P())
    return jax.jit(
        ev,
        in_shardings=(param_shardings, batch_sharding(mesh)),
        out_shardings=(replicated, replicated),
    )


def restore_target(abstract: dict, shardings: dict) -> dict:
    """ShapeDtypeStructs with the current mesh's shardings: orbax restores straight into them."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


# ---------------------------------------------------------------------------------------------
# The one builder


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """The train step of one config on one mesh, ready to lower, compile or call.

    `batch_rows`: rows of the batch the step is built for (the global batch in training; one
    node's rows in a dry-run). `step_fn` is `jax.jit(step)` with the state donated and the
    in/out shardings stated; `abstract_inputs()` gives the ShapeDtypeStructs (with shardings)
    it is lowered from, so no parameter memory is needed to compile it.
    """

    cfg: Config
    mesh: jax.sharding.Mesh
    batch_rows: int
    tx: optax.GradientTransformation
    lr_fn: Any
    specs: Any  # parameter PartitionSpecs
    abstract: dict  # the state as ShapeDtypeStructs (no shardings)
    state_specs: dict
    state_shardings: dict
    step_fn: Any

    def abstract_inputs(self) -> tuple[dict, dict]:
        """(state, batch) as ShapeDtypeStructs with their shardings."""
        return (
            restore_target(self.abstract, self.state_shardings),
            abstract_batch(self.cfg, self.mesh, self.batch_rows),
        )

    @functools.cached_property
    def lowered(self):
        """The step lowered from the abstract inputs (once)."""
        with jax.set_mesh(self.mesh):
            return self.step_fn.lower(*self.abstract_inputs())

    @functools.cached_property
    def compiled(self):
        """The step compiled once from the abstract inputs: `compiled(state, batch)`."""
        with jax.set_mesh(self.mesh):
            return self.lowered.compile()


def build_step(
    cfg: Config, mesh: jax.sharding.Mesh, *, batch_rows: int | None = None
) -> StepProgram:
    """The train step of `cfg` (an integer accum_steps) on `mesh`; TrainError if the batch does
    not divide. The trainer, the dry-run and `accum_steps = "auto"` all compile this."""
    rows = cfg.data.global_batch if batch_rows is None else int(batch_rows)
    check_batch(cfg, mesh, rows)
    tx, lr_fn = make_optimizer(cfg)
    specs = param_specs(cfg, mesh)
    abstract = abstract_state(cfg, tx)
    sspecs = state_specs(tx, abstract, specs)
    shardings = named(mesh, sspecs)
    return StepProgram(
        cfg=cfg,
        mesh=mesh,
        batch_rows=rows,
        tx=tx,
        lr_fn=lr_fn,
        specs=specs,
        abstract=abstract,
        state_specs=sspecs,
        state_shardings=shardings,
        step_fn=make_train_step(cfg, mesh, tx, lr_fn, specs, shardings),
    )
