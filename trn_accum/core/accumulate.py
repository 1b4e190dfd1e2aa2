"""Gradient accumulation with a static, communication-free minibatch layout.

`accumulate_gradients(loss_fn, steps=k, ...)` returns `grad_fn(params, batch, *args)` that
gives what `jax.value_and_grad(loss_fn, has_aux=...)(params, batch, *args)` gives on the full
batch, computed over k strided minibatches (see `trn_accum.sharding`):

    stacked = split_minibatches(batch, k)        # [k, B/k, ...], sharded P(None, *batch_spec)
    for i in range(k):                           # lax.scan (default) or a Python loop
        (L_i, aux_i), g_i = value_and_grad(loss_fn)(params, stacked[i], *args_i)
        w_i = weight_fn(stacked[i])              # e.g. number of real target tokens
        acc += where(w_i != 0, w_i * g_i, 0)     # float32, constrained to param_specs
    loss, grads = Σ w_i L_i / Σ w_i, Σ w_i g_i / Σ w_i          (0 and 0 when Σ w_i = 0)

Exactness: for a loss that is a weighted mean over its batch with weight w_i per minibatch, the
full-batch loss is Σ w_i L_i / Σ w_i, and so are the gradients; a mean of minibatch means is
wrong when the w_i differ. Zero-weight minibatches are dropped by selection (`jnp.where`), not by
multiplication, so a NaN loss of an all-padding minibatch (0/0) does not leak (0 * NaN = NaN).

`reduce="once"` moves the loop into a `shard_map` manual over the pure data-parallel axes and
reduces the sums once after it (see `accumulate_gradients`).

Everything it emits is static: a fixed-length `lax.scan` or straight-line code, no `lax.cond`,
no host callbacks, no data-dependent loop bounds (Neuron constraints).

Imports JAX (and numpy/stdlib) only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.core import sharding as shd

__all__ = ["AUX_REDUCTIONS", "LOOPS", "REDUCES", "accumulate_gradients"]

AUX_REDUCTIONS = ("mean", "sum", "max", "min", "concat")
LOOPS = ("scan", "unroll")
REDUCES = ("per_minibatch", "once")

_NO_DTYPE = object()


# ----------------------------------------------------------------------------- options


@dataclasses.dataclass(frozen=True)
class _Options:
    loss_fn: Callable
    steps: int
    mesh: Mesh | None
    batch_spec: Any
    param_specs: Any
    weight_fn: Callable | None
    aux_reduction: Any
    has_aux: bool
    rng_argnum: int | None
    grad_dtype: Any
    loop: str
    reduce: str


def accumulate_gradients(
    loss_fn: Callable,
    *,
    steps: int,
    mesh: Mesh | None = None,
    batch_spec: Any = None,
    param_specs: Any = None,
    weight_fn: Callable | None = None,
    aux_reduction: Any = None,
    has_aux: bool = False,
    rng_argnum: int | None = None,
    grad_dtype: Any = jnp.float32,
    loop: str = "scan",
    reduce: str = "per_minibatch",
) -> Callable:
    """Wrap `loss_fn(params, batch, *args)` into `grad_fn(params, batch, *args)` that returns
    `(loss, grads)` (or `((loss, aux), grads)` with `has_aux`) as `jax.value_and_grad` does on
    the full batch, accumulated over `steps` strided minibatches.

    Args:
      loss_fn: returns the (weighted) mean loss over the batch it is given, a scalar, or
        `(loss, aux)` when `has_aux`.
      steps: k, number of minibatches (static int >= 1). B must be divisible by k × the shard
        count of the batch axes in `batch_spec`.
      mesh, batch_spec: the mesh and the PartitionSpec of the batch leaves (one spec for all
        leaves, cut to each leaf's rank, or a pytree of specs). The stack [k, B/k, ...] is
        constrained to P(None, *spec) and every minibatch [B/k, ...] to spec. `mesh=None`:
        same math, no constraints.
      param_specs: PartitionSpecs (or NamedShardings) of the parameters, a pytree prefix of
        `params`. The float32 accumulator and each minibatch gradient are constrained to them.
      weight_fn: `weight_fn(minibatch) -> scalar` weight w_i (e.g. the number of real target
        tokens); None = equal weights. Weights should be >= 0; w_i == 0 drops minibatch i.
      aux_reduction: how aux leaves are combined over minibatches. None = default: scalar
        leaves -> "mean"; leaves whose axis 0 is B/k -> "concat"; others -> ValueError. Or a
        string for every leaf, a pytree prefix of aux with strings (None = default), or a
        callable `(key_path) -> str | None`. "mean": Σ w_i x_i / Σ w_i (zero-weight minibatches
        dropped); "sum", "max", "min": over all minibatches, unweighted (counts need "sum");
        "concat": per-example leaves [B/k, ...] stitched back into [B, ...] in the original row
        order. The default cannot tell a per-example leaf from one whose axis 0 equals B/k by
        coincidence: name such leaves explicitly (at k = 1 every choice gives the same value).
      has_aux: `loss_fn` returns `(loss, aux)`.
      rng_argnum: index into grad_fn's positional arguments (params = 0, batch = 1, so >= 2) of
        a PRNG key; minibatch i receives `jax.random.fold_in(key, i)`.
      grad_dtype: dtype of the returned gradients (None: each parameter's dtype). Accumulation
        is float32 regardless.
      loop: "scan" (fixed-length `lax.scan`: memory of one minibatch) or "unroll" (a Python
        loop: every slice static, nothing stacked at a loop index). Same numbers.
      reduce: "per_minibatch" (default: XLA reduces every minibatch's gradient across devices)
        or "once": over the pure data-parallel mesh axes (the leading axes of the batch
        sharding that no `param_specs` entry uses) each device accumulates its local
        contributions in a `shard_map` manual over those axes, and one psum runs after the
        loop; axes that shard parameters (fsdp) keep their per-minibatch reduction. Same
        numbers (each device's share of a minibatch is weighted by its own `weight_fn`, so
        `weight_fn` must be additive over rows, like a token count). Inside that region,
        activation constraints must not name the manual axes: use
        `trn_accum.sharding.constrain`, which drops them. With `rng_argnum`, minibatch i on
        manual-axes index j gets `fold_in(fold_in(key, i), j)`.

    Returns:
      grad_fn(params, batch, *args). Shapes are checked at trace time: ValueErrors name the
      offending leaf and numbers.
    """
    steps = shd.validate_steps(steps)
    if loop not in LOOPS:
        raise ValueError(f"loop={loop!r} must be one of {LOOPS}")
    if reduce not in REDUCES:
        raise ValueError(f"reduce={reduce!r} must be one of {REDUCES}")
    if rng_argnum is not None and (
        isinstance(rng_argnum, bool) or not isinstance(rng_argnum, int) or rng_argnum < 2
    ):
        raise ValueError(
            f"rng_argnum={rng_argnum!r} must be an int >= 2: the index of a PRNG key among "
            "grad_fn(params, batch, *args)'s positional arguments (params = 0, batch = 1)"
        )
    if mesh is not None:
        shd.check_auto_mesh(mesh)
        if batch_spec is not None and shd.is_spec(batch_spec):
            shd.check_spec_axes(shd.as_spec(batch_spec), mesh)
    if param_specs is not None and mesh is None and _has_bare_specs(param_specs):
        raise ValueError(
            "param_specs given as PartitionSpecs needs mesh=...; pass the mesh or NamedShardings"
        )
    if isinstance(aux_reduction, str) and aux_reduction not in AUX_REDUCTIONS:
        raise ValueError(f"aux_reduction={aux_reduction!r} must be one of {AUX_REDUCTIONS}")
    opts = _Options(
        loss_fn=loss_fn,
        steps=steps,
        mesh=mesh,
        batch_spec=batch_spec,
        param_specs=param_specs,
        weight_fn=weight_fn,
        aux_reduction=aux_reduction,
        has_aux=bool(has_aux),
        rng_argnum=rng_argnum,
        grad_dtype=_NO_DTYPE if grad_dtype is None else jnp.dtype(grad_dtype),
        loop=loop,
        reduce=reduce,
    )

    def grad_fn(params, batch, *args):
        return _accumulate(opts, params, batch, args)

    grad_fn.__name__ = f"accumulated_{getattr(loss_fn, '__name__', 'loss')}"
    grad_fn.__doc__ = f"{steps}-step accumulated value_and_grad of {loss_fn!r}."
    return grad_fn


def _is_sharding_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (P, NamedSharding))


def _has_bare_specs(tree: Any) -> bool:
    return any(isinstance(x, P) for x in jax.tree.leaves(tree, is_leaf=_is_sharding_leaf))


# ----------------------------------------------------------------------------- core


def _accumulate(opts: _Options, params: Any, batch: Any, args: tuple) -> Any:
    k, mesh = opts.steps, opts.mesh
    batch_size, specs = shd.validate_batch(batch, k, mesh=mesh, batch_spec=opts.batch_spec)
    if opts.rng_argnum is not None and opts.rng_argnum - 2 >= len(args):
        raise ValueError(
            f"rng_argnum={opts.rng_argnum} but grad_fn got {2 + len(args)} positional "
            "arguments (params, batch, *args)"
        )
    grad_specs = _param_specs(opts, params)
    manual = _reduce_once_axes(opts, specs, grad_specs) if opts.reduce == "once" else ()

    def constrain_grads(g):
        if grad_specs is None:
            return g
        leaves, treedef = jax.tree.flatten(g)
        out = [
            x if ms is None else shd.constrain(x, ms[0], ms[1])
            for x, ms in zip(leaves, grad_specs, strict=True)
        ]
        return jax.tree.unflatten(treedef, out)

    aux_shape = reductions = None
    if opts.has_aux:
        # Aux structure and reductions, from shapes alone (one abstract trace of loss_fn),
        # before the loop: carries need them.
        mb0 = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0] // k, *x.shape[1:]), x.dtype), batch
        )
        _, aux_shape = jax.eval_shape(
            functools.partial(_loss_with_aux, opts), params, mb0, *_minibatch_args(opts, args, 0)
        )
        reductions = _aux_reductions(opts, aux_shape, batch_size // k, k)
    acc = _Accumulator(reductions, aux_shape, constrain_grads)
    example_axes = specs[0][0] if mesh is not None and len(specs[0]) else None

    def local(params, batch, args, specs, vary):
        state, stacked_aux, loss_dtype = _loop(opts, acc, params, batch, args, specs, vary)
        return acc.finish(state, stacked_aux, loss_dtype, mesh, P(example_axes), vary)

    if not manual:
        loss, aux, grads = local(params, batch, args, specs, ())
    else:
        # reduce="once": manual over the pure data-parallel axes; each device accumulates its
        # local contributions, one psum after the loop (inside `finish`).
        m_entry = manual[0] if len(manual) == 1 else tuple(manual)
        inner_specs = [shd.drop_axes(s, manual) for s in specs]
        b_leaves, b_def = jax.tree.flatten(batch)
        batch_in = jax.tree.unflatten(b_def, [P(m_entry)] * len(b_leaves))
        aux_out = (
            None
            if aux_shape is None
            else jax.tree.map(lambda r: P(m_entry) if r == "concat" else P(), reductions)
        )

        def body(params, batch, *args):
            params = jax.tree.map(lambda p: jax.lax.pcast(p, manual, to="varying"), params)
            return local(params, batch, args, inner_specs, manual)

        try:
            loss, aux, grads = jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P(), batch_in, *([P()] * len(args))),
                out_specs=(P(), aux_out, P()),
                axis_names=set(manual),
            )(params, batch, *args)
        except ValueError as e:
            if "manual_axis_type" not in str(e):
                raise
            raise ValueError(
                f'reduce="once" runs loss_fn manual over mesh axes {manual}: a sharding '
                "constraint inside loss_fn names them or uses the concrete mesh; use "
                "trn_accum.sharding.constrain(x, mesh, spec), which drops manual axes "
                f"(JAX said: {str(e).splitlines()[0]})"
            ) from e

    def out_dtype(p):
        return jnp.result_type(p) if opts.grad_dtype is _NO_DTYPE else opts.grad_dtype

    grads = constrain_grads(jax.tree.map(lambda g, p: g.astype(out_dtype(p)), grads, params))
    return ((loss, aux), grads) if opts.has_aux else (loss, grads)


def _loss_with_aux(opts: _Options, p, mb, *a):
    out = opts.loss_fn(p, mb, *a)
    if opts.has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise ValueError(
                f"has_aux=True but loss_fn did not return a (loss, aux) pair: got "
                f"{type(out).__name__}"
            )
        return out[0], out[1]
    return out, None


def _minibatch_args(opts: _Options, args: tuple, i, vary: tuple[str, ...] = ()) -> tuple:
    """args with the PRNG key (if any) folded with the minibatch index (and, inside the manual
    region of reduce="once", with the device's index along the manual axes)."""
    if opts.rng_argnum is None:
        return args
    j = opts.rng_argnum - 2
    key = jax.random.fold_in(args[j], i)
    if vary:
        key = jax.random.fold_in(key, jax.lax.axis_index(vary))
    return args[:j] + (key,) + args[j + 1 :]


def _loop(opts, acc, params, batch, args, specs, vary):
    """Run the k minibatches; returns (accumulator state, stacked per-example aux, loss dtype).

    Shapes here are global, or per-device along the manual axes `vary` (reduce="once")."""
    k, mesh = opts.steps, opts.mesh
    leaves, treedef = jax.tree.flatten(batch)
    stacked = jax.tree.unflatten(
        treedef, [shd.split_leaf(x, k, mesh, s) for x, s in zip(leaves, specs, strict=True)]
    )
    vg = jax.value_and_grad(functools.partial(_loss_with_aux, opts), has_aux=True)
    loss_dtype = []  # filled while the body is traced

    def one_minibatch(mb, i):
        """(loss_i, aux_i, grads_i float32, w_i) of minibatch i; grads constrained."""
        mb = jax.tree.unflatten(
            treedef,
            [shd.constrain(x, mesh, s) for x, s in zip(jax.tree.leaves(mb), specs, strict=True)],
        )
        (loss_i, aux_i), g_i = vg(params, mb, *_minibatch_args(opts, args, i, vary))
        loss_dtype.append(jnp.result_type(loss_i))
        w_i = (
            jnp.asarray(opts.weight_fn(mb), jnp.float32)
            if opts.weight_fn is not None
            else jnp.float32(1.0)
        )
        if np.shape(w_i) != ():
            raise ValueError(f"weight_fn must return a scalar, got shape {np.shape(w_i)}")
        g_i = acc.constrain_grads(jax.tree.map(lambda g: g.astype(jnp.float32), g_i))
        return loss_i, aux_i, g_i, w_i

    state = acc.init(params)
    if vary:  # carries hold per-device partial sums
        state = jax.tree.map(lambda x: jax.lax.pcast(x, vary, to="varying"), state)
    if opts.loop == "scan":

        def body(carry, xs):
            mb, i = xs
            return acc.add(carry, *one_minibatch(mb, i))

        state, stacked_aux = jax.lax.scan(body, state, (stacked, jnp.arange(k)), length=k)
    else:
        pieces = []
        for i in range(k):
            mb = jax.tree.map(lambda x, i=i: x[i], stacked)
            state, per_example = acc.add(state, *one_minibatch(mb, i))
            pieces.append(per_example)
        stacked_aux = jax.tree.map(lambda *xs: jnp.stack(xs), *pieces)
    return state, stacked_aux, loss_dtype[0]


def _param_specs(opts: _Options, params: Any) -> list | None:
    """Per parameter leaf (jax.tree.leaves order): (mesh, PartitionSpec) or None."""
    if opts.param_specs is None:
        return None
    try:
        full = jax.tree.broadcast(opts.param_specs, params, is_leaf=_is_sharding_leaf)
    except ValueError as e:
        raise ValueError(f"param_specs must be a pytree prefix of params: {e}") from None

    def one(path, spec, p):
        where = f"param_specs{jax.tree_util.keystr(path)}"
        if spec is None:
            return None
        mesh = opts.mesh
        if isinstance(spec, NamedSharding):
            mesh, spec = spec.mesh, spec.spec
        shd.check_spec_axes(spec, mesh, what=where)
        if len(spec) > np.ndim(p):
            raise ValueError(
                f"{where} = {spec} has more entries than the parameter's rank {np.ndim(p)} "
                f"(shape {np.shape(p)})"
            )
        return (mesh, spec)

    specs = jax.tree.leaves(full, is_leaf=_is_sharding_leaf)
    p_flat, _ = jax.tree.flatten_with_path(params)
    return [one(path, s, p) for (path, p), s in zip(p_flat, specs, strict=True)]


def _reduce_once_axes(opts: _Options, specs: list[P], grad_specs: list | None) -> tuple:
    """The pure data-parallel axes for reduce="once": the leading mesh axes of the batch
    dimension's sharding (the same for every batch leaf) that no parameter spec uses."""
    if opts.mesh is None:
        return ()
    entries = {tuple(shd.spec_axes(s[0])) if len(s) else () for s in specs}
    if len(entries) != 1:
        raise ValueError(
            f'reduce="once" needs every batch leaf sharded the same way on axis 0, got {entries}'
        )
    batch_axes = next(iter(entries))
    used = set()
    for ms in grad_specs or ():
        if ms is not None:
            for entry in ms[1]:
                used.update(shd.spec_axes(entry))
    manual = []
    for axis in batch_axes:
        if axis in used:
            break
        manual.append(axis)
    return tuple(manual)


# ----------------------------------------------------------------------------- aux


def _aux_reductions(opts: _Options, aux_shape: Any, minibatch_size: int, k: int) -> Any:
    """A tree like aux whose leaves are reduction names."""
    if aux_shape is None:
        return None
    flat, treedef = jax.tree.flatten_with_path(aux_shape)
    spec = opts.aux_reduction
    if spec is None or isinstance(spec, str):
        chosen = [spec] * len(flat)
    elif callable(spec):
        chosen = [spec(path) for path, _ in flat]
    else:
        try:
            full = jax.tree.broadcast(spec, aux_shape, is_leaf=lambda x: x is None)
        except ValueError as e:
            raise ValueError(
                f"aux_reduction must be a string, a callable of the key path, or a pytree "
                f"prefix of aux: {e}"
            ) from None
        chosen = jax.tree.leaves(full, is_leaf=lambda x: x is None)
    out = []
    for (path, leaf), red in zip(flat, chosen, strict=True):
        name = jax.tree_util.keystr(path) or "<aux>"
        shape = np.shape(leaf)
        if red is None:
            if shape == ():
                red = "mean"
            elif shape[0] == minibatch_size:
                red = "concat"
            else:
                raise ValueError(
                    f"aux leaf {name} has shape {shape}: neither a scalar nor per-example "
                    f"(axis 0 = minibatch size {minibatch_size}); give it an explicit "
                    f"aux_reduction, one of {AUX_REDUCTIONS}"
                )
        if red not in AUX_REDUCTIONS:
            raise ValueError(f"aux_reduction for {name} is {red!r}, not one of {AUX_REDUCTIONS}")
        if red == "concat" and (shape == () or shape[0] != minibatch_size):
            raise ValueError(
                f"aux leaf {name} has shape {shape}: 'concat' needs axis 0 = the minibatch "
                f"size {minibatch_size} (B/k with k={k})"
            )
        out.append(red)
    return jax.tree.unflatten(treedef, out)


def _identity(red: str, dtype: Any) -> Any:
    dtype = jnp.dtype(dtype)
    if red in ("mean", "sum"):
        return 0
    if dtype == jnp.bool_:
        return red == "min"
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf if red == "max" else jnp.inf
    info = jnp.iinfo(dtype)
    return info.min if red == "max" else info.max


def _acc_dtype(red: str, dtype: Any) -> Any:
    dtype = jnp.dtype(dtype)
    if red == "mean" or (red == "sum" and jnp.issubdtype(dtype, jnp.floating)):
        return jnp.float32 if jnp.dtype(dtype).itemsize <= 4 else dtype
    return dtype


class _Accumulator:
    """Carry = (Σ w·L, Σ w, Σ w·g, aux carries). Per-example ("concat") aux leaves are returned
    per step and stacked by the loop."""

    def __init__(self, reductions: Any, aux_shape: Any, constrain_grads: Callable):
        self.reductions = reductions
        self.aux_shape = aux_shape
        self.constrain_grads = constrain_grads

    def _aux_flat(self):
        if self.aux_shape is None:
            return [], None
        reds = jax.tree.leaves(self.reductions)
        shapes, treedef = jax.tree.flatten(self.aux_shape)
        return list(zip(reds, shapes, strict=True)), treedef

    def init(self, params: Any) -> dict:
        grads = self.constrain_grads(
            jax.tree.map(lambda p: jnp.zeros(np.shape(p), jnp.float32), params)
        )
        aux = [
            None
            if red == "concat"
            else jnp.full(s.shape, _identity(red, s.dtype), _acc_dtype(red, s.dtype))
            for red, s in self._aux_flat()[0]
        ]
        return {
            "loss": jnp.float32(0.0),
            "weight": jnp.float32(0.0),
            "grads": grads,
            "aux": aux,
        }

    def add(self, state: dict, loss_i, aux_i, g_i, w_i) -> tuple[dict, list]:
        keep = w_i != 0
        loss = state["loss"] + jnp.where(keep, w_i * loss_i.astype(jnp.float32), 0.0)
        weight = state["weight"] + jnp.where(keep, w_i, 0.0)
        grads = jax.tree.map(lambda a, g: a + jnp.where(keep, w_i * g, 0.0), state["grads"], g_i)
        grads = self.constrain_grads(grads)
        aux_flat, _ = self._aux_flat()
        new_aux, per_example = [], []
        x_leaves = jax.tree.leaves(aux_i) if aux_flat else []
        for (red, _), carry, x in zip(aux_flat, state["aux"], x_leaves, strict=True):
            if red == "concat":
                new_aux.append(None)
                per_example.append(x)
                continue
            xa = x.astype(carry.dtype)
            if red == "mean":
                carry = carry + jnp.where(keep, w_i.astype(carry.dtype) * xa, 0)
            elif red == "sum":
                carry = carry + xa
            elif red == "max":
                carry = jnp.maximum(carry, xa)
            else:
                carry = jnp.minimum(carry, xa)
            new_aux.append(carry)
        return {"loss": loss, "weight": weight, "grads": grads, "aux": new_aux}, per_example

    def finish(self, state: dict, stacked_aux, loss_dtype, mesh, example_spec, psum_axes=()):
        """Divide the sums (after one reduction over `psum_axes`, for reduce="once")."""
        aux_flat, treedef = self._aux_flat()
        if psum_axes:
            state = dict(state)
            for key in ("loss", "weight", "grads"):
                state[key] = jax.lax.psum(state[key], psum_axes)
            reduced = []
            for (red, _), carry in zip(aux_flat, state["aux"], strict=True):
                if red in ("mean", "sum"):
                    carry = jax.lax.psum(carry, psum_axes)
                elif red == "max":
                    carry = jax.lax.pmax(carry, psum_axes)
                elif red == "min":
                    carry = jax.lax.pmin(carry, psum_axes)
                reduced.append(carry)
            state["aux"] = reduced
        total = state["weight"]
        nonzero = total != 0
        safe = jnp.where(nonzero, total, 1.0)
        loss = jnp.where(nonzero, state["loss"] / safe, 0.0).astype(loss_dtype)
        grads = jax.tree.map(lambda a: jnp.where(nonzero, a / safe, 0.0), state["grads"])
        grads = self.constrain_grads(grads)
        if treedef is None:
            return loss, None, grads
        out = []
        per_example = iter(stacked_aux or [])
        for (red, s), carry in zip(aux_flat, state["aux"], strict=True):
            if red == "concat":
                ys = next(per_example)  # [k, B/k, ...]
                merged = shd.merge_minibatches(ys).astype(s.dtype)
                merged = shd.constrain(merged, mesh, shd.cut_spec(example_spec, merged.ndim))
                out.append(merged)
            elif red == "mean":
                out.append(jnp.where(nonzero, carry / safe.astype(carry.dtype), 0).astype(s.dtype))
            else:
                out.append(carry.astype(s.dtype))
        return loss, jax.tree.unflatten(treedef, out), grads
