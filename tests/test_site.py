"""The documentation site builds with ``mkdocs build --strict``, and its HTML is whole.

Strict: a broken link or anchor, a missing include (``--8<--`` with ``check_paths``) or
a reference mkdocstrings cannot resolve fails the build. Skipped, with the reason, when
the ``docs`` extra is not installed (the ``test`` extra includes it, so CI builds the
site). The built HTML is checked without a browser: every page of the navigation is
there, the search index finds "abort", the state machine is a Mermaid block, the
reference is generated from the docstrings, the examples and the benchmarks' plots are
in. ``scripts/check_site.py`` checks the same site in headless Chromium.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS_PACKAGES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers")
MISSING = [name for name in DOCS_PACKAGES if importlib.util.find_spec(name) is None]

pytestmark = pytest.mark.skipif(
    bool(MISSING),
    reason=f"the docs extra is not installed (no {', '.join(MISSING)}): pip install -e '.[docs]'",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the site once, strictly, into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-6000:]
    return out


def _page(site: Path, path: str) -> str:
    return (site / path / "index.html").read_text()


def test_every_page_of_the_navigation_is_built(site: Path) -> None:
    """Each page mkdocs.yml's nav names is in the site, and a reference page per module."""
    lines = [line.strip() for line in (ROOT / "mkdocs.yml").read_text().splitlines()]
    nav = [
        line.split(": ", 1)[1] for line in lines if line.startswith("- ") and line.endswith(".md")
    ]
    modules = [line[2:] for line in lines if line.startswith("- omni_trio")]
    assert len(nav) > 20 and "omni_trio.testing" in modules
    for page in [*nav, *(f"reference/{module}.md" for module in modules)]:
        built = site / ("" if page == "index.md" else page.removesuffix(".md")) / "index.html"
        assert built.is_file(), page


def test_the_search_index_finds_abort(site: Path) -> None:
    """The search index holds the tutorial's section on aborts."""
    index = json.loads((site / "search" / "search_index.json").read_text())
    hits = [doc["location"] for doc in index["docs"] if "abort" in doc["text"].lower()]
    assert any(location.startswith("tutorial/") for location in hits), hits[:20]


def test_the_state_machine_is_a_mermaid_diagram(site: Path) -> None:
    """The design page's state machine is left for Mermaid to draw (a browser renders it)."""
    design = _page(site, "design")
    assert '<pre class="mermaid">' in design
    assert "stateDiagram-v2" in design


def test_the_reference_is_generated_from_the_docstrings(site: Path) -> None:
    """mkdocstrings rendered the public names, with their docstrings."""
    reference = _page(site, "reference/omni_trio")
    assert 'id="omni_trio.open_engine"' in reference
    assert "Submit <code>request</code> and wait for its output" in reference
    assert 'id="omni_trio.testing.FakeRunner"' in _page(site, "reference/omni_trio.testing")
    assert 'id="omni_trio.runners.DiffusersRunner"' in _page(site, "reference/omni_trio.runners")


def test_samples_are_included_from_their_files(site: Path) -> None:
    """The examples page and the tutorial show the example files' own text."""
    examples = _page(site, "examples")
    for path in sorted((ROOT / "examples").glob("*.py")):
        assert f'id="{path.stem}"' in examples, path.name
    assert "tiny_pipeline" in _page(site, "tutorial")


def test_the_performance_page_has_every_plot(site: Path) -> None:
    """The Performance page, rendered from docs/perf/*.json, shows each benchmark's plot."""
    performance = _page(site, "performance")
    for result in sorted((ROOT / "docs" / "perf").glob("*.json")):
        assert f"perf/{result.stem}.png" in performance, result.stem
        assert (site / "perf" / f"{result.stem}.png").is_file()
