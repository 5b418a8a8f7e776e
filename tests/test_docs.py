"""The site's code samples cannot drift from code that runs.

Every ```python block under docs/ is an include (the snippets directive,
``--8<-- "PATH"``) of a file under examples/ or docs/snippets/: tests/test_examples.py
runs every example, and every snippet is run by the test file that ``SNIPPETS_RUN_BY``
names (a sample that needs a model, a GPU or a server runs there with a tiny pipeline,
a fake runner or a local server, and the page says what to change). The README's
Python blocks are such files' text. The Performance page is what the benchmarks' JSON
renders, and the generated examples page lists every example.
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

#: Each file of docs/snippets/ and the test file that runs it.
SNIPPETS_RUN_BY = {
    "adapter_calls.py": "tests/test_doc_snippets.py",
    "assume_step_time.py": "tests/test_doc_snippets.py",
    "build_service.py": "tests/test_doc_snippets.py",
    "create_app.py": "tests/test_doc_snippets.py",
    "decode_defaults.py": "tests/test_doc_snippets.py",
    "diffusers_runner.py": "tests/test_doc_snippets.py",
    "edit_client.py": "tests/test_doc_snippets.py",
    "edit_request.py": "tests/test_doc_snippets.py",
    "images_sdk.py": "tests/test_doc_snippets.py",
    "mount_service.py": "tests/test_doc_snippets.py",
    "probe_abort.py": "tests/test_doc_snippets.py",
    "ray_deployment.py": "tests/test_doc_snippets.py",
    "real_runner.py": "tests/test_docs.py",
    "request_ledger.py": "tests/test_doc_snippets.py",
    "step_cache_policies.py": "tests/test_doc_snippets.py",
    "test_guide.py": "tests/test_examples.py",
    "tutorial_abort.py": "tests/test_examples.py",
    "tutorial_break.py": "tests/test_examples.py",
    "video_request.py": "tests/test_doc_snippets.py",
    "video_sdk.py": "tests/test_doc_snippets.py",
}


def _blocks(page: Path) -> list[tuple[int, str]]:
    """Each Python block of ``page``: its line and its body."""
    text = page.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(2)) for m in FENCE.finditer(text)]


def _includes(body: str) -> list[str] | None:
    """The paths ``body`` includes, or ``None`` if it is not only includes."""
    lines = [line for line in body.splitlines() if line.strip()]
    found = [INCLUDE.match(line.strip()) for line in lines]
    if not lines or not all(found):
        return None
    return [m.group(1) for m in found if m]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_every_python_block_is_an_include(page: Path) -> None:
    """A sample on the site is a file a test runs, included: never text of its own."""
    for line, body in _blocks(page):
        assert _includes(body) is not None, (
            f"{page.relative_to(ROOT)}:{line}: a ```python block that is not an include"
            ' (--8<-- "examples/NAME.py" or "docs/snippets/NAME.py")'
        )


def test_the_readmes_python_blocks_are_files_a_test_runs() -> None:
    """README.md (read on GitHub, which has no includes) shows files' text verbatim."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", readme, flags=re.DOTALL | re.MULTILINE)
    files = [*(ROOT / "examples").glob("*.py"), *(DOCS / "snippets").glob("*.py")]
    texts = {path.read_text() for path in files}
    assert len(blocks) >= 2
    for block in blocks:
        assert block in texts, f"a README block that is no example or snippet:\n{block}"


def test_every_include_is_a_file_a_test_runs() -> None:
    """Includes name examples/*.py or docs/snippets/*.py; every snippet has its test."""
    included = set()
    for page in PAGES:
        for _, body in _blocks(page):
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
