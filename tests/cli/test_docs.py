"""The command line as the docs show it: serving.md's table of ``serve``'s options is the
parser's, every command line of the docs' shell blocks parses with the project's own
parser (built as ``omni_trio.cli._main`` builds it: a renamed or removed option, a bad
value or a missing required one fails here), every option an inline ``omni-trio ...``
names exists, and every page whose shell blocks run the project's commands says how to
get them (the environment ``.venv``) before the first.

Pure file reading and argparse: no server, no command is run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
from pathlib import Path

import pytest

from omni_trio.cli._env import variable
from omni_trio.cli._main import _load_command, _parser, _serve_command
from omni_trio.cli._serve import add_serve_arguments
from tests.support.cli import ROOT

SERVING = ROOT / "docs" / "serving.md"
#: The README and the site's pages (mkdocs.yml's exclude_docs leaves out these folders).
NOT_ON_SITE = {"perf", "measurements", "hooks", "snippets"}
PAGES = [
    ROOT / "README.md",
    *sorted(
        page
        for page in (ROOT / "docs").rglob("*.md")
        if not NOT_ON_SITE & set(page.relative_to(ROOT / "docs").parts)
    ),
]
#: The languages of the shell blocks (none: a plain block).
SHELL = ("", "sh", "console", "bash", "shell")

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
    """docs/serving.md's table has one row per ``serve`` option, in the order of its
    declarations (``_serve_table``, ``--help``'s order), each with its variable: an option
    added to the table needs its row there."""
    rows = [OPTION_ROW.match(line) for line in SERVING.read_text().splitlines()]
    table = [(row[1], row[2]) for row in rows if row is not None]
    assert [option for option, _ in table] == serve_options()
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
        elif fence in SHELL and COMMAND.match(line):
            assert activated, (page.name, line)
        activated = activated or ACTIVATE in line


def _parser_of_the_command_line() -> argparse.ArgumentParser:
    """``omni-trio``'s parser, as ``main`` builds it (the serve extra installed)."""
    extras = {"serve": _serve_command(), "load": _load_command()}
    assert not any(isinstance(command, str) for command in extras.values()), extras
    return _parser(extras)


def parse(argv: list[str]) -> str | None:
    """Parse ``argv`` (the arguments after ``omni-trio``) as ``main`` does, running
    nothing: ``None`` if it parses, else argparse's error."""
    parser = _parser_of_the_command_line()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            _, unknown = parser.parse_known_args(argv)
    except SystemExit as exit:
        return None if exit.code == 0 else err.getvalue().strip() or f"exit {exit.code}"
    return f"unrecognized arguments: {' '.join(unknown)}" if unknown else None


#: A shell prompt before a command: ``$ ``, ``head$ ``.
PROMPT = re.compile(r"^\S*\$\s+")
#: What ends one command of a line and starts the next.
SEPARATORS = {"|", "||", "&&", ";", "&"}


def project_commands(line: str) -> list[list[str]]:
    """The arguments after ``omni-trio`` (or ``python -m omni_trio``) of each of the
    project's commands on one shell line (its prompt, comments, ``VAR=value``
    prefixes, ``&&``, ``|`` and ``&`` understood)."""
    lexer = shlex.shlex(PROMPT.sub("", line), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in SEPARATORS:
            commands.append([])
        else:
            commands[-1].append(token)
    found = []
    for words in commands:
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            words = words[1:]
        if words and os.path.basename(words[0]) == "omni-trio":
            found.append(words[1:])
        elif words[1:3] == ["-m", "omni_trio"] and re.fullmatch(
            r"python3?", words[0].split("/")[-1]
        ):
            found.append(words[3:])
    return found


def shell_lines(page: Path) -> list[tuple[int, str]]:
    """Each logical line (continuations joined) of ``page``'s shell blocks, numbered."""
    lines: list[tuple[int, str]] = []
    fence: str | None = None
    pending = ""
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
            continue
        if fence not in SHELL:
            continue
        if not pending:
            start = number
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            lines.append((start, pending.strip()))
            pending = ""
    return lines


def doc_commands() -> list[tuple[str, list[str]]]:
    """Every project command of the docs' shell blocks: ``(PAGE:LINE, argv)``."""
    return [
        (f"{page.relative_to(ROOT)}:{number}", argv)
        for page in PAGES
        for number, line in shell_lines(page)
        for argv in project_commands(line)
    ]


def test_the_checker_finds_commands_and_refuses_a_bad_one() -> None:
    """The reading of a line and the parse that the test below relies on."""
    line = "head$ FOO=1 omni-trio serve --model tiny-sd & .venv/bin/python -m omni_trio demo  # x"
    assert project_commands(line) == [["serve", "--model", "tiny-sd"], ["demo"]]
    assert project_commands("bash scripts/bootstrap.sh && pip install x") == []
    assert parse(["serve", "--model", "tiny-sd", "--max-batch-size", "2"]) is None
    assert parse(["--version"]) is None
    assert "--no-such-option" in (parse(["serve", "--model", "x", "--no-such-option"]) or "")
    assert "--model" in (parse(["serve", "--workers", "2"]) or "")  # required
    assert "--max-batch-size" in (parse(["serve", "--model", "x", "--max-batch-size", "0"]) or "")


def test_every_command_line_in_the_docs_parses() -> None:
    """Each ``omni-trio ...`` and ``python -m omni_trio ...`` of a shell block of the README
    or the site parses with the command's own parser: its options exist and its values
    are ones the command takes."""
    commands = doc_commands()
    assert {argv[0] for _, argv in commands} >= {"demo", "serve", "load"}, commands
    assert len(commands) > 20
    failures = [
        f"{where}: omni-trio {shlex.join(argv)}: {error}"
        for where, argv in commands
        if (error := parse(argv))
    ]
    assert not failures, "\n".join(failures)


#: An inline ``omni-trio ...`` of a page's prose.
INLINE = re.compile(r"`(?:omni-trio|python -m omni_trio) ([^`]*)`")


def test_every_option_an_inline_command_names_exists() -> None:
    """Inline commands (`` `omni-trio serve --ray --replicas N` ``) hold placeholders, so
    they are not parsed whole; each option they name is one of that command's."""
    parser = _parser_of_the_command_line()
    [subparsers] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    top = {option for action in parser._actions for option in action.option_strings}
    seen = 0
    for page in PAGES:
        for match in INLINE.finditer(page.read_text()):
            words = match.group(1).split()
            command = subparsers.choices.get(words[0]) if words else None
            known = top | {o for a in (command or parser)._actions for o in a.option_strings}
            for word in words:
                if word.startswith("--"):
                    seen += 1
                    option = word.split("=", 1)[0]
                    assert option in known, (
                        f"{page.relative_to(ROOT)}: {match.group(0)} names {option}, an option"
                        f" omni-trio {words[0]} does not have"
                    )
    assert seen > 5
