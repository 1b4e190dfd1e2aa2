"""Weighted mixtures: the stated rule held exactly (a reference simulation of the smooth
weighted round robin over every sample), 0.5/0.3/0.2 within 1 % over 1,000 sequences, resume
bit-identical, the run record covering each component and its weight, bad specs one line."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from trn_accum.config import drift
from trn_accum.config.files import ConfigError
from trn_accum.config.load import config_from_dict, config_to_dict
from trn_accum.data.datasets import DataError, MixtureDataset, make_dataset, step_metrics
from trn_accum.data.mixture import MAX_WINDOW, Schedule, window_counts

VOCAB = 400


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def write_mmidx(prefix: str, docs: list[np.ndarray]) -> str:
    """A Megatron .bin/.idx pair of uint16 `docs`, one sequence per document."""
    lengths = np.asarray([d.size for d in docs], np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1] * 2])
    with open(prefix + ".bin", "wb") as f:
        f.write(np.concatenate(docs).astype(np.uint16).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(docs), len(docs) + 1))
        f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes())
        f.write(np.arange(len(docs) + 1, dtype=np.int64).tobytes())
    return prefix


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Three corpora whose ids tell them apart: component k holds ids 100k+1 .. 100k+99; the
    third is small (it wraps within a few steps)."""
    root = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(0)
    out = []
    for k, n_docs in enumerate((60, 40, 6)):
        docs = [
            rng.integers(100 * k + 1, 100 * k + 100, rng.integers(5, 30)) for _ in range(n_docs)
        ]
        out.append(write_mmidx(str(root / f"c{k}"), docs))
    return out


def _spec(corpora, weights=(0.5, 0.3, 0.2)):
    names = ("web", "code", "math")
    return [
        {"path": p, "kind": "megatron", "weight": w, "name": n}
        for p, w, n in zip(corpora, weights, names, strict=True)
    ]


def _mix(corpora, weights=(0.5, 0.3, 0.2), batch=8, seed=0) -> MixtureDataset:
    return make_dataset(
        "mixture",
        seq_len=8,
        batch_size=batch,
        vocab_size=VOCAB,
        seed=seed,
        mixture=_spec(corpora, weights),
    )


def reference_components(counts: list[int], n: int) -> list[int]:
    """The component of each of the first n samples, by the stated rule, simulated sample by
    sample: credits += counts, the largest (earliest on ties) is taken, it gives back sum."""
    q, credit, out = sum(counts), [0] * len(counts), []
    for _ in range(n):
        credit = [c + a for c, a in zip(credit, counts, strict=True)]
        k = max(range(len(credit)), key=lambda i: (credit[i], -i))
        credit[k] -= q
        out.append(k)
    return out


def test_three_components_draw_exactly_per_the_rule(corpora):
    ds = _mix(corpora)
    assert ds.schedule.window == 10 and ds.schedule.counts.tolist() == [5, 3, 2]
    steps = 1000 // ds.batch_size
    want = reference_components([5, 3, 2], 1000)
    drawn = np.zeros(3, int)
    for s in range(steps):
        counts = ds.step_counts(s)
        per_step = [counts[n]["sequences"] for n in ds.names]
        ref = want[s * ds.batch_size : (s + 1) * ds.batch_size]
        assert per_step == [ref.count(k) for k in range(3)]
        rows = ds.rows(s, np.arange(ds.batch_size))
        first = rows["input_ids"][:, 0]
        assert ((first - 1) // 100).tolist() == ref  # each row from its component's corpus
        drawn += per_step
    assert drawn.tolist() == [500, 300, 200]
    shares = drawn / drawn.sum()
    assert np.all(np.abs(shares - [0.5, 0.3, 0.2]) <= 0.01)


def test_every_window_exact_and_prefixes_close_for_awkward_weights():
    sched = Schedule([1 / 3, 1 / 3, 1 / 3, 0.001])
    a, q = sched.counts, sched.window
    assert q == MAX_WINDOW and a.sum() == q
    assert window_counts([2, 1]) == (pytest.approx(np.asarray([2, 1])), 3)
    comp, _ = sched.locate(np.arange(3 * q))
    for w in range(3):
        assert np.bincount(comp[w * q : (w + 1) * q], minlength=4).tolist() == a.tolist()
    n = np.arange(1, q + 1)
    for k in range(4):
        prefix = np.cumsum(comp[:q] == k)
        assert np.max(np.abs(prefix - n * a[k] / q)) < 2
    assert sched.drawn(q + 5).tolist() == (a + np.bincount(comp[:5], minlength=4)).tolist()


def test_component_samples_are_each_corpus_stream(corpora):
    """A component's m-th sample is sample m of that corpus's own dataset (same seed)."""
    ds = _mix(corpora, seed=4)
    comp, local = ds.schedule.locate(np.arange(3 * ds.batch_size, 4 * ds.batch_size))
    rows = ds.rows(3, np.arange(ds.batch_size))
    for k, part in enumerate(ds.parts):
        sel = comp == k
        alone = part.read_windows(part.sample_ids(local[sel]))
        np.testing.assert_array_equal(rows["input_ids"][sel], alone[:, :-1])


def test_resume_mid_mixture_is_bit_identical(corpora):
    """Steps 6..19 from a fresh dataset (a restarted process) equal the uninterrupted run's,
    across the small component's epoch wraps, and any split of the rows between processes."""
    run = _mix(corpora, seed=7)
    straight = [run.rows(s, np.arange(8)) for s in range(20)]
    resumed = _mix(corpora, seed=7)
    for s in range(6, 20):
        halves = [resumed.rows(s, np.arange(4)), resumed.rows(s, np.arange(4, 8))]
        for key in straight[s]:
            np.testing.assert_array_equal(
                np.concatenate([h[key] for h in halves]), straight[s][key]
            )
    assert any(resumed.step_counts(s)["math"]["epoch"] >= 1 for s in range(20))
    other = _mix(corpora, seed=8).rows(6, np.arange(8))["input_ids"]
    assert not np.array_equal(other, straight[6]["input_ids"])


def test_step_metrics_tokens_and_epochs(corpora):
    ds = _mix(corpora)
    m = step_metrics(ds, 0)
    rows = ds.rows(0, np.arange(8))
    comp = (rows["input_ids"][:, 0] - 1) // 100
    for k, name in enumerate(ds.names):
        assert m[f"data_tokens/{name}"] == rows["target_mask"][comp == k].sum()
    assert not any(key.startswith("data_epoch/") for key in m)
    late = next(s for s in range(50) if ds.step_counts(s)["math"]["epoch"] >= 1)
    assert step_metrics(ds, late)["data_epoch/math"] == ds.step_counts(late)["math"]["epoch"]


def _cfg(corpora, weights=(0.5, 0.3, 0.2), kind="mixture"):
    return config_from_dict(
        {
            "model": {"max_seq_len": 8, "vocab_size": VOCAB},
            "data": {"kind": kind, "seq_len": 8, "mixture": _spec(corpora, weights)},
        }
    )


def test_run_record_covers_each_component_and_weight(corpora):
    """A resumed run with another weight is refused in one line unless allowed."""
    defaults = drift.run_record(config_to_dict(config_from_dict({})), None)  # as the loop
    records = []
    for w in ((0.5, 0.3, 0.2), (0.4, 0.4, 0.2)):
        cfg = _cfg(corpora, w)
        ds = _mix(corpora, w)
        records.append(drift.run_record(config_to_dict(cfg), ds.fingerprint))
    assert "w=0.3" in records[0]["data"]["fingerprint"]
    changes = drift.trajectory_changes(records[0], records[1], defaults)
    assert set(changes) == {"data.mixture", "data.fingerprint"}
    with pytest.raises(drift.ConfigDriftError) as e:
        drift.check_drift(changes, set(), run_dir="/r", step=5, record="config.json")
    assert "--allow-config-change" in _one_line(e)
    allowed = drift.check_allowed_keys(["data"], defaults)
    drift.check_drift(changes, allowed, run_dir="/r", step=5, record="config.json")
    same = drift.trajectory_changes(records[0], records[0], defaults)
    assert same == {}


@pytest.mark.parametrize(
    "weight,words",
    [(0, "must be a finite number > 0"), (-1, "> 0"), (math.nan, "> 0"), (True, "> 0")],
)
def test_bad_weight_one_line(corpora, weight, words):
    with pytest.raises(ConfigError) as e:
        _cfg(corpora, (0.5, weight, 0.2))
    assert words in _one_line(e) and "data.mixture[1].weight" in str(e.value)


def test_bad_specs_one_line(corpora, tmp_path):
    with pytest.raises(ConfigError) as e:
        _cfg(corpora, kind="megatron")
    assert 'data.kind = "mixture"' in _one_line(e)
    with pytest.raises(ConfigError) as e:
        config_from_dict({"data": {"kind": "mixture"}})
    assert "non-empty data.mixture" in _one_line(e)
    small = write_mmidx(str(tmp_path / "tiny"), [np.arange(1, 6)])
    spec = [{"path": corpora[0], "kind": "megatron", "weight": 1}, {"path": small, "weight": 1}]
    spec[1]["kind"] = "megatron"
    with pytest.raises(DataError) as e:
        make_dataset("mixture", seq_len=8, batch_size=2, vocab_size=VOCAB, mixture=spec)
    assert "holds 5 tokens, fewer than one sequence" in _one_line(e)
