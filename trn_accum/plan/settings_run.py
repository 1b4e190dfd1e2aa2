"""Where the settings search runs, and the hook `trn-accum train` hands the trainer.

`settings.choose` compiles its candidates on CPU devices shaped like min(nodes, 2) nodes of the
target. A process that has them (the dry-run of one node, a single-process run on the CPU
fallback) searches in place; any other (a trn2 or TPU run, a dry-run of several nodes) starts
`python -m trn_accum.plan.settings_run` with that many emulated CPU devices and reads its
Resolution as JSON. The result is the same either way: the compiles are deterministic, and
every process of a multi-process run reaches the same settings.

`for_run` is `Trainer.build`'s settings hook: the target is the run's own devices (trn2 on a
Neuron device, TPU v5e on one, the default platform, trn2, on the CPU fallback, which stands in
for it), and on an accelerator the pick is compiled on it once before the run compiles it
(`compile_on`): a pick its compiler refuses gives way to the next.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from trn_accum.analysis import platforms
from trn_accum.analysis.target_memory import refused_bytes
from trn_accum.config.auto import auto_keys
from trn_accum.config.load import Config, config_from_dict, config_to_dict
from trn_accum.plan.perfmodel import EMULATE_NODES
from trn_accum.plan.perfmodel_cli import pricing_env
from trn_accum.plan.resolution import Refused, Resolution, SettingsError, confirmed
from trn_accum.plan.settings import Target, choose, search


def platform_of(device) -> str:
    """The `trn_accum.analysis.platforms` name that prices a run on `device`'s kind."""
    if device.platform == "neuron":
        return "trn2"
    if device.platform == "tpu":
        kind = str(getattr(device, "device_kind", "")).lower()
        if "v5" in kind and ("lite" in kind or "v5e" in kind):
            return "tpu-v5e"
        raise SettingsError(
            f'a setting is "auto" on a {getattr(device, "device_kind", "TPU")!r} device, which '
            f"the step-time model has no rates for (it has {', '.join(platforms.PLATFORMS)}): "
            f"write the settings in the config instead"
        )
    return platforms.DEFAULT  # the CPU fallback stands in for trn2


def target_of(mesh: jax.sharding.Mesh) -> Target:
    """The run's own target: its platform, devices per process (a node), processes (nodes)."""
    devices = list(mesh.devices.flat)
    nodes = max(1, len({d.process_index for d in devices}))
    return Target(platform_of(devices[0]), len(devices) // nodes, nodes)


def _cpu_devices_here(n: int) -> list | None:
    """`n` CPU devices of this process to compile candidates on, None where it has not that
    many or runs other processes (a multi-process run compiles for its own mesh)."""
    if jax.process_count() != 1:
        return None
    try:
        cpus = jax.devices("cpu")
    except RuntimeError:  # no CPU backend in this process (JAX_PLATFORMS without cpu)
        return None
    return cpus[:n] if len(cpus) >= n else None


def resolve(
    cfg: Config,
    target: Target,
    *,
    confirm: Callable[[Any], None] | None = None,
    say: Callable[[str], None] | None = None,
) -> Resolution:
    """`settings.choose` of `cfg` on `target`, in this process where it has the CPU devices,
    else in a subprocess that has them; `confirm` runs here either way."""
    need = min(target.nodes, EMULATE_NODES) * target.devices_per_node
    devices = _cpu_devices_here(need) if auto_keys(cfg) else None
    if devices is not None or not auto_keys(cfg):
        return choose(cfg, target, devices=devices, confirm=confirm, say=say)
    t0 = time.perf_counter()
    res = _in_subprocess(cfg, target, need, say)
    return confirmed(cfg, res.rows, target.nodes, res.platform, res.budget_bytes, confirm, t0)


def _in_subprocess(cfg: Config, target: Target, devices: int, say) -> Resolution:
    """The search in `python -m trn_accum.plan.settings_run` on `devices` emulated CPU devices:
    its progress relayed to `say` line by line as it prices (a thread reads its stderr while
    this one reads the Resolution from its stdout, so neither pipe fills)."""
    env = pricing_env(devices)
    cmd = [sys.executable, "-m", "trn_accum.plan.settings_run", json.dumps(target.__dict__)]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    relay = threading.Thread(target=_relay, args=(proc.stderr, say, lines), daemon=True)
    relay.start()
    try:
        proc.stdin.write(json.dumps(config_to_dict(cfg)))
        proc.stdin.close()
        out = proc.stdout.read()
        proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: no search left running behind
            proc.kill()
            proc.wait()
        relay.join()  # the relay has read stderr to its end before it is closed
        proc.stdout.close()
        proc.stderr.close()
    if proc.returncode:
        last = next((ln for ln in reversed(lines) if ln.strip()), f"exit {proc.returncode}")
        raise SettingsError(f"the settings search failed: {last}")
    return Resolution.from_dict(json.loads(out))


def _relay(stream, say, lines: list[str]) -> None:
    """Every line of `stream` kept in `lines`; the search's own (its heading and candidates)
    passed to `say` as they come."""
    for line in stream:
        line = line.rstrip("\n")
        lines.append(line)
        if say and (line.startswith("  ") or line.startswith("settings search")):
            say(line)


def compile_on(mesh: jax.sharding.Mesh) -> Callable[[Any], None]:
    """A `confirm` that compiles the resolved step on `mesh` (the run's devices): `Refused`
    where its compiler runs out of memory (`target_memory.refused_bytes` reads the message)."""

    def confirm(cfg) -> None:
        from trn_accum.train import step

        try:
            step.build_step(cfg, mesh).lowered.compile()
        except Exception as e:
            asked = refused_bytes(str(e))
            if asked is None:
                raise
            raise Refused(f"its compiler asked {asked / 2**30:.2f} GiB") from None

    return confirm


def for_run(cfg: Config, mesh: jax.sharding.Mesh) -> tuple[Config, Resolution]:
    """`Trainer.build`'s settings hook: (cfg with every "auto" chosen, the Resolution)."""
    target = target_of(mesh)
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    say = (
        (lambda line: print(line, file=sys.stderr, flush=True))
        if jax.process_index() == 0
        else None
    )
    res = resolve(cfg, target, confirm=None if on_cpu else compile_on(mesh), say=say)
    return res.apply(cfg), res


def main(argv=None) -> int:
    """The subprocess: the target as JSON in argv, the config dict on stdin, the Resolution as
    JSON on stdout, the search's progress on stderr."""
    p = argparse.ArgumentParser(prog="python -m trn_accum.plan.settings_run")
    p.add_argument("target")
    a = p.parse_args(argv)
    target = Target(**json.loads(a.target))
    cfg = config_from_dict(json.loads(sys.stdin.read()))
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    try:
        s = search(cfg, target, say=say)
        res = confirmed(cfg, s.rows, target.nodes, s.plat.name, s.budget, None, t0)
    except SettingsError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(json.dumps(res.to_dict(), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
