"""`explore` of a config in its own process (`python -m trn_accum.plan.perfmodel_cli`, JSON on
stdout), with as many emulated CPU devices as its nodes need: the dry-run's own process has the
devices of one node only. `start_in_subprocess` starts it (the dry-run compiles its own step
meanwhile) and returns what waits for its report, a failure as one line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from trn_accum.analysis import platforms, steptime
from trn_accum.analysis import recommend as rec
from trn_accum.analysis.hlo.partitioned import PRICING_FLAGS
from trn_accum.config.load import load_config
from trn_accum.plan.perfmodel import (
    EMULATE_NODES,
    StepTimeError,
    fitting_k,
    with_choices,
)
from trn_accum.plan.search import explore, price_config


def pricing_env(devices: int) -> dict[str, str]:
    """The environment of a process that compiles steps to price them: JAX on `devices`
    emulated CPU devices (XLA_FLAGS, before its backend starts), `PRICING_FLAGS`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = (
        f"{flags} {PRICING_FLAGS} --xla_force_host_platform_device_count={devices} "
        "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    ).strip()
    return env


class Pending:
    """A started `python -m trn_accum.plan.perfmodel_cli`: `result()` waits for its report
    (StepTimeError: why it has none, one line); `cancel()` ends it unread."""

    def __init__(self, cmd: list[str], env: dict[str, str]):
        self.err = tempfile.TemporaryFile("w+")  # a file, not a pipe: never full while unread
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=self.err, text=True
        )

    def result(self) -> dict[str, Any]:
        out, _ = self.proc.communicate()
        with self.err:
            self.err.seek(0)
            err = self.err.read()
        if self.proc.returncode:
            lines = [ln for ln in err.splitlines() if ln.strip()]
            last = lines[-1] if lines else f"exit {self.proc.returncode}"
            raise StepTimeError(f"the step-time model could not price this config: {last}")
        return json.loads(out)

    def cancel(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()
        self.err.close()


def start_in_subprocess(
    config_path: str,
    overrides: Sequence[str],
    nodes: int,
    meshes: Sequence[str] | None = None,
    *,
    platform_name: str = platforms.DEFAULT,
    devices_per_node: int | None = None,
    search: bool = True,
) -> Pending:
    """`explore` of the config on `platform_name` (nodes of `devices_per_node` devices,
    default the platform's) in a fresh process with enough emulated CPU devices, started: its
    `Pending`. Candidates on the `meshes` named (of `recommend.MESHES`; None = all);
    `search=False`: the config alone (`search.price_config`)."""
    plat = platforms.get(platform_name)
    per_node = plat.devices_per_node if devices_per_node is None else devices_per_node
    n = per_node * EMULATE_NODES  # the scale table prices the pick on up to EMULATE_NODES
    cmd = [
        sys.executable,
        "-m",
        "trn_accum.plan.perfmodel_cli",
        "--config",
        config_path,
        "--nodes",
        str(nodes),
    ] + [a for o in overrides for a in ("--set", o)]
    if meshes:
        cmd += ["--meshes", ",".join(meshes)]
    cmd += ["--platform", plat.name, "--devices-per-node", str(per_node)]
    cmd += [] if search else ["--config-only"]
    return Pending(cmd, pricing_env(n))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trn_accum.plan.perfmodel_cli")
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--meshes", default=None, help="comma-separated names of recommend.MESHES")
    p.add_argument("--platform", default=platforms.DEFAULT, choices=sorted(platforms.PLATFORMS))
    p.add_argument("--devices-per-node", type=int, default=None)
    p.add_argument("--config-only", action="store_true", help="price the config alone")
    a = p.parse_args(argv)
    plat = platforms.get(a.platform)
    layout = steptime.Layout.of(plat, devices_per_node=a.devices_per_node)
    cfg = load_config(a.config, a.overrides)
    nodes = cfg.mesh.nodes if a.nodes is None else a.nodes
    if not isinstance(cfg.trainer.accum_steps, int):
        fits = fitting_k(cfg, cfg.mesh.axes(), nodes, layout)["accum_steps"]
        cfg = with_choices(cfg, k=fits or 1)
    meshes = None if a.meshes is None else {m: rec.MESHES[m] for m in a.meshes.split(",")}
    if a.config_only:
        report = price_config(cfg, nodes=nodes, layout=layout, plat=plat)
    else:
        report = explore(cfg, nodes=nodes, layout=layout, meshes=meshes, plat=plat)
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
