"""EngineConfig and GenerationRequest validation."""

from __future__ import annotations

import math
from typing import Any

import pytest

import omni_trio as ot


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
