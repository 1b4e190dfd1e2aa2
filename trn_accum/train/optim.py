"""Optimizer: gradient clipping, AdamW (the reference's decoupled decay or optax.adamw), schedule.

Two AdamW flavours (the Fuji reference: AXLearn `experiments/text/gpt/common.py`,
`adamw_decoupled_learner_config`):

- ``"reference"`` (the Fuji reference, Loshchilov & Hutter Algorithm 2)::

      update = -eta(t) * (alpha * adam(g) + lambda * theta)

  built as ``scale_by_adam -> scale(alpha) -> add_decayed_weights(lambda) ->
  scale_by_schedule(eta) -> scale(-1)``; ``eta`` peaks at 1.0, so the decay per step is
  ``eta(t) * lambda``, *not* multiplied by the learning rate ``alpha``.
- ``"adamw"`` (``optax.adamw``): ``update = -alpha * eta(t) * (adam(g) + lambda * theta)``; its
  decay per step is ``alpha * eta(t) * lambda``, i.e. ``1 / alpha`` times weaker (3,333x at
  alpha = 3e-4).

Both are preceded by ``clip_by_global_norm``. The schedule multiplier ``eta`` rises linearly from
0 to 1 over ``warmup_steps`` and then follows a cosine to ``end_fraction`` at ``total_steps``;
it is 1-based like the reference's (step 1 gets eta(1), see ``lr_multiplier``).

Non-finite steps are skipped without a conditional (``lax.cond``, ``optax.apply_if_finite`` and
``optax.MultiSteps`` lower to ``stablehlo.case``, which Neuron rejects: Neuron docs, "JAX NeuronX
Known Issues"): the new and
old states are both computed and one is selected element-wise with ``jnp.where``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from trn_accum.config.sections import OPTIMIZER_KINDS as KINDS


def lr_multiplier(*, warmup_steps: int, total_steps: int, end_fraction: float) -> optax.Schedule:
    """eta as a function of `count`, the updates applied so far: eta(t) rises linearly 0 -> 1
    over `warmup_steps` and follows a cosine 1 -> `end_fraction` at `total_steps`, evaluated
    1-based, t = count + 1, so the first update gets eta(1) = 1 / warmup_steps, not 0 (as in
    AXLearn, whose `scale_by_schedule` in axlearn/common/optimizers.py counts from 1)."""
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(
            f"schedule: warmup_steps={warmup_steps} must be >= 0 and total_steps={total_steps} >= 1"
        )
    if warmup_steps >= total_steps:
        # Warmup covering the whole run: a pure linear ramp (no cosine phase left).
        base = optax.linear_schedule(0.0, 1.0, max(warmup_steps, 1))
    else:
        base = _warmup_cosine(warmup_steps, total_steps, end_fraction)
    return lambda count: base(count + 1)


def _warmup_cosine(warmup_steps: int, total_steps: int, end_fraction: float) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=1.0,
        warmup_steps=warmup_steps,
        decay_steps=total_steps,  # optax counts the warmup inside decay_steps
        end_value=end_fraction,
    )


def make_optimizer(
    *,
    kind: str = "reference",
    learning_rate: float,
    weight_decay: float,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    clip_norm: float | None = 1.0,
    warmup_steps: int = 0,
    total_steps: int = 1,
    end_fraction: float = 0.1,
    decay_mask: Any = None,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns `(tx, lr_fn)`: the optax chain and the effective learning rate alpha * eta(step).

    `lr_fn(count)` is what the trainer logs as the learning rate (count = optimizer updates
    applied so far). `decay_mask`: optax mask (pytree of bools or callable) of the parameters
    that are decayed; None decays all. `clip_norm` None or <= 0 disables clipping.
    """
    if kind not in KINDS:
        raise ValueError(f"optimizer kind {kind!r} is not one of {KINDS}")
    eta = lr_multiplier(
        warmup_steps=warmup_steps, total_steps=total_steps, end_fraction=end_fraction
    )
    clip = [optax.clip_by_global_norm(clip_norm)] if clip_norm and clip_norm > 0 else []
    if kind == "reference":
        tx = optax.chain(
            *clip,
            optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
            optax.scale(learning_rate),
            optax.add_decayed_weights(weight_decay, mask=decay_mask),
            optax.scale_by_schedule(eta),
            optax.scale(-1.0),
        )
    else:
        tx = optax.chain(
            *clip,
            optax.adamw(
                lambda count: learning_rate * eta(count),
                b1=b1,
                b2=b2,
                eps=eps,
                weight_decay=weight_decay,
                mask=decay_mask,
            ),
        )

    def lr_fn(count):
        return learning_rate * eta(count)

    return tx, lr_fn


def all_finite(tree) -> jax.Array:
    """Scalar bool: every element of every leaf is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def select_tree(pred: jax.Array, on_true, on_false):
    """Element-wise `jnp.where(pred, a, b)` over two trees of the same structure (no cond)."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def guarded_update(
    tx: optax.GradientTransformation,
    grads,
    opt_state,
    params,
    *,
    finite: jax.Array | None = None,
) -> tuple[Any, Any, jax.Array]:
    """One optimizer update that keeps params and opt_state when the gradients are not finite.

    Returns `(new_params, new_opt_state, applied)`; `applied` is a scalar bool. `finite`
    defaults to `all_finite(grads)`; pass e.g. `isfinite(loss) & isfinite(grad_norm)` to reuse
    an existing reduction. Shardings of params/opt_state are preserved leaf by leaf.
    """
    if finite is None:
        finite = all_finite(grads)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    return (
        select_tree(finite, new_params, params),
        select_tree(finite, new_opt_state, opt_state),
        finite,
    )
