"""`trn-accum dry-run`: compile the real train step for one trn2.48xlarge on emulated CPU devices.

The process must already run N CPU devices (`trn_accum.cli` arranges it before JAX starts).
The mesh is the config's on those N devices (one trn2.48xlarge = 64 logical cores at LNC=2);
the batch is the rows one node carries when the config's global batch is spread over `nodes`
nodes (`--nodes`, default `mesh.nodes`), so every device sees the per-device batch of the real
run. The state is abstract (`jax.eval_shape`), inputs are `ShapeDtypeStruct`s with the real
shardings: no memory for parameters. The report:

- parameter count; exact per-device bytes of parameters, gradients (the float32 accumulator)
  and optimizer state, from each leaf's shard shape on the full multi-node mesh;
- XLA:CPU's `memory_analysis()` (arguments, outputs, temporaries) with its caveats, an
  analytic activation estimate, and the fit on the target (`fit.compiled_fits`: the platform's
  own compiler where at hand, else the peak live bytes of the partitioned module,
  `trn_accum.analysis.target_memory`) against the per-device budget (24 GiB per trn2 logical
  core): a report, not a blocker;
- FLOPs per step: analytic 6·N·tokens + causal attention, and `cost_analysis()` corrected for
  loop trip counts (XLA counts a while body once: the dot FLOPs of each loop computation, read
  from the compiled HLO, are added trip_count - 1 more times);
- the step-time floor (analytic FLOPs at peak) and the MFU formula for the node count (the
  step-time model's own process, `perfmodel_cli`, prices beside the compile);
- the collectives of `split_minibatches` compiled alone with the real input sharding (must be
  0, else a blocker), and the collectives of the whole step (inside / outside loops);
- the Neuron preflight (`trn_accum.neuron.preflight`) of the step's module right after the
  partitioner, the program the Neuron compiler is handed (XLA:CPU's later passes rewrite it for
  the CPU: bf16 work widened to float32, which would make remat's identity rounding a real
  one): blockers make the command exit non-zero, warnings are listed.

Where the config names a Neuron-only piece (`attention = "neuron_flash"`), the dry-run compiles
that piece's JAX-side code around stand-ins that follow the kernel's documented shapes, and the
report lists every substitution by name (`substitutions`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from trn_accum.analysis import platforms, target_memory
from trn_accum.analysis.collectives import count_collectives
from trn_accum.analysis.hlo import module as hlo_lib
from trn_accum.analysis.hlo.partitioned import compile_partitioned
from trn_accum.analysis.memory import (
    GIB,
    activation_estimate,
    compiled_memory,
    fit_by_steps,
    footprint,
    gather_once_bytes,
    state_shard_bytes,
)
from trn_accum.config.auto import auto_keys
from trn_accum.config.load import load_config
from trn_accum.core.mesh import resolve_axes
from trn_accum.core.split import split_minibatches
from trn_accum.errors import UserError, one_line
from trn_accum.model import fuji
from trn_accum.neuron import kernels, preflight
from trn_accum.plan import perfmodel, perfmodel_cli, settings_run
from trn_accum.plan.dryrun_report import format_report, loss_chunk_report, peak_note
from trn_accum.plan.resolution import Refused
from trn_accum.plan.settings import Target
from trn_accum.train import step
from trn_accum.train.flops import flops_per_step

__all__ = ["DryRunError", "format_report", "preflight_findings", "run", "substitutions"]


class DryRunError(UserError):
    """A user-caused dry-run problem (node count vs batch, ...): one line."""


# ---------------------------------------------------------------------------------------------
# Pure helpers


def _cost_flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # a backend without cost analysis
        return None
    if isinstance(cost, Sequence) and cost:
        cost = cost[0]
    if not isinstance(cost, Mapping) or "flops" not in cost:
        return None
    return float(cost["flops"])


def preflight_findings(hlo_text: str | hlo_lib.HloModule) -> tuple[list[str], list[str]]:
    """(blockers, warnings) of `trn_accum.neuron.preflight` as one-line strings; the PRNG is
    taken as rbg, what a trn2 run configures (`trn_accum.cluster.distributed.initialize`)."""
    blockers, warnings = [], []
    for f in preflight.preflight(hlo_text, prng_impl="rbg"):
        text = one_line(f)
        (blockers if f.severity == preflight.BLOCKER else warnings).append(text)
    return blockers, warnings


# ---------------------------------------------------------------------------------------------
# The dry-run


def run(
    config_path: str,
    *,
    overrides: Sequence[str] = (),
    devices: int | None = None,
    nodes: int | None = None,
    step_time: bool = False,
    step_time_meshes: Sequence[str] | None = None,
    search: bool = False,
    platform_name: str = platforms.DEFAULT,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Lower and compile the train step; returns the report (see the module docstring).
    `step_time`: add the step-time model of `platform_name` (`trn_accum.plan.perfmodel`, own
    process, nodes of this dry-run's device count) of the config; with `search` (or
    `step_time_meshes`) its candidates too, on `step_time_meshes` (names of
    `recommend.MESHES`; None = all), and the weak-scaling table. `say(line)` hears each stage
    as it starts and the settings search's candidates (default: silent)."""
    t_start = time.perf_counter()
    say = say or (lambda _: None)
    cfg = load_config(config_path, overrides)
    nodes = cfg.mesh.nodes if nodes is None else int(nodes)
    if nodes < 1 or cfg.data.global_batch % nodes:
        raise DryRunError(
            f"--nodes {nodes}: data.global_batch = {cfg.data.global_batch} must split evenly "
            f"over the nodes (rows per node = global_batch / nodes); pick a divisor"
        )
    plat = platforms.get(platform_name)
    say(f"dry-run: {config_path} on {devices or len(jax.devices())} emulated {plat.name} devices")
    subs = substitutions(cfg)
    started: list[perfmodel_cli.Pending] = []
    searching = search or bool(step_time_meshes)

    def start_step_time(resolution, n_dev: int) -> None:  # once the settings are known
        what = "the config and its candidates (--search: minutes)" if searching else "the config"
        say(f"dry-run: the {plat.name} step-time model of {what}, in a process of its own")
        sets = [*overrides, *resolved_settings(resolution)]
        kw = dict(platform_name=plat.name, devices_per_node=n_dev, search=searching)
        started.append(
            perfmodel_cli.start_in_subprocess(config_path, sets, nodes, step_time_meshes, **kw)
        )

    try:
        with kernels.substitute(kernels.reference_kernels()) if subs else contextlib.nullcontext():
            starts = start_step_time if step_time else None
            report = _run(cfg, config_path, overrides, devices, nodes, t_start, plat, say, starts)
        report["substitutions"] = subs
        if started:
            waited = time.perf_counter() - t_start
            say(f"dry-run: waiting for the step-time model ({waited:.0f} s so far)")
            try:
                report["step_time"] = started.pop().result()
            except perfmodel.StepTimeError as e:
                report["step_time"] = {"error": one_line(e)}
    finally:
        for pending in started:  # the dry-run failed: its step-time model goes too
            pending.cancel()
    return report


def resolved_settings(resolution) -> list[str]:
    """--set items fixing each setting the config leaves "auto" to what this dry-run resolved
    (the settings train will run), so that the step-time model prices the step the dry-run
    compiled and not the word "auto"."""
    return [f"{key}={resolution.settings[key]}" for key in resolution.auto]


def _tpu_fit_check(plat, node_batch: int, n_dev: int, budget: float):
    """The settings search's `confirm` where the platform's own compiler is at hand (libtpu for
    a TPU, compiling without a chip: `target_memory.tpu_devices`), else None (the estimate the
    search priced is the fit check)."""
    if target_memory.tpu_devices(plat.name, n_dev) is None:
        return None

    def confirm(cfg) -> None:
        devices = target_memory.tpu_devices(plat.name, n_dev)
        got = target_memory.tpu_footprint(_lower_on(cfg, node_batch), devices)
        if got > budget:
            raise Refused(f"the TPU compiler's peak {got / GIB:.2f} GiB > {budget / GIB:.2f} GiB")

    return confirm


def substitutions(cfg) -> list[dict[str, str]]:
    """The Neuron-only pieces `cfg` names that the dry-run compiles with stand-ins, by name.

    `attention = "neuron_flash"`: the NKI Library kernels cannot run on CPU devices; the whole
    JAX side (layout transposes, GQA folding, log-sum-exp, custom VJP, shard_map) compiles as on
    trn2 around pure-JAX stand-ins with the kernels' documented IO
    (`trn_accum.neuron.kernels.reference_kernels`).
    """
    if cfg.model.attention != "neuron_flash":
        return []
    why = (
        "the NKI kernel runs on NeuronCores only; the stand-in is exact attention with the "
        "kernel's documented IO (its [S, S] scores inflate the compiled temporaries)"
    )
    refs = kernels.reference_kernels()
    return [
        {"piece": f"nkilib {name}", "with": refs[key].name, "why": why}
        for name, key in (("attention_cte", "fwd"), ("attention_bwd", "bwd"))
    ]


def _lower_on(cfg, node_batch: int):
    """A function of devices that lowers the step of `cfg` for `node_batch` rows on a mesh of
    them (the target's compiler compiles it: `target_memory.estimate`)."""

    def lower(devices):
        return step.build_step(cfg, step.make_mesh(cfg, devices), batch_rows=node_batch).lowered

    return lower


def _run(
    cfg, config_path, overrides, devices, nodes, t_start, plat, say, start_step_time
) -> dict[str, Any]:
    notes: list[str] = []
    devs = jax.devices()
    n_dev = len(devs) if devices is None else devices
    if n_dev != len(devs):
        raise DryRunError(
            f"--devices {n_dev}: this process has {len(devs)} devices; run through "
            f"`trn-accum dry-run`, which sets the emulated device count"
        )
    node_batch = cfg.data.global_batch // nodes
    mesh = step.make_mesh(cfg, devs)
    # "auto" settings: what `trn-accum train` runs on this target, by the same search
    if auto_keys(cfg):
        say(f"dry-run: choosing {', '.join(auto_keys(cfg))} (the settings train will run)")
    budget = plat.budget_gib(cfg.trainer.memory_budget_gib) * GIB
    resolution = settings_run.resolve(
        cfg,
        Target(plat.name, n_dev, nodes),
        confirm=_tpu_fit_check(plat, node_batch, n_dev, budget),
        say=say,
    )
    cfg = resolution.apply(cfg)
    if start_step_time is not None:
        start_step_time(resolution, n_dev)
    say(
        f"dry-run: compiling the step ({cfg.model.num_layers} layers, {n_dev} devices, "
        f"k {cfg.trainer.accum_steps})"
    )
    program = step.build_step(cfg, mesh, batch_rows=node_batch)
    k = cfg.trainer.accum_steps
    local_shape = dict(mesh.shape)
    try:
        full_shape = resolve_axes(cfg.mesh.axes(), n_dev * nodes)
    except ValueError as e:
        raise DryRunError(
            f"mesh {cfg.mesh.axes()} on {nodes} nodes x {n_dev} devices: {e}"
        ) from None
    rows_per_group = node_batch // (local_shape["data"] * local_shape["fsdp"])
    rows_per_mb = rows_per_group // k
    abstract, specs, sspecs = program.abstract, program.specs, program.state_specs
    _, batch_in = program.abstract_inputs()

    t0 = time.perf_counter()
    _ = program.lowered  # timed on its own
    t1 = time.perf_counter()
    # one compile: the executable and the module right after the SPMD partitioner (the program's)
    compiled, partitioned = compile_partitioned(program.lowered)
    t2 = time.perf_counter()
    hlo_text = compiled.as_text()
    module = hlo_lib.parse_hlo(hlo_text)

    # The split alone, with the real input sharding: must move nothing.
    split = jax.jit(
        lambda b: split_minibatches(b, k, mesh=mesh, batch_spec=step.BATCH_SPEC),
        in_shardings=(step.batch_sharding(mesh),),
    )
    with jax.set_mesh(mesh):
        split_hlo = split.lower(batch_in).compile().as_text()
    split_counts = count_collectives(split_hlo)["total"]
    parted = hlo_lib.parse_hlo(partitioned)  # parsed once: collectives, fit estimate, preflight
    step_counts = count_collectives(parted)

    # Bytes per device, exact from shard shapes on the full (multi-node) mesh.
    n_params = fuji.num_params(cfg.model)
    sb = state_shard_bytes(abstract, specs, sspecs["opt_state"], full_shape)
    p_bytes, g_bytes, o_bytes = sb["params"], sb["grads"], sb["opt_state"]
    mem = compiled_memory(compiled)
    act = activation_estimate(cfg, rows_per_mb, local_shape.get("model", 1))
    budget_gib = plat.budget_gib(cfg.trainer.memory_budget_gib)
    state_bytes = p_bytes + g_bytes + o_bytes
    gathered = gather_once_bytes(
        abstract["params"],
        specs,
        full_shape,
        step.FSDP_AXES,
        cfg.model.compute_dtype,
        cfg.trainer.gather,
    )
    fixed = state_bytes + g_bytes + gathered  # + one minibatch's gradient, trainer.gather's
    analytic_total = fixed + act["total"]
    target = target_memory.estimate(plat.name, parted, _lower_on(cfg, node_batch), n_dev)
    fit_nodes = sorted({1, cfg.mesh.nodes, nodes})
    fit_table = [fit_by_steps(cfg, local_shape, fixed, n, budget) for n in fit_nodes]

    # FLOPs.
    fl = flops_per_step(cfg)  # the full global batch (all nodes)
    total_devices = n_dev * nodes
    cost = _cost_flops(compiled)
    dots = hlo_lib.dot_flops(module)
    cost_trips = None if cost is None else cost + dots["with_trips"] - dots["once"]
    peak_total = plat.peak_flops * total_devices
    floor_s = fl["total"] / peak_total

    blockers, warnings = preflight_findings(parted)  # not XLA:CPU's rewrite of it
    if sum(split_counts.values()):
        blockers.append(f"blocker: split: split_minibatches compiled to collectives {split_counts}")

    return {
        "config": config_path,
        "overrides": list(overrides),
        "notes": notes,
        "devices": n_dev,
        "nodes": nodes,
        "mesh_per_node": local_shape,
        "mesh_all_nodes": full_shape,
        "global_batch": cfg.data.global_batch,
        "seq_len": cfg.data.seq_len,
        "rows_per_node": node_batch,
        "accum_steps": k,
        "train_will_run": {**resolution.to_dict(), "text": resolution.format()},
        "rows_per_device_group_per_minibatch": rows_per_mb,
        "layers": cfg.model.num_layers,
        "layer_loop": cfg.model.layer_loop,
        "accum_loop": cfg.trainer.loop,
        "attention": cfg.model.attention,
        "remat": cfg.model.remat,
        "loss": loss_chunk_report(cfg, local_shape.get("model", 1), rows_per_mb),
        "params": n_params,
        "bytes_per_device": {
            "params": p_bytes,
            "grads": g_bytes,
            "opt_state": o_bytes,
            "state_total": state_bytes,
            "gather_once": gathered,
        },
        "compiled_memory_per_device": mem,
        "compiled_memory_caveat": (
            "XLA:CPU's figures, not the fit check: CPU computes bf16 in float32, schedules "
            "differently and moves with the jaxlib version; the fit reads the target's "
            "(fit.compiled_source, docs/dry-run.md)"
        ),
        "activation_estimate": act,
        "fit": {
            "budget_gib": budget_gib,
            "analytic_total_bytes": analytic_total,
            "analytic_fits": analytic_total <= budget,
            "compiled_total_bytes": target["bytes"],
            "compiled_fits": target["bytes"] <= budget,
            "compiled_source": target["source"],
            "xla_cpu_total_bytes": footprint(mem),
        },
        "fit_by_accum_steps": fit_table,
        "flops": {
            "analytic_per_step": fl["total"],
            "analytic_dense_6NT": fl["dense"],
            "analytic_attention": fl["attention"],
            "tokens_per_step": fl["tokens"],
            "analytic_per_device": fl["total"] / total_devices,
            "cost_analysis_per_device": cost,
            "hlo_dot_flops_once": dots["once"],
            "hlo_dot_flops_with_trips": dots["with_trips"],
            "cost_analysis_with_trips_per_device": cost_trips,
            "cost_analysis_with_trips_all_devices": None
            if cost_trips is None
            else cost_trips * total_devices,
        },
        "platform": plat.name,
        "step_time_floor_s": floor_s,
        "mfu_formula": (
            f"MFU = {fl['total']:.4g} FLOP / step_time_s / "
            f"({plat.peak_flops:.4g} FLOP/s x {total_devices:g} devices) = "
            f"{floor_s:.4g} s / step_time_s"
        ),
        "peak_note": peak_note(floor_s) if plat.name == "trn2" else plat.source,
        "split_collectives": split_counts,
        "step_collectives": {
            "outside_loops": step_counts["outside_loops"],
            "inside_loops": step_counts["inside_loops"],
        },
        "blockers": blockers,
        "warnings": warnings,
        "timings_s": {
            "lower": round(t1 - t0, 2),
            "compile": round(t2 - t1, 2),
            "total": round(time.perf_counter() - t_start, 2),
        },
    }
