"""The NKI flash-attention adapter: layouts, launch grids, custom VJP, per-device mapping.

`flash_attention(q, k, v)` is what `attention(..., impl="neuron_flash")` runs. The kernels
themselves come from the Neuron SDK (`load_nki_flash_kernels`); everything JAX-side (the layout
transposes, the GQA handling, the custom VJP and the `shard_map` over the mesh) is here and is
unit-tested on CPU with pure-JAX stand-ins that follow the kernels' documented shapes.

Importing this module imports no Neuron package.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

NEURON_EXTRA_HINT = (
    "install the [neuron] extra (pip install 'trn_accum[neuron]' with "
    "--extra-index-url https://pip.repos.neuron.amazonaws.com) or use attention='blockwise'"
)


def load_nki_flash_kernels():
    """The NKI kernels as keyword arguments of `nki_flash_attention`, or a one-line ValueError.

    {"flash_fwd": ..., "flash_attn_bwd": ...}: `nki.jit` kernels launched with an SPMD grid,
    `kernel[grid](*args, **kwargs)`. Caveat (Neuron release notes): the legacy `neuronxcc.nki`
    namespace these kernels are written in is rejected by the NKI compiler from SDK 2.28 and
    removed from neuronx-cc in 2.34; kernels with the same signatures from the `nki` namespace
    can be passed to `nki_flash_attention` directly.
    """
    try:
        from neuronxcc.nki.kernels.attention import flash_attn_bwd, flash_fwd
    except Exception as err:  # ImportError, or the PyPI placeholder packages raising on import
        raise ValueError(
            "attention='neuron_flash' needs the Neuron NKI kernels "
            f"(neuronxcc.nki.kernels.attention does not import here: {type(err).__name__}): "
            + NEURON_EXTRA_HINT
        ) from None
    return {"flash_fwd": flash_fwd, "flash_attn_bwd": flash_attn_bwd}


def nki_flash_attention(
    q,
    k,
    v,
    *,
    flash_fwd,
    flash_attn_bwd,
    config=None,
    softmax_scale: float | None = None,
    mixed_precision: bool = True,
):
    """Causal GQA attention through the NKI flash kernels: all the layout adaptation is here.

    q [B, S, H, Dh], k/v [B, S, KV, Dh] (one device's shard) -> [B, S, H, Dh]. The kernels are
    passed in (`load_nki_flash_kernels()` on Neuron; pure-JAX stand-ins in the CPU tests) and
    are launched as `kernel[grid](...)` with these documented layouts:

    - `flash_fwd[B, KV](q, k, v, seed, softmax_scale=, use_causal_mask=, mixed_precision=,
      dropout_p=)`: q (B, H, Dh, S), k (B, KV, Dh, S), v (B, KV, S, Dh) (FlashConfig default
      should_transpose_v=False); grid over KV heads for GQA (the kernel loops over the H // KV
      query heads of each KV head). Returns o (B, H, S, Dh) and, with the default
      FlashConfig(training=True), lse float32 (B, H, 128, S // 128) with lse[b, h, p, i] the
      log-sum-exp of query i*128 + p. S must be a multiple of `config.seq_tile_size` (a
      FlashConfig; None = the kernel's default, 2048): S is padded on the right to it, which
      causal masking hides from every real query.
    - `flash_attn_bwd[B, H](q, k, v, o, dy, lse, seed, use_causal_mask=, mixed_precision=,
      dropout_p=, softmax_scale=)`: q, k, v, o, dy all (B, H, Dh, S) (no GQA: K/V repeated to H
      heads here, dk/dv summed back over each group), lse as returned by flash_fwd; returns
      dq, dk, dv (B, H, Dh, S).

    All kernel IO shares q's dtype; Dh <= 128; dropout 0 (seed (1,) int32 is then unused).
    Sources: the Neuron docs pages nki.kernels.flash_fwd / nki.kernels.flash_attn_bwd and the
    kernels' source (aws-neuron/nki-samples, src/nki_samples/reference/attention.py).
    """
    b, s, h, dh = q.shape
    kvh = k.shape[2]
    g = h // kvh
    if dh > 128:
        raise ValueError(f"attention='neuron_flash': head_dim {dh} > 128 (kernel limit)")
    seq_tile = 2048 if config is None else int(config.seq_tile_size)
    if config is not None and not getattr(config, "training", True):
        raise ValueError("attention='neuron_flash': FlashConfig(training=False) returns no lse")
    scale = dh**-0.5 if softmax_scale is None else float(softmax_scale)
    sp = -(-s // seq_tile) * seq_tile
    seed = jnp.ones((1,), jnp.int32)
    fwd_kwargs = dict(
        softmax_scale=scale,
        use_causal_mask=True,
        mixed_precision=mixed_precision,
        dropout_p=0.0,
        config=config,
    )

    def forward(qp, kp, vp):
        qt = qp.transpose(0, 2, 3, 1)  # (B, H, Dh, Sp)
        kt = kp.astype(qp.dtype).transpose(0, 2, 3, 1)  # (B, KV, Dh, Sp)
        vt = vp.astype(qp.dtype).transpose(0, 2, 1, 3)  # (B, KV, Sp, Dh)
        o, lse = flash_fwd[b, kvh](qt, kt, vt, seed, **fwd_kwargs)  # (B,H,Sp,Dh), (B,H,128,Sp/128)
        return o, lse

    @jax.custom_vjp
    def run(qp, kp, vp):
        return forward(qp, kp, vp)[0].transpose(0, 2, 1, 3)

    def run_fwd(qp, kp, vp):
        o, lse = forward(qp, kp, vp)
        return o.transpose(0, 2, 1, 3), (qp, kp, vp, o, lse)

    def run_bwd(res, d_out):
        qp, kp, vp, o, lse = res
        dt = qp.dtype
        qt = qp.transpose(0, 2, 3, 1)  # (B, H, Dh, Sp)
        kt = jnp.repeat(kp.astype(dt), g, axis=2).transpose(0, 2, 3, 1)  # (B, H, Dh, Sp)
        vt = jnp.repeat(vp.astype(dt), g, axis=2).transpose(0, 2, 3, 1)  # (B, H, Dh, Sp)
        ot = o.transpose(0, 1, 3, 2)  # (B, H, Dh, Sp)
        dyt = d_out.astype(dt).transpose(0, 2, 3, 1)  # (B, H, Dh, Sp)
        dq, dk, dv = flash_attn_bwd[b, h](
            qt,
            kt,
            vt,
            ot,
            dyt,
            lse,
            seed,
            use_causal_mask=True,
            mixed_precision=mixed_precision,
            dropout_p=0.0,
            softmax_scale=scale,
        )

        def to_kv(x, dtype):  # (B, H, Dh, Sp) -> sum over each group -> (B, Sp, KV, Dh)
            x = x.astype(jnp.float32).reshape(b, kvh, g, dh, sp).sum(axis=2)
            return x.transpose(0, 3, 1, 2).astype(dtype)

        return dq.transpose(0, 3, 1, 2).astype(dt), to_kv(dk, kp.dtype), to_kv(dv, vp.dtype)

    run.defvjp(run_fwd, run_bwd)
    pad = ((0, 0), (0, sp - s), (0, 0), (0, 0))
    out = run(jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad))
    return out[:, :s].astype(q.dtype)


def shard_attention(fn, q, k, v, mesh):
    """Run `fn(q, k, v)` per device under `jax.shard_map`: batch over the mesh's "data"/"fsdp"
    axes, heads over "model", sequence whole (a custom kernel cannot be partitioned by XLA).

    q [B, S, H, Dh], k/v [B, S, KV, Dh]; `mesh` a Mesh or AbstractMesh (axes already manual,
    e.g. inside an outer shard_map, are left alone).
    """
    manual = set(getattr(mesh, "manual_axes", ()))
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    if sizes.get("seq", 1) > 1 and "seq" not in manual:
        raise ValueError(
            f"attention='neuron_flash': the sequence is sharded over 'seq' ({sizes['seq']}); "
            "the kernel needs whole sequences: use attention='blockwise' or seq=1"
        )
    batch = tuple(a for a in ("data", "fsdp") if sizes.get(a, 1) > 1 and a not in manual)
    head = "model" if sizes.get("model", 1) > 1 and "model" not in manual else None
    n_batch = math.prod(sizes[a] for a in batch)
    n_head = sizes[head] if head else 1
    if q.shape[0] % n_batch or k.shape[2] % n_head:
        raise ValueError(
            f"attention='neuron_flash': batch {q.shape[0]} must divide by {n_batch} "
            f"({'x'.join(batch)}) and KV heads {k.shape[2]} by {n_head} ('model')"
        )
    if not batch and head is None:
        return fn(q, k, v)
    spec = P(batch or None, None, head, None)
    if set(getattr(mesh, "explicit_axes", ())) & {*batch, head}:
        # Explicit-sharding axes: shard_map does not reshard its inputs itself.
        target = NamedSharding(mesh, spec) if isinstance(mesh, Mesh) else spec
        q, k, v = (jax.reshard(x, target) for x in (q, k, v))
    mapped = jax.shard_map(
        fn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False
    )
    return mapped(q, k, v)


def flash_attention(q, k, v, *, mesh=None, kernels=None):
    """Causal GQA attention through the NKI kernels, per device over `mesh` (default: the
    ambient mesh of `jax.set_mesh`, if any). `kernels`: the `load_nki_flash_kernels()` dict
    (default: loaded now; a one-line ValueError where they are missing)."""
    kernels = load_nki_flash_kernels() if kernels is None else kernels
    fn = functools.partial(nki_flash_attention, **kernels)
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty:
        return fn(q, k, v)
    return shard_attention(fn, q, k, v, mesh)
