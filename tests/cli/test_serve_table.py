"""``serve``'s options, each declared once (``_serve_table``): the table against the
fields of ``ServiceOptions``, the parser made of it, and where each option applies.

Pure reading of the table, the dataclass and the parser: no model loads, nothing runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from collections import Counter
from typing import Any

import pytest

from omni_trio.cli._declare import FIELD, field_default
from omni_trio.cli._env import variable
from omni_trio.cli._options import BUILT, unused_for_model, unused_options
from omni_trio.cli._serve import add_serve_arguments
from omni_trio.cli._serve_table import SERVE_OPTIONS, Applies
from omni_trio.serve._options import ServiceOptions
from tests.support.cli import ROOT

#: The fields of ``ServiceOptions``.
FIELDS = [field.name for field in dataclasses.fields(ServiceOptions)]


def leaf(path: str) -> bool:
    """Whether ``path`` names a field of ``ServiceOptions`` (dotted into a nested one)."""
    name, _, inner = path.partition(".")
    if name not in FIELDS:
        return False
    if not inner:
        return True
    nested = field_default(ServiceOptions, name)
    return dataclasses.is_dataclass(nested) and inner in {
        field.name for field in dataclasses.fields(nested)
    }


def test_every_field_has_one_option_and_every_option_one_field() -> None:
    """Every field of ``ServiceOptions`` is set by the table: by exactly one option (each
    field of a nested configuration by one), or built by ``_options`` from the options
    that name it; every option sets one field of it, or none, and then the command
    reads it itself. A new field without its option, or an option that names no field,
    fails here."""
    paths = [path for option in SERVE_OPTIONS for path in option.fields]
    assert all(leaf(path) for path in paths), [path for path in paths if not leaf(path)]
    assert sorted({path.partition(".")[0] for path in paths}) == sorted(FIELDS)
    twice = [
        path for path, n in Counter(paths).items() if n > 1 and path.partition(".")[0] not in BUILT
    ]
    assert not twice, twice
    assert set(BUILT) <= set(FIELDS)
    # A built field is named whole, never a field of it.
    assert all(path in BUILT for path in paths if path.partition(".")[0] in BUILT)
    for option in SERVE_OPTIONS:
        assert len({path.partition(".")[0] for path in option.fields}) <= 1, option.flag
    source = "".join(path.read_text() for path in (ROOT / "omni_trio" / "cli").glob("*.py"))
    own = [option.name for option in SERVE_OPTIONS if not option.fields]
    assert own and all(f"args.{name}" in source for name in own), own


def parser() -> argparse.ArgumentParser:
    """``serve``'s parser, as the command makes it."""
    made = argparse.ArgumentParser()
    add_serve_arguments(made)
    return made


def test_the_parser_is_the_table() -> None:
    """``add_serve_arguments`` adds the table's options, in its order, each with its
    aliases, its variable in its help, and its default: the declared one, else the field's
    (a flag's: argparse's)."""
    actions = [action for action in parser()._actions if action.option_strings != ["-h", "--help"]]
    assert [action.option_strings for action in actions] == [
        [option.flag, *option.aliases] for option in SERVE_OPTIONS
    ]
    for action, option in zip(actions, SERVE_OPTIONS, strict=True):
        assert action.dest == option.name
        assert (action.help or "").endswith(f"[{variable(option.flag)}]")
        if option.default_factory is not None:
            assert action.default == option.default_factory(), option.flag
        elif option.default is not FIELD:
            assert action.default == option.default, option.flag
        elif len(option.fields) == 1 and option.action is None:
            expected = field_default(ServiceOptions, option.fields[0])
            assert action.default == (None if expected is FIELD else expected), option.flag


def model(*, adapters: int, video: bool, family: str | None) -> Any:
    """A loaded model as ``unused_for_model`` reads it: its first runner's capabilities
    and family."""
    capabilities = types.SimpleNamespace(max_adapters=adapters, frames=object() if video else None)
    runner = types.SimpleNamespace(capabilities=capabilities, family=family)
    return types.SimpleNamespace(runners=[runner])


def flags(applies: Applies) -> list[str]:
    """The options that apply only where ``applies`` says, in the table's order."""
    return [option.flag for option in SERVE_OPTIONS if option.applies is applies]


@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        (["--model", "fake"], [Applies.RAY, Applies.REAL]),
        (["--model", "tiny-sd", "--ray"], [Applies.NOT_RAY, Applies.FAKE]),
    ],
)
def test_an_option_is_refused_where_its_table_entry_says_it_does_not_apply(
    argv: list[str], refused: list[Applies]
) -> None:
    """``unused_options`` (the arguments) lists the options whose ``applies`` does not hold,
    by where they apply, then in the table's order; ``--ray`` and the fake model decide."""
    args = parser().parse_args(argv)
    unused = unused_options(args)
    assert [u.option for u in unused] == [flag for where in refused for flag in flags(where)]
    reasons = {option.flag: option.applies for option in SERVE_OPTIONS}
    assert all(reasons[u.option] == Applies(u.reason) for u in unused)


#: Where an option applies that the model decides, in the order it is refused.
BY_MODEL = [Applies.ADAPTERS, Applies.VIDEO, Applies.VAE, Applies.LTX]


@pytest.mark.parametrize(
    ("loaded", "refused"),
    [
        # The fake model, and a pipeline served by its own call: no VAE omni_trio drives.
        (model(adapters=0, video=False, family=None), BY_MODEL),
        (model(adapters=4, video=False, family="sd"), [Applies.VIDEO, Applies.LTX]),
        (model(adapters=0, video=False, family="unet"), BY_MODEL),
        (model(adapters=0, video=True, family="wan"), [Applies.ADAPTERS, Applies.LTX]),
        (model(adapters=4, video=True, family="ltx"), []),
    ],
)
def test_an_option_the_model_leaves_without_effect_is_listed(
    loaded: Any, refused: list[Applies]
) -> None:
    """``unused_for_model``: what the model is (adapters, frames, its family) decides which
    of the table's options apply."""
    unused = [u.option for u in unused_for_model(loaded)]
    assert unused == [flag for where in refused for flag in flags(where)]
