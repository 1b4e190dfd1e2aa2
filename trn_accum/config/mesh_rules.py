"""The trainer's mesh and batch rules, on top of `trn_accum.core.mesh` and
`trn_accum.core.batch_rules` (which state the mesh-sizing and divisibility rules once): the
config's mesh over the devices, the batch split into k minibatches over the batch shards, and
`check_start`, what the trainer refuses before data or compiling (`trn-accum train` and
`trn-accum check-config` both call it)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from trn_accum.config.load import Config
from trn_accum.core.batch_rules import divisibility_error, valid_steps
from trn_accum.core.mesh import build_mesh, resolve_axes
from trn_accum.errors import UserError
from trn_accum.model.sharding import BATCH_AXES
from trn_accum.neuron import kernels


class TrainError(UserError):
    """A user-caused trainer problem (mesh vs devices, batch vs shards, run dir): one line."""


def mesh_shape(cfg: Config, devices: int, platform: str = "") -> dict[str, int]:
    """The axis sizes of `cfg.mesh` over `devices` devices (the -1 resolved by the one
    mesh-sizing rule, `trn_accum.core.mesh.resolve_axes`); TrainError if they do not fit.
    `platform`: the devices' platform ("cpu": the error says how to emulate more)."""
    axes = cfg.mesh.axes()
    try:
        return resolve_axes(axes, devices)
    except ValueError as e:
        fixed = math.prod(s for s in axes.values() if isinstance(s, int) and s > 0)
        more = ""
        if platform == "cpu" and fixed > devices:
            more = f"; or emulate them: XLA_FLAGS=--xla_force_host_platform_device_count={fixed}"
        raise TrainError(f"{e}{more}") from None


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
