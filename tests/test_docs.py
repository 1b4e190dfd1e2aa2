"""The docs hold: every ```python block of README.md and docs/api.md runs as written (in order,
one namespace per file, on the suite's 8 emulated CPU devices; a block preceded by
`<!-- not run -->` is skipped and counted), README.md stays within 12,000 bytes, docs/ within
100,000 (performance.md 15,000), no page reads as a diary (issue numbers, dates: only the
calibration page's measured-on dates), every relative link in README.md and docs/*.md names a
file that exists, and the tables drawn from benchmark JSON match it (docs/calibration.md's
table, docs/performance.md's error counts, docs/benchmarks.md's section)."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN_FILES = ("README.md", "docs/api.md")
README_LIMIT = 12_000  # bytes: a README a new user reads in five minutes
DOCS_LIMIT = 100_000  # bytes of docs/*.md: a manual, not a lab notebook
PERFORMANCE_LIMIT = 15_000  # docs/performance.md: what runs how fast, on what, measured how
DIARY = re.compile(r"issue [0-9]+|[0-9]{4}-[0-9]{2}-[0-9]{2}|this stop")
NOT_RUN = "<!-- not run -->"
FENCE = re.compile(r"^\s*```\s*([\w+-]*)\s*$")
INLINE_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
EXTERNAL = re.compile(r"^([a-z][a-z0-9+.-]*:|//|#)", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block: its language tag, first code line (1-based), code, and whether
    the line before its fence marks it not to run."""

    lang: str
    line: int
    code: str
    marked: bool


def code_blocks(text: str) -> list[Block]:
    """The fenced blocks of a markdown text, in order. ValueError on a fence left open."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        before = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
        end = next((j for j in range(i + 1, len(lines)) if FENCE.match(lines[j])), None)
        if end is None:
            raise ValueError(f"line {i + 1}: a code fence that is never closed")
        code = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(Block(m.group(1).lower(), i + 2, code, before == NOT_RUN))
        i = end + 1
    return blocks


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced blocks, with inline code spans removed."""
    out, inside = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            out.append((n, re.sub(r"`[^`]*`", "", line)))
    return out


def relative_links(text: str) -> list[tuple[int, str]]:
    """(line, target without #fragment) of every link to a path, inline or reference style."""
    found = []
    for n, line in prose_lines(text):
        targets = INLINE_LINK.findall(line) + REF_LINK.findall(line)
        found += [(n, t.split("#")[0]) for t in targets if not EXTERNAL.match(t)]
    return [(n, t) for n, t in found if t]


def test_code_blocks_parse_as_marked():
    text = (
        "intro\n```python\nx = 1\n```\n\n<!-- not run -->\n\n```python\nraise SystemExit\n```\n"
        "```\nmake train\n```\n```bash\nls\n```\n"
    )
    blocks = code_blocks(text)
    assert [(b.lang, b.line, b.marked) for b in blocks] == [
        ("python", 3, False),
        ("python", 9, True),
        ("", 12, False),
        ("bash", 15, False),
    ]
    assert blocks[0].code == "x = 1\n"
    with pytest.raises(ValueError, match="line 2: a code fence that is never closed"):
        code_blocks("text\n```python\nx = 1\n")


def test_relative_links_skip_code_and_urls():
    text = (
        "[a](docs/a.md#top) [b](https://x.org) [c](#here) `[d](not/a/link.md)`\n"
        "```\n[e](in/code.md)\n```\n[f]: ../examples/f.py\n[g](<docs/g.md>)\n"
    )
    assert relative_links(text) == [(1, "docs/a.md"), (5, "../examples/f.py"), (6, "docs/g.md")]


@pytest.mark.parametrize("name", RUN_FILES)
def test_python_blocks_run(name, capsys):
    """Each file's python blocks run in order in one namespace; the count is printed."""
    blocks = [
        b for b in code_blocks((REPO / name).read_text(encoding="utf-8")) if b.lang == "python"
    ]
    runnable = [b for b in blocks if not b.marked]
    assert runnable, f"{name} has no python block that runs"
    namespace: dict = {"__name__": "__docs__"}
    for b in runnable:
        try:
            exec(compile(b.code, f"{name}:{b.line}", "exec"), namespace)  # noqa: S102
        except Exception as e:  # noqa: BLE001 - name the block that failed
            pytest.fail(f"{name}: the python block at line {b.line} failed: {e!r}")
    with capsys.disabled():
        print(f"\n{name}: ran {len(runnable)} python blocks, {len(blocks) - len(runnable)} not run")


def test_readme_within_limit():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_LIMIT, (
        f"README.md is {size:,} bytes, over {README_LIMIT:,}: move detail into docs/"
    )


def test_relative_links_exist():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = [
        f"{page.relative_to(REPO)}:{n}: {target}"
        for page in pages
        for n, target in relative_links(page.read_text(encoding="utf-8"))
        if not (page.parent / target).exists()
    ]
    assert not missing, "links to files that do not exist:\n" + "\n".join(missing)


def test_docs_within_limits():
    sizes = {p.name: len(p.read_bytes()) for p in (REPO / "docs").glob("*.md")}
    assert sum(sizes.values()) <= DOCS_LIMIT, f"docs/*.md: {sum(sizes.values()):,} bytes {sizes}"
    assert sizes["performance.md"] <= PERFORMANCE_LIMIT, sizes["performance.md"]


def test_no_page_reads_as_a_diary():
    """No issue numbers, dates or progress-log phrases in README.md or docs/ (history goes to
    CHANGELOG.md); docs/calibration.md may date its measurements."""
    found = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for m in DIARY.finditer(line):
                dated = page.name == "calibration.md" and m.group(0)[0].isdigit()
                if not dated:
                    found.append(f"{page.relative_to(REPO)}:{n}: {m.group(0)}")
    assert not found, "\n".join(found)


def _docs_tables():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import docs_tables  # benchmarks/docs_tables.py: what `make docs` writes

    return docs_tables


@pytest.mark.parametrize("page", ["calibration.md", "performance.md", "benchmarks.md"])
def test_generated_tables_are_what_make_docs_writes(page):
    """docs/calibration.md's table (benchmarks/calibration.json's rows), performance.md's error
    counts (the same rows) and benchmarks.md's bench section (benchmarks/report.json): each page
    is what `make docs` renders from the sources now."""
    path = REPO / "docs" / page
    assert path.read_text(encoding="utf-8") == _docs_tables().rendered()[path], (
        f"docs/{page} is stale: run `make docs`"
    )


def test_make_docs_rewrites_stale_figures_from_the_rows():
    """A stale table gives way to the rows (TPU v5e first, every row once, the prose around it
    kept); a group's count, median |error| and rows within 15 % are recomputed."""
    dt = _docs_tables()

    def row(name, platform, measured_s, predicted_s, error_pct):
        return {
            "name": name,
            "platform": platform,
            "role": "predicted",
            "measured_s": measured_s,
            "predicted_s": predicted_s,
            "error_pct": error_pct,
        }

    rows = [row("b", "trn2", 2.0, 2.5, 25.0), row("a", "tpu-v5e", 1.0, 1.1, 10.0)]
    rows.append(row("c", "tpu-v5e", 1.0, 0.8, -20.0))
    stale = "| `old` | tpu-v5e | fitted | 9 | 9 | +0.0 % |"
    page = f"intro\n\n{dt.TABLE_HEAD}\n|---|\n{stale}\n\nafter\n"
    got = dt.calibration_page(page, rows)
    assert got.startswith("intro\n\n") and got.endswith("\n\nafter\n")
    assert [ln.split("`")[1] for ln in got.splitlines() if ln.startswith("| `")] == ["a", "c", "b"]
    assert "| `a` | tpu-v5e | predicted | 1 | 1.1 | +10.0 % |" in got
    cells = dt.group_cells(rows, "predicted", lambda r: r["platform"] == "tpu-v5e")
    assert cells == ["2", "15.0 %", "1"]
