"""The argparse value types every command shares: what each accepts, what it says
when it refuses. Pure calls."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pytest

from omni_trio.cli._types import (
    adapter,
    bound,
    byte_count,
    count,
    finite,
    fraction,
    gpus,
    header,
    integer,
    positive,
    result_cache,
    seconds,
    size,
    sizes,
    span,
    threshold,
)

ACCEPTED: list[tuple[Callable[[str], Any], str, Any]] = [
    (count(0, 65535), "8000", 8000),
    (count(1), "1", 1),
    (integer, "-3", -3),
    (threshold, "16", 16),
    (threshold, " Never ", None),
    (finite, "-1.5", -1.5),
    (positive, "0.25", 0.25),
    (fraction, "0", 0.0),
    (fraction, "1", 1.0),
    (seconds, "0", 0.0),
    (bound, "0.5", 0.5),
    (bound, " NONE ", None),
    (span, "3", (0.0, 3.0)),
    (span, "1:2.5", (1.0, 2.5)),
    (gpus, "0.5", 0.5),
    (size, "64x32", (64, 32)),
    (sizes, "64x32, 128x128", ((64, 32), (128, 128))),
    (byte_count, "100", 100),
    (byte_count, "512M", 512 << 20),
    (byte_count, " 2g ", 2 << 30),
    (byte_count, "64KiB", 64 << 10),
    (result_cache, "1G", (1 << 30, None)),
    (result_cache, "1G:/var/cache/a:b", (1 << 30, "/var/cache/a:b")),
    (header, " Authorization :  Bearer x ", ("Authorization", "Bearer x")),
    (adapter, "ink=ink.safetensors", [("ink", "ink.safetensors")]),
    # Comma-separated, spaces around each; a path keeps any '=' after the first.
    (
        adapter,
        "ink=a/ink.safetensors, film=b=2.safetensors",
        [("ink", "a/ink.safetensors"), ("film", "b=2.safetensors")],
    ),
]

#: What ``adapter`` says for a value it refuses (``NAME=PATH`` and the name's rule).
NAME_PATH = "expected NAME=PATH (a name of letters, digits, '_', '.', '-'), got "

REFUSED: list[tuple[Callable[[str], Any], str, str]] = [
    (count(0, 65535), "http", "expected an integer from 0 to 65535, got 'http'"),
    (count(0, 65535), "65536", "expected an integer from 0 to 65535, got '65536'"),
    (count(1), "0", "expected an integer >= 1, got '0'"),
    (integer, "high", "expected an integer, got 'high'"),
    (threshold, "0", "expected an integer >= 1, got '0'"),
    (finite, "nan", "expected a finite number, got 'nan'"),
    (positive, "inf", "expected a finite number, got 'inf'"),
    (positive, "0", "expected a number > 0, got '0'"),
    (positive, "-1", "expected a number > 0, got '-1'"),
    (fraction, "2", "expected a number from 0 to 1, got '2'"),
    (fraction, "nan", "expected a number from 0 to 1, got 'nan'"),
    (seconds, "inf", "expected a number of seconds >= 0, got 'inf'"),
    (seconds, "-1", "expected a number of seconds >= 0, got '-1'"),
    (bound, "0", "expected a number of seconds > 0 or 'none', got '0'"),
    (bound, "nan", "expected a number of seconds > 0 or 'none', got 'nan'"),
    (bound, "never", "expected a number of seconds > 0 or 'none', got 'never'"),
    (span, "3:1", "expected MAX or MIN:MAX seconds, got '3:1'"),
    (span, "a:1", "expected MAX or MIN:MAX seconds, got 'a:1'"),
    (gpus, "-1", "expected a number of GPUs >= 0, got '-1'"),
    (size, "64", "expected WIDTHxHEIGHT, e.g. 64x64, got '64'"),
    (size, "0x64", "expected WIDTHxHEIGHT, e.g. 64x64, got '0x64'"),
    (sizes, "64x64,", "expected WIDTHxHEIGHT, e.g. 64x64, got ''"),
    (byte_count, "0", "expected a number of bytes (512M, 2G), got '0'"),
    (byte_count, "12Q", "expected a number of bytes (512M, 2G), got '12Q'"),
    (byte_count, "-1M", "expected a number of bytes (512M, 2G), got '-1M'"),
    (result_cache, "1G:", "expected BYTES[:DIR], got '1G:'"),
    (header, "Authorization", "expected 'Name: value', got 'Authorization'"),
    (header, ": x", "expected 'Name: value', got ': x'"),
    (adapter, "ink.safetensors", NAME_PATH + "'ink.safetensors'"),
    (adapter, "=ink.safetensors", NAME_PATH + "'=ink.safetensors'"),
    (adapter, "ink=", NAME_PATH + "'ink='"),
    (adapter, "ink=a.safetensors,film", NAME_PATH + "'film'"),
    (adapter, "ink=a.safetensors,", NAME_PATH + "''"),
    (adapter, "my ink=a.safetensors", NAME_PATH + "'my ink=a.safetensors'"),
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
