"""The command line as the docs show it: serving.md's table of ``serve``'s options is the
parser's, and every page whose shell blocks run the project's commands says how to get
them (the environment ``.venv``) before the first.

Pure file reading and argparse: no server.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from omni_trio.cli._env import variable
from omni_trio.cli._serve import add_serve_arguments
from tests.support.cli import ROOT

SERVING = ROOT / "docs" / "serving.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: A row of serving.md's options table: | `--option` | `VARIABLE` | default | meaning |
OPTION_ROW = re.compile(r"^\| `(--[a-z-]+)` \| `([A-Z_]+)` \| (.+?) \| (.+) \|$")
#: A line of a shell block that runs a command of the environment.
COMMAND = re.compile(r"^(?:\S+\$ +|\$ +)?(?:[A-Z_]+=\S+ +)*(?:python|omni-trio|pip|ray)\b")
ACTIVATE = "source .venv/bin/activate"


def serve_options() -> list[str]:
    """``serve``'s long options, as its parser has them (``--help`` aside)."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    longs = ([o for o in action.option_strings if o.startswith("--")] for action in parser._actions)
    return [options[0] for options in longs if options and options[0] != "--help"]


def test_the_options_table_is_the_parsers() -> None:
    """docs/serving.md's table has one row per ``serve`` option, each with its variable: an
    option added to the parser needs its row."""
    rows = [OPTION_ROW.match(line) for line in SERVING.read_text().splitlines()]
    table = [(row[1], row[2]) for row in rows if row is not None]
    assert sorted(option for option, _ in table) == sorted(serve_options())
    assert all(name == variable(option) for option, name in table), table


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_a_page_with_commands_says_to_activate_the_environment_first(page: Path) -> None:
    """A shell block that runs ``python``, ``omni-trio``, ``pip`` or ``ray`` comes after the
    page says ``source .venv/bin/activate`` (bare, they would be the system's: a
    traceback, or "command not found"); the README's first command, before it, names
    ``.venv/bin/python``."""
    activated = False
    fence: str | None = None  # the open block's language, "" for none
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
        elif fence in ("", "sh", "console") and COMMAND.match(line):
            assert activated, (page.name, line)
        activated = activated or ACTIVATE in line
