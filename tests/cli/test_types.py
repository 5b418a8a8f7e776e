"""The argparse value types every command shares: what each accepts, what it says
when it refuses. Pure calls."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pytest

from omni_trio.cli import _types as types

ACCEPTED: list[tuple[Callable[[str], Any], str, Any]] = [
    (types.count(0, 65535), "8000", 8000),
    (types.count(1), "1", 1),
    (types.integer, "-3", -3),
    (types.threshold, "16", 16),
    (types.threshold, " Never ", None),
    (types.finite, "-1.5", -1.5),
    (types.positive, "0.25", 0.25),
    (types.fraction, "0", 0.0),
    (types.fraction, "1", 1.0),
    (types.seconds, "0", 0.0),
    (types.span, "3", (0.0, 3.0)),
    (types.span, "1:2.5", (1.0, 2.5)),
    (types.gpus, "0.5", 0.5),
    (types.size, "64x32", (64, 32)),
    (types.header, " Authorization :  Bearer x ", ("Authorization", "Bearer x")),
]

REFUSED: list[tuple[Callable[[str], Any], str, str]] = [
    (types.count(0, 65535), "http", "expected an integer from 0 to 65535, got 'http'"),
    (types.count(0, 65535), "65536", "expected an integer from 0 to 65535, got '65536'"),
    (types.count(1), "0", "expected an integer >= 1, got '0'"),
    (types.integer, "high", "expected an integer, got 'high'"),
    (types.threshold, "0", "expected an integer >= 1, got '0'"),
    (types.finite, "nan", "expected a finite number, got 'nan'"),
    (types.positive, "inf", "expected a finite number, got 'inf'"),
    (types.positive, "0", "expected a number > 0, got '0'"),
    (types.positive, "-1", "expected a number > 0, got '-1'"),
    (types.fraction, "2", "expected a number from 0 to 1, got '2'"),
    (types.fraction, "nan", "expected a number from 0 to 1, got 'nan'"),
    (types.seconds, "inf", "expected a number of seconds >= 0, got 'inf'"),
    (types.seconds, "-1", "expected a number of seconds >= 0, got '-1'"),
    (types.span, "3:1", "expected MAX or MIN:MAX seconds, got '3:1'"),
    (types.span, "a:1", "expected MAX or MIN:MAX seconds, got 'a:1'"),
    (types.gpus, "-1", "expected a number of GPUs >= 0, got '-1'"),
    (types.size, "64", "expected WIDTHxHEIGHT, e.g. 64x64, got '64'"),
    (types.size, "0x64", "expected WIDTHxHEIGHT, e.g. 64x64, got '0x64'"),
    (types.header, "Authorization", "expected 'Name: value', got 'Authorization'"),
    (types.header, ": x", "expected 'Name: value', got ': x'"),
]


@pytest.mark.parametrize(("parse", "text", "value"), ACCEPTED)
def test_each_type_parses_its_values(parse: Callable[[str], Any], text: str, value: Any) -> None:
    assert parse(text) == value


@pytest.mark.parametrize(("parse", "text", "message"), REFUSED)
def test_each_type_says_what_it_expected(
    parse: Callable[[str], Any], text: str, message: str
) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        parse(text)
    assert str(refused.value) == message
