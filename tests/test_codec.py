"""The request codec (``omni_trio._codec``): every field to a record and back.

No concurrency: plain functions over requests.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from omni_trio import DDIMSampler, GenerationRequest, SDESampler, StepCache
from omni_trio._codec import (
    NOT_OUTPUT,
    request_fingerprint,
    request_from_record,
    request_record,
)


def _image(channels: int, *, levels: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(channels)
    values = torch.rand(channels, 8, 8, generator=generator)
    return (values * 255).round() / 255 if levels else values


#: A value for every field of ``GenerationRequest``, none of them its default.
EVERY_FIELD: dict[str, Any] = {
    "prompt": "a red fox",
    "negative_prompt": "blur",
    "num_steps": 7,
    "height": 8,
    "width": 8,
    "guidance_scale": 3.25,
    "seed": 2**63 + 5,
    "num_images": 2,
    "preview_every": 3,
    "extra": {"clip_skip": 1, "note": "n"},
    "priority": -4,
    "deadline_s": 12.5,
    "image": _image(3, levels=True),
    "mask": _image(1, levels=True),
    "strength": 0.6,
    "num_frames": None,  # with a mask it would be refused: see the video case below
    "cache": StepCache(kind="first-block", threshold=0.3),
    "adapters": {"ink": 0.8, "paper": -1.5},
    "tenant": "acme",
    # With a mask they would be refused: see the sampled case below.
    "sampler": None,
    "return_trajectory": False,
}


def test_every_field_of_a_request_is_named_here() -> None:
    """L77, L78: the day a field is added to the request, this fails until the codec's
    tests give it a value (and so check that it is carried)."""
    assert set(EVERY_FIELD) == {f.name for f in dataclasses.fields(GenerationRequest)}


@pytest.mark.parametrize("levels", [True, False], ids=["8-bit", "float"])
def test_a_request_survives_json_and_pickle_records_field_for_field(levels: bool) -> None:
    """L77: a job's record (JSON) and a plan's join (tensors kept) give back the very
    request: every field, images bit for bit (a PNG only where it is exact)."""
    fields = {**EVERY_FIELD, "image": _image(3, levels=levels), "mask": _image(1, levels=levels)}
    request = GenerationRequest(**fields)
    text = json.loads(json.dumps(request_record(request)))
    assert ("png" in text["image"]) is levels
    for record in (text, request_record(request, images="tensor")):
        again = request_from_record(record)
        assert again == request
        for item in dataclasses.fields(GenerationRequest):
            mine, theirs = getattr(request, item.name), getattr(again, item.name)
            if isinstance(mine, torch.Tensor):
                assert mine.dtype == theirs.dtype
                assert torch.equal(mine, theirs), item.name
            else:
                assert mine == theirs, item.name
                assert type(mine) is type(theirs), item.name


def test_an_image_to_video_request_survives_too() -> None:
    """L77: a video job's request, with frames and its first image."""
    request = GenerationRequest(
        prompt="waves", num_frames=9, height=8, width=8, image=_image(3, levels=False), seed=1
    )
    assert request_from_record(json.loads(json.dumps(request_record(request)))) == request


def test_a_sampled_request_survives_and_its_sampler_names_its_output() -> None:
    """L100, L78: a sampler and ``return_trajectory`` go through JSON and back; each of
    their fields changes the fingerprint, as the trajectory and the images change."""
    base = GenerationRequest(
        prompt="p", num_steps=5, seed=3, sampler=SDESampler(noise_level=0.9, steps=(1, 3))
    )
    variants = [
        dataclasses.replace(base, return_trajectory=True),
        dataclasses.replace(base, sampler=SDESampler(noise_level=0.8, steps=(1, 3))),
        dataclasses.replace(base, sampler=SDESampler(noise_level=0.9, steps=(1, 4))),
        dataclasses.replace(base, sampler=SDESampler(noise_level=0.9)),
        dataclasses.replace(base, sampler=DDIMSampler(eta=0.9, steps=(1, 3))),
        dataclasses.replace(base, sampler=None),
    ]
    for request in [base, *variants]:
        assert request_from_record(json.loads(json.dumps(request_record(request)))) == request
    prints = {request_fingerprint(request) for request in [base, *variants]}
    assert len(prints) == len(variants) + 1


def test_a_record_of_an_earlier_version_is_read_and_a_foreign_one_refused() -> None:
    """L77: a store written before the codec kept fewer fields and its image as bare PNG
    text; it still reads. A record naming a field the request lacks is refused."""
    request = GenerationRequest(prompt="p", height=8, width=8, image=_image(3, levels=True))
    old = {"prompt": "p", "height": 8, "width": 8, "image": request_record(request)["image"]["png"]}
    assert request_from_record(old) == dataclasses.replace(request, strength=0.8)
    with pytest.raises(ValueError, match="unknown fields"):
        request_from_record({"prompt": "p", "scheduler": "euler"})


def test_the_fingerprint_follows_every_output_field_and_no_other() -> None:
    """L78: a checkpoint names its request by the fields that decide the output: changing
    any of them changes the fingerprint; priority, deadline, previews and tenant do not."""
    base = GenerationRequest(**EVERY_FIELD)
    other: dict[str, Any] = {
        "prompt": "a blue fox",
        "negative_prompt": "sharp",
        "num_steps": 8,
        "height": 8,
        "width": 8,
        "guidance_scale": 3.5,
        "seed": 6,
        "num_images": 3,
        "preview_every": 1,
        "extra": {"clip_skip": 2, "note": "n"},
        "priority": 9,
        "deadline_s": 99.0,
        "image": _image(3, levels=False),
        "mask": 1 - EVERY_FIELD["mask"],
        "strength": 0.7,
        "num_frames": None,
        "cache": StepCache(kind="first-block", threshold=0.31),
        "adapters": {"ink": 0.9, "paper": -1.5},
        "tenant": "other",
        "sampler": None,
        "return_trajectory": False,
    }
    assert set(other) == set(EVERY_FIELD)
    # The images fix the size; no frames nor sampler beside a mask (the sampled case below).
    unchanged = {"height", "width", "num_frames", "sampler", "return_trajectory"}
    for name, value in other.items():
        if name in unchanged:
            continue
        changed = GenerationRequest(**{**EVERY_FIELD, name: value})
        same = request_fingerprint(changed) == request_fingerprint(base)
        assert same is (name in NOT_OUTPUT), name
