"""Neuron helpers: preflight on real compiled programs, env, PRNG, peak FLOP/s, detection."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.neuron import platform as neuron
from trn_accum.neuron.platform import configure_prng, neuron_env, peak_flops_per_device
from trn_accum.neuron.preflight import BLOCKER, WARNING, blockers, format_findings, preflight

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
X = jnp.ones((4, 4), jnp.float32)


def _hlo(f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


def _rules(findings, severity=None):
    return sorted({f.rule for f in findings if severity is None or f.severity == severity})


# ---------------------------------------------------------------------- programs


def _cond(x):
    return lax.cond(x.sum() > 0, lambda y: y * 2, lambda y: y - 1, x)


def _debug_print(x):
    jax.debug.print("sum={s}", s=x.sum())
    return x * 2


def _pure_callback(x):
    return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _data_dependent_while(x):
    def cond(c):
        return c[1] < c[0].sum()

    return lax.while_loop(cond, lambda c: (c[0] * 1.01, c[1] + 1.0), (x, 0.0))[0]


def _traced_bound_fori(x, n):
    return lax.fori_loop(0, n, lambda i, c: c * 1.5, x)


def _complex(x):
    return jnp.abs(jnp.fft.fft(x))


def _integer_dot(x):
    xi = x.astype(jnp.int32)
    return (xi @ xi).astype(jnp.float32)


def _scan(x):
    return lax.scan(lambda c, _: (jnp.sin(c) @ c, None), x, None, length=5)[0]


def _scan_stacking(x):
    return lax.scan(lambda c, _: (jnp.sin(c) @ c, c.sum(0)), x, None, length=5)


def _static_fori(x):
    return lax.fori_loop(0, 3, lambda i, c: c * 1.5, x)


def _normal(x, key):
    return x + jax.random.normal(jax.random.fold_in(key, 3), x.shape)


@pytest.mark.parametrize(
    "fn,args,expected",
    [
        (_cond, (X,), ["conditional"]),
        (_debug_print, (X,), ["host-callback"]),
        (_pure_callback, (X,), ["host-callback"]),
        (_data_dependent_while, (X,), ["dynamic-loop"]),
        (_traced_bound_fori, (X, jnp.int32(3)), ["dynamic-loop"]),
        (_complex, (X,), ["complex"]),
        (_integer_dot, (X,), ["integer-dot"]),
        (_scan, (X,), []),
        (_static_fori, (X,), []),
    ],
    ids=lambda v: getattr(v, "__name__", None) if callable(v) else None,
)
def test_blockers_of_real_programs(fn, args, expected):
    findings = preflight(_hlo(fn, *args), prng_impl="threefry2x32")
    assert _rules(findings, BLOCKER) == expected, format_findings(findings)
    for f in blockers(findings):
        assert f.source and f.source.startswith(f"jit({fn.__name__})"), f


def test_float64_under_x64():
    with jax.enable_x64(True):
        text = _hlo(lambda x: (x.astype(jnp.float64) * 2).astype(jnp.float32), X)
    findings = preflight(text, prng_impl="threefry2x32")
    assert _rules(findings, BLOCKER) == ["float64"]
    assert preflight(_hlo(lambda x: x * 2, X), prng_impl="threefry2x32") == []


def test_scan_stacking_outputs_is_a_warning_only():
    findings = preflight(_hlo(_scan_stacking, X), prng_impl="threefry2x32")
    assert [(f.severity, f.rule) for f in findings] == [(WARNING, "dus-in-loop")]
    assert "dynamic_update_slice" in findings[0].source


def test_threefry_warned_only_when_rbg_is_configured():
    text = _hlo(_normal, X, jax.random.key(0, impl="threefry2x32"))
    assert preflight(text, prng_impl="threefry2x32") == []
    findings = preflight(text, prng_impl="rbg")
    assert [(f.severity, f.rule) for f in findings] == [(WARNING, "threefry")]
    # an rbg key: random bits come from rng-bit-generator; its fold_in still uses Threefry
    rbg_key = jax.random.key(0, impl="rbg")
    draw = jax.jit(lambda x, k: x + jax.random.normal(k, x.shape))
    assert "rng_bit_generator" in draw.lower(X, rbg_key).as_text()  # XLA:CPU expands it (Philox)
    assert preflight(draw.lower(X, rbg_key).compile().as_text(), prng_impl="rbg") == []
    rbg_fold = preflight(_hlo(_normal, X, rbg_key), prng_impl="rbg")
    assert [(f.severity, f.rule) for f in rbg_fold] == [(WARNING, "threefry")]


def _strip_backend_configs(text):
    """HLO text without its `, backend_config={...}` JSON attributes (any key order)."""
    out, pos, key = [], 0, ", backend_config="
    while (i := text.find(key, pos)) >= 0:
        _, end = json.JSONDecoder().raw_decode(text, i + len(key))
        out.append(text[pos:i])
        pos = end
    return "".join(out) + text[pos:]


def test_static_loops_recognised_without_xla_annotation():
    """A loop in scan shape (counter from a constant, +1, compared with a constant) is static
    even when the HLO carries no known_trip_count; a data-dependent bound stays a blocker."""
    scan_text = _hlo(_scan, X)
    assert "known_trip_count" in scan_text
    bare = _strip_backend_configs(scan_text)
    assert "known_trip_count" not in bare and " while(" in bare
    assert blockers(preflight(bare, prng_impl="threefry2x32")) == []
    wl = _strip_backend_configs(_hlo(_data_dependent_while, X))
    assert _rules(preflight(wl, prng_impl="threefry2x32"), BLOCKER) == ["dynamic-loop"]
    fori = _strip_backend_configs(_hlo(_traced_bound_fori, X, jnp.int32(3)))
    assert _rules(preflight(fori, prng_impl="threefry2x32"), BLOCKER) == ["dynamic-loop"]


def test_clean_mlp_train_step_with_scan_accumulation_has_no_blocker():
    """Sharded MLP step: 4 minibatches in a lax.scan, weighted by token counts, AdamW with
    clipping, non-finite steps skipped with jnp.where (no lax.cond)."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    k, b, d, h = 4, 32, 16, 32
    p_sh = {"w1": NamedSharding(mesh, P("fsdp", None)), "w2": NamedSharding(mesh, P(None, "fsdp"))}
    params = {
        "w1": jax.ShapeDtypeStruct((d, h), jnp.float32, sharding=p_sh["w1"]),
        "w2": jax.ShapeDtypeStruct((h, d), jnp.float32, sharding=p_sh["w2"]),
    }
    batch_sh = NamedSharding(mesh, P(("data", "fsdp")))
    batch = {
        "x": jax.ShapeDtypeStruct((b, d), jnp.float32, sharding=batch_sh),
        "mask": jax.ShapeDtypeStruct((b,), jnp.float32, sharding=batch_sh),
    }
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    def loss_fn(p, mb):
        y = jnp.tanh(mb["x"] @ p["w1"]) @ p["w2"]
        per = ((y - mb["x"]) ** 2).mean(-1)
        return (per * mb["mask"]).sum() / jnp.maximum(mb["mask"].sum(), 1.0)

    def step(p, o, bt):
        mbs = jax.tree.map(lambda a: a.reshape(b // k, k, *a.shape[1:]).swapaxes(0, 1), bt)

        def body(acc, mb):
            loss, g = jax.value_and_grad(loss_fn)(p, mb)
            w = mb["mask"].sum()
            return (acc[0] + w * loss, jax.tree.map(lambda a, gi: a + w * gi, acc[1], g)), None

        zeros = jax.tree.map(jnp.zeros_like, p)
        (tot, gsum), _ = lax.scan(body, (jnp.float32(0), zeros), mbs)
        wsum = jnp.maximum(bt["mask"].sum(), 1.0)
        grads = jax.tree.map(lambda g: g / wsum, gsum)
        updates, new_o = opt.update(grads, o, p)
        new_p = optax.apply_updates(p, updates)
        finite = jnp.isfinite(optax.tree.norm(grads))
        new_p = jax.tree.map(lambda a, b_: jnp.where(finite, a, b_), new_p, p)
        return new_p, new_o, tot / wsum

    o_abs = jax.eval_shape(opt.init, params)
    text = jax.jit(step, donate_argnums=(0, 1)).lower(params, o_abs, batch).compile().as_text()
    findings = preflight(text, prng_impl="rbg")
    assert blockers(findings) == [], format_findings(findings)
    assert findings == [], format_findings(findings)
    assert " while(" in text  # the accumulation loop stayed rolled


def test_finding_text_and_format():
    findings = preflight(_hlo(_cond, X), prng_impl="threefry2x32")
    line = format_findings(findings)
    assert line.startswith("blocker: conditional: ") and "jnp.where" in line
    assert "\n" not in line
    assert format_findings([]) == "no Neuron preflight findings"


# ---------------------------------------------------------------------- env, PRNG, FLOP/s


def test_neuron_env():
    env = neuron_env()
    assert env["NEURON_CC_FLAGS"] == (
        "--target=trn2 --model-type=transformer --distribution-strategy=llm-training -O1"
    )
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert env["NEURON_COMPILE_CACHE_URL"] == neuron.DEFAULT_COMPILE_CACHE
    assert env["NEURON_RUN_TRIVIAL_COMPUTATION_ON_CPU"] == "1"
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS" not in env
    env1 = neuron_env(
        1,
        compile_cache="s3://bucket/cache",
        extra_cc_flags=["--auto-cast=none"],
        efa=False,
        root_comm_id="10.0.0.1:62182",
        visible_cores="0-31",
    )
    assert env1["NEURON_LOGICAL_NC_CONFIG"] == "1"
    assert env1["NEURON_CC_FLAGS"].endswith(" -O1 --auto-cast=none")
    assert env1["NEURON_RT_ROOT_COMM_ID"] == "10.0.0.1:62182"
    assert env1["NEURON_RT_VISIBLE_CORES"] == "0-31" and "FI_PROVIDER" not in env1
    assert "NEURON_COMPILE_CACHE_URL" not in neuron_env(compile_cache=None)
    with pytest.raises(ValueError, match="lnc=4"):
        neuron_env(4)
    with pytest.raises(ValueError, match="--internal-foo"):
        neuron_env(extra_cc_flags=["--internal-foo"])


def test_apply_env_keeps_user_values(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    applied = neuron.apply_env({"NEURON_LOGICAL_NC_CONFIG": "2", "NEURON_CC_FLAGS": "-O1"})
    assert applied == {"NEURON_CC_FLAGS": "-O1"}
    assert os.environ["NEURON_LOGICAL_NC_CONFIG"] == "1"
    assert neuron.apply_env({"NEURON_LOGICAL_NC_CONFIG": "2"}, overwrite=True)
    assert os.environ["NEURON_LOGICAL_NC_CONFIG"] == "2"


def test_peak_flops_per_device(monkeypatch):
    assert peak_flops_per_device() is None  # this backend is CPU
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert peak_flops_per_device("neuron") == 83.375e12
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    assert peak_flops_per_device("neuron", 2) == 166.75e12
    assert peak_flops_per_device("trn2", 1) == 83.375e12
    assert peak_flops_per_device("neuron") * 64 == pytest.approx(667e12 * 16)  # one instance
    assert peak_flops_per_device("cpu") is None and peak_flops_per_device("gpu", 2) is None


def test_configure_prng():
    before = jax.config.jax_default_prng_impl
    try:
        assert configure_prng("cpu") == before
        assert configure_prng() == before  # no Neuron here
        assert configure_prng("neuron") == "rbg"
        assert jax.random.key(0).dtype == jax.random.key(0, impl="rbg").dtype
    finally:
        jax.config.update("jax_default_prng_impl", before)


# ---------------------------------------------------------------------- detection


def test_neuron_not_available_here():
    assert jax.default_backend() == "cpu"
    assert neuron.neuron_available() is False
    assert neuron.neuron_plugin_installed() is False


def test_detection_logic(monkeypatch):
    monkeypatch.setattr(neuron, "neuron_plugin_installed", lambda: True)
    monkeypatch.setattr(neuron.glob, "glob", lambda pattern: ["/dev/neuron0"])
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    before = jax.config.jax_platforms
    try:
        jax.config.update("jax_platforms", None)
        assert neuron.neuron_available() is True
        monkeypatch.setenv("JAX_PLATFORMS", "cpu")
        assert neuron.neuron_available() is False
        monkeypatch.setenv("JAX_PLATFORMS", "neuron,cpu")
        assert neuron.neuron_available() is True
        jax.config.update("jax_platforms", "cpu")  # the config wins over the environment
        assert neuron.neuron_available() is False
    finally:
        jax.config.update("jax_platforms", before)


def _fake_dist(root, name, version, entry_points=""):
    d = root / f"{name}-{version}.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if entry_points:
        (d / "entry_points.txt").write_text(entry_points)


def test_plugin_detection_from_installed_metadata(tmp_path, monkeypatch):
    placeholder = tmp_path / "a"
    placeholder.mkdir()
    _fake_dist(placeholder, "libneuronxla", "0.0.1")  # the PyPI placeholder
    monkeypatch.syspath_prepend(str(placeholder))
    assert neuron.neuron_plugin_installed() is False
    real = tmp_path / "b"
    real.mkdir()
    _fake_dist(real, "fake_neuron_plugin", "2.0", "[jax_plugins]\nneuron = fake_neuron_plugin\n")
    monkeypatch.syspath_prepend(str(real))
    assert neuron.neuron_plugin_installed() is True


def test_detection_initialises_no_backend():
    code = (
        "import trn_accum.neuron.platform as n\n"
        "from jax._src import xla_bridge\n"
        "assert n.neuron_available() is False\n"
        "assert not xla_bridge._backends, xla_bridge._backends\n"
        "print('OK')\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr[-2000:]


def test_one_lnc_setting_drives_compiler_and_runtime(monkeypatch):
    """NEURON_LOGICAL_NC_CONFIG is the setting; an explicit --lnc in NEURON_CC_FLAGS follows it
    (trn2_env rewrites it) and, set to another value by hand, is a one-line error."""
    assert neuron.cc_flags_lnc("--target=trn2 --lnc=1 -O1") == "1"
    assert neuron.cc_flags_lnc("--lnc 2") == "2" and neuron.cc_flags_lnc("-O1") is None
    assert neuron.lnc_setting({}) == 2
    assert neuron.lnc_setting({"NEURON_CC_FLAGS": "--lnc=1"}) == 1
    assert neuron.lnc_setting({"NEURON_LOGICAL_NC_CONFIG": "1", "NEURON_CC_FLAGS": "-O1"}) == 1
    with pytest.raises(
        ValueError, match=r"NEURON_LOGICAL_NC_CONFIG=2 but NEURON_CC_FLAGS has --lnc=1"
    ) as e:
        neuron.lnc_setting({"NEURON_LOGICAL_NC_CONFIG": "2", "NEURON_CC_FLAGS": "--lnc=1"})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="must be 1 or 2"):
        neuron.lnc_setting({"NEURON_LOGICAL_NC_CONFIG": "4"})
    env = neuron.trn2_env(
        {"NEURON_CC_FLAGS": "--target=trn2 --lnc=1", "NEURON_LOGICAL_NC_CONFIG": "1"}
    )
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "1" and "--lnc=1" in env["NEURON_CC_FLAGS"]
    env = neuron.trn2_env({"NEURON_CC_FLAGS": "--target=trn2 --lnc 1"})  # the flag decides
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "1"
    assert neuron.with_cc_lnc("-O1 --lnc=1 --lnc 1", 2) == "-O1 --lnc=2 --lnc 2"
    with pytest.raises(ValueError, match="--lnc=1 disagrees with lnc=2"):
        neuron_env(2, extra_cc_flags=["--lnc=1"])


@pytest.mark.parametrize(
    "flags",
    [
        "--lnc=1",
        "--lnc 1",
        "--logical-nc-config=1",
        "--logical-nc-config 1",
        "-lnc=1",
        "-lnc 1",
        "-O1 --logical-nc-config=1 --target=trn2",
    ],
)
def test_every_lnc_flag_spelling_is_read_and_rewritten(flags):
    assert neuron.cc_flags_lnc(flags) == "1"
    rewritten = neuron.with_cc_lnc(flags, 2)
    assert neuron.cc_flags_lnc(rewritten) == "2"
    assert rewritten.replace("2", "1", 1) == flags  # only the value changed
    # The compiler flag beside a disagreeing runtime variable is caught, whatever the spelling.
    env = {"NEURON_LOGICAL_NC_CONFIG": "2", "NEURON_CC_FLAGS": flags}
    with pytest.raises(
        ValueError, match="NEURON_LOGICAL_NC_CONFIG=2 but NEURON_CC_FLAGS has -"
    ) as e:
        neuron.lnc_setting(env)
    written = flags if not flags.startswith("-O1") else "--logical-nc-config=1"
    assert f"NEURON_CC_FLAGS has {written}:" in str(e.value)  # named as the user wrote it
    assert neuron.lnc_setting({"NEURON_CC_FLAGS": flags}) == 1


def test_lnc_flag_lookalikes_are_not_read():
    assert neuron.cc_flags_lnc("--lnc-extra=1 --xlnc=1 -lncx 1") is None
    assert neuron.with_cc_lnc("--model-type=transformer", 1) == "--model-type=transformer"


def test_peak_flops_reads_the_one_lnc_setting(monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.setenv("NEURON_CC_FLAGS", "--logical-nc-config=1")
    assert peak_flops_per_device("neuron") == 83.375e12  # the compiler flag alone sets LNC=1
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with pytest.raises(ValueError, match="must use the same logical NeuronCore size"):
        peak_flops_per_device("neuron")
