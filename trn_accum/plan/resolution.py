"""What the settings search (`trn_accum.plan.settings.choose`) decided, and the one rule that
turns its priced rows into a pick: `trn_accum.analysis.recommend.recommend` (the fastest that
fits, then the headroom band), confirmed by the platform's compiler where the caller has one
(`confirmed`). The Resolution's `line()` is what `dry-run` prints and `train` logs."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from trn_accum.analysis import recommend as rec
from trn_accum.analysis.memory import format_bytes
from trn_accum.config.auto import AUTO_KEYS, auto_keys, setting, with_settings
from trn_accum.errors import UserError
from trn_accum.model.attention import BLOCKED

# Candidate field <- config key (the Candidate of `recommend`; None there is the config's value)
FIELDS = {
    "trainer.accum_steps": "k",
    "trainer.reduce": "reduce",
    "model.remat": "remat",
    "model.attention": "attention",
    "model.attention_block": "attention_block",
    "model.loss_chunk": "loss_chunk",
}


class SettingsError(UserError):
    """No candidate fits the budget, or the platform cannot be priced: one line."""


class Refused(Exception):
    """`confirm`'s answer for a candidate the platform's compiler would not fit."""


def values_of(cand: rec.Candidate) -> dict[str, Any]:
    """{config key: value} of a candidate (the inverse of `_cand`)."""
    return {key: getattr(cand, field) for key, field in FIELDS.items()}


@dataclasses.dataclass
class Resolution:
    """What `choose` decided: the settings (every key of AUTO_KEYS), the keys that were
    "auto", the pick's row and reasons, every priced row, and the seconds it took."""

    settings: dict[str, Any]
    auto: list[str]
    platform: str
    budget_bytes: float
    pick: dict | None = None
    rows: list = dataclasses.field(default_factory=list)
    refused: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def apply(self, cfg):
        """`cfg` with every "auto" replaced by the chosen setting."""
        return with_settings(cfg, {k: self.settings[k] for k in self.auto})

    def line(self) -> str:
        """The one line `dry-run` prints and `train` logs before it compiles."""
        v = self.settings
        kind = v["model.attention"]
        block = f" {v['model.attention_block']}" if kind in BLOCKED else ""
        chunk = v["model.loss_chunk"]
        loss = "whole minibatch" if chunk == 0 else f"{chunk}-token chunks"
        text = (
            f"train will run: accum_steps {v['trainer.accum_steps']}, reduce {v['trainer.reduce']}"
            f", remat {v['model.remat']}, attention {kind}{block}, loss {loss}"
        )
        if not self.auto:
            return text + ' (as written: no setting is "auto")'
        s = (self.pick or {}).get("summary", {})
        return (
            f"{text} (chosen for {', '.join(self.auto)} by the {self.platform} step-time model: "
            f"predicted {s.get('predicted_step_s', 0):.3f} s a step, "
            f"{format_bytes(s.get('memory_bytes') or 0)} of {format_bytes(self.budget_bytes)} "
            f"per device; {len(self.rows)} candidates priced in {self.seconds:.0f} s)"
        )

    def format(self) -> str:
        """The line, the pick's reasons and the table of every priced candidate."""
        lines = [self.line()]
        if self.pick:
            lines += [f"  why: {r}" for r in self.pick.get("reasons", [])]
        lines += [f"  refused by the platform's compiler: {r}" for r in self.refused]
        if self.rows:
            lines += rec.format_rows(self.rows)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": dict(self.settings),
            "auto": list(self.auto),
            "platform": self.platform,
            "budget_bytes": self.budget_bytes,
            "line": self.line(),
            "pick": self.pick,
            "refused": list(self.refused),
            "candidates": [
                {**r, "candidate": dataclasses.asdict(r["candidate"])} for r in self.rows
            ],
            "seconds": round(self.seconds, 1),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Resolution:
        rows = [{**r, "candidate": rec.Candidate(**r["candidate"])} for r in d["candidates"]]
        return cls(
            settings=d["settings"],
            auto=d["auto"],
            platform=d["platform"],
            budget_bytes=d["budget_bytes"],
            pick=d["pick"],
            rows=rows,
            refused=d["refused"],
            seconds=d["seconds"],
        )


def confirmed(cfg, rows, nodes: int, platform_name: str, budget, confirm, t0) -> Resolution:
    """The Resolution of the best of `rows` at `nodes` that `confirm(resolved_cfg)` accepts:
    one that raises `Refused` is marked as not fitting and the next is taken."""
    refused = []
    while True:
        pick = rec.recommend(rows, nodes)
        if pick is None:
            raise SettingsError(
                f'{", ".join(auto_keys(cfg))} = "auto": the platform\'s compiler refused every '
                f"candidate that fits by the estimate ({'; '.join(refused)}): raise "
                f"trainer.memory_budget_gib or use more devices"
            )
        row = next(r for r in rows if dataclasses.asdict(r["candidate"]) == pick["candidate"])
        pick = {**pick, "summary": row["summary"]}
        values = values_of(row["candidate"])
        settings = {
            k: values[k] if setting(cfg, k) == "auto" else setting(cfg, k) for k in AUTO_KEYS
        }
        res = Resolution(settings, auto_keys(cfg), platform_name, budget, pick, rows, refused)
        try:
            if confirm is not None:
                confirm(res.apply(cfg))
        except Refused as e:
            refused.append(f"{pick['label']}: {e}")
            row["fits"] = False
            continue
        res.seconds = time.perf_counter() - t0
        return res
