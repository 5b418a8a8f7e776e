"""Fuzz the HTTP layer in-process: whatever the body, a 4xx JSON error or a success (L52).

Determinism rules:
- Hypothesis runs derandomized (``derandomize=True``, no example database), a fixed
  number of examples, no deadline (the machine is shared);
- one app (an instant ``FakeRunner``) serves every example of a test, inside its
  lifespan, on trio and asyncio; each example has its hang budget
  (``anyio.fail_after``) and leaves the engine idle and ``/health`` at 200.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from omni_trio.serve import ServeConfig, Service
from omni_trio.serve._errors import ApiError
from omni_trio.serve._schema import KNOWN_FIELDS
from omni_trio.serve._video_body import video_body, video_spec
from omni_trio.testing import assert_engine_idle
from tests.support.core import BUDGET
from tests.support.serve import PATH, make_service, parse_sse, serving

pytestmark = pytest.mark.anyio

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class RawNumber(str):
    """A JSON number literal written as is (``json.dumps`` cannot write > 4300 digits)."""


#: Values that broke or could break a layer: too large for a float, an int64 or
#: Python's 4300-digit conversion limit, not finite, not encodable, empty, long.
HOSTILE: list[object] = [
    *(2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**400, -(10**400), 2 * 10**308),
    *(RawNumber("7" * 310), RawNumber("7" * 5000), RawNumber("-" + "7" * 5000)),
    *(float("nan"), float("inf"), float("-inf"), 1e308, -0.0, 5e-324),
    *("\ud800", "a\udfffb", "\udbff\ud800", "\x00", "", " " * 300, "\U0001f600"),
]

#: Strings with anything in them: lone surrogates, NUL, controls, astral characters.
odd_text = st.text(st.characters(exclude_categories=()), max_size=12) | st.sampled_from(
    ["", "auto", "64x64", "0x0", "64x", "9999999x1", "b64_json", "url", "png", "gif",
     "transparent", "opaque", "fake", "\ud800", "\x00", "a\udfffb", "\U0001f600", "1" * 300]
)  # fmt: skip

#: Numbers, from small to hostile.
numbers = st.one_of(
    st.integers(-3, 300),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [value for value in HOSTILE if not isinstance(value, str) or isinstance(value, RawNumber)]
    ),
)

json_values = st.recursive(
    st.none() | st.booleans() | numbers | odd_text,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(odd_text, children, max_size=3)
    ),
    max_leaves=8,
)


#: Values near what each field takes, so bodies often get past the first check.
NEAR: dict[str, st.SearchStrategy[object]] = {
    "prompt": st.text(max_size=20) | odd_text,
    "negative_prompt": st.text(max_size=20) | odd_text,
    "model": st.sampled_from(["fake", "dall-e-3"]),
    "n": st.integers(-1, 5),
    "num_inference_steps": st.integers(-1, 6),
    "size": st.sampled_from(["64x64", "32x16", "auto", "60x64", "512x512", "64x64x64"]),
    "stream": st.booleans(),
    "preview_every": st.integers(-1, 3),
    "partial_images": st.integers(-1, 4),
    "seed": st.integers(-1, 2**64),
    "guidance_scale": st.floats(-20, 20),
    "response_format": st.sampled_from(["b64_json", "url"]),
    "output_format": st.sampled_from(["png", "jpeg", "webp", "gif", "bmp"]),
    "output_compression": st.integers(-1, 101),
    "background": st.sampled_from(["auto", "opaque", "transparent"]),
    "quality": st.sampled_from(["low", "high", "auto", "hd"]),
    "frame_count": st.integers(-1, 3),
    "svg": st.dictionaries(st.text(max_size=4), json_values, max_size=2),
}


def plausible(field: str) -> st.SearchStrategy[object]:
    """Half the time a value near what ``field`` takes, else a hostile one, or anything."""
    near = NEAR.get(field, st.text(max_size=8))
    kinds = {"near": near, "hostile": st.sampled_from(HOSTILE), "any": json_values}
    return st.sampled_from(["near", "near", "hostile", "any"]).flatmap(kinds.__getitem__)


#: Bodies of the API's own fields: a prompt, up to four more.
api_bodies = st.lists(
    st.sampled_from(sorted(KNOWN_FIELDS - {"prompt"})), unique=True, max_size=4
).flatmap(
    lambda names: st.fixed_dictionaries({name: plausible(name) for name in ["prompt", *names]})
)

#: Bodies of any keys, some the API's.
any_bodies = st.dictionaries(
    st.sampled_from(sorted(KNOWN_FIELDS)) | odd_text, json_values, max_size=4
)


def encode(value: object) -> str:
    """JSON text of ``value``, writing ``RawNumber`` literals as they are."""
    if isinstance(value, RawNumber):
        return str(value)
    if isinstance(value, list):
        return "[" + ",".join(encode(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{encode(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)  # ASCII: lone surrogates become \ud800 escapes


@st.composite
def raw_bodies(draw: st.DrawFn) -> bytes:
    """Request bodies: encoded JSON (sometimes in another encoding, or cut), or random bytes."""
    kind = draw(st.sampled_from(["json", "json", "json", "other-encoding", "cut", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    text = encode(draw(api_bodies | any_bodies | json_values))
    if kind == "other-encoding":
        return text.encode(draw(st.sampled_from(["utf-16", "utf-16-be", "utf-32", "utf-8-sig"])))
    data = text.encode()
    if kind == "cut":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    return data


@pytest.fixture
async def app() -> AsyncIterator[tuple[Service, httpx.AsyncClient]]:
    """One app for every example of a test, inside its lifespan."""
    service, _ = make_service(max_body_bytes=1 << 16)
    async with serving(service) as client:
        yield service, client


def check_answer(response: httpx.Response, stream: bool) -> None:
    """A 4xx with an OpenAI-style error object, or a complete success."""
    assert response.status_code < 500, response.text
    code = response.json()["error"]["code"] if response.status_code != 200 else "ok"
    event(f"{response.status_code} {code}")
    if response.status_code != 200:
        assert response.status_code in (400, 413), response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert isinstance(error["message"], str) and len(response.content) < 1000
        return
    if stream:
        events = parse_sse(response.text)
        assert events[-1][0] == "image_generation.completed", events[-1]
    else:
        assert response.json()["data"]


async def after_each(service: Service, client: httpx.AsyncClient) -> None:
    health = await client.get("/health")
    assert (health.status_code, health.json()["status"]) == (200, "ok")
    assert service.engine is not None
    assert_engine_idle(service.engine)


@FUZZ
@given(body=raw_bodies())
async def test_any_body_gets_a_4xx_json_error_or_a_success(
    app: tuple[Service, httpx.AsyncClient], body: bytes
) -> None:
    """L52: arbitrary bodies (JSON of any shape, wrong types, huge integers, odd strings,
    other encodings, cut JSON, random bytes) never get a 5xx; /health stays 200."""
    service, client = app
    with anyio.fail_after(BUDGET):
        response = await client.post(PATH, content=body)
        stream = response.headers.get("content-type", "").startswith("text/event-stream")
        check_answer(response, stream)
        await after_each(service, client)


@FUZZ
@given(body=api_bodies)
async def test_any_fields_get_a_4xx_json_error_or_a_success(
    app: tuple[Service, httpx.AsyncClient], body: dict[str, Any]
) -> None:
    """L52: bodies built from the API's fields with values of any type and range
    never get a 5xx; a 200 is a complete answer (JSON, or a stream that ends with
    ``image_generation.completed``); /health stays 200."""
    service, client = app
    with anyio.fail_after(BUDGET):
        response = await client.post(PATH, content=encode(body).encode())
        check_answer(response, body.get("stream") is True)
        await after_each(service, client)


#: ``seconds`` of a video body: any number or text, hostile ones among them.
seconds_values = st.one_of(
    st.integers(),
    st.integers(-(10**400), 10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(0, 600),
    st.sampled_from(HOSTILE),
    odd_text,
    st.from_regex(r"[0-9]{0,4}(\.[0-9]{0,3})?", fullmatch=True),
)


@FUZZ
@given(seconds=seconds_values, as_form=st.booleans())
def test_any_seconds_make_a_clip_on_the_rule_or_a_400_naming_seconds(
    seconds: object, as_form: bool
) -> None:
    """L73, L52: a video body's ``seconds`` of any value, as JSON or as form text, is a
    clip of 1 to 4320 frames on the runner's rule (4k + 1) or a 400 naming ``seconds``;
    nothing else is raised (an integer past a float's range made ``float()`` overflow)."""
    config = ServeConfig(model_name="fake-video", default_width=16, default_height=16)
    form: list[tuple[str, str | bytes]] | None = None
    body = b""
    if as_form:
        text = seconds if isinstance(seconds, str) else encode(seconds)
        form = [("prompt", "a fox"), ("seconds", text)]
    else:
        body = ('{"prompt": "a fox", "seconds": ' + encode(seconds) + "}").encode()
    refused: ApiError | None = None
    try:
        spec = video_spec(
            video_body(body, form), config, fps=16.0, default_seconds=4.0, rule=(4, 1)
        )
    except ApiError as error:
        refused = error
    if refused is not None:
        event(f"{refused.status} {refused.param}")
        assert (refused.status, refused.param) == (400, "seconds"), refused.message
        assert "\n" not in refused.message and len(refused.message) < 300
        return
    event("200")
    frames = spec.request.num_frames
    assert frames is not None and 1 <= frames <= 4320 and frames % 4 == 1
