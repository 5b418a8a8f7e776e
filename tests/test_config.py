"""EngineConfig and GenerationRequest validation."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

import omni_trio as ot
from omni_trio._request import MAX_GUIDANCE_SCALE


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_waiting": -1}, "max_waiting"),
        ({"event_buffer": 0}, "event_buffer"),
        ({"event_buffer": 1.5}, "event_buffer"),
        ({"shutdown_grace": -1}, "shutdown_grace"),
        ({"shutdown_grace": math.nan}, "shutdown_grace"),
        ({"shutdown_grace": "1"}, "shutdown_grace"),
        ({"max_steps": True}, "max_steps"),
        ({"max_height": 0}, "max_height"),
        ({"max_frame_pixels": 0}, "max_frame_pixels"),
        ({"max_step_s": 0}, "max_step_s"),
        ({"max_step_s": math.inf}, "max_step_s"),
        ({"stop_timeout_s": -1}, "stop_timeout_s"),
        ({"stop_timeout_s": None}, "stop_timeout_s"),
    ],
)
def test_bad_config_fields_raise_value_error_naming_them(fields: dict[str, Any], name: str) -> None:
    """Every config field is validated at construction, the error names it."""
    with pytest.raises(ValueError, match=name):
        ot.EngineConfig(**fields)


def test_config_defaults_are_generous() -> None:
    """The defaults admit what the contract promises: >= 256 waiting, 1,000 steps, 2,048 px."""
    config = ot.EngineConfig()
    assert config.max_waiting >= 256
    assert config.max_steps >= 1000
    assert config.max_height >= 2048 and config.max_width >= 2048
    assert config.shutdown_grace == 0.0
    assert isinstance(ot.EngineConfig(shutdown_grace=2).shutdown_grace, float)


def test_request_is_frozen_and_copies_extra() -> None:
    """A request cannot change after admission, not even through the caller's dict."""
    extra: dict[str, object] = {"a": 1}
    request = ot.GenerationRequest(extra=extra)
    extra["a"] = 2
    assert request.extra["a"] == 1
    with pytest.raises(TypeError):
        request.extra["a"] = 3  # type: ignore[index]
    with pytest.raises(AttributeError):
        request.num_steps = 2  # type: ignore[misc]


def test_request_without_engine_limits_is_valid() -> None:
    """Construction checks types and signs only; engine limits are checked by submit."""
    request = ot.GenerationRequest(num_steps=5000, height=8192, width=8192)
    assert request.num_steps == 5000
    with pytest.raises(ot.InvalidRequestError, match="num_steps"):
        ot.EngineConfig().check_request(request)


# Hostile input: numbers that do not fit, text that is not text, subclasses that lie.


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"guidance_scale": 10**400}, "guidance_scale"),
        ({"guidance_scale": -(10**400)}, "guidance_scale"),
        ({"num_steps": -(10**5000)}, "num_steps"),
        ({"seed": 10**5000}, "seed"),
    ],
)
def test_request_numbers_too_large_name_their_field(fields: dict[str, Any], name: str) -> None:
    """L4: an int too large for a float (or to print) is refused by name, no OverflowError."""
    with pytest.raises(ot.InvalidRequestError) as info:
        ot.GenerationRequest(**fields)
    assert info.value.field == name
    assert str(info.value).startswith(f"{name}: ")


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"shutdown_grace": 10**400}, "shutdown_grace"),
        ({"event_buffer": 10**400}, "event_buffer"),
        ({"max_waiting": 10**5000}, "max_waiting"),
    ],
)
def test_config_numbers_too_large_name_their_field(fields: dict[str, Any], name: str) -> None:
    """An int too large for a float or a buffer size is refused by name, never OverflowError."""
    with pytest.raises(ValueError, match=f"^{name}: ") as info:
        ot.EngineConfig(**fields)
    assert not isinstance(info.value, OverflowError)


def test_config_takes_large_finite_values() -> None:
    """A huge but finite grace, and sizes up to sys.maxsize, are settings, not errors."""
    config = ot.EngineConfig(shutdown_grace=1e300, max_waiting=sys.maxsize)
    assert config.shutdown_grace == 1e300
    assert config.max_waiting == sys.maxsize


@pytest.mark.parametrize("scale", [1e300, MAX_GUIDANCE_SCALE * 1.001, -1e5, 10**5])
def test_guidance_scale_beyond_the_bound_is_refused(scale: float) -> None:
    """L4: |guidance_scale| > MAX_GUIDANCE_SCALE could only overflow in the model: refused."""
    with pytest.raises(ot.InvalidRequestError, match="guidance_scale: must be ") as info:
        ot.GenerationRequest(guidance_scale=scale)
    assert info.value.field == "guidance_scale"


def test_guidance_scale_within_the_bound_is_kept() -> None:
    """The bound itself, negative guidance and ints are valid; ints are stored as floats."""
    for scale in (MAX_GUIDANCE_SCALE, -MAX_GUIDANCE_SCALE, 0, 7.5):
        request = ot.GenerationRequest(guidance_scale=scale)
        assert request.guidance_scale == scale
        assert type(request.guidance_scale) is float


NOT_TEXT = {
    "lone_high_surrogate": "a\ud800b",
    "lone_low_surrogate": "\udfff",
    "nul": "stop\x00here",
    "escape": "\x1b[31mred",
    "delete": "a\x7f",
    "c1_control": "next\x85line",
}


@pytest.mark.parametrize("text", sorted(NOT_TEXT))
@pytest.mark.parametrize("name", ["prompt", "negative_prompt"])
def test_text_that_is_not_text_is_refused_at_admission(name: str, text: str) -> None:
    """L4: lone surrogates and control characters are refused, naming the field.

    A lone surrogate cannot be encoded as UTF-8 (a tokenizer raises on it, deep in
    the model, where it would look like a model failure).
    """
    fields: dict[str, Any] = {name: NOT_TEXT[text]}
    with pytest.raises(ot.InvalidRequestError) as info:
        ot.GenerationRequest(**fields)
    assert info.value.field == name
    message = str(info.value)
    assert message.startswith(f"{name}: must be text: ")
    message.encode("utf-8")  # the message itself is text


@pytest.mark.parametrize(
    "extra",
    [{"a\ud800": 1}, {"key": "bad\ud800value"}, {"key": "nul\x00"}],
    ids=["key", "surrogate_value", "nul_value"],
)
def test_extra_keys_and_string_values_must_be_text(extra: dict[str, object]) -> None:
    """L4: extra's keys and string values follow the prompt's rule, named as "extra"."""
    with pytest.raises(ot.InvalidRequestError) as info:
        ot.GenerationRequest(extra=extra)
    assert info.value.field == "extra"
    str(info.value).encode("utf-8")


def test_text_with_tabs_newlines_and_any_script_is_text() -> None:
    """Tab, newline, carriage return, emoji with joiners and combining marks are text."""
    prompt = "line one\n\tline two\r\n👩\u200d🔬 café ﷺ 日本語"
    assert ot.GenerationRequest(prompt=prompt, negative_prompt=prompt).prompt == prompt


class LyingStr(str):
    """Claims to be empty and equal to everything."""

    def __len__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = str.__hash__


class LyingInt(int):
    """Claims to be less than everything."""

    def __lt__(self, other: object) -> bool:
        return True

    def __gt__(self, other: object) -> bool:
        return False


class LyingFloat(float):
    """Converts to NaN."""

    def __float__(self) -> float:
        return math.nan


def test_subclasses_are_stored_as_exact_builtins() -> None:
    """Subclass methods never run in validation: the request holds exact str/int/float."""
    request = ot.GenerationRequest(
        prompt=LyingStr("x" * 20),
        num_steps=LyingInt(5),
        guidance_scale=LyingFloat(3.0),
        extra={LyingStr("k"): LyingStr("v")},
    )
    assert type(request.prompt) is str and len(request.prompt) == 20
    assert type(request.num_steps) is int and request.num_steps == 5
    assert type(request.guidance_scale) is float and request.guidance_scale == 3.0
    assert [type(key) for key in request.extra] == [str]
    with pytest.raises(ot.InvalidRequestError, match="longer than 10"):
        ot.EngineConfig(max_prompt_chars=10).check_request(request)


class HostileMapping(Mapping[str, object]):
    """A mapping whose reads raise."""

    def __getitem__(self, key: str) -> object:
        raise RuntimeError("no")

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("no")

    def __len__(self) -> int:
        return 1


def test_unreadable_extra_is_refused_by_name() -> None:
    """A mapping that raises when read is an invalid ``extra``, not a crash."""
    with pytest.raises(ot.InvalidRequestError) as info:
        ot.GenerationRequest(extra=HostileMapping())
    assert info.value.field == "extra"


#: Tenant names that are not one line of text (L4, L58): blank, padded, broken over
#: lines or tabs, or not text at all. Each is refused wherever a name enters.
NOT_A_NAME = {
    "space": " ",
    "newline": "\n",
    "blank": " \t ",
    "leading_space": " acme",
    "trailing_newline": "acme\n",
    "tab": "ac\tme",
    "carriage_return": "ac\rme",
    "line_separator": "ac\u2028me",
    "ideographic_space": "\u3000acme",
    "nul": "ac\x00me",
    "lone_surrogate": "ac\ud800me",
    "empty": "",
    "too_long": "x" * 257,
}


def _with_tenant(where: str, name: str) -> object:
    if where == "request":
        return ot.GenerationRequest(tenant=name)
    fields: dict[str, Any] = {where: {name: 1}}
    return ot.EngineConfig(**fields)


@pytest.mark.parametrize("text", sorted(NOT_A_NAME))
@pytest.mark.parametrize("where", ["request", "tenant_weights", "tenant_max_waiting"])
def test_a_tenant_name_that_is_not_one_line_of_text_is_refused(where: str, text: str) -> None:
    """L4, L58: a tenant name is text of 1 to 256 characters on one line, neither blank
    nor padded with whitespace (it is a log field and a metrics label): the request's
    ``tenant`` and the config's tables' keys refuse anything else, naming the field."""
    error = ot.InvalidRequestError if where == "request" else ValueError
    field = "tenant" if where == "request" else where
    with pytest.raises(error, match=f"^{field}: ") as info:
        _with_tenant(where, NOT_A_NAME[text])
    str(info.value).encode("utf-8")  # the message itself is text


@pytest.mark.parametrize("where", ["request", "tenant_weights", "tenant_max_waiting"])
def test_a_tenant_name_is_any_one_line_of_text(where: str) -> None:
    """L58: inner spaces, any script and 256 characters make a name."""
    for name in ("acme corp", "café", "日本語", "x" * 256):
        _with_tenant(where, name)
