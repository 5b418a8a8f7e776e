"""A command's options declared once each, and what is made of them.

An ``Option`` holds everything about one option: its spellings, its value type,
its default, its help, its section of ``--help``, where it applies, and the field of
the options' dataclass it sets (``ServiceOptions`` for ``serve``, keyed by the
field's name, dotted into a nested dataclass: ``engine_config.max_steps``). A table
of them (``_serve_table``) is the whole command line of a command; from it:

- ``add_options``: its argparse arguments, in the table's order, each in its
  section (made at its first option) and, where marked, among the section's
  options of which at most one may be given;
- ``field_values``: the fields its parsed arguments set, nested dataclasses built;
- its variables: ``_env`` names each after its option's first spelling.

A default left out of a declaration is the field's own (the dataclass's, read
when the parser is built), so an option whose default is the library's writes
none; a flag's is argparse's.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import enum
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["FIELD", "Group", "Option", "add_options", "field_default", "field_values"]


class _Field(enum.Enum):
    FIELD = "the default of the field the option sets"


#: An option's default when its declaration gives none: the field's (argparse's if none).
FIELD = _Field.FIELD

#: The actions that take no value (a flag): their default is argparse's.
_FLAGS = ("store_true", "store_false")


@dataclass(frozen=True, slots=True, kw_only=True)
class Group:
    """A section of ``--help``: the options listed under its title.

    Args:
        title: the section's heading.
    """

    title: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    """One command-line option: everything about it, in one place.

    Args:
        flag: its name as typed (``--max-batch-size``): its ``dest`` (unless ``dest``
            says otherwise) and its variable's name (``OMNI_TRIO_MAX_BATCH_SIZE``).
        aliases: other spellings (``--api-key``).
        sets: the field of the options' dataclass that its value sets, dotted into a
            nested dataclass (``engine_config.max_batch_size``); several where one
            value sets several (``--max-size``); empty: the command reads it itself
            (``--port``), or a function builds its field (``_options``).
        help: its line in ``--help`` (its variable is added to it).
        type: parses its text (``_types``); ``None``: the text itself.
        default: its value when neither the command line nor its variable gives one;
            ``FIELD``: the default of the field it sets, or argparse's.
        default_factory: makes the default when the parser is built (it reads the
            environment: a folder under ``$XDG_STATE_HOME``).
        metavar: its value's name in ``--help``.
        choices: the values it takes.
        action: argparse's action (``store_true``, ``extend``, a class); ``None``: store.
        dest: where argparse stores it, when not the name of ``flag``.
        required: the command line (or its variable) must give it.
        group: the section of ``--help`` it is listed in; ``None``: the command's own.
        exclusive: at most one of its group's exclusive options may be given.
        applies: where it applies (a command's own enumeration); ``None``: every run.
            One given where it does not apply is refused (``_given``).
    """

    flag: str
    aliases: tuple[str, ...] = ()
    sets: str | tuple[str, ...] = ()
    help: str | None = None
    type: Callable[[str], Any] | None = None
    default: Any = FIELD
    default_factory: Callable[[], Any] | None = None
    metavar: str | None = None
    choices: Sequence[str] | None = None
    # builtins: ``type`` is the field above, in the class's body.
    action: str | builtins.type[argparse.Action] | None = None
    dest: str | None = None
    required: bool = False
    group: Group | None = None
    exclusive: bool = False
    applies: enum.Enum | None = None

    @property
    def name(self) -> str:
        """Its ``dest``: where the parsed arguments hold its value."""
        return self.dest or self.flag.removeprefix("--").replace("-", "_")

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields it sets (``sets``, as a tuple)."""
        return (self.sets,) if isinstance(self.sets, str) else self.sets


def field_default(cls: type[Any], path: str) -> Any:
    """The default of ``cls``'s field at ``path`` (dotted into nested dataclasses).

    Returns:
        It, or ``FIELD`` where the field has none.
    """
    name, _, inner = path.partition(".")
    [found] = [field for field in dataclasses.fields(cls) if field.name == name]
    if found.default is not dataclasses.MISSING:
        value = found.default
    elif found.default_factory is not dataclasses.MISSING:
        value = found.default_factory()
    else:
        return FIELD
    return field_default(type(value), inner) if inner else value


def _default(option: Option, cls: type[Any] | None) -> Any:
    """``option``'s default: as declared, else the field's (one field only; none without
    ``cls``), else ``FIELD``."""
    if option.default_factory is not None:
        return option.default_factory()
    if (
        option.default is not FIELD
        or option.action in _FLAGS
        or len(option.fields) != 1
        or cls is None
    ):
        return option.default
    return field_default(cls, option.fields[0])


def add_options(
    parser: argparse.ArgumentParser, options: Sequence[Option], cls: type[Any] | None
) -> None:
    """Add each of ``options`` to ``parser``, in order, each in its section.

    Args:
        parser: the command's parser.
        options: the command's table.
        cls: the dataclass whose fields the options set (their defaults); ``None``: an
            option that declares no default has none (``None``: the command leaves the
            field out, to its dataclass's default).
    """
    sections: dict[Group | None, Any] = {None: parser}
    exclusive: dict[Group | None, Any] = {}
    for option in options:
        if option.group is not None and option.group not in sections:
            sections[option.group] = parser.add_argument_group(option.group.title)
        section = sections[option.group]
        if option.exclusive:
            if option.group not in exclusive:
                exclusive[option.group] = section.add_mutually_exclusive_group()
            section = exclusive[option.group]
        given = {
            "action": option.action,
            "type": option.type,
            "default": _default(option, cls),
            "metavar": option.metavar,
            "choices": option.choices,
            "dest": option.dest,
            "help": option.help,
        }
        keywords = {key: value for key, value in given.items() if value not in (None, FIELD)}
        if option.required:
            keywords["required"] = True
        section.add_argument(option.flag, *option.aliases, **keywords)


def field_values(
    args: argparse.Namespace,
    options: Sequence[Option],
    cls: type[Any],
    *,
    built: Collection[str] = (),
) -> dict[str, Any]:
    """The fields of ``cls`` that the parsed ``args`` of ``options`` set, by name.

    A repeatable option's list becomes a tuple (the fields are frozen data); the
    fields of a nested dataclass become one, its other fields its defaults. The
    fields in ``built`` are left out: the command builds each from its options.

    Raises:
        ValueError: a nested dataclass refuses its fields' values.
    """
    values: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for option in options:
        value = getattr(args, option.name) if option.fields else None
        if isinstance(value, list):
            value = tuple(value)
        for path in option.fields:
            name, _, inner = path.partition(".")
            if name in built:
                continue
            if inner:
                nested.setdefault(name, {})[inner] = value
            else:
                values[name] = value
    for name, inner_values in nested.items():
        values[name] = type(field_default(cls, name))(**inner_values)
    return values
