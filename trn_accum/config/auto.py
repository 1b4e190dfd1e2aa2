"""The settings a config may leave "auto" for the settings search (`trn_accum.plan.settings`)
to choose before the step is built, and reading or setting them by their dotted keys."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from trn_accum.config.sections import Config

# The settings a config may leave "auto" for the settings search (trn_accum.plan.settings) to
# choose before the step is built: none of them changes what the run computes (drift.FREE_KEYS).
AUTO_KEYS = (
    "trainer.accum_steps",
    "trainer.reduce",
    "model.remat",
    "model.attention",
    "model.attention_block",
    "model.loss_chunk",
)


def setting(cfg: Config, key: str) -> Any:
    """The value of a dotted config key ("model.remat") in `cfg`."""
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def with_settings(cfg: Config, values: Mapping[str, Any]) -> Config:
    """`cfg` with each dotted key of `values` ("trainer.accum_steps": 2, ...) set."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(
        cfg,
        **{s: dataclasses.replace(getattr(cfg, s), **kw) for s, kw in sections.items()},
    )


def auto_keys(cfg: Config) -> list[str]:
    """The keys of `AUTO_KEYS` that `cfg` leaves "auto" (for the settings search to choose)."""
    return [k for k in AUTO_KEYS if setting(cfg, k) == "auto"]


def layout_config(cfg: Config) -> Config:
    """`cfg` with each "auto" of `AUTO_KEYS` set to a plain value (k 1, reduce per minibatch,
    no remat, blockwise attention in 512 blocks, the whole loss): for readers of a run's state
    (import-hf), whose shapes and shardings these settings do not change, so that no settings
    search runs where nothing trains."""
    plain = {
        "trainer.accum_steps": 1,
        "trainer.reduce": "once" if cfg.trainer.gather != "per_minibatch" else "per_minibatch",
        "model.remat": "none",
        "model.attention": "blockwise",
        "model.attention_block": 512,
        "model.loss_chunk": 0,
    }
    return with_settings(cfg, {k: plain[k] for k in auto_keys(cfg)})
