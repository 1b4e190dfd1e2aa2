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
optimizer, parameter and state shardings, abstract inputs, the jitted step); `make_mesh` and
`check_batch` hold the trainer's mesh and batch rules (on top of `trn_accum.core.sharding`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.core.accumulate import accumulate_gradients
from trn_accum.core.sharding import (
    build_mesh,
    check_axis_sizes,
    divisibility_error,
    resolve_axes,
    split_minibatches,
    valid_steps,
)
from trn_accum.errors import UserError
from trn_accum.model import fsdp, fuji
from trn_accum.neuron import kernels
from trn_accum.train import optim
from trn_accum.train.config import Config

BATCH_AXES = ("data", "fsdp")
FSDP_AXES = ("fsdp",)  # the batch axis the parameters are also sharded over (trainer.gather)
BATCH_SPEC = P(BATCH_AXES)  # leaves [B, S]: rows over the batch axes, sequence replicated
AUX_REDUCTION = {"per_example_loss": "concat", "num_target_tokens": "sum"}


class TrainError(UserError):
    """A user-caused trainer problem (mesh vs devices, batch vs shards, run dir): one line."""


# ---------------------------------------------------------------------------------------------
# Mesh and batch rules


def mesh_shape(cfg: Config, devices: int, platform: str = "") -> dict[str, int]:
    """The axis sizes of `cfg.mesh` over `devices` devices (the -1 resolved); TrainError if they
    do not fit. `platform`: the devices' platform ("cpu" hints at emulating more)."""
    axes = check_axis_sizes(cfg.mesh.axes())
    fixed = math.prod(s for s in axes.values() if s != -1)
    more = "run on more devices"
    if platform == "cpu":
        more = f"emulate them: XLA_FLAGS=--xla_force_host_platform_device_count={fixed}"
    if fixed > devices or devices % fixed:
        raise TrainError(
            f"mesh {axes} needs a multiple of {fixed} devices but {devices} are available: "
            f"lower mesh sizes (e.g. --set mesh.fsdp=...) or {more}"
        )
    if -1 not in axes.values() and fixed != devices:
        raise TrainError(
            f"mesh {axes} uses {fixed} devices but {devices} are available: set one axis "
            f"to -1 (all remaining devices) or match the device count"
        )
    try:
        return resolve_axes(axes, devices)
    except ValueError as e:
        raise TrainError(f"mesh {axes} on {devices} devices: {e}") from None


def make_mesh(cfg: Config, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
    """The mesh of `cfg.mesh` over `devices` (default: all). TrainError if they do not fit."""
    devices = list(jax.devices() if devices is None else devices)
    mesh_shape(cfg, len(devices), devices[0].platform if devices else "")
    try:
        return build_mesh(cfg.mesh.axes(), devices)
    except ValueError as e:
        raise TrainError(f"mesh {cfg.mesh.axes()} on {len(devices)} devices: {e}") from None


def batch_shards(mesh: jax.sharding.Mesh) -> int:
    """Shards of the batch axis: the mesh's data x fsdp."""
    return mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)


def check_batch(cfg: Config, mesh: jax.sharding.Mesh, global_batch: int | None = None) -> int:
    """Returns k; TrainError unless the global batch divides by k x batch shards."""
    return check_split(cfg, dict(mesh.shape), global_batch)


def check_split(cfg: Config, shape: Mapping[str, int], global_batch: int | None = None) -> int:
    """Returns k; TrainError unless the global batch divides by k x batch shards of a mesh of
    axis sizes `shape` ({"data": 4, "fsdp": 2, "model": 1})."""
    k = cfg.trainer.accum_steps
    if not isinstance(k, int):
        raise TrainError(
            f"trainer.accum_steps = {k!r}: the trainer needs an integer; pick one with "
            f"`trn-accum dry-run` and set it with --set trainer.accum_steps=K"
        )
    b = cfg.data.global_batch if global_batch is None else global_batch
    shards = math.prod(shape.get(a, 1) for a in BATCH_AXES)
    error = divisibility_error(b, k, shards)
    if error:
        valid = valid_steps(b, shards)
        hint = (
            f"valid accum_steps on this mesh: {list(valid[:8])}"
            if valid
            else f"no accum_steps works: make data.global_batch a multiple of {k * shards}"
        )
        wild = {a for a, n in cfg.mesh.axes().items() if n == -1}
        axes = " x ".join(
            f"{a} {shape.get(a, 1)}"
            + (" (mesh." + a + " = -1: all devices left)" if a in wild else "")
            for a in BATCH_AXES
        )
        raise TrainError(
            f"data.global_batch = {b} is not divisible by accum_steps ({k}) x batch shards "
            f"({axes} = {shards} on {math.prod(shape.values())} devices) = {k * shards}: {hint}"
        )
    return k


def check_start(cfg: Config, devices: int | Sequence[Any] | None = None) -> int:
    """What the trainer refuses at start, before data or compiling (TrainError, one line): the
    attention kernels, the mesh on `devices` (a count, the devices, or None: this process's
    JAX devices) and, for an integer accum_steps, the batch split. `trn-accum train` and
    `trn-accum check-config` both call it. Returns the device count."""
    check_attention(cfg)
    if not isinstance(devices, int):
        devices = list(jax.devices() if devices is None else devices)
    count = devices if isinstance(devices, int) else len(devices)
    platform = "" if isinstance(devices, int) or not devices else devices[0].platform
    shape = mesh_shape(cfg, count, platform)
    if cfg.trainer.accum_steps != "auto":
        check_split(cfg, shape)
    return count


def check_attention(cfg: Config) -> None:
    """TrainError now (not a traceback at trace time) when "neuron_flash" has no kernels here."""
    if cfg.model.attention == "neuron_flash":
        try:
            kernels.active_kernels()
        except ValueError as e:
            raise TrainError(str(e)) from None


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
    uses it (`trn_accum.model.fsdp`): its gradients are reduce-scattered."""
    return fsdp.sharded_loss(cfg.model, specs)


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
        grad_dtype=jnp.float32,
        loop=cfg.trainer.loop,
        reduce=cfg.trainer.reduce,
        gather=cfg.trainer.gather,  # the model casts every matrix to the compute dtype itself
        gather_dtype=cfg.model.compute_dtype,
        reduce_dtype=cfg.trainer.reduce_dtype,  # the one cross-replica gradient reduction
        skip_nonfinite=cfg.trainer.skip_nonfinite,  # all dropped: a NaN step, skipped
    )

    def step(state, batch):
        out = grad_fn(state["params"], batch)
        (loss, aux), grads = out[:2]
        dropped = out[2] if cfg.trainer.skip_nonfinite else jnp.int32(0)
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
            "dropped_minibatches": dropped,
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


def flops_per_step(cfg: Config, global_batch: int | None = None) -> dict[str, float]:
    """Analytic training FLOPs of one optimizer step (forward + backward, no remat recompute).

    dense = 6 * N * tokens (N counts the tied embedding once: the LM head matmul uses it);
    attention = 6 * L * H * Dh * S per token (QK^T and PV, causal: half of the 12 L H Dh S of
    non-causal attention).
    """
    m = cfg.model
    b = cfg.data.global_batch if global_batch is None else global_batch
    s = cfg.data.seq_len
    tokens = b * s
    n = fuji.num_params(m)
    dense = 6.0 * n * tokens
    attn = 6.0 * m.num_layers * m.num_heads * m.head_dim * s * tokens
    return {"params": n, "tokens": tokens, "dense": dense, "attention": attn, "total": dense + attn}


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
