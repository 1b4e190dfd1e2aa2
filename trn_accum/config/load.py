"""Typed run configuration: dataclasses per section, loaded from TOML, validated on load.

A config file names every section `[model]`, `[mesh]`, `[data]`, `[optimizer]`, `[trainer]`,
`[checkpoint]`, or builds on another file with a top-level `extends = "fuji-tiny.toml"`
(relative to the file; its tables' keys override the base's), so that an empty or partial file
is refused instead of meaning the 3B defaults. Within a section a missing key takes the
dataclass default; an unknown key is an error.
`load_config(path, overrides)` applies `--set`-style overrides ("section.key=value", value parsed
as TOML, a bare word taken as a string) and validates every field and the cross-section rules.
Every problem raises `ConfigError` (a ValueError) with one line naming the key, the value and
what is allowed.

The allowed values of a choice key come from the module that implements it (the model, the
accumulation core, the optimizer, the data), so a new choice is added in one place.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from trn_accum.config.files import EXTENDS, ConfigError, read_config_file
from trn_accum.config.sections import (
    MAX_SEED,
    SECTIONS,
    SHARDING_RULE_SETS,
    CheckpointConfig,
    Config,
    DataConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    TrainerConfig,
)
from trn_accum.core.mesh import check_axis_sizes
from trn_accum.data.datasets import config_problem as data_problem

__all__ = [
    "ConfigError",
    "load_config",
    "config_from_dict",
    "config_to_dict",
    "parse_override",
    "apply_overrides",
    "MAX_SEED",
    "SECTIONS",
    "SHARDING_RULE_SETS",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimizerConfig",
    "TrainerConfig",
]


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> Config:
    """Read a TOML config (and the chain of files it `extends`), apply "section.key=value"
    overrides, validate. The file, after its `extends` chain, must name every section of
    SECTIONS. Raises ConfigError."""
    raw = read_config_file(Path(path))
    _check_tables(raw)
    missing = [name for name in SECTIONS if name not in raw]
    if missing:
        raise ConfigError(
            f"config file {str(path)!r} does not name the section(s) "
            f"{', '.join(f'[{n}]' for n in missing)}: the trainer needs every one of "
            f"{', '.join(f'[{n}]' for n in SECTIONS)} (a missing key takes its default); add "
            f'them, or start the file with extends = "fuji-tiny.toml" (a config it builds on, '
            f"relative to the file)"
        )
    return config_from_dict(apply_overrides(raw, overrides))


def apply_overrides(raw: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of the raw TOML dict with each "section.key=value" override applied."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for item in overrides:
        section, key, value = parse_override(item)
        sect = out.setdefault(section, {})
        if not isinstance(sect, dict):
            raise ConfigError(f"override {item!r}: {section!r} is not a table in the config file")
        sect[key] = value
    return out


def parse_override(item: str) -> tuple[str, str, Any]:
    """ "trainer.accum_steps=8" -> ("trainer", "accum_steps", 8). The value is parsed as TOML;
    a value that is not TOML (a bare word such as auto or /data/x) is kept as a string."""
    name, sep, text = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key or "." in key:
        raise ConfigError(
            f"override {item!r}: expected section.key=value, e.g. trainer.accum_steps=8"
        )
    if section not in SECTIONS:
        raise ConfigError(
            f"override {item!r}: unknown section {section!r}; allowed: {', '.join(SECTIONS)}"
        )
    text = text.strip()
    if not text:
        raise ConfigError(f"override {item!r}: empty value for {section}.{key}")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return section, key, value


def config_from_dict(raw: Mapping[str, Any]) -> Config:
    """Build and validate a Config from a nested dict (TOML tables, or `config_to_dict` output)."""
    _check_tables(raw)
    sections = {
        name: _build_section(name, cls, raw.get(name, {})) for name, cls in SECTIONS.items()
    }
    cfg = Config(**sections)
    _check_config(cfg)
    return cfg


def _check_tables(raw: Mapping[str, Any]) -> None:
    """Every top-level name of `raw` is a known section holding a table (ConfigError)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config must be a table of sections, got {type(raw).__name__}")
    for name, value in raw.items():
        if name not in SECTIONS:
            raise ConfigError(
                f"unknown config section [{name}]; allowed: {', '.join(SECTIONS)} (and a "
                f'top-level {EXTENDS} = "base.toml")'
            )
        if not isinstance(value, Mapping):
            raise ConfigError(f"[{name}] must be a table of keys, got {value!r}")


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain nested dict (TOML/JSON-serialisable) of a Config: for logs and checkpoint metadata."""
    return dataclasses.asdict(cfg)


def _build_section(name: str, cls: type, values: Mapping[str, Any]):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(_unknown_key(name, key, value, fields))
        choices = fields[key].metadata.get("choices")
        _check_type(f"{name}.{key}", value, hints[key], choices)
    kwargs = {k: float(v) if hints[k] is float else v for k, v in values.items()}
    return cls(**kwargs)


def _unknown_key(section: str, key: str, value: Any, allowed: Iterable[str]) -> str:
    """The one line for `section.key = value` where [section] has no such key: the section(s)
    that do have it (a key set in the wrong section), else the keys [section] allows."""
    homes = [n for n, cls in SECTIONS.items() if key in {f.name for f in dataclasses.fields(cls)}]
    head = f"unknown key {section}.{key} = {value!r}"
    if not homes:
        return f"{head}; allowed keys in [{section}]: {', '.join(allowed)}"
    where = " and ".join(f"[{n}]" for n in homes)
    return (
        f"{head}: {key} belongs to {where}, not [{section}]; write {homes[0]}.{key} "
        f"(with --set) or put it under [{homes[0]}] in the config file"
    )


def _describe(tp, choices) -> str:
    if choices:
        return "one of " + ", ".join(repr(c) for c in choices)
    if tp == (int | str):
        return 'an integer or "auto"'
    if tp == (str | list[str]):  # data.path
        return "a directory or glob, or a non-empty list of them"
    if tp == list[dict]:  # data.mixture
        return "a list of tables {path, weight, kind}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[tp]


def _check_type(key: str, value: Any, tp, choices) -> None:
    if tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
    elif tp is str:
        ok = isinstance(value, str) and (not choices or value in choices)
    elif tp is bool:
        ok = isinstance(value, bool)
    elif tp == (int | str):  # trainer.accum_steps
        ok = (isinstance(value, int) and not isinstance(value, bool)) or value == "auto"
    elif tp == (str | list[str]):  # data.path
        ok = isinstance(value, str) or (
            isinstance(value, list) and bool(value) and all(isinstance(v, str) and v for v in value)
        )
    elif tp == list[dict]:  # data.mixture (each table: `data.datasets.config_problem`)
        ok = isinstance(value, list) and all(isinstance(v, dict) for v in value)
    else:  # pragma: no cover - a field type this module does not know
        raise TypeError(f"{key}: unsupported field type {tp}")
    if not ok:
        raise ConfigError(f"{key} = {value!r}: must be {_describe(tp, choices)}")


# ---------------------------------------------------------------------------------------------
# Validation of values and cross-section rules


def _require(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r}: {rule}")


def _check_config(cfg: Config) -> None:
    m, mesh, d, o, t, c = cfg.model, cfg.mesh, cfg.data, cfg.optimizer, cfg.trainer, cfg.checkpoint
    if t.gather != "per_minibatch" and t.reduce not in ("once", "auto"):
        raise ConfigError(
            f'trainer.gather = {t.gather!r} needs trainer.reduce = "once" (the weights are '
            f"gathered before the minibatch loop it runs manual over the batch axes), got "
            f'{t.reduce!r}: set trainer.reduce = "once" or trainer.gather = "per_minibatch"'
        )
    if t.reduce_dtype != "float32" and t.reduce not in ("once", "auto"):
        raise ConfigError(
            f'trainer.reduce_dtype = {t.reduce_dtype!r} needs trainer.reduce = "once" (it '
            f"narrows the one cross-replica gradient reduction after the minibatch loop), got "
            f'{t.reduce!r}: set trainer.reduce = "once" or trainer.reduce_dtype = "float32"'
        )

    for name in (
        "vocab_size",
        "num_layers",
        "hidden_dim",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "ffn_dim",
        "max_seq_len",
        "attention_block",
    ):
        if getattr(m, name) != "auto":  # attention_block may be "auto"
            _require(getattr(m, name) >= 1, f"model.{name}", getattr(m, name), "must be >= 1")
    _require(
        m.hidden_dim % m.num_heads == 0,
        "model.num_heads",
        m.num_heads,
        f"must divide model.hidden_dim ({m.hidden_dim})",
    )
    _require(
        m.num_heads % m.num_kv_heads == 0,
        "model.num_kv_heads",
        m.num_kv_heads,
        f"must divide model.num_heads ({m.num_heads})",
    )
    _require(m.head_dim % 2 == 0, "model.head_dim", m.head_dim, "must be even (RoPE rotates pairs)")
    for name in (
        "rope_theta",
        "norm_eps",
        "init_std",
        "rope_scaling_factor",
        "rope_low_freq_factor",
    ):
        _require(getattr(m, name) > 0, f"model.{name}", getattr(m, name), "must be > 0")
    hi, lo, n = m.rope_high_freq_factor, m.rope_low_freq_factor, m.rope_original_max_len
    _require(hi > lo, "model.rope_high_freq_factor", hi, f"must be > rope_low_freq_factor {lo}")
    _require(n >= 1, "model.rope_original_max_len", n, "must be >= 1")
    if m.loss_chunk != "auto":
        rule = 'must be >= 0 (0 = no chunking), or "auto"'
        _require(m.loss_chunk >= 0, "model.loss_chunk", m.loss_chunk, rule)

    try:
        check_axis_sizes(mesh.axes())
    except ValueError:
        sizes = mesh.axes()
        for name, size in sizes.items():
            _require(
                size >= 1 or size == -1, f"mesh.{name}", size, "must be >= 1, or -1 (the rest)"
            )
        wild = [n for n, s in sizes.items() if s == -1]
        raise ConfigError(
            f"mesh.{wild[1]} = -1: only one mesh axis may be -1 (mesh.{wild[0]} is -1 already)"
        ) from None
    _require(mesh.nodes >= 1, "mesh.nodes", mesh.nodes, "must be >= 1")
    if mesh.rules == "fsdp":
        _require(
            mesh.model == 1,
            "mesh.model",
            mesh.model,
            'rules = "fsdp" has no tensor parallelism: set mesh.model = 1 or mesh.rules = "trn2"',
        )
    if mesh.rules == "trn2" and mesh.model > 1:
        for name in ("num_heads", "num_kv_heads", "ffn_dim", "vocab_size"):
            value = getattr(m, name)
            _require(
                value % mesh.model == 0,
                f"model.{name}",
                value,
                f'must be divisible by mesh.model ({mesh.model}) under rules = "trn2"',
            )
    if mesh.fsdp > 1:
        _require(
            m.hidden_dim % mesh.fsdp == 0,
            "model.hidden_dim",
            m.hidden_dim,
            f"must be divisible by mesh.fsdp ({mesh.fsdp}): parameters shard it",
        )

    _require(d.seq_len >= 2, "data.seq_len", d.seq_len, "must be >= 2")
    _require(
        d.seq_len <= m.max_seq_len,
        "data.seq_len",
        d.seq_len,
        f"must be <= model.max_seq_len ({m.max_seq_len})",
    )
    _require(d.global_batch >= 1, "data.global_batch", d.global_batch, "must be >= 1")
    _require(d.eval_batches >= 0, "data.eval_batches", d.eval_batches, "must be >= 0")
    for key, seed in (("data.seed", d.seed), ("trainer.seed", t.seed)):
        _require(0 <= seed <= MAX_SEED, key, seed, f"must be in 0..{MAX_SEED} (a 32-bit seed)")
    if problem := data_problem(d.kind, d.path, d.mixture):
        raise ConfigError(problem)

    _require(o.peak_lr > 0, "optimizer.peak_lr", o.peak_lr, "must be > 0")
    _require(o.weight_decay >= 0, "optimizer.weight_decay", o.weight_decay, "must be >= 0")
    for name in ("b1", "b2"):
        v = getattr(o, name)
        _require(0 <= v < 1, f"optimizer.{name}", v, "must be in [0, 1)")
    _require(o.eps > 0, "optimizer.eps", o.eps, "must be > 0")
    _require(o.clip_norm >= 0, "optimizer.clip_norm", o.clip_norm, "must be >= 0 (0 = no clipping)")
    _require(o.warmup_steps >= 0, "optimizer.warmup_steps", o.warmup_steps, "must be >= 0")
    _require(
        o.decay_steps > o.warmup_steps,
        "optimizer.decay_steps",
        o.decay_steps,
        f"must be > optimizer.warmup_steps ({o.warmup_steps}); it counts from step 0",
    )
    _require(
        0 <= o.final_lr_fraction <= 1,
        "optimizer.final_lr_fraction",
        o.final_lr_fraction,
        "must be in [0, 1]",
    )

    _require(t.steps >= 1, "trainer.steps", t.steps, "must be >= 1")
    if t.accum_steps != "auto":
        _require(
            t.accum_steps >= 1, "trainer.accum_steps", t.accum_steps, 'must be >= 1, or "auto"'
        )
    # The global batch vs accum_steps x batch shards rule needs the mesh resolved on the
    # devices (an axis of -1, a mesh that does not fit them): `trn_accum.train.step.check_batch`
    # states it after `make_mesh`, so a mesh problem is reported as one first.
    _require(
        t.stop_after_nonfinite >= 0,
        "trainer.stop_after_nonfinite",
        t.stop_after_nonfinite,
        "must be >= 0 (0 = never stop)",
    )
    _require(
        0 <= t.max_skipped_fraction <= 1,
        "trainer.max_skipped_fraction",
        t.max_skipped_fraction,
        "must be in [0, 1] (1 = never stop)",
    )
    _require(t.log_every >= 1, "trainer.log_every", t.log_every, "must be >= 1")
    _require(t.eval_every >= 0, "trainer.eval_every", t.eval_every, "must be >= 0 (0 = never)")
    _require(
        t.memory_budget_gib > 0, "trainer.memory_budget_gib", t.memory_budget_gib, "must be > 0"
    )

    _require(c.every >= 0, "checkpoint.every", c.every, "must be >= 0 (0 = only at exit)")
    _require(c.keep >= 1, "checkpoint.keep", c.keep, "must be >= 1")
