"""MkDocs hooks: the pages generated at every build, so they cannot go stale.

- ``examples.md``: every ``examples/*.py``, included whole (a test runs each one).
- ``reference/MODULE.md``: one page per module that mkdocs.yml's ``extra.reference``
  names, rendered by mkdocstrings from the docstrings, and the nav's Reference section.
- ``performance.md``: its text rendered from ``docs/perf/*.json`` by the benchmarks'
  own renderer (``benchmarks.docs.docs_page``), with the plots beside the JSON.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _summary(path: Path) -> str:
    """The first line of the module docstring of ``path``."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def examples_page() -> str:
    """The Markdown of the examples page: one section per file, its source included."""
    lines = [
        "# Examples",
        "",
        "Every program in `examples/`, as it is in the repository. Each runs on a CPU in"
        " seconds with a tiny model built from a config (no downloads), and"
        " `tests/test_examples.py` runs every one, so none of them can drift from the library."
        " Run one from the repository root: `python examples/NAME.py`.",
        "",
    ]
    for path in sorted(EXAMPLES.glob("*.py")):
        lines += [
            f"## `{path.name}` {{ #{path.stem} }}",
            "",
            _summary(path),
            "",
            "```python",
            f'--8<-- "examples/{path.name}"',
            "```",
            "",
        ]
    return "\n".join(lines)


def reference_page(module: str) -> str:
    """The Markdown of ``module``'s reference page."""
    return f"# `{module}`\n\n::: {module}\n"


def on_config(config: Any) -> Any:
    """Fill the nav's Reference section with a page per module of ``extra.reference``."""
    pages = [{module: f"reference/{module}.md"} for module in config["extra"]["reference"]]
    for entry in config["nav"]:
        if isinstance(entry, dict) and "Reference" in entry:
            entry["Reference"] = pages
    return config


def on_files(files: Any, config: Any) -> Any:
    """Add the generated pages: the examples, and the reference."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, "examples.md", content=examples_page()))
    for module in config["extra"]["reference"]:
        page = File.generated(config, f"reference/{module}.md", content=reference_page(module))
        files.append(page)
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace performance.md's text by the page rendered from the benchmarks' JSON."""
    if page.file.src_uri != "performance.md":
        return markdown
    from benchmarks.docs import docs_page

    docs = ROOT / "docs"
    return docs_page(docs / "perf", docs)
