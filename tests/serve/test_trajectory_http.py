"""Stochastic sampling and trajectories over HTTP (L100): the body's ``sampler`` and
``return_trajectory``, the answer's ``omni_trio.trajectory`` (safetensors, base64).

The in-process app inside its lifespan, on trio and asyncio: tiny Flux (seeded weights,
built once) where a trajectory must equal the Python API's bitwise, one torch thread,
each request alone (nothing batches with it); an instant ``FakeRunner``, which samples
no way, where only the body's checks and the runner's refusal matter. The docs' client
(docs/snippets/trajectory_client.py) runs in a worker thread, its ``httpx.Client`` sent
to the in-process app through the event loop.
"""

from __future__ import annotations

import base64
import functools
import io
import json
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import httpx
import pytest
import torch
from PIL import Image

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.serve import ServeConfig, Service
from tests.support.core import BUDGET
from tests.support.runners import tiny
from tests.support.serve import (
    PATH,
    ROOT,
    assert_refused_and_serving,
    make_service,
    parse_sse,
    serving,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]

TENSORS = ("latents", "timesteps", "schedule", "steps", "noise", "log_probs")
BODY: dict[str, Any] = {
    "prompt": "a red flower",
    "n": 2,
    "seed": 11,
    "sampler": {"kind": "sde", "noise_level": 0.8, "steps": [0, 2]},
    "return_trajectory": True,
}


def flux_service() -> Service:
    config = ServeConfig(
        model_name="tiny-flux", default_width=64, default_height=64, default_steps=3
    )
    return Service(DiffusersRunner(tiny("flux")), config=config)


def decoded(text: str) -> ot.Trajectory:
    return ot.Trajectory.from_safetensors(base64.b64decode(text))


def assert_equal(mine: ot.Trajectory, theirs: ot.Trajectory) -> None:
    """Bitwise: every tensor (its dtype and shape too), the sampler, the prediction."""
    assert (mine.sampler, mine.prediction) == (theirs.sampler, theirs.prediction)
    for name in TENSORS:
        first, second = getattr(mine, name), getattr(theirs, name)
        assert first.dtype == second.dtype and torch.equal(first, second), name


async def test_a_sampled_request_gets_the_python_apis_trajectory_bitwise() -> None:
    """L100: a body with the SDE sampler and ``return_trajectory`` answers with its
    trajectory, whose decoded tensors equal the Python API's for the same request and seed
    bitwise; streamed, each image's ``completed`` event carries that image's rows."""
    service = flux_service()
    expected = ot.GenerationRequest(
        prompt="a red flower",
        num_images=2,
        seed=11,
        num_steps=3,
        width=64,
        height=64,
        guidance_scale=service.config.default_guidance_scale,
        sampler=ot.SDESampler(noise_level=0.8, steps=(0, 2)),
        return_trajectory=True,
    )
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            answer = await client.post(PATH, json=BODY)
            streamed = await client.post(PATH, json={**BODY, "stream": True})
            plain = await client.post(PATH, json={"prompt": "a red flower"})
            assert service.engine is not None
            python = (await service.engine.generate(expected)).trajectory
    assert answer.status_code == 200, answer.text
    assert python is not None and python.steps.tolist() == [0, 2]
    assert_equal(decoded(answer.json()["omni_trio"]["trajectory"]), python)
    completed = [data for event, data in parse_sse(streamed.text) if event.endswith("completed")]
    assert [data["image_index"] for data in completed] == [0, 1]
    for index, data in enumerate(completed):
        rows = slice(index, index + 1)
        mine = decoded(data["omni_trio"]["trajectory"])
        assert_equal(
            mine,
            ot.Trajectory(
                sampler=python.sampler,
                prediction=python.prediction,
                latents=python.latents[rows],
                timesteps=python.timesteps,
                schedule=python.schedule,
                steps=python.steps,
                noise=python.noise[rows],
                log_probs=python.log_probs[rows],
            ),
        )
    assert "trajectory" not in plain.json()["omni_trio"]


@pytest.mark.parametrize(
    ("fields", "param", "code", "words"),
    [
        ({"sampler": "sde"}, "sampler", "invalid_type", "must be an object"),
        ({"sampler": {"kind": "euler"}}, "sampler", "invalid_value", "kind: must be one of"),
        ({"sampler": {"noise_level": 0.7}}, "sampler", "invalid_value", "kind: must be one of"),
        ({"sampler": {"kind": "sde", "noise_level": 0}}, "sampler", "invalid_value", "> 0"),
        ({"sampler": {"kind": "sde", "noise_level": "1"}}, "sampler", "invalid_value", "number"),
        ({"sampler": {"kind": "ddim", "eta": 1.5}}, "sampler", "invalid_value", "eta: must be <="),
        ({"sampler": {"kind": "sde", "eta": 1}}, "sampler", "invalid_value", "eta: is not a field"),
        ({"sampler": {"kind": "sde", "steps": [1, 1]}}, "sampler", "invalid_value", "twice"),
        ({"sampler": {"kind": "sde", "steps": [4]}}, "sampler", "invalid_value", "past"),
        ({"sampler": {"kind": "sde", "\ud800": 1}}, "sampler", "invalid_value", "not a field"),
        ({"return_trajectory": "yes"}, "return_trajectory", "invalid_type", "a boolean"),
        ({"return_trajectory": True}, "return_trajectory", "invalid_value", "needs a sampler"),
        ({"sampler": {"kind": "sde"}}, "sampler", "invalid_value", "cannot sample"),
    ],
)
async def test_a_bad_sampler_or_trajectory_is_a_400_naming_its_field(
    fields: dict[str, Any], param: str, code: str, words: str
) -> None:
    """L100, L52: a sampler that is not one (its kind, a field's type or value, a step past
    the request's 4), a trajectory without a sampler, and a sampler the model cannot run
    (a fake runner samples no way: refused at admission as the runner refuses it) are each
    a 400 naming ``sampler`` or ``return_trajectory``; nothing is admitted."""
    service, runner = make_service()
    body = json.dumps({"prompt": "a cat", **fields})  # ASCII: "\ud800" as an escape
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            response = await client.post(PATH, content=body.encode())
            assert words in response.json()["error"]["message"], response.text
            await assert_refused_and_serving(client, service, runner, response, param, code)


class ToTheApp(httpx.BaseTransport):
    """A synchronous client's transport, from a worker thread, to an in-process app's
    ``AsyncClient`` in the event loop."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        async def send() -> httpx.Response:
            sent = self._client.build_request(
                request.method, request.url.path, content=request.read(), headers=request.headers
            )
            return await self._client.send(sent)

        response = anyio.from_thread.run(send)
        return httpx.Response(
            response.status_code, headers=response.headers, content=response.content
        )


async def test_the_docs_client_decodes_its_trajectory(monkeypatch: pytest.MonkeyPatch) -> None:
    """L100: docs/snippets/trajectory_client.py, verbatim, against tiny Flux's server: a
    trajectory of its four images and the three steps its sampler names."""
    snippet = ROOT / "docs" / "snippets" / "trajectory_client.py"
    names: dict[str, Any] = {}
    with anyio.fail_after(BUDGET):
        async with serving(flux_service()) as client:
            monkeypatch.setattr(
                httpx, "Client", functools.partial(httpx.Client, transport=ToTheApp(client))
            )
            code = compile(snippet.read_text(), str(snippet), "exec")
            await anyio.to_thread.run_sync(exec, code, names)
    trajectory: ot.Trajectory = names["trajectory"]
    assert trajectory.sampler == ot.SDESampler(noise_level=0.7, steps=(0, 1, 2))
    assert trajectory.latents.shape[:2] == (4, 4) and trajectory.log_probs.shape == (4, 3)


def test_bytes_that_are_no_trajectory_are_refused_in_one_line() -> None:
    """L100: ``Trajectory.from_safetensors`` refuses, with a ``ValueError`` that says why,
    bytes cut short, a header that is not JSON, a safetensors file of other tensors, and a
    trajectory's file missing a tensor or with a sampler that is not one."""
    import safetensors.torch

    one = {"x": torch.zeros(1)}
    trajectory = ot.Trajectory(
        sampler=ot.SDESampler(),
        prediction="flow",
        latents=torch.zeros(1, 2, 3),
        timesteps=torch.ones(1),
        schedule=torch.ones(1, 2),
        steps=torch.zeros(1, dtype=torch.int64),
        noise=torch.zeros(1, 1, 3),
        log_probs=torch.zeros(1, 1),
    )
    assert_equal(ot.Trajectory.from_safetensors(trajectory.to_safetensors()), trajectory)
    header = {"format": "omni_trio.trajectory/1", "prediction": "flow"}
    cases = {
        b"\x01": "shorter than",
        (100).to_bytes(8, "little") + b"{}": "cut short",
        (2).to_bytes(8, "little") + b"{]": "not JSON",
        safetensors.torch.save(one): "format",
        safetensors.torch.save(
            one, metadata={**header, "sampler": '{"kind": "sde"}'}
        ): "no latents",
        safetensors.torch.save(one, metadata={**header, "sampler": '{"kind": 1}'}): "kind",
    }
    for data, words in cases.items():
        with pytest.raises(ValueError, match=words):
            ot.Trajectory.from_safetensors(data)


async def test_an_edit_form_takes_a_sampler_and_answers_its_trajectory() -> None:
    """L100: ``/v1/images/edits`` takes ``sampler`` (a JSON object's text in a form field)
    and ``return_trajectory`` (``true``): an image-to-image edit on tiny SD with DDIM's
    ``eta`` answers with the Python API's trajectory for the same image, bitwise; a
    sampler field that is no JSON object, and one the model cannot run, are 400s naming
    ``sampler``."""
    noise = torch.rand(64, 64, 3, generator=torch.Generator().manual_seed(3))
    picture = Image.fromarray((noise * 255).to(torch.uint8).numpy())
    png = io.BytesIO()
    picture.save(png, format="PNG")
    config = ServeConfig(model_name="tiny-sd", default_width=64, default_height=64)
    service = Service(DiffusersRunner(tiny_pipeline("sd")), config=config)
    expected = ot.GenerationRequest(
        prompt="a red flower",
        seed=11,
        num_steps=3,
        width=64,
        height=64,
        guidance_scale=config.default_guidance_scale,
        image=picture,
        strength=0.7,
        sampler=ot.DDIMSampler(eta=1.0),
        return_trajectory=True,
    )
    form = {
        "prompt": "a red flower",
        "seed": "11",
        "num_inference_steps": "3",
        "strength": "0.7",
        "sampler": json.dumps({"kind": "ddim", "eta": 1.0}),
        "return_trajectory": "true",
    }

    async def edit(**fields: str) -> httpx.Response:
        files = {"image": ("in.png", png.getvalue(), "image/png")}
        return await client.post("/v1/images/edits", data={**form, **fields}, files=files)

    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            answer = await edit()
            huge = '{"kind": "ddim", "eta": 1' + "0" * 5000 + "}"  # as a JSON body's
            texts = ("ddim", "[1]", "{", '{"kind": "sde"}', huge)
            refused = [await edit(sampler=text) for text in texts]
            assert service.engine is not None
            python = (await service.engine.generate(expected)).trajectory
    assert answer.status_code == 200, answer.text
    assert python is not None and python.log_probs.shape == (1, 2)  # strength 0.7 of 3
    assert_equal(decoded(answer.json()["omni_trio"]["trajectory"]), python)
    assert [r.status_code for r in refused] == [400] * 5
    assert {r.json()["error"]["param"] for r in refused} == {"sampler"}
    assert "must be a JSON object" in refused[0].json()["error"]["message"]
    assert "eta: must be finite" in refused[4].json()["error"]["message"]
