"""docs/data.md holds: its TOML [data] table loads as a config, and its worked example runs as
written and prints what its comments say."""

from __future__ import annotations

import contextlib
import io
import re
import tomllib
from pathlib import Path

from trn_accum.config.load import config_from_dict

DOC = Path(__file__).resolve().parents[1] / "docs" / "data.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


def test_the_toml_mixture_loads():
    (table,) = _blocks("toml")
    raw = tomllib.loads(table)
    cfg = config_from_dict({**raw, "model": {"max_seq_len": raw["data"]["seq_len"]}})
    assert [c["weight"] for c in cfg.data.mixture] == [0.5, 0.3, 0.2]
    assert cfg.data.kind == "mixture"


def test_the_worked_example_runs_and_prints_its_comments():
    (code,) = _blocks("python")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {})
    said = [line.split("# ", 1)[1] for line in code.splitlines() if "print(" in line]
    assert out.getvalue().splitlines() == said
