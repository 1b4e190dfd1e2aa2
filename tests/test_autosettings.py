"""model.remat / model.loss_chunk = "auto", chosen with k from memory (plan/autosettings.py):
the order (remat none first, smallest k, largest loss chunk) against injected measures, the
chunk sized from the memory left and confirmed by the measure, the config's values, the model's
refusal of an unresolved "auto", and the trainer's path to the compiled measure."""

from pathlib import Path

import pytest

from trn_accum.analysis.autotune import AutotuneError
from trn_accum.config.load import ConfigError, load_config
from trn_accum.plan import autosettings as auto

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "fuji-tiny.toml")
GIB = 2**30
# 64 rows per batch shard x 128 tokens = 8192 tokens per shard per step
BIG = ["data.global_batch=512", "data.seq_len=128", "trainer.memory_budget_gib=1.0"]
AUTO = ["trainer.accum_steps=auto", "model.remat=auto", "model.loss_chunk=auto"]


class Mesh:  # only .shape is read when a measure is injected
    shape = {"data": 4, "fsdp": 2, "model": 1}


class Model:
    """Bytes of a step: state + activations(remat) / k + one loss chunk's logits (exact at
    LOGIT_BYTES per logit: the analytic sizing then agrees with the measure), plus `extra`
    bytes at chunks above `spike_from` tokens (where the analytic sizing is too hopeful)."""

    def __init__(self, act, state=0.25 * GIB, extra=0, spike_from=None):
        self.act, self.state, self.extra, self.spike_from = act, state, extra, spike_from
        self.calls = []

    def __call__(self, cfg, k):
        m = cfg.model
        self.calls.append((m.remat, k, m.loss_chunk))
        tokens = (m.loss_chunk or 8192 // k) * 512 * auto.LOGIT_BYTES
        big = self.spike_from is not None and (m.loss_chunk or 8192 // k) > self.spike_from
        return int(self.state + self.act[m.remat] / k + tokens + (self.extra if big else 0))


def test_chunk_candidates_and_the_analytic_size():
    assert auto.chunk_candidates(8192, 1024) == [8192, 4096, 2048, 1024]
    assert auto.chunk_candidates(3000, 1024) == [3000, 1500]  # exact halves only
    assert auto.chunk_candidates(512, 1024) == [512]
    per_token = 100.0
    cands = [8192, 4096, 2048, 1024]
    assert auto.largest_fitting_chunk(cands, 1024, 7168 * per_token, per_token) == 8192
    assert auto.largest_fitting_chunk(cands, 1024, 7167 * per_token, per_token) == 4096
    assert auto.largest_fitting_chunk(cands, 1024, 0, per_token) == 1024


def test_remat_none_smallest_k_and_the_whole_loss_when_they_fit():
    cfg = load_config(TINY, BIG + AUTO)
    m = Model(
        {"none": 1.2 * GIB, "save_attention": 0.7 * GIB, "save_qkvo": 0.6 * GIB, "full": 0.2 * GIB}
    )
    new, r = auto.resolve(cfg, Mesh(), measure=m)
    # none, the whole minibatch's loss: k=1 1.45 GiB no, k=2 0.85 GiB + 4096 tokens' logits fits
    assert (r.remat, r.accum_steps, r.loss_chunk) == ("none", 2, 0)
    assert (new.model.remat, new.trainer.accum_steps, new.model.loss_chunk) == ("none", 2, 0)
    assert {c[0] for c in m.calls} == {"none"}  # the saving policies and full never compiled
    assert r.whole_chunk == 4096 and r.bytes <= r.budget_bytes == GIB
    assert {"remat": "none", "k": 2, "loss_chunk": 0, "bytes": r.bytes, "fits": True} in r.tried
    assert all(row["loss_chunk"] == 0 for row in r.tried)  # no chunked loss compiled
    assert r.logit_bytes == 4096 * 512 * auto.LOGIT_BYTES
    text = r.format()
    assert "chose remat = none, accum_steps = 2, loss_chunk = 0 (whole minibatch)" in text
    assert r.to_dict()["margin_bytes"] == GIB - r.bytes


def test_next_policy_only_when_none_fits_at_any_k():
    """The order: none, save_attention (no second attention forward), save_qkvo, full."""
    cfg = load_config(TINY, BIG + AUTO)
    sizes = {"none": 64 * GIB, "save_attention": 1.3 * GIB, "save_qkvo": 1.2 * GIB}
    m = Model({**sizes, "full": 0.2 * GIB})
    _, r = auto.resolve(cfg, Mesh(), measure=m)
    assert r.remat == "save_attention" and r.accum_steps == 2
    assert [c[0] for c in m.calls].count("save_qkvo") == 0
    m = Model({**sizes, "save_attention": 64 * GIB, "full": 0.2 * GIB})
    _, r = auto.resolve(cfg, Mesh(), measure=m)
    assert r.remat == "save_qkvo" and r.accum_steps == 2
    assert [c[0] for c in m.calls].count("full") == 0


def test_the_chunk_grows_as_far_as_the_memory_left_and_the_measure_agree():
    cfg = load_config(TINY, BIG + AUTO + ["trainer.accum_steps=1"])
    # k=1: 0.25 + 0.3 GiB + 1024 tokens' logits (5 MiB) leaves ~0.44 GiB: all 8192 tokens'
    # logits (40 MiB) fit by the arithmetic, but the measure finds 0.5 GiB more above 2048
    m = Model({"none": 0.3 * GIB}, extra=0.5 * GIB, spike_from=2048)
    _, r = auto.resolve(cfg, Mesh(), measure=m)
    assert r.loss_chunk == 2048
    # the whole loss first (no), the reference (yes), then down from the whole (cached in use)
    assert [c[2] for c in m.calls] == [0, 1024, 0, 4096, 2048]
    assert [row["fits"] for row in r.tried] == [False, True, False, False, True]


def test_set_values_are_kept():
    over = ["trainer.accum_steps=auto", "model.remat=full", "model.loss_chunk=auto"]
    cfg = load_config(TINY, BIG + over)
    m = Model({"none": 0.0, "save_attention": 0.0, "save_qkvo": 0.0, "full": 1.2 * GIB})
    _, r = auto.resolve(cfg, Mesh(), measure=m)
    assert r.remat == "full" and {c[0] for c in m.calls} == {"full"}
    over = ["trainer.accum_steps=4", "model.remat=auto", "model.loss_chunk=256"]
    cfg = load_config(TINY, BIG + over)
    m = Model({"none": 0.2 * GIB, "save_attention": 0.0, "save_qkvo": 0.0, "full": 0.0})
    new, r = auto.resolve(cfg, Mesh(), measure=m)
    assert (new.model.remat, new.trainer.accum_steps, new.model.loss_chunk) == ("none", 4, 256)
    assert m.calls == [("none", 4, 256)]


def test_nothing_fits_is_one_line_naming_every_policy():
    cfg = load_config(TINY, BIG + AUTO)
    m = Model({p: 64 * GIB for p in ("none", "save_attention", "save_qkvo", "full")})
    with pytest.raises(AutotuneError) as e:
        auto.resolve(cfg, Mesh(), measure=m)
    msg = str(e.value)
    assert "\n" not in msg and "none, save_attention, save_qkvo, full" in msg
    assert "memory_budget_gib" in msg


def test_config_values_and_the_model_refuses_an_unresolved_auto():
    import jax

    from trn_accum.model import fuji

    cfg = load_config(TINY, AUTO)
    assert (cfg.model.remat, cfg.model.loss_chunk) == ("auto", "auto")
    with pytest.raises(ConfigError, match=r'model.loss_chunk = -1: must be >= 0 .* or "auto"'):
        load_config(TINY, ["model.loss_chunk=-1"])
    with pytest.raises(ConfigError, match="model.remat = 'some'"):
        load_config(TINY, ["model.remat=some"])
    params = jax.eval_shape(fuji.init_params, cfg.model, jax.random.key(0))
    batch = {k: jax.ShapeDtypeStruct((2, 8), "int32") for k in ("input_ids", "target_labels")}
    batch["target_mask"] = jax.ShapeDtypeStruct((2, 8), "bool")
    with pytest.raises(ValueError, match='model.remat = "auto" is chosen before the step'):
        jax.eval_shape(lambda p, b: fuji.loss_fn(p, b, cfg.model), params, batch)


def test_loss_chunk_report():
    cfg = load_config(TINY, ["model.loss_chunk=100", "data.seq_len=64"])
    rep = auto.loss_chunk_report(cfg, Mesh(), rows_per_minibatch=4)  # 256 tokens per shard
    assert rep == {
        "loss_chunk": 100,
        "tokens_per_chunk": 100,
        "chunks_per_minibatch": 3,
        "logit_bytes_per_device": 100 * 512 * auto.LOGIT_BYTES,
    }
    cfg = load_config(TINY, ["model.loss_chunk=0"])
    assert auto.loss_chunk_report(cfg, Mesh(), 4)["tokens_per_chunk"] == 256


def test_the_trainer_resolves_every_auto_on_the_fit_checks_figure(monkeypatch):
    """Trainer.build's resolution reaches autok's compile (faked here: no compile) with each
    candidate's settings and the dry-run's figure (the target's estimate), not the backend's."""
    from trn_accum.plan import autok
    from trn_accum.train import step

    seen = []

    def fake(cfg, mesh, rows, figure):
        seen.append((cfg.model.remat, cfg.trainer.accum_steps, cfg.model.loss_chunk, figure))
        return (
            GIB // 2 if cfg.model.remat == "none" and cfg.trainer.accum_steps >= 2 else GIB,
            0.0,
        )

    monkeypatch.setattr(autok, "_compile_step_bytes", fake)
    cfg = load_config(TINY, AUTO + ["trainer.memory_budget_gib=0.75"])
    new, r = auto.resolve_for_run(cfg, step.make_mesh(cfg))
    assert (new.model.remat, new.trainer.accum_steps, new.model.loss_chunk) == ("none", 2, 0)
    assert {s[3] for s in seen} == {"target"} and {s[0] for s in seen} == {"none"}
    assert "chose remat = none, accum_steps = 2" in r.format()


def test_a_compiler_refusal_counts_at_the_bytes_it_asked(monkeypatch):
    """On a chip the compiler refuses a step too big instead of compiling it: the search reads
    the bytes it asked (a TPU's message) and goes on, on either figure; any other compile error
    is raised on CPU, and on an accelerator whose plugin takes no dump options the "target"
    figure is the backend's own footprint, said in the method."""
    from trn_accum.plan import autok

    oom = "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 20.41G of 15.75G hbm."

    class Program:
        lowered = "lowered"

        def __init__(self, message):
            self.message = message

        @property
        def compiled(self):
            raise RuntimeError(self.message)

    def refusing_partitioner(message):
        def compile_partitioned(lowered):
            raise RuntimeError(message)

        return compile_partitioned

    cfg = load_config(TINY, ["model.remat=none"])
    asked = round(20.41 * GIB)
    monkeypatch.setattr(autok.step_lib, "build_step", lambda *a, **k: Program(oom))
    monkeypatch.setattr(autok, "compile_partitioned", refusing_partitioner(oom))
    assert autok._compile_step_bytes(cfg, "mesh-a", 8, "compiled")[0] == asked
    assert autok._compile_step_bytes(cfg, "mesh-a", 8, "target")[0] == asked
    monkeypatch.setattr(autok.step_lib, "build_step", lambda *a, **k: Program("INTERNAL: boom"))
    with pytest.raises(RuntimeError, match="boom"):
        autok._compile_step_bytes(cfg, "mesh-b", 8, "compiled")
    # an accelerator whose plugin refuses the dump options: its own footprint (refused here)
    monkeypatch.setattr(autok, "compile_partitioned", refusing_partitioner("no option xla_dump"))
    with pytest.raises(RuntimeError, match="no option xla_dump"):  # on CPU: raised
        autok._compile_step_bytes(cfg, "mesh-c", 8, "target")
    monkeypatch.setattr(autok.jax, "default_backend", lambda: "neuron")
    monkeypatch.setattr(autok.step_lib, "build_step", lambda *a, **k: Program(oom))
    measure = autok.CompiledMemory(cfg, "mesh-d", batch_rows=8, depth="full")
    assert measure(1) == asked and measure.fell_back
    assert "its own footprint instead" in measure.method


def test_the_compiled_figure_is_the_compilers_peak_where_it_reports_one(monkeypatch):
    """`figure="compiled"` (and the "target" fallback on a plugin that takes no dump options)
    read `target_memory.backend_peak`: a TPU compile's own peak, which the chip's limit holds,
    not arguments + outputs - aliased + temporaries (docs/dry-run.md: the chip ran steps whose
    sum was above its memory); the sum where the analysis has no peak (XLA:CPU)."""
    import types

    from trn_accum.plan import autok

    parts = dict(argument=10 * GIB, output=10 * GIB, alias=10 * GIB, temp=6 * GIB)
    stats = {f"{k}_size_in_bytes": v for k, v in parts.items()}

    class Program:
        lowered = "lowered"

        def __init__(self, **extra):
            self.stats = types.SimpleNamespace(**stats, **extra)

        @property
        def compiled(self):
            return types.SimpleNamespace(memory_analysis=lambda: self.stats)

    cfg = load_config(TINY, ["model.remat=none"])
    peak = 13 * GIB
    monkeypatch.setattr(autok.step_lib, "build_step", lambda *a, **k: Program())
    assert autok._compile_step_bytes(cfg, "mesh-sum", 8, "compiled")[0] == 16 * GIB
    builds = lambda *a, **k: Program(peak_memory_in_bytes=peak)  # noqa: E731
    monkeypatch.setattr(autok.step_lib, "build_step", builds)
    assert autok._compile_step_bytes(cfg, "mesh-peak", 8, "compiled")[0] == peak

    def no_dump(lowered):
        raise RuntimeError("no option xla_dump")

    monkeypatch.setattr(autok, "compile_partitioned", no_dump)
    monkeypatch.setattr(autok.jax, "default_backend", lambda: "tpu")
    measure = autok.CompiledMemory(cfg, "mesh-fallback", batch_rows=8, depth="full")
    assert measure(1) == peak and measure.fell_back
