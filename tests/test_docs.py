"""The site's code samples cannot drift from code that runs.

Every ```python block under docs/ is a copy of a file under examples/ or docs/snippets/,
named in its fence (```python title="examples/NAME.py"```), and its text is the file's,
so a page reads the same on GitHub, which has no includes, as on the site
(``docs/hooks/site.py`` checks the copies at every build too, and
``python docs/hooks/site.py`` rewrites them). tests/test_examples.py runs every example,
and every snippet is run by the test file that ``SNIPPETS_RUN_BY`` names (a sample that
needs a model, a GPU or a server runs there with a tiny pipeline, a fake runner or a
local server, and the page says what to change). The README's Python blocks are such
files' text. The Performance page is what the benchmarks' JSON renders, and the
generated examples page shows every example. The install page's extras table lists
every extra, and the benchmarks' help every benchmark.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from benchmarks.docs import docs_page
from benchmarks.suite import BENCHMARKS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

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
    "output_store.py": "tests/serve/test_output_urls.py",
    "probe_abort.py": "tests/test_doc_snippets.py",
    "ray_deployment.py": "tests/test_doc_snippets.py",
    "ray_model_spec.py": "tests/serve/test_ray.py",
    "real_runner.py": "tests/test_docs.py",
    "request_ledger.py": "tests/test_doc_snippets.py",
    "step_cache_policies.py": "tests/test_doc_snippets.py",
    "trajectory_client.py": "tests/serve/test_trajectory_http.py",
    "test_guide.py": "tests/test_examples.py",
    "tutorial_abort.py": "tests/test_examples.py",
    "tutorial_break.py": "tests/test_examples.py",
    "video_request.py": "tests/test_doc_snippets.py",
    "video_sdk.py": "tests/test_doc_snippets.py",
}


@cache
def _site_hooks() -> ModuleType:
    """docs/hooks/site.py, the module mkdocs loads, imported once."""
    name = "omni_trio_site_hooks"
    spec = importlib.util.spec_from_file_location(name, DOCS / "hooks" / "site.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as mkdocs does: its dataclass needs the module registered
    spec.loader.exec_module(module)
    return module


PAGES: list[Path] = _site_hooks().pages()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_every_python_block_is_a_copy_of_its_file(page: Path) -> None:
    """A sample on a page names the file it copies, and is that file's text verbatim."""
    problems = _site_hooks().copy_problems(page.read_text(), str(page.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


def test_no_page_has_an_include_that_github_shows_as_text() -> None:
    """No page carries a snippet include (``--8<--``): GitHub would show it literally."""
    for page in PAGES:
        assert "--8<--" not in page.read_text(), page.relative_to(ROOT)


def test_a_stale_copy_is_found_and_synced() -> None:
    """A copy whose file changed is reported (so the strict build fails), and the sync
    rewrites it, at any indentation; a block with no title is reported."""
    hooks = _site_hooks()
    text = (ROOT / "examples" / "quickstart.py").read_text()
    page = (
        "Intro\n\n"
        '```python title="examples/quickstart.py"\n' + text.replace("a flower", "a tree") + "```\n"
        "\n- in a list:\n\n"
        '    ```python title="docs/snippets/real_runner.py"\n    runner = None\n    ```\n'
        "\n```python\nprint()\n```\n"
    )
    problems = hooks.copy_problems(page, "page.md")
    fences = [n for n, line in enumerate(page.splitlines(), 1) if "```python" in line]
    assert [p.split(": ", 1)[0] for p in problems] == [f"page.md:{n}" for n in fences]
    assert "differs from the file" in problems[0]
    assert "names no file" in problems[2]
    synced = hooks.synced(page)
    left = hooks.copy_problems(synced, "page.md")
    assert [p.split(": ", 1)[1] for p in left] == [problems[2].split(": ", 1)[1]]
    snippet = (DOCS / "snippets" / "real_runner.py").read_text()
    indented = "".join(f"    {line}" if line.strip() else line for line in snippet.splitlines(True))
    assert indented in synced


def test_the_readmes_python_blocks_are_files_a_test_runs() -> None:
    """README.md (read on GitHub, which has no includes) shows files' text verbatim."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", readme, flags=re.DOTALL | re.MULTILINE)
    files = [*(ROOT / "examples").glob("*.py"), *(DOCS / "snippets").glob("*.py")]
    texts = {path.read_text() for path in files}
    assert len(blocks) >= 2
    for block in blocks:
        assert block in texts, f"a README block that is no example or snippet:\n{block}"


def test_every_copied_file_is_a_file_a_test_runs() -> None:
    """Pages copy examples/*.py or docs/snippets/*.py; every snippet has its test and a page."""
    copied = {block.path for page in PAGES for block in _site_hooks().copies(page.read_text())}
    assert copied, "no page shows a file"
    snippets = {p.name for p in (DOCS / "snippets").glob("*.py")}
    assert snippets == set(SNIPPETS_RUN_BY)
    for name, test_file in SNIPPETS_RUN_BY.items():
        assert name in (ROOT / test_file).read_text(), (name, test_file)
        assert f"docs/snippets/{name}" in copied, f"docs/snippets/{name} is on no page"


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


def test_examples_page_shows_every_example() -> None:
    """The generated examples page has a section and a checked copy of each examples/*.py."""
    hooks = _site_hooks()
    page: str = hooks.examples_page()
    assert hooks.copy_problems(page, "examples.md") == []
    shown = {block.path for block in hooks.copies(page)}
    for path in sorted((ROOT / "examples").glob("*.py")):
        assert f"examples/{path.name}" in shown
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


def test_the_install_pages_table_lists_every_extra() -> None:
    """docs/install.md's extras table has a row for each extra pyproject.toml defines."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    table = (DOCS / "install.md").read_text().split("\n## Extras\n", 1)[1].split("\n## ")[0]
    rows = re.findall(r"^\| `([\w-]+)` \|", table, flags=re.MULTILINE)
    assert sorted(rows) == sorted(extras), "docs/install.md's extras table"


def test_the_benchmarks_help_lists_every_benchmark_in_the_suites_order() -> None:
    """``python -m benchmarks --help`` (its description is the module's docstring) names
    every benchmark the suite runs, in its order (the order ``all`` runs them in), then
    ``all``."""
    import benchmarks.__main__

    shown = benchmarks.__main__.__doc__ or ""
    listed = re.findall(r"^([a-z-]+) {2,}\S", shown, flags=re.MULTILINE)
    assert listed == [*BENCHMARKS, "all"]
