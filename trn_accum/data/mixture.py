"""`MixtureDataset`: several corpora drawn in fixed proportions, each with a weight.

    [data]
    kind = "mixture"
    mixture = [
      {path = "/data/web_text_document", kind = "megatron", weight = 0.5},
      {path = "/data/code", weight = 0.3},                      # kind "tokens" by default
      {path = "/data/math-hf", kind = "hf", weight = 0.2, name = "math"},
    ]

The rule. Weights are normalized to sum 1 and written as integer counts ``a_k`` of a window
of ``Q`` samples: ``Q`` is the least common denominator of the normalized weights read as
the decimals written (0.5/0.3/0.2 -> Q = 10, a = 5, 3, 2); when that exceeds `MAX_WINDOW`,
``Q = MAX_WINDOW`` and ``a`` is its largest-remainder apportionment (ties to the earlier
component). Sample ``i`` of the stream (row ``r`` of step ``s`` is ``i = s * B + r``) comes
from component ``pattern[i mod Q]``, where ``pattern`` is the smooth weighted round robin
over ``a``: position ``j`` adds ``a_k`` to every component's credit, takes the component with
the most credit (the earliest on a tie) and takes ``Q`` from its credit. So every aligned
window of ``Q`` samples holds exactly ``a_k`` samples of component ``k``, spread evenly within
it, and a step of ``B`` rows draws ``C_k((s + 1) B) - C_k(s B)`` from component ``k``, where
``C_k(n) = (n // Q) a_k + (pattern[:n mod Q] == k).sum()``.

Component ``k``'s ``m``-th sample (``m = (i // Q) a_k + `` its rank within the window) is
sample ``m`` of that corpus's own endless stream (`TokenDataset`: its windows in an order
permuted per epoch with ``(data.seed, epoch)``; epoch ``m // windows``), so a step's batch
depends only on the seed and the step, as for one corpus, and a resumed run is bit-identical.
Eval rows take the same pattern over each component's held-out windows.

The schedule is our own rather than Grain's ``MapDataset.mix``, which is also a closed form
(index -> component and key) with whole windows exact: Grain scales the weights so that the
smallest is 100 and truncates (0.35/0.33/0.32 mixes as 109/103/100, i.e. 0.3494/0.3301/
0.3205), where this rule keeps the weights as written; its mix ends at the first exhausted
component unless each is repeated, where here each component wraps into its own seeded epochs
(the held-out split and per-epoch order `TokenDataset` already gives); and it would add a
dependency for what is some forty lines here. Resume needs no iterator state either way: the
rows of a step follow from ``(seed, step)``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from trn_accum.data.batches import assemble, check_common, check_rows, check_split
from trn_accum.data.token_dataset import TokenDataset
from trn_accum.data.tokens import DataError

MAX_WINDOW = 1 << 16
COMPONENT_KINDS = ("tokens", "megatron", "hf")
COMPONENT_KEYS = ("path", "weight", "kind", "name")


def component_specs(entries: Any) -> list[dict[str, Any]]:
    """The `data.mixture` tables, checked and completed (kind "tokens", name from the path).
    DataError, one line, for a malformed entry, a weight <= 0 or NaN, or a name used twice."""
    if not isinstance(entries, list) or len(entries) < 1:
        raise DataError(
            f"data.mixture = {entries!r}: must be a non-empty list of tables "
            f'{{path = "...", weight = 0.5, kind = "tokens"|"megatron"|"hf"}}'
        )
    out = []
    for i, e in enumerate(entries):
        where = f"data.mixture[{i}]"
        if not isinstance(e, Mapping):
            raise DataError(f"{where} = {e!r}: must be a table {{path = ..., weight = ...}}")
        if unknown := sorted(set(e) - set(COMPONENT_KEYS)):
            raise DataError(f"{where} has unknown key {unknown[0]!r}; allowed: {COMPONENT_KEYS}")
        path, weight, kind = e.get("path"), e.get("weight"), e.get("kind", "tokens")
        if not isinstance(path, str) or not path:
            raise DataError(f"{where}.path = {path!r}: must name the corpus (a non-empty string)")
        ok = isinstance(weight, int | float) and not isinstance(weight, bool)
        if not ok or not math.isfinite(weight) or weight <= 0:
            raise DataError(
                f"{where}.weight = {weight!r} ({path}): must be a finite number > 0; leave the "
                f"corpus out of data.mixture to draw nothing from it"
            )
        if kind not in COMPONENT_KINDS:
            raise DataError(f"{where}.kind = {kind!r}: must be one of {COMPONENT_KINDS}")
        name = e.get("name", os.path.basename(path.rstrip("/")) or path)
        if not isinstance(name, str) or not name:
            raise DataError(f"{where}.name = {name!r}: must be a non-empty string")
        out.append({"path": path, "weight": weight, "kind": kind, "name": name})
    names = [c["name"] for c in out]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise DataError(
            f"data.mixture names the component {dup[0]!r} twice: give each a distinct name "
            f'(name = "...")'
        )
    return out


def window_counts(weights: Sequence[float]) -> tuple[np.ndarray, int]:
    """(a: int64 samples of each component per window, Q: the window), per the module rule."""
    fr = [Fraction(repr(float(w))) for w in weights]
    shares = [f / sum(fr) for f in fr]
    q = math.lcm(*(s.denominator for s in shares))
    if q <= MAX_WINDOW:
        return np.asarray([int(s * q) for s in shares], np.int64), q
    q = MAX_WINDOW
    exact = [s * q for s in shares]
    a = [math.floor(x) for x in exact]
    order = sorted(range(len(a)), key=lambda k: (-(exact[k] - a[k]), k))
    for k in order[: q - sum(a)]:
        a[k] += 1
    return np.asarray(a, np.int64), q


def smooth_pattern(a: np.ndarray, q: int) -> np.ndarray:
    """The smooth weighted round robin over counts `a` (summing to `q`): int64 [q]."""
    credit = [0] * len(a)
    counts = [int(x) for x in a]
    out = np.empty(q, np.int64)
    for j in range(q):
        credit = [c + n for c, n in zip(credit, counts, strict=True)]
        k = max(range(len(credit)), key=lambda i: (credit[i], -i))
        credit[k] -= q
        out[j] = k
    return out


class Schedule:
    """Which component, and which of its samples, each sample of the mixture is."""

    def __init__(self, weights: Sequence[float]):
        self.counts, self.window = window_counts(weights)
        if not self.counts.all():
            k = int(np.argmin(self.counts))
            raise DataError(
                f"data.mixture weight {weights[k]!r} is below 1/{MAX_WINDOW} of the total "
                f"({sum(weights)!r}): raise it or leave that component out"
            )
        self.pattern = smooth_pattern(self.counts, self.window)
        ranks = np.zeros(self.window, np.int64)
        for k in range(self.counts.size):
            sel = self.pattern == k
            ranks[sel] = np.arange(int(sel.sum()))
        self.ranks = ranks

    def locate(self, sample: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(component, that component's sample index) of each mixture sample (int64)."""
        sample = np.asarray(sample, np.int64)
        pos = sample % self.window
        comp = self.pattern[pos]
        return comp, (sample // self.window) * self.counts[comp] + self.ranks[pos]

    def drawn(self, n: int) -> np.ndarray:
        """C_k(n): the samples each component gave to the first `n` of the mixture."""
        full, rest = divmod(int(n), self.window)
        return full * self.counts + np.bincount(self.pattern[:rest], minlength=self.counts.size)


class MixtureDataset:
    """Rows of global batches drawn from `parts` (one `TokenDataset` each, built with this
    seq_len, batch size and seed) per `Schedule(weights)`."""

    def __init__(self, parts: Sequence[TokenDataset], specs: Sequence[Mapping[str, Any]]):
        if len(parts) != len(specs) or not parts:
            raise DataError("a mixture needs one spec per component and at least one component")
        first = parts[0]
        check_common(first.seq_len, first.batch_size, None)
        self.parts = list(parts)
        self.specs = [dict(s) for s in specs]
        self.names = [s["name"] for s in self.specs]
        self.seq_len, self.batch_size = first.seq_len, first.batch_size
        self.vocab_size = first.vocab_size
        self.schedule = Schedule([s["weight"] for s in self.specs])

    @property
    def fingerprint(self) -> str:
        """Each component's name, kind, weight and data fingerprint, in order (one line)."""
        return "; ".join(
            f"{s['name']} {s['kind']} w={s['weight']!r} {p.fingerprint}"
            for s, p in zip(self.specs, self.parts, strict=True)
        )

    def rows(
        self, step: int, row_indices: np.ndarray, split: str = "train"
    ) -> dict[str, np.ndarray]:
        """The given rows (indices into the global batch of `step`) as int32/float32 [n, S]."""
        check_split(split)
        rows = check_rows(row_indices, self.batch_size)
        comp, local = self.schedule.locate(int(step) * self.batch_size + rows)
        windows = np.empty((rows.size, self.seq_len + 1), np.int64)
        lengths = np.empty(rows.size, np.int64)
        where = f"train step {step + 1}" if split == "train" else f"eval batch {step}"
        for k, part in enumerate(self.parts):
            sel = comp == k
            if sel.any():
                ids = part.sample_ids(local[sel], split)
                windows[sel] = part.read_windows(ids, split)
                lengths[sel] = part.window_lengths(ids, split)
                part.check_windows(windows[sel], rows[sel], f"{where} ({self.names[k]})")
        return assemble(windows, lengths)

    def step_counts(self, step: int) -> dict[str, dict[str, int]]:
        """Per component name: the sequences, the target tokens (real, unpadded) and the epoch
        (of its last sample) the whole global batch of train step `step` draws from it."""
        b = self.batch_size
        comp, local = self.schedule.locate(np.arange(int(step) * b, (int(step) + 1) * b))
        out = {}
        for k, part in enumerate(self.parts):
            m = local[comp == k]
            lengths = part.window_lengths(part.sample_ids(m)) if m.size else m
            epoch = int(m.max()) // part.num_train_windows if m.size else -1
            out[self.names[k]] = {
                "sequences": int(m.size),
                "tokens": int(np.maximum(lengths - 1, 0).sum()),
                "epoch": epoch,
            }
        return out

    def step_metrics(self, step: int) -> dict[str, float]:
        """`step_counts` as flat metrics.jsonl fields: ``data_tokens/NAME`` and, once a
        component has wrapped, ``data_epoch/NAME``."""
        out: dict[str, float] = {}
        for name, c in self.step_counts(step).items():
            out[f"data_tokens/{name}"] = c["tokens"]
            if c["epoch"] > 0:
                out[f"data_epoch/{name}"] = c["epoch"]
        return out
