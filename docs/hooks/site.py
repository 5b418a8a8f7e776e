"""MkDocs hooks: the pages generated at every build, so they cannot go stale, and the
check that every code sample on a page is a copy of the file a test runs.

- ``examples.md``: every ``examples/*.py``, its text copied in whole (a test runs each one).
- ``reference/MODULE.md``: one page per module that mkdocs.yml's ``extra.reference``
  names, rendered by mkdocstrings from the docstrings, and the nav's Reference section.
- ``performance.md``: its text rendered from ``docs/perf/*.json`` by the benchmarks' own
  renderer (``benchmarks.docs.docs_page``), with the plots beside the JSON.

A Python block on a page names the file it shows in its fence, ```python
title="examples/NAME.py"```, and its body is that file's text, so the page reads the same
on GitHub (which has no includes) as on the site. A block that is no such copy, or whose
text differs from its file, is a warning, which fails ``mkdocs build --strict``;
``python docs/hooks/site.py`` rewrites every copy from its file.
"""

from __future__ import annotations

import ast
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DOCS = ROOT / "docs"
#: Folders of docs/ that are not pages of the site (mkdocs.yml's exclude_docs).
NOT_PAGES = frozenset({"perf", "measurements", "hooks", "snippets"})
#: A Python block: the fence's indentation, the rest of its opening line, its body.
BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)```(?:python|py)\b(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    flags=re.DOTALL | re.MULTILINE,
)
TITLE = re.compile(r'\btitle="(?P<path>[^"]+)"')
#: What a block may copy: an example, or a snippet under docs/snippets/.
COPYABLE = re.compile(r"(examples|docs/snippets)/[\w.]+\.py")
SYNC = "python docs/hooks/site.py"

log = logging.getLogger("mkdocs.hooks.site")


@dataclass(frozen=True, slots=True, kw_only=True)
class Copy:
    """One Python block of a page: where it is, the file its title names, its text."""

    line: int
    path: str | None
    body: str
    start: int
    end: int
    indent: str


def pages() -> list[Path]:
    """The site's Markdown pages under docs/ (the generated ones aside)."""
    return sorted(p for p in DOCS.rglob("*.md") if not NOT_PAGES & set(p.relative_to(DOCS).parts))


def copies(text: str) -> list[Copy]:
    """Each Python block of ``text``, its body without the fence's indentation."""
    found = []
    for match in BLOCK.finditer(text):
        indent = match["indent"]
        lines = match["body"].splitlines(keepends=True)
        body = "".join(line.removeprefix(indent) for line in lines)
        title = TITLE.search(match["info"])
        found.append(
            Copy(
                line=text.count("\n", 0, match.start()) + 1,
                path=title["path"] if title else None,
                body=body,
                start=match.start("body"),
                end=match.end("body"),
                indent=indent,
            )
        )
    return found


def copy_problems(text: str, where: str) -> list[str]:
    """What is wrong with the Python blocks of ``text`` (page ``where``): one line each."""
    problems = []
    for block in copies(text):
        at = f"{where}:{block.line}"
        if block.path is None:
            problems.append(
                f'{at}: a ```python block names no file (```python title="examples/NAME.py"'
                ' or "docs/snippets/NAME.py"): code on a page is a copy of a file a test runs'
            )
        elif not COPYABLE.fullmatch(block.path) or not (ROOT / block.path).is_file():
            problems.append(f"{at}: {block.path} is no file under examples/ or docs/snippets/")
        elif (ROOT / block.path).read_text() != block.body:
            problems.append(f"{at}: the copy of {block.path} differs from the file: {SYNC}")
    return problems


def synced(text: str) -> str:
    """``text`` with every titled block's body replaced by its file's current text."""
    for block in reversed(copies(text)):
        if block.path is None or not (ROOT / block.path).is_file():
            continue
        lines = (ROOT / block.path).read_text().splitlines(keepends=True)
        body = "".join(block.indent + line if line.strip() else line for line in lines)
        text = text[: block.start] + body + text[block.end :]
    return text


def _summary(path: Path) -> str:
    """The first line of the module docstring of ``path``."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def examples_page() -> str:
    """The Markdown of the examples page: one section per file, its text copied in."""
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
            f'```python title="examples/{path.name}"',
            path.read_text().rstrip("\n"),
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
    """Warn of a code block that is no copy of its file; render performance.md's text."""
    for problem in copy_problems(markdown, f"docs/{page.file.src_uri}"):
        log.warning(problem)
    if page.file.src_uri != "performance.md":
        return markdown
    # The `mkdocs` command puts its own folder on sys.path, not the repository's (only
    # `python -m mkdocs` does): the benchmarks' renderer is imported from the checkout.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.docs import docs_page

    return docs_page(DOCS / "perf", DOCS)


def main() -> int:
    """Rewrite every page's copies from their files; report the pages changed."""
    for path in pages():
        text = path.read_text()
        new = synced(text)
        if new != text:
            path.write_text(new)
            sys.stdout.write(f"synced {path.relative_to(ROOT)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
