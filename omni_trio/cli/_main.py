"""``omni-trio {demo,serve,load}`` (also ``python -m omni_trio``).

A mistake prints one line on stderr, ``omni-trio: error: <what, and what to do>``,
and no traceback unless ``--debug`` is given. Exit statuses: 0 done, 1 error (a
model that does not load, a request that fails, a missing extra), 2 usage error
(an unknown option, a bad value, a ``--model`` that is not a diffusers folder),
130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

from .._version import __version__
from ._demo import add_demo_arguments, run_demo
from ._errors import EXIT_USAGE, PROG, CommandError, report, reported
from ._given import record_given

__all__ = ["LOAD_MODULES", "SERVE_EXTRA_MODULES", "main"]

SERVE_EXTRA_MODULES = ("starlette", "hypercorn", "uvicorn", "prometheus_client", "pydantic")
"""What ``pip install 'omni_trio[serve]'`` installs, as imported."""

LOAD_MODULES = (*SERVE_EXTRA_MODULES, "httpx")
"""What ``load`` imports: the ``serve`` package (the extra) and its HTTP client."""

SERVE_EXTRA_PIP = "pip install 'omni_trio[serve]'"

_EPILOG = """\
exit status: 0 done; 1 error (a model that does not load, a request that fails,
a missing extra); 2 usage error (an unknown option, a bad value, a --model that is
not a diffusers folder); 130 interrupted. Errors print one line; --debug adds the
traceback."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        _usage_error(self.prog, message)


def _usage_error(prog: str, message: str) -> NoReturn:
    sys.stderr.write(f"{PROG}: error: {message} (see '{prog} --help')\n")
    sys.exit(EXIT_USAGE)


def _missing(modules: Sequence[str]) -> str | None:
    """The first of ``modules`` that cannot be imported, found without importing any."""
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return name
    return None


# A command's two functions (add its arguments, run it), or the name of what its
# extra is missing.
_Command = (
    tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]] | str
)


def _extra_command(modules: Sequence[str], load: Callable[[], _Command]) -> _Command:
    """``load()`` (which imports a command's functions), or what is missing when the extra is."""
    missing = _missing(modules)
    if missing is None:
        try:
            return load()
        except ImportError as exc:  # installed but broken, or a dependency of one missing
            missing = exc.name or str(exc)
    return missing


def _serve_command() -> _Command:
    """``(add_serve_arguments, run_serve)``, or what is missing when the extra is."""

    def load() -> _Command:
        from ._serve import add_serve_arguments, run_serve

        return add_serve_arguments, run_serve

    return _extra_command(SERVE_EXTRA_MODULES, load)


def _load_command() -> _Command:
    """``(add_load_arguments, run_load_command)``, or what is missing when the extra is."""

    def load() -> _Command:
        from ._loadtest_command import add_load_arguments, run_load_command

        return add_load_arguments, run_load_command

    return _extra_command(LOAD_MODULES, load)


#: What each command that needs the serve extra does, for its ``--help`` line.
_EXTRA_ABOUT = {
    "serve": "serve a model over HTTP (OpenAI images API), drain on SIGTERM",
    "load": "open-loop load test of an images endpoint: goodput and latency under an SLO",
}


def _parser(extras: Mapping[str, _Command]) -> _Parser:
    parser = _Parser(
        prog=PROG,
        description="A structured-concurrency serving engine for diffusion models.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,serve,load}")
    demo = commands.add_parser(
        "demo",
        help="generate one image with a tiny model, no downloads",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_demo_arguments(demo)
    record_given(demo)
    _add_debug(demo)
    for name, command in extras.items():
        about = _EXTRA_ABOUT[name]
        if isinstance(command, str):
            # Without the extra the options are unknown: accept any, so that whatever
            # was typed the user learns what to install.
            commands.add_parser(name, help=f"{about} (needs {SERVE_EXTRA_PIP})", add_help=False)
            continue
        command_parser = commands.add_parser(
            name,
            help=about,
            epilog=_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command[0](command_parser)
        record_given(command_parser)
        _add_debug(command_parser)
    return parser


def _add_debug(command: argparse.ArgumentParser) -> None:
    # On each command too, so that "demo ... --debug" works; SUPPRESS keeps a top-level one.
    command.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the chosen command, return its exit status.

    The ``omni-trio`` console script and ``python -m omni_trio`` both run this.

    Args:
        argv: the arguments after the program's name.

    Returns:
        The exit status: 0 done, 1 error, 2 usage error, 130 interrupted.

    Raises:
        SystemExit: from argparse, for ``--help``, ``--version`` and usage errors
            (status 0 or 2, its message already printed).
    """
    extras = {"serve": _serve_command(), "load": _load_command()}
    parser = _parser(extras)
    args, unknown = parser.parse_known_args(argv)
    command = extras.get(args.command)
    if isinstance(command, str):
        return report(
            CommandError(
                f"{args.command} needs the 'serve' extra ({command} is missing): {SERVE_EXTRA_PIP}"
            ),
            debug=args.debug,
        )
    if unknown:
        _usage_error(f"{PROG} {args.command}", f"unrecognized arguments: {' '.join(unknown)}")
    run: Callable[[argparse.Namespace], int] = run_demo if command is None else command[1]
    return reported(lambda: run(args), debug=args.debug)
