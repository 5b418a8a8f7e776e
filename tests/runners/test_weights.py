"""A real model's weights updated in place (L102) and put to sleep (L103).

Determinism: tiny Flux pipelines with seeded weights on the CPU, built fresh for each
test that changes them; images are compared bitwise. A pipeline loaded from a folder
(``saved``) has its tensors at the odd addresses safetensors left them at, and a
woken one must keep them there (a kernel's path depends on alignment); an updated
pipeline is compared with one built with the same weights, both in memory. The
engine's tests hold the worker at a gated step (``GatedDiffusers``): where an update
or a sleep lands needs no timing.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import save_file

import omni_trio as ot
from omni_trio.runners import CheckpointError, DiffusersRunner, tiny_lora, tiny_pipeline
from omni_trio.runners._load import load_pipeline
from omni_trio.testing import probe_engine, wait_until
from tests.support.core import BUDGET
from tests.support.parallel import images_of
from tests.support.runners import GatedDiffusers, request

#: Seconds: a tiny Flux per test, built or loaded, and a few requests through it.
SLOW = 2 * BUDGET


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Flux saved in a folder (``save_pretrained``)."""
    folder = tmp_path_factory.mktemp("flux")
    tiny_pipeline("flux").save_pretrained(folder)
    return folder


@pytest.fixture
def runner() -> Iterator[DiffusersRunner]:
    """A runner over a fresh tiny Flux (seed 0); closed after."""
    made = DiffusersRunner(tiny_pipeline("flux"))
    yield made
    made.close()


def with_transformer_of(seed: int) -> Any:
    """A fresh tiny Flux (seed 0) whose transformer is seed ``seed``'s."""
    base = tiny_pipeline("flux")
    return type(base)(
        **{**base.components, "transformer": tiny_pipeline("flux", seed=seed).transformer}
    )


def tensors(pipe: Any) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the pipeline's models, by ``component.name``."""
    return {
        f"{component}.{name}": tensor
        for component, module in pipe.components.items()
        if isinstance(module, torch.nn.Module)
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
    }


def test_an_update_is_copied_in_place_and_a_revert_puts_it_back(runner: DiffusersRunner) -> None:
    """L102: a state dict of the denoiser (names without prefix) is copied into its tensors
    in place (their storage stays): the images are those of a pipeline built with those
    weights; a revert gives the old images back, bitwise; a commit keeps it."""
    r = request("flux")
    before = images_of(runner, r)
    pipe = runner._pipeline
    places = {name: tensor.data_ptr() for name, tensor in tensors(pipe).items()}
    new = tiny_pipeline("flux", seed=1).transformer.state_dict()
    runner.update_weights(new, key="one")
    assert {name: tensor.data_ptr() for name, tensor in tensors(pipe).items()} == places
    updated = images_of(runner, r)
    expected = DiffusersRunner(with_transformer_of(1))
    assert torch.equal(updated, images_of(expected, r))
    expected.close()
    runner.revert_weights()
    assert torch.equal(images_of(runner, r), before)
    runner.update_weights(new, key="one")
    runner.commit_weights()
    assert torch.equal(images_of(runner, r), updated)


def test_a_file_with_component_prefixes_updates_those_components(
    runner: DiffusersRunner, tmp_path: Path
) -> None:
    """L102: a ``.safetensors`` file whose names are prefixed ``component.`` updates each
    component's tensors, and a mapping of components to state dicts does the same."""
    other = tiny_pipeline("flux", seed=2)
    file = tmp_path / "update.safetensors"
    chosen = {
        "vae.decoder.conv_out.weight": other.vae.decoder.conv_out.weight,
        "transformer.proj_out.weight": other.transformer.proj_out.weight,
    }
    save_file({name: t.detach().contiguous() for name, t in chosen.items()}, str(file))
    runner.update_weights(file, key="file")
    runner.commit_weights()
    mine = tensors(runner._pipeline)
    for name, tensor in chosen.items():
        assert torch.equal(mine[name], tensor)
    norm = {"text_encoder": {"final_layer_norm.weight": torch.full((32,), 0.5)}}
    runner.update_weights(norm, key="mapping")
    assert torch.equal(
        mine["text_encoder.final_layer_norm.weight"],
        norm["text_encoder"]["final_layer_norm.weight"],
    )


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ({"no_such.weight": torch.zeros(2)}, "no_such.weight is no tensor of the model"),
        ({"proj_out.weight": torch.zeros(2, 2)}, "has the shape [2, 2]"),
        ({"proj_out.weight": torch.zeros(64, 32, dtype=torch.int64)}, "is torch.int64"),
        ({"proj_out.weight": "zeros"}, "is a str"),
        ({"unet": {"x": torch.zeros(1)}}, "no model 'unet'"),
        ({}, "a state dict maps names"),
        ("missing.safetensors", "no .safetensors file"),
        (12, "a .safetensors file or a state dict"),
    ],
)
def test_a_source_that_does_not_fit_is_refused_and_changes_nothing(
    runner: DiffusersRunner, source: Any, says: str
) -> None:
    """L102: a tensor that names nothing of the model, of another shape or kind, another
    component, a file that is not there: ``WeightsError`` (``invalid``) naming it; every
    tensor is as it was."""
    before = {name: tensor.clone() for name, tensor in tensors(runner._pipeline).items()}
    with pytest.raises(ot.WeightsError, match=re.escape(says)) as caught:
        runner.update_weights(source, key="bad")
    assert caught.value.reason == "invalid"
    after = tensors(runner._pipeline)
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())


def test_a_lora_update_runs_unmerged_in_every_request(
    runner: DiffusersRunner, tmp_path: Path
) -> None:
    """L102: a LoRA update is every request's base adapter at scale 1, unmerged: its
    images are those of the same LoRA loaded as an adapter and named at 1.0; it is not
    listed; the next LoRA update replaces it, a revert puts the first back, and the
    runner's close takes it out of the pipeline."""
    pipe = runner._pipeline
    first = tiny_lora(pipe, tmp_path, "first", seed=3)
    second = tiny_lora(pipe, tmp_path, "second", seed=4)
    base = {name: tensor.clone() for name, tensor in tensors(pipe).items()}
    runner.update_weights(first, key="a")
    runner.commit_weights()
    assert runner.adapters() == ()
    layers = {n: t for n, t in tensors(pipe).items() if ".base_layer." in n}
    assert layers
    for name, tensor in layers.items():  # not merged: each base as it was
        assert torch.equal(tensor, base[name.replace(".base_layer.", ".")])
    r = request("flux")
    with_first = images_of(runner, r)
    reference = DiffusersRunner(tiny_pipeline("flux"))
    reference.load_adapter("first", first)
    reference.load_adapter("second", second)
    assert torch.equal(with_first, images_of(reference, request("flux", adapters={"first": 1.0})))
    both = request("flux", adapters={"second": 0.5})
    runner.load_adapter("second", second)
    assert torch.equal(
        images_of(runner, both),
        images_of(reference, request("flux", adapters={"first": 1.0, "second": 0.5})),
    )
    runner.unload_adapter("second")
    runner.update_weights(second, key="b")
    assert torch.equal(
        images_of(runner, r), images_of(reference, request("flux", adapters={"second": 1.0}))
    )
    runner.revert_weights()
    assert torch.equal(images_of(runner, r), with_first)
    reference.close()
    runner.close()
    plain = DiffusersRunner(pipe)
    assert torch.equal(images_of(plain, r), images_of(DiffusersRunner(tiny_pipeline("flux")), r))
    plain.close()


def test_an_update_clears_the_prompt_cache_and_renames_the_checkpoints_model(
    runner: DiffusersRunner,
) -> None:
    """L102: the texts encoded with the old weights are dropped, and a checkpoint taken on
    them is refused on the new ones (``CheckpointError``: another model), while a
    revert keeps the model's name."""
    r = request("flux")
    state = runner.prepare(r, "before")
    runner.step([state])
    data = runner.checkpoint_bytes(runner.checkpoint(state))
    runner.discard(state)
    assert runner.prompt_cache_statistics().entries > 0
    runner.update_weights({"proj_out.bias": torch.zeros(64)}, key="zero")
    assert runner.prompt_cache_statistics().entries == 0
    runner.revert_weights()
    restored, steps = runner.restore(r, "again", data)
    assert steps == 1
    runner.discard(restored)
    runner.update_weights({"proj_out.bias": torch.zeros(64)}, key="zero")
    runner.commit_weights()
    with pytest.raises(CheckpointError, match="model"):
        runner.restore(r, "after", data)


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleep_frees_every_weight_and_the_wake_gives_the_same_images(
    saved: Path, level: int
) -> None:
    """L103: asleep, every parameter and buffer of a pipeline loaded from its folder is
    empty on its device; level 1 moved all their bytes to host memory, level 2 dropped
    those the folder's files hold (all but the buffers the files lack, moved). Awake,
    the images are the ones before, bitwise; once closed the pipeline is whole."""
    pipe = load_pipeline(saved)
    runner = DiffusersRunner(pipe)
    r = request("flux")
    before = images_of(runner, r)
    total = sum(t.nbytes for t in {id(t): t for t in tensors(pipe).values()}.values())
    freed = runner.sleep_weights(level)
    assert all(t.numel() == 0 for t in tensors(pipe).values())
    assert freed.offloaded + freed.dropped == total and freed.kept == 0
    if level == 1:
        assert freed.dropped == 0
    else:
        assert freed.dropped > 0.99 * total
    assert runner.sleep_weights(level) == ot.abc.SleepBytes()  # asleep: nothing more
    runner.wake_weights()
    assert torch.equal(images_of(runner, r), before)
    runner.sleep_weights(level)
    runner.close()
    assert all(t.numel() for t in tensors(pipe).values())


def test_a_level_2_wake_refuses_a_file_that_changed(saved: Path) -> None:
    """L103: a file a level-2 sleep dropped weights of that changed since (its time) is
    refused at the wake (``WeightsError``, ``failed``) and the runner sleeps on; as it
    was, the wake brings the weights back. An updated tensor is never dropped."""
    pipe = load_pipeline(saved)
    runner = DiffusersRunner(pipe)
    runner.update_weights({"proj_out.bias": torch.zeros(64)}, key="zero")
    runner.commit_weights()
    r = request("flux")
    before = images_of(runner, r)
    freed = runner.sleep_weights(2)
    assert freed.offloaded >= 64 * 4
    file = saved / "transformer" / "diffusion_pytorch_model.safetensors"
    stat = file.stat()
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(ot.WeightsError, match="changed") as caught:
        runner.wake_weights()
    assert caught.value.reason == "failed"
    assert all(t.numel() == 0 for t in tensors(pipe).values())
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    runner.wake_weights()
    assert torch.equal(images_of(runner, r), before)
    runner.close()


@pytest.mark.anyio
async def test_the_engine_updates_a_model_between_the_requests_in_flight_and_the_next(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """L102: through the engine, ``finish``: the request held in its first step ends on the
    old weights (the images of a run on them), the one submitted meanwhile runs on the
    new ones (a run on a pipeline built with them); each names its version. A checkpoint
    taken before is refused: the request resumed from it starts over, and says so."""
    runner = GatedDiffusers(tiny_pipeline("flux"))
    new_weights = tiny_pipeline("flux", seed=1).transformer.state_dict()
    old_request, new_request = request("flux", seed=1), request("flux", seed=2)
    checkpoints: list[bytes] = []
    policy = ot.CheckpointPolicy(every_s=0, sink=lambda c: checkpoints.append(c.data))
    with anyio.fail_after(SLOW):
        async with ot.open_engine(runner) as engine:
            old = engine.submit(old_request, checkpoint=policy)
            await runner.wait_arrived(1)
            async with anyio.create_task_group() as group:
                group.start_soon(lambda: engine.update_weights(new_weights, label="rl-1"))
                await wait_until(lambda: probe_engine(engine).is_held)
                new = engine.submit(new_request)
                runner.open_gate()
            async with old, new:
                old_output, new_output = await old.result(), await new.result()
            async with engine.submit(old_request, resume_from=checkpoints[0]) as resumed:
                again = await resumed.result()
    assert old_output.weight_version == ot.WeightVersion(number=0)
    assert new_output.weight_version == ot.WeightVersion(number=1, label="rl-1")
    before, after = DiffusersRunner(tiny_pipeline("flux")), DiffusersRunner(with_transformer_of(1))
    assert torch.equal(old_output.images, images_of(before, old_request))
    assert torch.equal(new_output.images, images_of(after, new_request))
    assert torch.equal(again.images, images_of(after, old_request))
    assert any(
        "is refused" in record.message and "starts from step 0" in record.message
        for record in caplog.records
    )


@pytest.mark.anyio
@pytest.mark.parametrize("level", [1, 2])
async def test_a_request_suspended_by_a_sleep_resumes_after_the_wake_bitwise(
    saved: Path, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    """L103: through the engine, ``suspend``: the request held in its first step is
    suspended at its boundary, the model sleeps (its bytes freed), and after the wake the
    request ends with the images of its uninterrupted run, and so does the next."""
    caplog.set_level(logging.INFO, logger="omni_trio.engine")
    runner = GatedDiffusers(load_pipeline(saved))
    r = request("flux", num_steps=3)
    with anyio.fail_after(SLOW):
        async with ot.open_engine(runner) as engine:
            runner.open_gate()
            uninterrupted = await engine.generate(r)
        runner = GatedDiffusers(load_pipeline(saved))
        async with ot.open_engine(runner) as engine:
            held = engine.submit(r)
            await runner.wait_arrived(1)
            async with anyio.create_task_group() as group:
                reports: list[ot.SleepReport] = []

                async def sleep() -> None:
                    reports.append(await engine.sleep(level, policy="suspend"))

                group.start_soon(sleep)
                await wait_until(lambda: probe_engine(engine).is_held)
                runner.release(1)
            assert reports[0].freed_bytes > 0 and engine.sleep_level == level
            await engine.wake()
            runner.open_gate()
            async with held:
                resumed = await held.result()
            after = await engine.generate(r)
    assert resumed.metrics.preemptions == 1
    assert torch.equal(resumed.images, uninterrupted.images)
    assert torch.equal(after.images, uninterrupted.images)
    assert any("asleep at level" in record.message for record in caplog.records)
