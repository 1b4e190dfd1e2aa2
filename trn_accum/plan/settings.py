"""Every setting a config leaves "auto", chosen once, by the step-time model: `choose` is what
`trn-accum train`, `trn-accum dry-run` and `check-config --settings` run.

The settings (`trn_accum.config.load.AUTO_KEYS`): trainer.accum_steps (k), trainer.reduce,
model.remat, model.attention (and model.attention_block) and model.loss_chunk. None of them
changes what a run computes (`trn_accum.config.drift.FREE_KEYS`): each is a way to lay out the
same step, so the fastest that fits is the right one.

How a candidate is judged:
- time: `trn_accum.plan.perfmodel.predict` compiles its step on CPU devices shaped like one or
  two nodes of the target and prices every op and collective at the platform's fitted rates
  (`trn_accum.analysis.platforms`): "predicted_step_s";
- memory: the same compile's peak live bytes per device at full depth
  (`perfmodel.compiled_fits`, the dry-run's fit check on CPU) against the budget
  (trainer.memory_budget_gib, at most the device's memory).

The search is staged, as the step-time model's mesh search is (`trn_accum.plan.search`):
1. k: the `K_LIMIT` smallest k whose analytic bytes fit (`search.compile_ks`), with every other
   "auto" at its base value (reduce per minibatch, no remat, blockwise attention in 512 blocks,
   the whole loss). Where none fits, the base moves down `fuji.distinct_remat_policies` (each
   saves less), then to a loss in `REFERENCE_CHUNK`-token chunks, until one does.
2. One setting at a time on the fastest that fits: the other reduce mode (with a data axis to
   reduce over), the other remat policies, each attention kind of the platform with each block
   of `search.ATTENTION_BLOCKS` (at most the sequence), and the other loss chunks (the whole
   minibatch, the reference chunk, and a chunk sized from the two measured footprints). Repeated
   once on a new fastest.
3. The next two valid k above the fastest's, at its settings.
Then the pick, by the rule `dry-run`'s mesh search uses too
(`trn_accum.analysis.recommend.recommend`): the fastest that fits, or within `HEADROOM_BAND`
(5 %) of its predicted time the candidate with the fewest peak bytes per device, because no fit
check on CPU is the target's allocator and the model does not tell such times apart. Then
`confirm` (the caller's) compiles the pick where a platform compiler is at hand (the chip
of a run; libtpu for a TPU dry-run); a pick it refuses is passed over for the next.

Candidate attention kinds: blockwise and flash everywhere; neuron_flash on a Neuron device only,
once `trn-accum neuron-check` has passed its row on that node (`neuron_flash_passed`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

from trn_accum.analysis import platforms, steptime
from trn_accum.analysis import recommend as rec
from trn_accum.analysis.memory import GIB, format_bytes
from trn_accum.config.auto import AUTO_KEYS, auto_keys, setting, with_settings
from trn_accum.core.mesh import resolve_axes
from trn_accum.errors import UserError
from trn_accum.model import fuji
from trn_accum.model.attention import BLOCKED
from trn_accum.plan.perfmodel import Programs, compiled_fits, fitting_k, predict
from trn_accum.plan.resolution import Resolution, SettingsError, confirmed, values_of
from trn_accum.plan.search import ATTENTION_BLOCKS, compile_ks

K_LIMIT = 3  # ks priced in stage 1
HEADROOM_KS = 2  # ks above the pick priced in stage 3
REFERENCE_CHUNK = 1024  # tokens per batch shard: the chunked loss's base
ATTENTION_KINDS = ("blockwise", "flash")  # every platform; neuron_flash: `attention_kinds`
BASE = {
    "trainer.reduce": "per_minibatch",
    "model.remat": "none",
    "model.attention": "blockwise",
    "model.attention_block": 512,
    "model.loss_chunk": 0,
}
MESH = "config"  # the config's own mesh: the settings search does not change it


@dataclasses.dataclass(frozen=True)
class Target:
    """What the search prices for: a platform of `trn_accum.analysis.platforms`, its devices
    per node (JAX devices) and the node count."""

    platform: str
    devices_per_node: int
    nodes: int


# `trn-accum neuron-check` records each row's status here on the node it ran on
NEURON_CHECK_RECORD = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
    "trn_accum",
    "neuron-check.json",
)


def record_neuron_check(rows: dict[str, str], path: str = NEURON_CHECK_RECORD) -> None:
    """Write `trn-accum neuron-check`'s row statuses ({name: status}) for this node, replacing
    the last record whole (a temp file renamed over it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"rows": dict(rows)}, f)
    os.replace(tmp, path)


def neuron_flash_passed(path: str = NEURON_CHECK_RECORD) -> bool:
    """Whether `trn-accum neuron-check` passed its neuron-flash row on this node (its record
    at `path`: {"rows": {name: status}})."""
    try:
        with open(path) as f:
            rows = json.load(f).get("rows", {})
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(rows, dict) and rows.get("neuron-flash") == "pass"


def attention_kinds(target: Target) -> tuple[str, ...]:
    """The attention kinds a search may choose on `target` (see the module docstring)."""
    from trn_accum.neuron import platform

    on_neuron = target.platform == "trn2" and platform.neuron_available()
    return ATTENTION_KINDS + (("neuron_flash",) if on_neuron and neuron_flash_passed() else ())


def _cand(values: dict[str, Any]) -> rec.Candidate:
    return rec.Candidate(
        mesh=MESH,
        nodes=0,  # set by the search
        k=values["trainer.accum_steps"],
        reduce=values["trainer.reduce"],
        remat=values["model.remat"],
        attention=values["model.attention"],
        attention_block=values["model.attention_block"],
        loss_chunk=values["model.loss_chunk"],
    )


@dataclasses.dataclass
class Search:
    """One search's state: the config, what it prices on, the rows priced so far."""

    cfg: Any
    target: Target
    plat: platforms.Platform
    layout: steptime.Layout
    budget: float
    kw: dict
    rows: list = dataclasses.field(default_factory=list)
    seen: dict = dataclasses.field(default_factory=dict)
    say: Callable[[str], None] = lambda _: None

    @property
    def data_axis(self) -> int:
        shape = resolve_axes(self.cfg.mesh.axes(), self.layout.devices_per_node * self.target.nodes)
        return shape.get("data", 1)

    def program(self, values: dict[str, Any]) -> tuple[dict[str, Any], rec.Candidate]:
        """(the settings, the candidate) of the program these settings build here."""
        if values["trainer.reduce"] == "once" and self.data_axis == 1:
            values = {**values, "trainer.reduce": "per_minibatch"}  # the same program
        return values, dataclasses.replace(_cand(values), nodes=self.target.nodes)

    def price(self, values: dict[str, Any]) -> dict | None:
        """The row of the candidate with these settings (priced once), None where it cannot be
        built (a block the sequence does not take, a k the batch does not split into)."""
        values, cand = self.program(values)
        if cand in self.seen:
            return self.seen[cand]
        c = with_settings(self.cfg, values)
        t0 = time.perf_counter()
        try:
            summary = predict(c, nodes=self.target.nodes, **self.kw)
        except (ValueError, UserError) as e:
            self.say(f"  skipped {cand.label()}: {str(e).splitlines()[0]}")
            self.seen[cand] = None
            return None
        row = {"candidate": cand, "fits": compiled_fits(summary, self.budget), "summary": summary}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        self.rows.append(row)
        self.seen[cand] = row
        mem = summary.get("memory_bytes") or 0
        self.say(
            f"  [{len(self.rows)}] {cand.label()}: {summary.get('predicted_step_s', 0):.3f} s, "
            f"{format_bytes(mem)} ({'fits' if row['fits'] else 'over'}; "
            f"{time.perf_counter() - t0:.0f} s)"
        )
        return row

    def announce(self, stage: str, todo: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`todo`, after one line saying how many of them are new and, at the mean time of
        the candidates priced so far, about how long they take."""
        new: dict[rec.Candidate, dict[str, Any]] = {}
        for values in todo:  # one each, in order
            new.setdefault(self.program(values)[1], values)
        n = sum(c not in self.seen for c in new)
        took = [r["seconds"] for r in self.rows]
        eta = f", about {n * sum(took) / len(took):.0f} s" if took else ""
        if n:
            self.say(f"  {stage}: {n} candidate(s) to price{eta}")
        return list(new.values())

    def best(self) -> dict | None:
        """`recommend`'s pick among the rows so far (None while none fits)."""
        return rec.recommend(self.rows, self.target.nodes)


def _options(cfg, key: str, target: Target) -> tuple:
    """The values stage 2 tries for `key` (only the config's where it is not "auto")."""
    if setting(cfg, key) != "auto":
        return (setting(cfg, key),)
    if key == "trainer.reduce":
        needs_once = cfg.trainer.gather != "per_minibatch" or cfg.trainer.reduce_dtype != "float32"
        return ("once",) if needs_once else ("per_minibatch", "once")
    if key == "model.attention":
        return attention_kinds(target)
    if key == "model.attention_block":
        blocks = tuple(b for b in ATTENTION_BLOCKS if b <= cfg.data.seq_len)
        return blocks or (cfg.data.seq_len,)
    raise KeyError(key)


def _base(cfg, target: Target) -> dict[str, Any]:
    """Stage 1's settings beside k: the config's, or `BASE` for each "auto"."""
    out = {}
    for key in AUTO_KEYS[1:]:
        value = setting(cfg, key)
        if value == "auto":
            value = BASE[key] if key != "trainer.reduce" else _options(cfg, key, target)[0]
            if key == "model.attention_block":
                value = min(value, cfg.data.seq_len)
        out[key] = value
    return out


def _ks(s: Search, values: dict[str, Any]) -> list[int]:
    """The valid ks whose analytic bytes fit, with these settings (the config's k alone where
    it is not "auto")."""
    k = s.cfg.trainer.accum_steps
    if k != "auto":
        return [k]
    c = with_settings(s.cfg, {**values, "trainer.accum_steps": 1})
    table = fitting_k(c, s.cfg.mesh.axes(), s.target.nodes, s.layout, s.budget)["table"]
    return sorted(compile_ks(table, s.budget)) or [1]


def _all_ks(s: Search, values: dict[str, Any]) -> list[int]:
    c = with_settings(s.cfg, {**values, "trainer.accum_steps": 1})
    table = fitting_k(c, s.cfg.mesh.axes(), s.target.nodes, s.layout, s.budget)["table"]
    return sorted(r["k"] for r in table)


def _bases(cfg, target: Target) -> list[dict[str, Any]]:
    """Stage 1's bases, most memory first: `_base`, then (where "auto") each remat policy that
    saves less, then the chunked loss."""
    base = _base(cfg, target)
    out = [base]
    if cfg.model.remat == "auto":
        policies = fuji.distinct_remat_policies(base["model.attention"])
        order = [p for p in ("save_attention", "save_qkvo", "full") if p in policies]
        out += [{**base, "model.remat": p} for p in order]
    if cfg.model.loss_chunk == "auto":  # where the minibatch is longer than the chunk
        out += [{**b, "model.loss_chunk": REFERENCE_CHUNK} for b in list(out)]
    return out


def _chunk_options(s: Search, pick: dict[str, Any]) -> list[int]:
    """The whole loss, the reference chunk, and the largest power-of-two chunk whose logits the
    memory left at the reference chunk holds (from the two priced footprints)."""
    out = [0, REFERENCE_CHUNK]
    whole = s.seen.get(
        dataclasses.replace(_cand({**pick, "model.loss_chunk": 0}), nodes=s.target.nodes)
    )
    ref = s.seen.get(
        dataclasses.replace(
            _cand({**pick, "model.loss_chunk": REFERENCE_CHUNK}), nodes=s.target.nodes
        )
    )
    if whole and ref and not whole["fits"] and ref["fits"]:
        tokens = _minibatch_tokens(s, pick)
        a, b = ref["summary"]["memory_bytes"], whole["summary"]["memory_bytes"]
        per_token = (b - a) / max(1, tokens - REFERENCE_CHUNK)
        c = REFERENCE_CHUNK
        while c * 2 < tokens and a + (c * 2 - REFERENCE_CHUNK) * per_token <= s.budget:
            c *= 2
        out.append(c)
    return out


def _minibatch_tokens(s: Search, values: dict[str, Any]) -> int:
    """Tokens per batch shard per minibatch at these settings (the whole loss's chunk)."""
    shape = resolve_axes(s.cfg.mesh.axes(), s.layout.devices_per_node * s.target.nodes)
    shards = shape.get("data", 1) * shape.get("fsdp", 1)
    rows = s.cfg.data.global_batch // shards // values["trainer.accum_steps"]
    return max(1, rows) * s.cfg.data.seq_len


def _variants(s: Search, pick: dict[str, Any]) -> list[dict[str, Any]]:
    """Stage 2's candidates: `pick` with one "auto" setting changed (attention kind and block
    together)."""
    out = []
    cfg = s.cfg
    for key in ("trainer.reduce", "model.remat"):
        if setting(cfg, key) == "auto":
            if key == "model.remat":
                opts = fuji.distinct_remat_policies(pick["model.attention"])
            else:
                opts = _options(cfg, key, s.target)
            out += [{**pick, key: v} for v in opts if v != pick[key]]
    kinds = _options(cfg, "model.attention", s.target)
    blocks = _options(cfg, "model.attention_block", s.target)
    for kind in kinds:
        for block in blocks if kind in BLOCKED else (pick["model.attention_block"],):
            if (kind, block) != (pick["model.attention"], pick["model.attention_block"]):
                out.append({**pick, "model.attention": kind, "model.attention_block": block})
    if cfg.model.loss_chunk == "auto":
        whole = _minibatch_tokens(s, pick)  # a chunk of the whole minibatch or more: no chunk
        out += [{**pick, "model.loss_chunk": c} for c in _chunk_options(s, pick) if c < whole]
    return out


def _pick_values(s: Search) -> dict[str, Any] | None:
    """The settings of the fastest row that fits so far (None while none fits): stages 2 and 3
    search around it; the headroom rule chooses among all rows once, at the end."""
    fits = [r for r in s.rows if r["fits"]]
    return values_of(min(fits, key=rec.sort_key)["candidate"]) if fits else None


def search(cfg, target: Target, *, devices=None, say: Callable[[str], None] | None = None):
    """Stages 1-3 of the module docstring: the `Search` with every priced row (its `best()`
    is the pick before any `confirm`). SettingsError where nothing fits."""
    plat = platforms.get(target.platform)
    layout = steptime.Layout.of(plat, devices_per_node=target.devices_per_node)
    budget = plat.budget_gib(cfg.trainer.memory_budget_gib) * GIB
    kw = dict(layout=layout, devices=devices, plat=plat, programs=Programs())
    s = Search(cfg, target, plat, layout, budget, kw, say=say or (lambda _: None))
    keys = auto_keys(cfg)
    s.say(f"settings search for {', '.join(keys)} on {plat.name} ({target.nodes} node(s))")
    for base in _bases(cfg, target):  # stage 1
        ks = [{**base, "trainer.accum_steps": k} for k in _ks(s, base)[:K_LIMIT]]
        for values in s.announce("k", ks):
            s.price(values)
        if s.best() is not None:
            break
    pick = _pick_values(s)
    if pick is None:
        least = min((r["summary"].get("memory_bytes") or 0 for r in s.rows), default=0)
        raise SettingsError(
            f'{", ".join(keys)} = "auto": no candidate fits the budget of '
            f"{format_bytes(budget)} per device on {plat.name} (the least: {format_bytes(least)}"
            f", {len(s.rows)} priced): raise trainer.memory_budget_gib, or use more devices"
        )
    for _ in range(2):  # stage 2, once more on a new fastest
        for values in s.announce("one setting at a time", _variants(s, pick)):
            s.price(values)
        new = _pick_values(s)
        if new == pick:
            break
        pick = new
    if cfg.trainer.accum_steps == "auto":  # stage 3: larger k at the pick's settings
        above = [k for k in _all_ks(s, pick) if k > pick["trainer.accum_steps"]]
        larger = [{**pick, "trainer.accum_steps": k} for k in above[:HEADROOM_KS]]
        for values in s.announce("larger k", larger):
            s.price(values)
    return s


def choose(
    cfg,
    target: Target,
    *,
    devices=None,
    confirm: Callable[[Any], None] | None = None,
    say: Callable[[str], None] | None = None,
) -> Resolution:
    """The settings train runs for `cfg` on `target` (the one search: see the module
    docstring). `devices`: the CPU devices to compile candidates on (default: this process's
    devices, which must number min(nodes, 2) x devices_per_node). `confirm(resolved_cfg)`
    raises `Refused` where the platform's own compiler does not fit the pick: the next pick is
    taken. Nothing is priced where no setting is "auto"."""
    t0 = time.perf_counter()
    keys = auto_keys(cfg)
    plat = platforms.get(target.platform)
    budget = plat.budget_gib(cfg.trainer.memory_budget_gib) * GIB
    if not keys:
        return Resolution({k: setting(cfg, k) for k in AUTO_KEYS}, [], plat.name, budget)
    s = search(cfg, target, devices=devices, say=say)
    return confirmed(cfg, s.rows, target.nodes, plat.name, s.budget, confirm, t0)
