"""The options that do not apply, refused: ``--replicas`` without ``--ray``, and the like.

argparse keeps no record of which options the command line gave, only the values,
and an option left at its default looks like one given its default's value.
``record_given(parser)`` makes each option of a command note its ``dest`` in the
namespace as the command line gives it (its value is stored as argparse stores
it); ``given(args)`` reads that set.

A command then lists what does not apply, as ``Unused`` (the option's ``dest``, and
why), and ``refuse_unused`` decides:

- given on the command line, an option that does not apply is a usage error, one
  line naming it and why (``--replicas: applies with --ray only``);
- from its variable (``OMNI_TRIO_REPLICAS``, see ``_env``), it is ignored and said
  so in the log: one environment often serves several servers (a container image's,
  a fleet's settings, for image and video models, with and without Ray), and a
  setting that one of them does not use must not stop it.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from ._env import variable
from ._errors import UsageError

__all__ = ["Unused", "given", "record_given", "refuse_unused"]

#: The namespace attribute that holds the set of the options the command line gave.
_GIVEN = "given_options"

# One recording subclass per argparse action class.
_RECORDING: dict[type[argparse.Action], type[argparse.Action]] = {}


class _Records(argparse.Action):
    """Mixed into an action's class: note the ``dest`` when the command line gives it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given_ = getattr(namespace, _GIVEN, None)
        if given_ is None:
            given_ = set()
            setattr(namespace, _GIVEN, given_)
        given_.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


def record_given(parser: argparse.ArgumentParser) -> None:
    """Make every option of ``parser`` note its ``dest`` when the command line gives it."""
    for action in parser._actions:  # argparse has no public list of its actions
        if not action.option_strings or isinstance(action, _Records):
            continue
        cls = type(action)
        if cls not in _RECORDING:
            _RECORDING[cls] = type(f"Recorded{cls.__name__}", (_Records, cls), {})
        # The action's own class, with the note first: argparse calls it as before.
        action.__class__ = _RECORDING[cls]


def given(args: argparse.Namespace) -> frozenset[str]:
    """The ``dest`` of every option the command line gave (none if not recorded)."""
    return frozenset(getattr(args, _GIVEN, ()))


@dataclass(frozen=True, slots=True, kw_only=True)
class Unused:
    """An option that does not apply to this run.

    Args:
        dest: the option's ``dest``.
        option: the option as typed (``--replicas``).
        reason: why it does not apply (``applies with --ray only``).
    """

    dest: str
    option: str
    reason: str


def refuse_unused(
    args: argparse.Namespace, unused: Iterable[Unused], *, from_environment: Collection[str]
) -> list[str]:
    """Refuse an option that does not apply and was given; return the notes for the others.

    Args:
        args: the parsed arguments (``record_given`` noted what was given).
        unused: the options that do not apply to this run.
        from_environment: the ``dest`` of each option whose value came from its variable.

    Returns:
        One line per option from its variable that does not apply, to log: it is
        ignored.

    Raises:
        UsageError: the first of ``unused`` that the command line gave; the
            message names it and says why.
    """
    typed = given(args)
    notes = []
    for option in unused:
        if option.dest in typed:
            raise UsageError(f"{option.option}: {option.reason}")
        if option.dest in from_environment:
            name = variable(option.option)
            notes.append(f"{name} ignored: {option.option} {option.reason}")
    return notes
