"""`model.remat = "auto"` and `model.loss_chunk = "auto"`: chosen together with k from the memory
the step needs, what `trainer.accum_steps = "auto"` does for k alone (`trn_accum.plan.autok`).

The order is what one TPU v5e chip measured on the 4-layer Fuji proxy (docs/performance.md, "On
the chip"; rows in benchmarks/measured-tpu-v5e.json): the loss chunk moved the step most (128 ->
1024 tokens per batch shard -23 %, the whole minibatch a further -7 %), then remat (none against
save_qkvo, -11 % and -1 %); k was even at seq 2048 (k=1 0.556 s, k=2 0.561 s), while at seq
8192 k=2 beat k=1 by 18-19 % (0.725 against 0.885 s, 0.703 against 0.863 s), where k=1 is over
the budget by the estimate and the TPU compiler fits it by recomputing (`autok`). So:

1. remat: the first of `REMAT_ORDER` ("none", "save_attention", "save_qkvo", "full") at which
   some k fits (only the configured policy when it is not "auto"); save_attention is save_qkvo
   with the attention's residuals kept, so that its backward runs no second forward (fewer
   FLOPs, more memory; not measured on a chip: its place is by the work it removes);
2. the loss of the whole minibatch (no chunking) at the smallest k it fits
   (`trn_accum.analysis.autotune.autotune`, a binary search; only the configured k when it is
   not "auto"): a larger k shrinks the minibatch and its logits;
3. where no k fits the whole loss: the smallest k that fits with the loss chunked at
   `REFERENCE_CHUNK` tokens per batch shard, then the chunk sized from the memory left at that
   (remat, k): headroom = budget - bytes at the reference; a chunk of c tokens per batch shard
   holds c x (vocab / model axis) logits per device at `LOGIT_BYTES` each, so the largest
   candidate (the whole minibatch's halves, down to the reference) whose extra logits fit the
   headroom is compiled, and halved until one fits (the reference did).

A configured loss chunk is kept (step 2 at that chunk). The whole minibatch is written 0.

Each "fits" is the measure's bytes against the budget: the fit check's estimate of the compiled
step, in the trainer and the dry-run alike (`autok.CompiledMemory`, whose docstring says why not
the backend's own footprint).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from trn_accum.analysis.autotune import (
    GIB,
    AutotuneError,
    AutotuneResult,
    autotune,
    candidate_steps,
    format_bytes,
)
from trn_accum.plan import autok
from trn_accum.train import step as step_lib

REMAT_ORDER = ("none", "save_attention", "save_qkvo", "full")
REFERENCE_CHUNK = 1024  # tokens per batch shard at which k is searched
# Bytes per logit per device while one chunk is live: its float32 logits (4) and their float32
# gradient (4), and the compute-dtype copy the LM head's backward reads (2). Only a proposal, each
# choice is compiled: the estimate's own difference between the whole loss and 1024-token chunks
# is 7.3 B per logit on the 4-layer proxy (seq 2048, k 2, remat none) and 13.3 on the 3B (remat
# none, k 2), the dry-runs in docs/performance.md and configs/fuji-3b-trn2.toml.
LOGIT_BYTES = 10

# (config with int settings, k) -> bytes per device
Measure = Callable[[Any, int], int]


@dataclasses.dataclass(frozen=True)
class SettingsResult:
    """The choice, each (remat, k, loss chunk) measured, and the k search at the chosen policy.

    `whole_chunk`: tokens per batch shard of one minibatch at the chosen k; `loss_chunk` 0 means
    that whole (no chunking). `tried`: rows {remat, k, loss_chunk, bytes, fits} in the order
    measured. `bytes` / `budget_bytes`: per device, the choice's and the budget."""

    accum_steps: int
    remat: str
    loss_chunk: int
    bytes: int
    budget_bytes: int
    whole_chunk: int
    tried: tuple[dict, ...]
    k_search: AutotuneResult
    method: str = ""
    logit_bytes: int = 0  # one chunk's logits per device at LOGIT_BYTES each

    @property
    def margin_bytes(self) -> int:
        return self.budget_bytes - self.bytes

    def format(self) -> str:
        chunk = "whole minibatch" if self.loss_chunk == 0 else f"{self.loss_chunk} tokens"
        lines = [
            f'remat / loss_chunk / accum_steps = "auto": budget {format_bytes(self.budget_bytes)}'
            f" per device; bytes = {self.method}",
            f"  {'remat':<14} {'k':>3} {'loss_chunk':>10} {'bytes per device':>18}  fits",
        ]
        for row in self.tried:
            lc = row["loss_chunk"] or "whole"
            fits = "yes" if row["fits"] else "no"
            lines.append(
                f"  {row['remat']:<14} {row['k']:>3} {lc!s:>10} {format_bytes(row['bytes']):>18}"
                f"  {fits}"
            )
        lines.append(
            f"  chose remat = {self.remat}, accum_steps = {self.accum_steps}, loss_chunk = "
            f"{self.loss_chunk} ({chunk}): {format_bytes(self.bytes)}, "
            f"{format_bytes(self.margin_bytes)} under the budget"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "accum_steps": self.accum_steps,
            "remat": self.remat,
            "loss_chunk": self.loss_chunk,
            "loss_chunk_tokens": self.loss_chunk or self.whole_chunk,
            "loss_chunk_logit_bytes": self.logit_bytes,
            "bytes": self.bytes,
            "budget_bytes": self.budget_bytes,
            "margin_bytes": self.margin_bytes,
            "tried": [dict(r) for r in self.tried],
            "method": self.method,
            "k_search": self.k_search.to_dict(),
        }


def chunk_candidates(whole: int, reference: int) -> list[int]:
    """Tokens per batch shard to try, largest first: `whole`, then its exact halves while they
    stay >= `reference` (the reference itself last where it divides `whole`)."""
    out, c = [], whole
    while c >= reference:
        out.append(c)
        if c % 2:
            break
        c //= 2
    return out or [whole]


def largest_fitting_chunk(
    candidates: list[int], reference: int, headroom: float, per_token_bytes: float
) -> int:
    """The first of `candidates` (descending) whose logits beyond the reference chunk's fit
    `headroom` bytes: (c - reference) x `per_token_bytes` <= headroom; else the reference."""
    for c in candidates:
        if (c - reference) * per_token_bytes <= headroom:
            return c
    return reference


def logit_bytes_per_token(cfg, mesh) -> float:
    """Bytes per device of one token's logits in a loss chunk: vocab / model axis x LOGIT_BYTES."""
    return cfg.model.vocab_size / max(1, dict(mesh.shape).get("model", 1)) * LOGIT_BYTES


def loss_chunk_report(cfg, mesh, rows_per_minibatch: int) -> dict[str, Any]:
    """The loss chunk a resolved `cfg` uses, per batch shard: {"loss_chunk" (the setting),
    "tokens_per_chunk", "chunks_per_minibatch", "logit_bytes_per_device" (one chunk's logits at
    LOGIT_BYTES each)}. rows_per_minibatch: rows per batch shard (device group) per minibatch."""
    whole = rows_per_minibatch * cfg.data.seq_len
    chunk = cfg.model.loss_chunk
    tokens = min(chunk, whole) if chunk else whole
    return {
        "loss_chunk": chunk,
        "tokens_per_chunk": tokens,
        "chunks_per_minibatch": -(-whole // tokens),
        "logit_bytes_per_device": int(tokens * logit_bytes_per_token(cfg, mesh)),
    }


def _with(cfg, **model):
    trainer = {k: model.pop(k) for k in ("accum_steps",) if k in model}
    out = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))
    if trainer:
        out = dataclasses.replace(out, trainer=dataclasses.replace(cfg.trainer, **trainer))
    return out


class _CompiledMeasure:
    """measure(cfg, k) -> bytes: `autok.CompiledMemory` of each candidate config; `method` says
    how the last was obtained."""

    def __init__(self, mesh, rows: int, depth: str, figure: str):
        self.mesh, self.rows, self.depth, self.figure = mesh, rows, depth, figure
        self.method = "compiled"

    def __call__(self, cfg, k: int) -> int:
        m = autok.CompiledMemory(
            cfg, self.mesh, batch_rows=self.rows, depth=self.depth, figure=self.figure
        )
        out = m(k)
        self.method = m.method
        return out


def resolve_for_run(cfg, mesh) -> tuple[Any, SettingsResult | AutotuneResult | None]:
    """`resolve` as a run calls it (`Trainer.build(cfg, settings=resolve_for_run)`): every
    process must pick the same settings, and compiled bytes agree everywhere; a choice of depth
    by measured compile time ("auto") might not, so a multi-process run extrapolates."""
    depth = "auto" if jax.process_count() == 1 else "extrapolate"
    return resolve(cfg, mesh, depth=depth)


def needs_search(cfg) -> bool:
    return cfg.model.remat == "auto" or cfg.model.loss_chunk == "auto"


def resolve(
    cfg,
    mesh,
    *,
    batch_rows: int | None = None,
    measure: Measure | None = None,
    depth: str = "auto",
    figure: str = "target",
) -> tuple[Any, SettingsResult | AutotuneResult | None]:
    """(cfg with every "auto" among trainer.accum_steps, model.remat and model.loss_chunk
    replaced, the search's result or None where nothing was "auto"). See the module docstring.

    batch_rows: rows of the compiled batch (default data.global_batch; one node's rows in a
    dry-run). `measure(cfg, k)` defaults to compiling the step (`autok.CompiledMemory`)."""
    if not needs_search(cfg):
        return autok.resolve_accum_steps(
            cfg, mesh, batch_rows=batch_rows, depth=depth, figure=figure
        )
    rows = cfg.data.global_batch if batch_rows is None else int(batch_rows)
    shards = step_lib.batch_shards(mesh)
    ks = candidate_steps(rows, shards)
    if cfg.trainer.accum_steps != "auto":
        ks = (int(cfg.trainer.accum_steps),)
    measure = measure or _CompiledMeasure(mesh, rows, depth, figure)
    budget = cfg.trainer.memory_budget_gib * GIB
    remats = REMAT_ORDER if cfg.model.remat == "auto" else (cfg.model.remat,)
    tokens = rows // shards * cfg.data.seq_len  # per batch shard per step
    per_token = logit_bytes_per_token(cfg, mesh)
    tried: list[dict] = []

    def bytes_at(remat: str, k: int, chunk: int) -> int:
        b = int(measure(_with(cfg, remat=remat, loss_chunk=chunk, accum_steps=k), k))
        tried.append({"remat": remat, "k": k, "loss_chunk": chunk, "bytes": b, "fits": b <= budget})
        return b

    def smallest_k(remat: str, chunk_of_k) -> AutotuneResult | None:
        try:
            return autotune(
                ks,
                lambda k: bytes_at(remat, k, chunk_of_k(k)),
                budget,
                context=f"remat {remat}, batch {rows} rows over {shards} batch shards",
            )
        except AutotuneError:
            return None

    def reference(k: int) -> int:  # whole where a minibatch holds no more than the reference
        return 0 if tokens // k <= REFERENCE_CHUNK else REFERENCE_CHUNK

    for remat in remats:
        if cfg.model.loss_chunk != "auto":
            search, chunk_of_k = smallest_k(remat, lambda k: cfg.model.loss_chunk), None
        else:  # the whole minibatch's loss at the smallest k it fits, else grown from the reference
            search, chunk_of_k = smallest_k(remat, lambda k: 0), reference
            if search is None and tokens // ks[0] > REFERENCE_CHUNK:  # else the same programs
                search = smallest_k(remat, reference)
            else:
                chunk_of_k = None
        if search is None:
            continue
        k = search.accum_steps
        chunk = cfg.model.loss_chunk if cfg.model.loss_chunk != "auto" else 0
        chosen = search.table[k]
        if chunk_of_k is not None:
            chunk = chunk_of_k(k)
            if chunk:
                grow = functools.partial(bytes_at, remat, k)
                chunk, chosen = _grow_chunk(tokens // k, budget, chosen, per_token, grow)
        resolved = _with(cfg, remat=remat, loss_chunk=chunk, accum_steps=k)
        return resolved, SettingsResult(
            accum_steps=k,
            remat=remat,
            loss_chunk=chunk,
            bytes=chosen,
            budget_bytes=int(budget),
            whole_chunk=tokens // k,
            tried=tuple(tried),
            k_search=search,
            method=getattr(measure, "method", "injected measure"),
            logit_bytes=int(min(chunk or tokens // k, tokens // k) * per_token),
        )
    raise AutotuneError(
        f"remat / accum_steps = auto: no remat policy ({', '.join(remats)}) fits the budget of "
        f"{format_bytes(budget)} per device at any k ({', '.join(map(str, ks))}): "
        + ", ".join(
            f"{r['remat']} k={r['k']} loss_chunk={r['loss_chunk'] or 'whole'}: "
            f"{format_bytes(r['bytes'])}"
            for r in tried
        )
        + "; raise trainer.memory_budget_gib, shorten data.seq_len, or use more devices"
    )


def _grow_chunk(whole: int, budget: float, ref_bytes: int, per_token: float, bytes_at):
    """(chunk, bytes): the largest loss chunk that fits, from the reference's `ref_bytes` up
    (module docstring, step 3); chunk 0 for the whole minibatch. `bytes_at(chunk)` measures."""
    cands = chunk_candidates(whole, REFERENCE_CHUNK)
    start = largest_fitting_chunk(cands, REFERENCE_CHUNK, budget - ref_bytes, per_token)
    for c in cands[cands.index(start) :] if start in cands else []:
        if c == REFERENCE_CHUNK:
            break
        value = 0 if c == whole else c
        b = bytes_at(value)
        if b <= budget:
            return value, b
    return REFERENCE_CHUNK, ref_bytes
