"""Peers table: our accumulation next to what users would write instead, same model, batch, mesh.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python benchmarks/peers.py
    python3 benchmarks/peers.py --config configs/calibration/proxy-tpu-v5e-l4.toml \
        --set trainer.accum_steps=8 --set model.remat=none --rounds 5 --json OUT.json

The first (also `make bench`'s, via benchmarks/report.py): the tiny Fuji (configs/fuji-tiny.toml,
float32 compute, mesh data 4 x fsdp 2, k 4); `--config`/`--set section.key=value` name another, k
its trainer.accum_steps (>= 2). Loss `fuji.loss_fn` with the config's model settings (remat,
attention, loss chunk), the trainer's optimizer and mesh, a synthetic unevenly padded batch of the
config's shape. Methods: full batch (`accumulate_gradients(steps=1)`); ours, reduce per_minibatch
/ once (`steps=k`, token-count weights, strided split: no data moves); contiguous scan (minibatch
i = rows [i B/k, (i+1) B/k), a `lax.scan`, mean of the minibatch means: AXLearn's and Levanter's
way); optax.MultiSteps(k). Two passes, lean enough for a 503 M-parameter model on a 16 GiB chip:

1. Gradient error, max over leaves of max |g - g_ref| / max |g_ref| (g_ref: the first method's
   that ran): per method a grads-only jitted (params, batch) -> gradients, run once, at most two
   gradient trees alive, each executable dropped after use; MultiSteps: k calls with an inner
   optimizer whose state keeps the accumulated gradient it is given.
2. Timing, round-robin (one step of each method a round, round 0 warms up, median over rounds)
   on one shared (params, opt_state) chain every method steps in turn (values differ per round,
   times do not): a jitted optimizer step (gradients, `tx.update`, `apply_updates`; params and
   optimizer state donated and returned, no gradients returned); MultiSteps k calls of a jitted
   step on host-sliced minibatches, its state (chain's optimizer state, zero accumulator) built
   before its turn and dropped after, untimed.

A compile or run refusal (the chip's RESOURCE_EXHAUSTED) is a row with "error" (first line) and
"refused_bytes" where named; ratios are then to the first method that ran (rows' "reference",
"grad_reference"). Columns: step time / reference, temporaries per device (the timed step's
`memory_analysis`; MultiSteps: one call), collectives of the split (the in-graph reshape, or
MultiSteps' slices, x k), gradient error. `--json PATH`: the result, with the command line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

# XLA:CPU can deadlock emulated devices' collectives: the concurrency-optimized scheduler orders
# them differently per device, and its thread pool (a thread a core unless PJRT_NPROC, read when
# the backend starts, says more) runs dry while collectives ready at once block it (the full batch
# step here, 2 cores: 8 runs of 10 hung; 16 threads: 0 of 6). Set here for this script; a
# process that starts JAX first (report.py) has it from its caller (the Makefile's bench lines).
_FLAGS = os.environ.get("XLA_FLAGS", "")
_CPU = os.environ.get("JAX_PLATFORMS", "").startswith("cpu") or "device_count" in _FLAGS
if _CPU and "concurrency_optimized" not in _FLAGS:
    os.environ["XLA_FLAGS"] = f"{_FLAGS} --xla_cpu_enable_concurrency_optimized_scheduler=false"
if _CPU:
    os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from trn_accum.analysis import collectives as coll  # noqa: E402
from trn_accum.analysis.target_memory import refused_bytes  # noqa: E402
from trn_accum.config.load import load_config  # noqa: E402
from trn_accum.core.accumulate import Strategy, accumulate_gradients  # noqa: E402
from trn_accum.core.split import split_minibatches  # noqa: E402
from trn_accum.errors import UserError  # noqa: E402
from trn_accum.model import fuji  # noqa: E402
from trn_accum.train import step  # noqa: E402

DEFAULT_CONFIG = "configs/fuji-tiny.toml"
DEFAULT_SET = ("model.compute_dtype=float32",)
MS = "optax.MultiSteps"
METHODS = ("full batch", "ours per_minibatch", "ours once", "contiguous scan", MS)


def _setup(path: Path, overrides) -> SimpleNamespace:
    """Config, k, mesh, shardings, optimizer, the parameters' init, the batch and its slices."""
    cfg = load_config(path, overrides)
    k = cfg.trainer.accum_steps
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise SystemExit(f"peers.py: trainer.accum_steps = {k!r}: needs an integer k >= 2")
    mesh = step.make_mesh(cfg)
    step.check_batch(cfg, mesh)  # k x batch shards divide the global batch
    specs = step.param_specs(cfg, mesh)
    shard, tx = step.named(mesh, specs), step.make_optimizer(cfg)[0]
    init = jax.jit(lambda: fuji.init_params(cfg.model, jax.random.key(0)), out_shardings=shard)
    abs_o = jax.eval_shape(tx.init, jax.eval_shape(init))
    opt_shard = step.named(mesh, step.state_specs(tx, {"opt_state": abs_o}, specs)["opt_state"])
    b, s = cfg.data.global_batch, cfg.data.seq_len
    rng = np.random.default_rng(0)
    keep = np.linspace(0.1, 1.0, b)[:, None]
    mask = (rng.uniform(size=(b, s)) < keep).astype(np.float32)
    mask[:, 0] = 1.0
    ids, labels = (rng.integers(0, cfg.model.vocab_size, (b, s)).astype(np.int32) for _ in range(2))
    host = {"input_ids": ids, "target_labels": labels, "target_mask": mask}
    s = SimpleNamespace(cfg=cfg, k=k, mesh=mesh, specs=specs, shard=shard, tx=tx, init=init)
    s.abs_o, s.opt_shard, s.bsh = abs_o, opt_shard, step.batch_sharding(mesh)
    s.batch = jax.device_put(host, s.bsh)
    # MultiSteps' call i gets rows [i B/k, (i+1) B/k) of the sharded batch, over the batch axes
    r = b // k
    cut = [lambda x, i=i: jax.tree.map(lambda a: a[i * r : (i + 1) * r], x) for i in range(k)]
    s.slices = [jax.jit(c, out_shardings=s.bsh) for c in cut]
    s.loss = lambda p, mb: fuji.loss_fn(p, mb, cfg.model)
    return s


def _jit(fn, ins, outs, donate=()):
    return jax.jit(fn, in_shardings=ins, out_shardings=outs, donate_argnums=donate)


def _contiguous(b, k, mesh):
    """[B, ...] -> [k, B/k, ...], minibatch i = rows [i B/k, (i+1) B/k), over the batch axes."""
    sh = NamedSharding(mesh, P(None, step.BATCH_AXES))
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x.reshape(k, -1, *x.shape[1:]), sh), b
    )


def _grad_fns(s) -> dict:
    """name -> grads(params, batch) for the in-graph methods."""

    def ours(steps, reduce):
        kw = {"mesh": s.mesh, "batch_spec": step.BATCH_SPEC, "param_specs": s.specs}
        kw.update(has_aux=True, aux_reduction=step.AUX_REDUCTION)
        kw["weight_fn"] = lambda mb: mb["target_mask"].sum()  # the token counts
        kw["strategy"] = Strategy(grad_dtype=jnp.float32, reduce=reduce)
        fn = accumulate_gradients(s.loss, steps=steps, **kw)
        return lambda p, b: fn(p, b)[1]

    def contiguous(p, b):
        def body(acc, mb):
            g = jax.grad(lambda q: s.loss(q, mb)[0])(p)
            return jax.tree.map(jnp.add, acc, g), None

        zero = jax.tree.map(jnp.zeros_like, p)
        total, _ = jax.lax.scan(body, zero, _contiguous(b, s.k, s.mesh))
        return jax.tree.map(lambda g: g / s.k, total)

    fns = (ours(1, "per_minibatch"), ours(s.k, "per_minibatch"), ours(s.k, "once"), contiguous)
    return dict(zip(METHODS[:4], fns, strict=True))


def _ms_fn(loss, tx, *, apply: bool):
    """One MultiSteps call on a minibatch: (p, state, mb) -> (new p, state), or the state alone."""

    def fn(p, o, mb):
        u, o = tx.update(jax.grad(lambda q: loss(q, mb)[0])(p), o, p)
        return (optax.apply_updates(p, u), o) if apply else o

    return fn


def _ms_state(inner, acc, mesh, *, shardings=False):
    """MultiSteps' state (or its shardings) of `inner` (the optimizer's) and `acc` (its sum)."""
    rep = NamedSharding(mesh, P())
    counts = [rep] * 2 if shardings else [jax.device_put(jnp.int32(0), rep) for _ in range(2)]
    return optax.MultiStepsState(*counts, inner, acc, ())


def _ms_grads(s, p, b):
    """MultiSteps' accumulated gradient: the state of an inner optimizer that keeps its input."""
    keep = optax.GradientTransformation(optax.tree.zeros_like, lambda u, _o, params=None: (u, u))
    cap = optax.MultiSteps(keep, every_k_schedule=s.k)
    sh = _ms_state(s.shard, s.shard, s.mesh, shardings=True)
    o = jax.jit(cap.init, out_shardings=sh)(p)
    f = _jit(_ms_fn(s.loss, cap, apply=False), (s.shard, sh, s.bsh), sh, (1,))
    for i in range(s.k):
        o = f(p, o, s.slices[i](b))
    return o.inner_opt_state


def _error(e: Exception, prefix: str = "") -> dict:
    """A refusal as row fields: its first line, and the bytes it asked where it names them."""
    message = str(e).strip()
    out = {prefix + "error": message.splitlines()[0][:400] if message else repr(e)}
    if (asked := refused_bytes(message)) is not None:
        out[prefix + "refused_bytes"] = asked
    return out


def _free() -> None:
    jax.clear_caches()
    gc.collect()


def _grad_errors(s, methods, params, log) -> tuple[dict, str | None]:
    """name -> the gradient error pass's row fields; the reference's name."""
    fns = {n: _jit(f, (s.shard, s.bsh), s.shard) for n, f in _grad_fns(s).items()}
    fns[MS] = lambda p, b: _ms_grads(s, p, b)
    ref, ref_g, out = None, None, {}
    for n in methods:
        try:
            g = jax.block_until_ready(fns[n](params, s.batch))
        except Exception as e:  # a refusal is a row, not the end of the table
            out[n] = {"grad_rel_err": None, **_error(e, "grad_")}
            log(f"  peers: {n}: gradients: {out[n]['grad_error'][:200]}")
        else:
            ref, ref_g = (n, g) if ref is None else (ref, ref_g)
            pairs = zip(jax.tree.leaves(g), jax.tree.leaves(ref_g), strict=True)
            err = max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))) for x, y in pairs)
            out[n] = {"grad_rel_err": err}
        g = None
        _free()
    return out, ref


def _time(s, methods, params, rows, rounds, log) -> tuple[dict, dict]:
    """Per method: its step's seconds in each timed round on the shared chain, its temporaries."""

    def timed(f):
        def fn(p, o, b):
            u, o = s.tx.update(f(p, b), o, p)
            return optax.apply_updates(p, u), o

        sh = (s.shard, s.opt_shard)
        return _jit(fn, (*sh, s.bsh), sh, (0, 1)), (params, s.abs_o, s.batch)

    jitted = {n: timed(f) for n, f in _grad_fns(s).items()}
    ms = optax.MultiSteps(s.tx, every_k_schedule=s.k)
    ms_sh = (s.shard, _ms_state(s.opt_shard, s.shard, s.mesh, shardings=True))
    args = (params, _ms_state(s.abs_o, params, s.mesh), s.slices[0](s.batch))
    jitted[MS] = (_jit(_ms_fn(s.loss, ms, apply=True), (*ms_sh, s.bsh), ms_sh, (0, 1)), args)
    compiled, temp = {}, {}
    for n in methods:
        try:
            compiled[n] = jitted[n][0].lower(*jitted[n][1]).compile()
            temp[n] = compiled[n].memory_analysis().temp_size_in_bytes
        except Exception as e:  # the chip compiler's refusal: a row
            rows[n].update(_error(e))
            log(f"  peers: {n}: compile: {rows[n]['error'][:200]}")
    del jitted
    _free()
    zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=s.shard)
    opt_init = jax.jit(s.tx.init, out_shardings=s.opt_shard)

    def turn(n, p, o):
        if n != MS:
            t0 = time.perf_counter()
            p, o = jax.block_until_ready(compiled[n](p, o, s.batch))
            return p, o, time.perf_counter() - t0
        st = jax.block_until_ready(_ms_state(o, zeros(p), s.mesh))  # untimed: built, dropped
        t0 = time.perf_counter()
        for i in range(s.k):
            p, st = compiled[MS](p, st, s.slices[i](s.batch))
        jax.block_until_ready((p, st))
        return p, st.inner_opt_state, time.perf_counter() - t0

    chain, params = [params, opt_init(params)], None
    times = {n: [] for n in compiled}
    for r in range(rounds + 1):  # round 0 warms up
        for n in [n for n in compiled if "error" not in rows[n]]:
            try:
                *chain, dt = turn(n, *chain)
            except Exception as e:  # refused at run time: a row, and a fresh chain if donated
                rows[n].update(_error(e))
                log(f"  peers: {n}: run: {rows[n]['error'][:200]}")
                chain = None if any(x.is_deleted() for x in jax.tree.leaves(chain)) else chain
                chain = chain or [p := s.init(), opt_init(p)]
                continue
            times[n] += [dt] if r else []
    return times, temp


def _splits(s, methods) -> dict:
    """name -> collectives of the method's split (counted in its own compiled program)."""

    def counts(fn) -> dict[str, int]:
        text = jax.jit(fn, in_shardings=(s.bsh,)).lower(s.batch).compile().as_text()
        total = coll.count_collectives(text, coll.MAIN_COLLECTIVES)["total"]
        return {c: n for c, n in total.items() if n}

    out = {"full batch": {}}
    if {"ours per_minibatch", "ours once"} & set(methods):
        ours = counts(lambda b: split_minibatches(b, s.k, mesh=s.mesh, batch_spec=step.BATCH_SPEC))
        out["ours per_minibatch"] = out["ours once"] = ours
    if "contiguous scan" in methods:
        out["contiguous scan"] = counts(lambda b: _contiguous(b, s.k, s.mesh))
    if MS in methods:
        out[MS] = {c: n * s.k for c, n in counts(s.slices[1]).items()}
    return out


def run(root, *, rounds=7, log=print, config=None, overrides=(), methods=None) -> dict:
    """The peers' result (module docstring); `config` None: the tiny default, float32 compute."""
    root = Path(root).resolve()
    if config is None:
        config, overrides = DEFAULT_CONFIG, (*DEFAULT_SET, *overrides)
    path = (root / config).resolve()
    shown = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
    s = _setup(path, overrides)
    methods = [n for n in METHODS if methods is None or n in methods]
    rows = {n: {} for n in methods}
    with jax.set_mesh(s.mesh):
        params = s.init()
        errs, gref = _grad_errors(s, methods, params, log)
        times, temp = _time(s, methods, params, rows, rounds, log)
        split = _splits(s, methods)
    ran = [n for n in methods if times.get(n) and "error" not in rows[n]]
    ref = ran[0] if ran else None
    out = []
    for n in methods:
        med = statistics.median(times[n]) if n in ran else None
        row = {"method": n, "step_s_median": med}
        row["step_ratio"] = med / statistics.median(times[ref]) if med is not None else None
        row["temp_bytes"] = int(temp[n]) if n in temp else None
        row["temp_ratio"] = temp[n] / temp[ref] if n in temp and ref else None
        row.update(split_collectives=split[n], **errs[n], runs=times.get(n, []))
        out.append({**row, "reference": ref, "grad_reference": gref, **rows[n]})
        ratio, err = row["step_ratio"], row["grad_rel_err"]
        err = "-" if err is None else f"{err:.2g}"
        log(f"  peers: {n}: {'-' if ratio is None else f'{ratio:.2f}x'}, err {err}")
    d, m = s.cfg.data, s.cfg.model
    result = {"k": s.k, "mesh": dict(s.mesh.shape), "batch": [d.global_batch, d.seq_len]}
    result.update(params=fuji.num_params(m), rounds=rounds, rows=out, load=os.getloadavg()[0])
    names = ("compute_dtype", "remat", "attention", "attention_block", "loss_chunk")
    result.update(
        config=shown, overrides=list(overrides), settings={a: getattr(m, a) for a in names}
    )
    result.update(jax=jax.__version__, device_kind=jax.devices()[0].device_kind)
    return {**result, "command": shlex.join(sys.argv)}


def markdown(peers: dict) -> str:
    mesh = ", ".join(f"{a}={n}" for a, n in peers["mesh"].items())
    config, sets = peers.get("config", DEFAULT_CONFIG), peers.get("overrides", list(DEFAULT_SET))
    what = "tiny Fuji float32"
    if (config, list(sets)) != (DEFAULT_CONFIG, list(DEFAULT_SET)):
        what = config + (f" with {', '.join(sets)}" if sets else "")
    rows = peers["rows"]
    ref = next((r["reference"] for r in rows if r.get("reference")), "full batch")
    gref = next((r["grad_reference"] for r in rows if r.get("grad_reference")), "full batch")
    out = [
        f"Peers ({what}, {peers['params']:,} parameters, mesh ({mesh}), batch "
        f"{peers['batch'][0]} x {peers['batch'][1]} with uneven padding, k={peers['k']}; "
        f"round-robin, median of {peers['rounds']} rounds, load average {peers['load']:.1f}):",
        "",
        f"| method | step time / {ref} | temp per device | split collectives | "
        f"gradient error vs {gref} |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        split = ", ".join(f"{k} {v}" for k, v in r["split_collectives"].items()) or "none"
        ratio = "error: " + r.get("error", "not run")[:80].replace("|", "/")
        if "refused_bytes" in r:
            ratio = f"refused ({r['refused_bytes'] / 2**30:.2f} GiB asked)"
        ratio = f"{r['step_ratio']:.2f}" if r.get("step_ratio") is not None else ratio
        temp = "-" if r.get("temp_bytes") is None else f"{r['temp_bytes'] / 2**20:.2f} MiB"
        temp += f" ({r['temp_ratio']:.2f}x)" if r.get("temp_ratio") is not None else ""
        err = f"{r['grad_rel_err']:.1e}" if r.get("grad_rel_err") is not None else "-"
        out.append(f"| {r['method']} | {ratio} | {temp} | {split} | {err} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help=f"TOML config (default {DEFAULT_CONFIG}, float32 compute)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="S.KEY=VALUE")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds after a warm-up one")
    ap.add_argument("--json", metavar="PATH", help="write the result dict here")
    ap.add_argument("--methods", nargs="+", choices=METHODS, help="a subset (quote the names)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    config = None if args.config is None else str(Path(args.config).resolve())
    root, log = Path(__file__).resolve().parent.parent, lambda m: print(m, file=sys.stderr)
    try:
        opts = {"config": config, "overrides": args.overrides, "methods": args.methods}
        result = run(root, rounds=args.rounds, log=log, **opts)
    except UserError as e:
        raise SystemExit(f"peers.py: {e}") from None
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
