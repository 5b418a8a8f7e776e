"""Options from the environment: ``OMNI_TRIO_<OPTION>`` for every ``serve`` option.

``--max-batch-size`` is ``OMNI_TRIO_MAX_BATCH_SIZE``, ``--no-access-log`` is
``OMNI_TRIO_NO_ACCESS_LOG`` (a flag: ``1``, ``true``, ``yes`` or ``on`` sets it;
``0``, ``false``, ``no``, ``off`` or empty leaves it). The command line wins: a
variable only replaces the option's default. A variable's text is checked by the
option's own parser, once the command line is parsed, and a bad one is a usage
error that names the variable.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._errors import UsageError

__all__ = ["PREFIX", "read_environment", "resolve_environment", "variable"]

PREFIX = "OMNI_TRIO_"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def variable(option: str) -> str:
    """The variable of ``option``: ``--max-batch-size`` is ``OMNI_TRIO_MAX_BATCH_SIZE``."""
    return PREFIX + option.removeprefix("--").replace("-", "_").upper()


@dataclass(frozen=True, slots=True)
class _FromEnv:
    """An option's default taken from a variable, parsed once the command line is.

    Not a ``str``, so argparse leaves it alone (it converts ``str`` defaults
    itself, and its error would not name the variable).
    """

    variable: str
    text: str
    action: argparse.Action


def read_environment(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None
) -> None:
    """Make every long option of ``parser`` default to its variable, where it is set.

    Also names the variable in each option's help. A required option whose
    variable is set is not required any more.
    """
    environ = os.environ if environ is None else environ
    for action in parser._actions:  # argparse has no public list of its actions
        options = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if not options:
            continue
        name = variable(options[0])
        action.help = f"{action.help or ''} [{name}]".lstrip()
        if name in environ:
            action.default = _FromEnv(name, environ[name], action)
            action.required = False


def resolve_environment(args: argparse.Namespace) -> frozenset[str]:
    """Replace each default taken from a variable by its parsed value, in place.

    Returns:
        The ``dest`` of each option whose value came from its variable.

    Raises:
        UsageError: a variable's value is not one the option accepts; the
            message names the variable.
    """
    resolved = set()
    for dest, value in vars(args).items():
        if isinstance(value, _FromEnv):
            setattr(args, dest, _parse(value))
            resolved.add(dest)
    return frozenset(resolved)


def _parse(found: _FromEnv) -> Any:
    action, text = found.action, found.text
    if action.nargs == 0:  # a flag: store_true, store_false
        word = text.strip().lower()
        if word not in _TRUE | _FALSE:
            raise UsageError(f"{found.variable}: expected 1 or 0 (true or false), got {text!r}")
        return action.const if word in _TRUE else (not action.const)
    value: Any = text
    if action.type is not None:
        convert: Any = action.type
        try:
            value = convert(text)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
            detail = str(exc) if isinstance(exc, argparse.ArgumentTypeError) else "invalid value"
            raise UsageError(f"{found.variable}: {detail}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise UsageError(f"{found.variable}: expected one of {choices}, got {text!r}")
    return value
