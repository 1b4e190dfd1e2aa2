"""The layout is the architecture: imports run one way, no cycles, modules stay small.

Every `import trn_accum...` in the package is read with `ast` (function-level imports too), and
the graph is checked against the layers of docs/design.md:

    errors  <-  core  <-  model  <-  data, checkpoint  <-  config  <-  train  <-  plan, interop
            <-  cli
                  neuron/, analysis/, cluster/ beside, never importing train, plan, cli or model
                  optax.py (the optax adapters) imports core alone
"""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "trn_accum"

# package room -> rooms it may import (itself always allowed)
LOWER = ("data", "checkpoint", "config")  # what the trainer is built from
ALLOWED = {
    "errors": set(),
    "core": set(),  # JAX only
    "neuron": {"errors", "analysis"},  # preflight reads the HLO parser
    "analysis": {"errors", "core", "neuron"},  # steptime reads neuron.platform figures
    "model": {"errors", "core", "neuron"},  # the NKI adapter lives in neuron/kernels.py
    "cluster": {"errors", "neuron"},
    "data": {"errors"},  # prepared token files and datasets: NumPy, no JAX model
    "checkpoint": {"errors"},  # orbax, the run dir and its readers
    # the schema's choice lists come from what implements them (core, model, data)
    "config": {"errors", "core", "model", "neuron", "data", "checkpoint"},
    "train": {"errors", "core", "model", "neuron", "analysis", "cluster", *LOWER},
    "plan": {"errors", "core", "model", "neuron", "analysis", "cluster", *LOWER, "train"},
    # Hugging Face Llama checkpoints in and out of run directories
    "interop": {"errors", "core", "model", "neuron", "analysis", "cluster", *LOWER, "train"},
    "optax": {"core", "errors"},  # optax adapters (accumulation across calls)
    "cli": {
        "errors",
        "core",
        "model",
        "neuron",
        "analysis",
        "cluster",
        *LOWER,
        "train",
        "plan",
        "interop",
    },
    "__init__": {"core"},
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """module -> trn_accum modules it imports (anywhere in the file)."""
    graph = {}
    modules = {_module_name(p) for p in PKG.rglob("*.py")}
    for path in PKG.rglob("*.py"):
        name = _module_name(path)
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from trn_accum.x import y`: y is a submodule of x, or a name defined in x
                targets = [
                    f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                ]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t.startswith("trn_accum") and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


GRAPH = _imports()


def test_no_import_cycles():
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for d in sorted(GRAPH.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d) :] + [d]))
            if not state.get(d):
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if not state.get(m):
            visit(m)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_run_one_way(module):
    room = _room(module)
    bad = sorted(
        d for d in GRAPH[module] if _room(d) != room and _room(d) not in ALLOWED[room] | {room}
    )
    assert not bad, f"{module} ({room}/) imports {bad}; allowed rooms: {sorted(ALLOWED[room])}"


def test_core_imports_only_jax_numpy_and_stdlib():
    import sys

    allowed = {"jax", "numpy", "trn_accum"} | set(sys.stdlib_module_names)
    for path in (PKG / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                tops = [node.module.split(".")[0]]
            else:
                continue
            assert set(tops) <= allowed, (path.name, tops)


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_modules_read_as_their_names(path):
    """Issue 36: a module does one job, under 400 lines, and `ruff format` lays it out (no
    `# fmt: skip/off/on` holds it in shape)."""
    lines = path.read_text().splitlines()
    name = path.relative_to(PKG.parent)
    marks = [i for i, line in enumerate(lines, 1) if "# fmt:" in line]
    assert not marks, f"{name} has `# fmt:` marks on lines {marks}"
    assert len(lines) < 400, f"{name} has {len(lines)} lines: split it by job"


def test_no_private_jax_imports():
    """Only JAX's public API: no `jax._src` import anywhere in the package (at any level)."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            if any(n == "jax._src" or n.startswith("jax._src.") for n in names):
                found.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    assert not found, f"imports of jax._src (use JAX's public API): {found}"


def test_accumulate_gradients_fits_on_a_screen():
    from trn_accum.core import accumulate

    n = len(Path(accumulate.__file__).read_text().splitlines())
    assert n <= 300, f"core/accumulate.py has {n} lines (the core idea fits in 300)"


def test_no_folder_holds_more_than_15_modules_or_a_fifth_of_the_lines():
    """A folder holds one job: at most 15 modules (its __init__ aside), and no top-level
    folder (its subfolders with it) more than 20 % of the package's lines."""
    folders = {p.parent for p in PKG.rglob("*.py")}
    crowded = {
        str(f.relative_to(PKG)): n
        for f in folders
        if (n := sum(1 for p in f.glob("*.py") if p.name != "__init__.py")) > 15
    }
    assert not crowded, f"folders over 15 modules: {crowded}"
    lines = {p: len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    total = sum(lines.values())
    share = {}
    for path, n in lines.items():
        top = path.relative_to(PKG).parts[0]
        share[top] = share.get(top, 0) + n
    heavy = {top: f"{n / total:.1%}" for top, n in share.items() if n > 0.2 * total}
    assert not heavy, f"top-level folders over 20 % of {total} lines: {heavy}"


def test_reading_a_run_dir_imports_neither_the_loop_nor_the_settings_search():
    """eval, export-hf and import-hf (interop/) build the model and read checkpoints: the
    training loop and the search that chooses "auto" settings are not theirs to load."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from trn_accum.interop import commands, convert, evaluate\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('trn_accum.'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    assert "trn_accum.interop.evaluate" in out  # the import itself happened
    search = {"autok", "autosettings", "search", "recommend"}  # wherever they live
    loaded = [
        m
        for m in out
        if m.endswith(".loop") or m.startswith("trn_accum.plan") or m.split(".")[-1] in search
    ]
    assert not loaded, f"the readers load {loaded}"
