"""Peers table: our accumulation next to what users would write instead, same model, batch, mesh.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python benchmarks/peers.py

(also called by `benchmarks/report.py`, i.e. `make bench`). The tiny Fuji (configs/fuji-tiny.toml,
float32 compute, mesh data 4 x fsdp 2), one padded batch (row r keeps a growing fraction of its
target tokens, as real packed/padded batches do), k = 4, AdamW of the trainer. Every method is
one jitted optimizer step (gradients, `tx.update`, `apply_updates`; parameters and optimizer
state donated, shardings stated) except optax.MultiSteps, which is k calls of a jitted step on
host-sliced minibatches, the way its users run it:

- full batch: `accumulate_gradients(steps=1)` (the reference gradient);
- ours, reduce per_minibatch / once: `accumulate_gradients(steps=4)` with the token-count
  weights (`trn_accum.core`, strided split: no data moves);
- contiguous scan: minibatch i = rows [i B/k, (i+1) B/k) stated in the stacked sharding, a
  `lax.scan` over them, mean of the minibatch means (the in-graph accumulation of AXLearn and
  Levanter);
- optax.MultiSteps(every_k_schedule=k): mean of the k minibatch gradients, applied at the k-th.

Timed round-robin in one process (one step of each method per round, median over rounds), so
load on the shared machine hits all of them alike. Columns: step time / full batch, temporary
memory per device (`memory_analysis`; MultiSteps: one call), collectives of the split (the
in-graph reshape, or MultiSteps' slice of the sharded global batch, x k), gradient error (max
over leaves of max |g - g_full| / max |g_full|; MultiSteps: its accumulated gradient, read
through an SGD(1) inner optimizer).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

_NO_DEADLOCK = "--xla_cpu_enable_concurrency_optimized_scheduler"
if _NO_DEADLOCK not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_NO_DEADLOCK}=false".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from trn_accum.analysis import collectives as coll  # noqa: E402
from trn_accum.config.load import load_config  # noqa: E402
from trn_accum.core.accumulate import Strategy, accumulate_gradients  # noqa: E402
from trn_accum.core.split import split_minibatches  # noqa: E402
from trn_accum.model import fuji  # noqa: E402
from trn_accum.train import step  # noqa: E402

K = 4
METHODS = ("full batch", "ours per_minibatch", "ours once", "contiguous scan", "optax.MultiSteps")


def _problem(root):
    cfg = load_config(root / "configs/fuji-tiny.toml", ["model.compute_dtype=float32"])
    mesh = step.make_mesh(cfg)
    specs = step.param_specs(cfg, mesh)
    shard = step.named(mesh, specs)
    params = jax.jit(lambda: fuji.init_params(cfg.model, jax.random.key(0)), out_shardings=shard)()
    b, s = cfg.data.global_batch, cfg.data.seq_len
    rng = np.random.default_rng(0)
    keep = np.linspace(0.1, 1.0, b)[:, None]
    mask = (rng.uniform(size=(b, s)) < keep).astype(np.float32)
    mask[:, 0] = 1.0
    host = {
        "input_ids": rng.integers(0, cfg.model.vocab_size, (b, s)).astype(np.int32),
        "target_labels": rng.integers(0, cfg.model.vocab_size, (b, s)).astype(np.int32),
        "target_mask": mask,
    }
    batch = jax.device_put(host, step.batch_sharding(mesh))
    return cfg, mesh, specs, shard, params, batch


def _loss(cfg):
    return lambda p, mb: fuji.loss_fn(p, mb, cfg.model)


def _grad_fns(cfg, mesh, specs):
    """name -> grads(params, batch) for the in-graph methods."""
    loss = _loss(cfg)

    def ours(k, reduce):
        fn = accumulate_gradients(
            loss,
            steps=k,
            mesh=mesh,
            batch_spec=step.BATCH_SPEC,
            param_specs=specs,
            weight_fn=lambda mb: mb["target_mask"].sum(),
            has_aux=True,
            aux_reduction=step.AUX_REDUCTION,
            strategy=Strategy(grad_dtype=jnp.float32, reduce=reduce),
        )
        return lambda p, b: fn(p, b)[1]

    def contiguous(p, b):
        def one(x):
            y = x.reshape(K, x.shape[0] // K, *x.shape[1:])
            return jax.lax.with_sharding_constraint(
                y, NamedSharding(mesh, P(None, step.BATCH_AXES))
            )

        def body(acc, mb):
            g = jax.grad(lambda q: loss(q, mb)[0])(p)
            return jax.tree.map(jnp.add, acc, g), None

        zero = jax.tree.map(jnp.zeros_like, p)
        total, _ = jax.lax.scan(body, zero, jax.tree.map(one, b))
        return jax.tree.map(lambda g: g / K, total)

    return {
        "full batch": ours(1, "per_minibatch"),
        "ours per_minibatch": ours(K, "per_minibatch"),
        "ours once": ours(K, "once"),
        "contiguous scan": contiguous,
    }


def _jit_step(grads_fn, tx, mesh, shard, opt_shard):
    def fn(p, o, b):
        g = grads_fn(p, b)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, g

    return jax.jit(
        fn,
        in_shardings=(shard, opt_shard, step.batch_sharding(mesh)),
        out_shardings=(shard, opt_shard, shard),
        donate_argnums=(0, 1),
    )


def _split_counts(fn, mesh, batch) -> dict[str, int]:
    with jax.set_mesh(mesh):
        text = jax.jit(fn, in_shardings=(step.batch_sharding(mesh),)).lower(batch).compile()
    counts = coll.count_collectives(text.as_text(), coll.MAIN_COLLECTIVES)["total"]
    return {k: n for k, n in counts.items() if n}


def _host_slice(i: int, rows: int, mesh):
    """Rows [i rows, (i+1) rows) of the sharded global batch, resharded over the batch axes:
    what a MultiSteps user feeds each call."""
    return jax.jit(
        lambda b: jax.tree.map(lambda x: x[i * rows : (i + 1) * rows], b),
        out_shardings=step.batch_sharding(mesh),
    )


def _rel_err(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _copy(tree):
    return jax.tree.map(lambda x: x.copy(), tree)


def run(root, *, rounds: int = 7, log=print) -> dict:
    cfg, mesh, specs, shard, params, batch = _problem(root)
    tx, _ = step.make_optimizer(cfg)
    opt_shard = step.named(
        mesh, step.state_specs(tx, {"opt_state": tx.init(params)}, specs)["opt_state"]
    )
    rows_mb = cfg.data.global_batch // K
    compiled, temp, grads = {}, {}, {}
    with jax.set_mesh(mesh):
        for name, g in _grad_fns(cfg, mesh, specs).items():
            f = _jit_step(g, tx, mesh, shard, opt_shard)
            c = f.lower(params, tx.init(params), batch).compile()
            compiled[name], temp[name] = c, c.memory_analysis().temp_size_in_bytes
            grads[name] = c(_copy(params), tx.init(params), batch)[2]
        ms = optax.MultiSteps(tx, every_k_schedule=K)
        ms_state = jax.tree.map(lambda x: x, ms.init(params))
        ms_shard = jax.tree.map(lambda x: x.sharding, ms_state)
        slices = [_host_slice(i, rows_mb, mesh) for i in range(K)]

        def ms_fn(tx_):
            def fn(p, o, mb):
                g = jax.grad(lambda q: _loss(cfg)(q, mb)[0])(p)
                u, o = tx_.update(g, o, p)
                return optax.apply_updates(p, u), o

            return fn

        ms_step = jax.jit(ms_fn(ms), donate_argnums=(0, 1),
                          out_shardings=(shard, ms_shard))  # fmt: skip
        mb0 = slices[0](batch)
        c = ms_step.lower(params, ms_state, mb0).compile()
        temp["optax.MultiSteps"] = c.memory_analysis().temp_size_in_bytes
        sgd = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=K)
        p1, o1 = _copy(params), sgd.init(params)
        for i in range(K):
            p1, o1 = jax.jit(ms_fn(sgd))(p1, o1, slices[i](batch))
        grads["optax.MultiSteps"] = jax.tree.map(lambda a, b: a - b, params, p1)

        def run_ms(state):
            p, o = state
            for i in range(K):
                p, o = ms_step(p, o, slices[i](batch))
            return p, o

        states = {n: (_copy(params), tx.init(params)) for n in compiled}
        states["optax.MultiSteps"] = (_copy(params), ms.init(params))
        times = {n: [] for n in METHODS}
        for r in range(rounds + 1):  # round 0 warms up
            for n in METHODS:
                t0 = time.perf_counter()
                if n == "optax.MultiSteps":
                    states[n] = run_ms(states[n])
                else:
                    p, o, _ = compiled[n](*states[n], batch)
                    states[n] = (p, o)
                jax.block_until_ready(states[n])
                if r:
                    times[n].append(time.perf_counter() - t0)
    split = {
        "full batch": {},
        "ours per_minibatch": _split_counts(
            lambda b: split_minibatches(b, K, mesh=mesh, batch_spec=step.BATCH_SPEC), mesh, batch
        ),
        "contiguous scan": _split_counts(
            lambda b: jax.tree.map(
                lambda x: jax.lax.with_sharding_constraint(
                    x.reshape(K, rows_mb, *x.shape[1:]),
                    NamedSharding(mesh, P(None, step.BATCH_AXES)),
                ),
                b,
            ),
            mesh,
            batch,
        ),  # fmt: skip
        "optax.MultiSteps": {k: v * K for k, v in _split_counts(slices[1], mesh, batch).items()},
    }
    split["ours once"] = split["ours per_minibatch"]
    full = statistics.median(times["full batch"])
    rows = []
    for n in METHODS:
        med = statistics.median(times[n])
        rows.append({
            "method": n, "step_s_median": med, "step_ratio": med / full, "temp_bytes": int(temp[n]),
            "temp_ratio": temp[n] / temp["full batch"], "split_collectives": split[n],
            "grad_rel_err": _rel_err(grads[n], grads["full batch"]), "runs": times[n],
        })  # fmt: skip
        log(f"  peers: {n}: {rows[-1]['step_ratio']:.2f}x, err {rows[-1]['grad_rel_err']:.2g}")
    return {"k": K, "mesh": dict(mesh.shape), "batch": [cfg.data.global_batch, cfg.data.seq_len],
            "params": fuji.num_params(cfg.model), "rounds": rounds, "rows": rows,
            "load": os.getloadavg()[0]}  # fmt: skip


def markdown(peers: dict) -> str:
    mesh = ", ".join(f"{a}={n}" for a, n in peers["mesh"].items())
    out = [
        f"Peers (tiny Fuji float32, {peers['params']:,} parameters, mesh ({mesh}), batch "
        f"{peers['batch'][0]} x {peers['batch'][1]} with uneven padding, k={peers['k']}; "
        f"round-robin, median of {peers['rounds']} rounds, load average {peers['load']:.1f}):",
        "",
        "| method | step time / full batch | temp per device | split collectives | "
        "gradient error vs full batch |",
        "|---|---|---|---|---|",
    ]
    for r in peers["rows"]:
        split = ", ".join(f"{k} {v}" for k, v in r["split_collectives"].items()) or "none"
        out.append(
            f"| {r['method']} | {r['step_ratio']:.2f} | {r['temp_bytes'] / 2**20:.2f} MiB "
            f"({r['temp_ratio']:.2f}x) | {split} | {r['grad_rel_err']:.1e} |"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    from pathlib import Path

    print(
        markdown(
            run(Path(__file__).resolve().parent.parent, log=lambda m: print(m, file=sys.stderr))
        )
    )
