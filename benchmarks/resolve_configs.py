"""The shipped configs' settings are the settings search's output: benchmarks/resolutions.json.

    .venv/bin/python benchmarks/resolve_configs.py               # every config: search, rewrite
    .venv/bin/python benchmarks/resolve_configs.py --only NAME   # one of them
    .venv/bin/python benchmarks/resolve_configs.py --only NAME --from DRY_RUN.json
                                       # store a dry-run JSON that RECORDS[NAME]'s command wrote

For each config of `RECORDS`, the `trn-accum dry-run ... --no-step-time --json` that runs the
settings search `trn-accum train` runs (`trn_accum.plan.settings.choose`) on its target: the
calibration `-auto` configs as they are (every setting "auto"), the 3B config with its six
settings set to "auto" on the command line. The record keeps the command, the target, the config
as the search read it, the JAX version and program, and the Resolution: every candidate priced,
with its op features, collectives and peak bytes, and the pick.

tests/test_resolutions.py holds the configs to the records: the 3B config states the pick, every
record's search replayed at today's constants (`trn_accum.analysis.platforms`, the search's own
stages and headroom rule, with each compile read from the record) picks what it stored, and one
stored candidate compiled afresh prices as stored. So a change to a config, to the step-time
model's constants or to the search's rules that moves a pick fails there, until this script is
rerun and the config states the new pick. The 3B's search compiles each candidate on 128 emulated
devices: about a minute each on 2 idle cores, 10-20 minutes in all; a proxy's 1-2 minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import shlex
import subprocess
import sys

from trn_accum.config.auto import AUTO_KEYS

ROOT = pathlib.Path(__file__).resolve().parents[1]
TABLE = ROOT / "benchmarks" / "resolutions.json"
AUTO_SETS = [f"{key}=auto" for key in AUTO_KEYS]
# name -> (config, overrides, dry-run flags beside --config/--set)
RECORDS = {
    "fuji-3b-trn2": ("configs/fuji-3b-trn2.toml", AUTO_SETS, ["--devices", "64"]),
    "proxy-tpu-v5e-l4-auto": (
        "configs/calibration/proxy-tpu-v5e-l4-auto.toml",
        [],
        ["--platform", "tpu-v5e", "--devices", "1"],
    ),
    "proxy-tpu-v5e-l4-s8192-auto": (
        "configs/calibration/proxy-tpu-v5e-l4-s8192-auto.toml",
        [],
        ["--platform", "tpu-v5e", "--devices", "1"],
    ),
}


def command(name: str) -> list[str]:
    """The dry-run argv (after `trn-accum`) whose search `name`'s record stores."""
    config, overrides, flags = RECORDS[name]
    sets = [a for o in overrides for a in ("--set", o)]
    return ["dry-run", "--config", config, *flags, *sets, "--no-step-time", "--json"]


def record(name: str, dry_run: dict) -> dict:
    """The record of `name` from the dry-run JSON its command printed."""
    from trn_accum.config.load import config_to_dict, load_config

    config, overrides, _ = RECORDS[name]
    res = dry_run["train_will_run"]
    program = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    import jax

    return {
        "command": "trn-accum " + shlex.join(command(name)),
        "config": config,
        "overrides": overrides,
        "target": {
            "platform": res["platform"],
            "devices_per_node": dry_run["devices"],
            "nodes": dry_run["nodes"],
        },
        "config_read": config_to_dict(load_config(ROOT / config, overrides)),
        "jax_version": jax.__version__,
        "program": program,
        "date": datetime.date.today().isoformat(),
        "resolution": res,
    }


def run(name: str) -> dict:
    """`name`'s dry-run, run here (its search's progress on stderr), as JSON."""
    argv = [sys.executable, "-m", "trn_accum.cli", *command(name)]
    print(f"{name}: {shlex.join(argv[2:])}", file=sys.stderr, flush=True)
    out = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=sorted(RECORDS), help="one config (default: all)")
    p.add_argument("--from", dest="from_json", help="the dry-run JSON of --only's command")
    a = p.parse_args(argv)
    if a.from_json and not a.only:
        p.error("--from needs --only NAME")
    table = json.loads(TABLE.read_text()) if TABLE.exists() else {"records": {}}
    table["about"] = __doc__.split("\n\n")[2].replace("\n", " ")
    for name in [a.only] if a.only else sorted(RECORDS):
        got = json.loads(pathlib.Path(a.from_json).read_text()) if a.from_json else run(name)
        table["records"][name] = record(name, got)
        print(f"{name}: {table['records'][name]['resolution']['line']}", flush=True)
    TABLE.write_text(json.dumps(table, indent=1, sort_keys=True, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
