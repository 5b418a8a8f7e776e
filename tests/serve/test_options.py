"""``ServiceOptions`` and ``build_service``: the one way a service is built from options.

Pure calls on the ``fake`` model (no engine opens: a service's engine opens with its
app's lifespan, which these tests never run).
"""

from __future__ import annotations

import pickle

import pytest

from omni_trio import EngineConfig
from omni_trio.serve import ServeConfig, UploadLimits
from omni_trio.serve._models import FALLBACK_FPS, FALLBACK_GUIDANCE, TINY_SIZE, TINY_STEPS
from omni_trio.serve._options import OptionError, ServiceOptions, build_service
from omni_trio.testing import FakeRunner


def test_what_the_options_leave_to_the_model_is_the_models() -> None:
    """``None`` is the model's own: its name, size, steps (capped at the engine's
    ``max_steps``) and guidance; a setting given is that setting."""
    service = build_service(ServiceOptions(model="fake", step_seconds=0.0))
    width, height = TINY_SIZE
    assert service.config == ServeConfig(
        model_name="fake",
        default_width=width,
        default_height=height,
        default_steps=TINY_STEPS,
        default_guidance_scale=FALLBACK_GUIDANCE,
    )
    assert service.engine_config == EngineConfig()
    assert service.upload_limits == UploadLimits()
    assert service.videos.config.fps == FALLBACK_FPS  # not a video model: the fallback
    capped = build_service(
        ServiceOptions(model="fake", engine_config=EngineConfig(max_steps=5), video_fps=10.0)
    )
    assert (capped.config.default_steps, capped.videos.config.fps) == (5, 10.0)
    given = ServiceOptions(
        model="fake",
        devices=("cpu", "cpu"),
        model_name="m",
        default_size=(32, 48),
        default_steps=3,
        default_guidance_scale=2.0,
        max_priority=1,
        upload_limits=UploadLimits(max_bytes=100),
        video_jobs=2,
        video_ttl_s=5.0,
    )
    loaded = given.load_model()  # one runner per device
    assert [type(runner) for runner in loaded.runners] == [FakeRunner] * 2
    built = build_service(given, model=loaded)
    assert (built.config.model_name, built.config.default_width, built.config.default_height) == (
        "m",
        32,
        48,
    )
    assert (built.config.default_steps, built.config.default_guidance_scale) == (3, 2.0)
    assert (built.config.max_priority, built.upload_limits.max_bytes) == (1, 100)
    assert (built.videos.config.max_jobs, built.videos.config.ttl_s) == (2, 5.0)


def test_a_serve_config_sets_every_http_setting() -> None:
    """``with_serve_config``: the service's configuration is that one, its defaults
    included (what ``deployment(serve_config=...)`` asks for)."""
    config = ServeConfig(model_name="m", default_steps=4, max_body_bytes=999, retry_after_s=3)
    service = build_service(ServiceOptions(model="fake").with_serve_config(config))
    assert service.config == config


@pytest.mark.parametrize(
    ("options", "field", "detail"),
    [
        ({"default_size": (60, 64)}, "default_size", "width: must be a multiple of 8"),
        ({"default_steps": 300}, "default_steps", "num_steps: must be <= 200 (engine limit)"),
    ],
)
def test_a_default_the_model_refuses_names_its_field(
    options: dict[str, object], field: str, detail: str
) -> None:
    """The defaults are checked once, as a request: the error names the field of the
    options (never a command-line option) and survives a pickle (a Ray replica's)."""
    engine_config = EngineConfig(max_steps=200)
    with pytest.raises(OptionError) as refused:
        build_service(ServiceOptions(model="fake", engine_config=engine_config, **options))  # type: ignore[arg-type]
    error = refused.value
    assert error.option == field
    assert str(error).startswith(f"{field}: the model refuses it: {detail}")
    assert isinstance(error, ValueError)
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.option, copy.detail, str(copy)) == (
        OptionError,
        error.option,
        error.detail,
        str(error),
    )


def test_a_setting_out_of_range_is_a_value_error_naming_its_field() -> None:
    """What a configuration refuses is its ``ValueError``, naming its own field."""
    with pytest.raises(ValueError, match=r"^max_jobs: must be an int >= 1, got 0$"):
        build_service(ServiceOptions(model="fake", video_jobs=0))
