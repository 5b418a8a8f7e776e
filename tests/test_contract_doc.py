"""docs/contract.md states every rule the code and tests cite, each pinned by a real test.

Pure file reading: no engine, no clock, no threads.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = ROOT / "docs" / "contract.md"
RULE = re.compile(r"\bL\d{1,3}\b")
ROW = re.compile(r"^\| (L\d{1,3}) \| (.+?) \| (.+?) \|$")
# Where the project cites rules: its code, tests, examples and docs (not generated figures).
CITING = [
    *ROOT.glob("omni_trio/**/*.py"),
    *ROOT.glob("tests/**/*.py"),
    *ROOT.glob("examples/*.py"),
    *ROOT.glob("benchmarks/**/*.py"),
    *ROOT.glob("docs/**/*.md"),
    ROOT / "README.md",
]


def contract_rows() -> dict[str, tuple[str, list[str]]]:
    """Parse the rule tables: number -> (promise, pinning tests)."""
    rows: dict[str, tuple[str, list[str]]] = {}
    for line in CONTRACT.read_text(encoding="utf-8").splitlines():
        match = ROW.match(line)
        if match is None:
            continue
        number, promise, pinned = match.groups()
        assert number not in rows, f"{number} is defined twice in docs/contract.md"
        rows[number] = (promise, [test.strip() for test in pinned.split(",")])
    return rows


def docstrings(path: Path) -> dict[str, str]:
    """Map each function and class of a module (also ``Class.method``) to its docstring."""
    found: dict[str, str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = prefix + child.name
                found[name] = ast.get_docstring(child) or ""
                visit(child, name + ".")

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return found


def test_contract_page_defines_rules() -> None:
    """The page parses into rules, each with a promise and at least one pinning test."""
    rows = contract_rows()
    assert rows, "no rule table parsed from docs/contract.md"
    for number, (promise, tests) in rows.items():
        assert promise.endswith("."), f"{number}: the promise should be one sentence"
        assert tests, f"{number} has no pinning test"


def test_every_cited_rule_is_defined() -> None:
    """No file cites an L-number that docs/contract.md does not define."""
    defined = set(contract_rows())
    undefined: dict[str, set[str]] = {}
    for path in CITING:
        if path == CONTRACT or not path.is_file():
            continue
        for number in RULE.findall(path.read_text(encoding="utf-8")):
            if number not in defined:
                undefined.setdefault(number, set()).add(str(path.relative_to(ROOT)))
    assert not undefined, f"cited but not in docs/contract.md: {undefined}"


def rule_order(number: str) -> int:
    """Sort key: L7 before L10."""
    return int(number[1:])


RULES: list[str] = sorted(contract_rows(), key=rule_order)


@pytest.mark.parametrize("number", RULES)
def test_rule_is_pinned_by_an_existing_test_that_names_it(number: str) -> None:
    """Each pinning test exists, is a test, and names its rule in its docstring."""
    _, tests = contract_rows()[number]
    for test in tests:
        file, _, name = test.partition("::")
        path = ROOT / file
        assert path.is_file(), f"{number}: {file} does not exist"
        docs = docstrings(path)
        assert name in docs, f"{number}: {test} does not exist"
        assert name.rpartition(".")[2].startswith("test_"), f"{number}: {test} is not a test"
        assert number in RULE.findall(docs[name]), f"{number}: {test} does not name {number}"


def test_project_files_speak_of_the_project_alone() -> None:
    """No file of the project points to an outside design document."""
    # Spelled in pieces so that this file does not match itself.
    shared, brief = "shared", "brief"
    outside = re.compile(rf"\.\./{shared}|{shared}/design|design {brief}|\bthe {brief}\b")
    files = [
        *CITING,
        *ROOT.glob("scripts/*"),
        *ROOT.glob(".ci/*"),
        ROOT / "pyproject.toml",
    ]
    citing = sorted(
        str(path.relative_to(ROOT))
        for path in files
        if path.is_file() and outside.search(path.read_text(encoding="utf-8"))
    )
    assert not citing, f"these files cite an outside brief: {citing}"
