"""The site's code samples cannot drift from code that runs.

Every ```python block under docs/ is either an include (the snippets directive,
``--8<-- "PATH"``) of a file under examples/ or docs/snippets/, or is marked
``<!-- not-run: REASON -->`` on the line before it. tests/test_examples.py runs every
example; every snippet is run by the test file that ``SNIPPETS_RUN_BY`` names. The
Performance page is what the benchmarks' JSON renders, and the generated examples page
lists every example.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from benchmarks.docs import docs_page

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: The site's pages: mkdocs.yml's exclude_docs leaves out these folders.
NOT_ON_SITE = {"perf", "measurements", "hooks", "snippets"}
PAGES = sorted(p for p in DOCS.rglob("*.md") if not NOT_ON_SITE & set(p.relative_to(DOCS).parts))
# Fences at any indentation (inside a list item too).
FENCE = re.compile(
    r"^[ \t]*```(python|py)\b[^\n]*\n(.*?)^[ \t]*```", flags=re.DOTALL | re.MULTILINE
)
INCLUDE = re.compile(r'^--8<-- "([^"]+)"$')
NOT_RUN = re.compile(r"^<!-- not-run: (\S.*) -->$")

#: Each file of docs/snippets/ and the test file that runs it.
SNIPPETS_RUN_BY = {
    "real_runner.py": "tests/test_docs.py",
    "test_guide.py": "tests/test_examples.py",
    "tutorial_abort.py": "tests/test_examples.py",
    "tutorial_break.py": "tests/test_examples.py",
}


def _blocks(page: Path) -> list[tuple[int, str, str]]:
    """Each Python block of ``page``: its line, the line before it, its body."""
    text = page.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        blocks.append((text[: match.start()].count("\n") + 1, before, match.group(2)))
    return blocks


def _includes(body: str) -> list[str] | None:
    """The paths ``body`` includes, or ``None`` if it is not only includes."""
    lines = [line for line in body.splitlines() if line.strip()]
    found = [INCLUDE.match(line.strip()) for line in lines]
    if not lines or not all(found):
        return None
    return [m.group(1) for m in found if m]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_every_python_block_is_an_include_or_marked_not_run(page: Path) -> None:
    """A sample is a file a test runs, or says on the line before it why it is not run."""
    for line, before, body in _blocks(page):
        if _includes(body) is None:
            assert NOT_RUN.match(before), (
                f"{page.relative_to(ROOT)}:{line}: a ```python block that is neither an"
                ' include (--8<-- "examples/NAME.py") nor marked <!-- not-run: REASON -->'
            )


def test_every_include_is_a_file_a_test_runs() -> None:
    """Includes name examples/*.py or docs/snippets/*.py; every snippet has its test."""
    included = set()
    for page in PAGES:
        for _, _, body in _blocks(page):
            included.update(_includes(body) or [])
    assert included, "no page includes a file"
    for path in included:
        assert (ROOT / path).is_file(), path
        assert re.fullmatch(r"(examples|docs/snippets)/[\w.]+\.py", path), path
    snippets = {p.name for p in (DOCS / "snippets").glob("*.py")}
    assert snippets == set(SNIPPETS_RUN_BY)
    for name, test_file in SNIPPETS_RUN_BY.items():
        assert name in (ROOT / test_file).read_text(), (name, test_file)
        assert f"docs/snippets/{name}" in included, f"docs/snippets/{name} is on no page"


def test_real_runner_snippet_makes_a_runner() -> None:
    """docs/snippets/real_runner.py makes the step-by-step runner of a diffusers pipeline."""
    from omni_trio.runners import DiffusersRunner, tiny_pipeline

    namespace: dict[str, Any] = {"pipeline": tiny_pipeline("sd")}
    exec((DOCS / "snippets" / "real_runner.py").read_text(), namespace)
    runner = namespace["runner"]
    try:
        assert isinstance(runner, DiffusersRunner)
    finally:
        runner.close()


def _site_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("site_hooks", DOCS / "hooks" / "site.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_examples_page_includes_every_example() -> None:
    """The generated examples page has a section and an include for each examples/*.py."""
    page: str = _site_hooks().examples_page()
    for path in sorted((ROOT / "examples").glob("*.py")):
        assert f'--8<-- "examples/{path.name}"' in page
        assert f"{{ #{path.stem} }}" in page


def test_performance_page_is_what_the_json_renders() -> None:
    """docs/performance.md is the benchmarks' JSON rendered (the site renders it again)."""
    assert (DOCS / "performance.md").read_text() == docs_page(DOCS / "perf", DOCS), (
        "docs/performance.md is stale: python -m benchmarks.docs"
    )


def _nav_section(title: str) -> list[str]:
    """The pages mkdocs.yml's nav lists under the section ``title``, in order."""
    lines = (ROOT / "mkdocs.yml").read_text().splitlines()
    start = lines.index(f"  - {title}:")
    pages = []
    for line in lines[start + 1 :]:
        if not line.startswith("      "):
            break
        pages.append(line.rsplit(": ", 1)[1])
    assert pages, title
    return pages


def _where_next() -> str:
    """docs/index.md's "Where next" section."""
    text = (DOCS / "index.md").read_text()
    return text.split("\n## Where next\n", 1)[1].split("\n## ", 1)[0]


def test_the_home_page_links_every_how_to_and_reference_page() -> None:
    """docs/index.md's "Where next" names every how-to of the nav and every reference
    module of mkdocs.yml's ``extra.reference``: a new page or module needs its link."""
    links = set(re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", _where_next()))
    for page in _nav_section("How-to guides"):
        assert page in links, f"docs/index.md's Where next does not link {page}"
    config = (ROOT / "mkdocs.yml").read_text()
    modules = re.findall(r"^    - (omni_trio[\w.]*)$", config, flags=re.MULTILINE)
    assert "omni_trio.serve.ray" in modules
    for module in modules:
        assert f"reference/{module}.md" in links, module


def _contract_sections() -> dict[str, str]:
    """Each rule of docs/contract.md and the anchor of the section that defines it."""
    anchor, sections = "", {}
    for line in (DOCS / "contract.md").read_text().splitlines():
        if line.startswith("## "):
            title = re.sub(r"[^\w\s-]", "", line[3:]).strip().lower()
            anchor = re.sub(r"[\s-]+", "-", title)
        elif match := re.match(r"^\| (L\d+) \|", line):
            sections[match.group(1)] = anchor
    return sections


def test_the_home_pages_failures_link_their_rules_sections() -> None:
    """Each rule docs/index.md's table cites links the contract's section that defines it."""
    sections = _contract_sections()
    table = (DOCS / "index.md").read_text().split("## What it removes", 1)[1].split("\n## ")[0]
    cited = re.findall(r"\[(L\d+)(?:-(L\d+))?\]\(contract\.md#([\w-]+)\)", table)
    assert len(cited) >= 20, cited
    for first, last, anchor in cited:
        for rule in filter(None, (first, last)):
            assert sections.get(rule) == anchor, (rule, anchor, sections.get(rule))
    for rule in ("L40", "L57", "L78", "L81", "L86"):
        assert rule in {first for first, _, _ in cited}, rule
