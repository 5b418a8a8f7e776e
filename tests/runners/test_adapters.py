"""Adapters (LoRA) in ``DiffusersRunner``: loaded by name while serving, per row (L85-L87).

The LoRAs are tiny and random (``omni_trio.runners.tiny_lora``, made with peft); every
output is compared with the pipeline's own call on a second copy of the tiny pipeline
with the same file loaded by diffusers and ``set_adapters([...], weights)``.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_lora, tiny_pipeline
from omni_trio.runners._adapters import wrapped_layers
from omni_trio.runners._tinylora import tiny_lora_weights
from omni_trio.testing import probe_engine
from tests.support.core import BUDGET
from tests.support.runners import GatedDiffusers, ModuleGate, reference, request

#: Float tolerance of a row against the pipeline's own call (measured in the mixed batch
#: of 3 steps: at most 6.0e-6 on SD3, 4.5e-6 on SDXL, 1.5e-6 on Flux, 1.2e-6 on SD,
#: 1.0e-6 on Wan 2.1, 7.7e-7 on LTX-Video, 2.1e-7 on Qwen-Image, against a LoRA
#: effect of 0.009 (Qwen-Image) to 0.8 (SD)).
TOLERANCE = 2e-5

#: The files each test kind gets: (name, seed, rank).
LORAS = (("ink", 1, 4), ("film", 2, 8), ("dust", 3, 4))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("loras")


@cache
def _pipe(kind: str, copy: int) -> Any:
    """Copy 0 serves the runners under test; copy 1 is the pipeline's own reference."""
    return tiny_pipeline(kind)


def loras(kind: str, folder: Path, count: int = 2) -> dict[str, Path]:
    """The kind's first ``count`` LoRA files (each made once per folder), by name."""
    made = {}
    for name, seed, rank in LORAS[:count]:
        path = folder / kind / f"{name}.safetensors"
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            tiny_lora(_pipe(kind, 0), path.parent, name, seed=seed, rank=rank)
        made[name] = path
    return made


@cache
def _reference_pipe(kind: str, folder: Path) -> Any:
    """Copy 1 with ``ink`` and ``film`` loaded by diffusers under those names."""
    pipe = _pipe(kind, 1)
    for name, path in loras(kind, folder).items():
        with warnings.catch_warnings():
            # PEFT's note on every adapter after the first.
            warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
            pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
    return pipe


def own_call(kind: str, folder: Path, r: ot.GenerationRequest) -> torch.Tensor:
    """The pipeline's own call for ``r`` with ``set_adapters(names, scales)`` (or none)."""
    pipe = _reference_pipe(kind, folder)
    if r.adapter_pairs:
        pipe.enable_lora()
        names, scales = zip(*r.adapter_pairs, strict=True)
        pipe.set_adapters(list(names), list(scales))
    else:
        pipe.disable_lora()
    return reference(kind, r, pipeline=pipe)


@pytest.fixture
def runner_of(folder: Path) -> Iterator[Any]:
    """``runner_of(kind, **options)``: a runner with the kind's LoRAs loaded; closed after."""
    made: list[DiffusersRunner] = []

    def make(kind: str, *, load: bool = True, **options: Any) -> DiffusersRunner:
        runner = DiffusersRunner(_pipe(kind, 0), **options)
        made.append(runner)
        if load:
            for name, path in loras(kind, folder).items():
                runner.load_adapter(name, path)
        return runner

    yield make
    for runner in made:
        runner.close()
    for runner in made:
        assert wrapped_layers(runner._pipeline) == 0  # the last close put every forward back


def run_batch(runner: DiffusersRunner, requests: list[ot.GenerationRequest]) -> list[torch.Tensor]:
    """Prepare, step together to the end and decode: one batch, no engine."""
    states = [runner.prepare(r, f"r{i}") for i, r in enumerate(requests)]
    try:
        for _ in range(requests[0].num_steps):
            runner.step(states)
        return [runner.decode(state).float().cpu() for state in states]
    finally:
        for state in states:
            runner.discard(state)


#: The first test of a kind builds two pipelines and makes its LoRA files: on a loaded
#: machine of 2 cores that alone took 100 s (CPU time: about 10).
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("kind", ["sd", "sdxl", "sd3", "flux", "qwen-image", "wan", "ltx"])
def test_a_mixed_batch_equals_each_request_alone_with_set_adapters(
    kind: str, folder: Path, runner_of: Any
) -> None:
    """L86: different adapters, several per request, none, one at two scales: one forward
    per step, each row equal to the pipeline's own call with ``set_adapters`` (2e-5), on
    every family the runner drives with adapters (guided ones' unconditional rows too)."""
    runner = runner_of(kind)
    assert runner.capabilities.max_adapters == 4
    steps: dict[str, Any] = {"num_steps": 3}
    if kind == "qwen-image":
        steps["negative_prompt"] = "dull"  # Qwen-Image guides only with a negative prompt
    requests = [
        request(kind, adapters={"ink": 0.8}, **steps),
        request(kind, adapters={"ink": 0.8, "film": 0.3}, seed=3, **steps),
        request(kind, seed=4, **steps),
        request(kind, adapters={"ink": -0.5}, seed=5, prompt="a blue flower", **steps),
    ]
    denoiser = runner._pipeline.unet if kind in ("sd", "sdxl") else runner._pipeline.transformer
    calls: list[int] = []
    handle = denoiser.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        outputs = run_batch(runner, requests)
    finally:
        handle.remove()
    assert len(calls) == 3  # one model call per step for all four
    for r, output in zip(requests, outputs, strict=True):
        expected = own_call(kind, folder, r)
        assert (output - expected).abs().max().item() < TOLERANCE, r.adapter_pairs
    # The adapters change the image, far beyond the tolerance (Qwen-Image's tiny
    # transformer the least: by 0.009, 470 times it).
    plain = own_call(kind, folder, dataclasses.replace(requests[0], adapters=()))
    assert (outputs[0] - plain).abs().max().item() > 100 * TOLERANCE


def test_text_encoder_layers_run_the_requests_adapters(folder: Path, runner_of: Any) -> None:
    """L86: a file with text-encoder keys changes the prompt's encoding, per request."""
    runner = runner_of("sd")
    state = runner.prepare(request("sd", adapters={"ink": 1.0}), "a")
    plain = runner.prepare(request("sd"), "b")
    try:
        assert not torch.equal(
            state.cond["encoder_hidden_states"], plain.cond["encoder_hidden_states"]
        )
    finally:
        runner.discard(state)
        runner.discard(plain)


def test_adapters_and_a_step_cache_in_one_batch(folder: Path, runner_of: Any) -> None:
    """L81, L86: rows that skip, rows that compute, each with its adapters: each output
    equals the request alone (2e-5), and the cached request did skip."""
    runner = runner_of("flux")
    cached = request(
        "flux",
        num_steps=8,
        adapters={"ink": 0.8},
        cache=ot.StepCache(kind="first-block", threshold=0.4),
    )
    requests = [cached, request("flux", num_steps=8, adapters={"film": 0.5}, seed=3)]
    requests.append(request("flux", num_steps=8, seed=4))
    together = run_batch(runner, requests)
    alone = [run_batch(runner, [r])[0] for r in requests]
    for a, b in zip(together, alone, strict=True):
        assert (a - b).abs().max().item() < TOLERANCE
    state = runner.prepare(cached, "c")
    for _ in range(cached.num_steps):
        runner.step([state])
    metrics = runner.cache_metrics(state)
    runner.discard(state)
    assert metrics is not None and metrics.calls_skipped > 0


def test_a_file_for_another_model_is_refused_and_nothing_stays(
    folder: Path, runner_of: Any, tmp_path: Path
) -> None:
    """L85: validated at load; on refusal no layer keeps any of it."""
    runner = runner_of("flux", load=False)
    before = run_batch(runner, [request("flux")])[0]
    with pytest.raises(ot.AdapterError) as caught:
        runner.load_adapter("sd-file", loras("sd", folder)["ink"])
    assert caught.value.reason == "invalid"
    # A diffusers-format file with a key no layer of the model has: refused too.
    weights = tiny_lora_weights(_pipe("flux", 0), seed=9)
    layers = weights["transformer_lora_layers"]
    layers["transformer_blocks.0.attn.to_nowhere.lora_A.weight"] = torch.zeros(4, 8)
    layers["transformer_blocks.0.attn.to_nowhere.lora_B.weight"] = torch.zeros(8, 4)
    type(_pipe("flux", 0)).save_lora_weights(
        str(tmp_path), weight_name="odd.safetensors", **weights
    )
    with pytest.raises(ot.AdapterError, match="to_nowhere") as caught:
        runner.load_adapter("odd", tmp_path / "odd.safetensors")
    assert caught.value.reason == "invalid"
    with pytest.raises(ot.AdapterError, match=r"\.safetensors"):
        runner.load_adapter("pickle", tmp_path / "x.bin")
    assert runner.adapters() == ()
    pipe = _pipe("flux", 0)
    assert not any(
        "omni_trio" in name
        for module in pipe.transformer.modules()
        for name in getattr(module, "lora_A", {})
    )
    assert torch.equal(run_batch(runner, [request("flux")])[0], before)


def _old_format(tensors: dict[str, Any]) -> dict[str, Any]:
    """diffusers' older keys (``lora.down``/``lora.up``) for a PEFT-format denoiser's."""
    return {
        key.replace(".lora_A.", ".lora.down.").replace(".lora_B.", ".lora.up."): value
        for key, value in tensors.items()
    }


def _kohya(tensors: dict[str, Any]) -> dict[str, Any]:
    """kohya's keys (``lora_unet_..._to_q.lora_down.weight``, an ``alpha`` each) for a
    PEFT-format UNet's."""
    made: dict[str, Any] = {}
    for key, value in tensors.items():
        module, part = key.removeprefix("unet.").rsplit(".lora_", 1)
        stem = "lora_unet_" + module.replace(".", "_")
        made[f"{stem}.{'lora_down' if part.startswith('A') else 'lora_up'}.weight"] = value
        made[f"{stem}.alpha"] = torch.tensor(4.0)
    return made


#: A layer the tiny UNet has (which the tiny LoRAs leave alone), and one it does not (it
#: has two down blocks).
_LAYER = "down_blocks.0.attentions.0.transformer_blocks.0.ff.net.2"
_NO_LAYER = "down_blocks.7.attentions.0.transformer_blocks.0.attn1.to_q"


def _landing_nowhere(files: dict[str, Path]) -> dict[str, tuple[dict[str, Any], str]]:
    """Adapters with tensors that land nowhere, each with what the refusal names."""
    from safetensors.torch import load_file

    peft = load_file(str(files["ink"]))
    unet = {key: value for key, value in peft.items() if key.startswith("unet.")}
    layer = _pipe("sd", 0).unet.get_submodule(_LAYER)
    a, b = torch.zeros(4, layer.in_features), torch.zeros(layer.out_features, 4)
    stray = {f"{_NO_LAYER}.lora_A.weight": a, f"{_NO_LAYER}.lora_B.weight": b}
    return {
        # diffusers' older format, two tensors for a layer the model does not have.
        "old": (_old_format({**unet, **{f"unet.{k}": v for k, v in stray.items()}}), _NO_LAYER),
        # kohya's format, the same.
        "kohya": (_kohya({**unet, **{f"unet.{k}": v for k, v in stray.items()}}), _NO_LAYER),
        # PEFT's format, and two tensors of the older one for a layer it has: diffusers
        # renames a file's keys only when its first is not PEFT's, so PEFT skips them.
        "mixed": (
            {
                **peft,
                f"unet.{_LAYER}.lora.down.weight": a,
                f"unet.{_LAYER}.lora.up.weight": b,
            },
            f"{_LAYER}.lora.down.weight",
        ),
        # A text encoder this pipeline does not have.
        "component": ({**peft, "text_encoder_2.x.lora_A.weight": a}, "text_encoder_2"),
        # Half a pair: a layer's lora_A without its lora_B.
        "half": ({**peft, f"unet.{_LAYER}.lora_A.weight": a}, "half a LoRA pair"),
    }


@pytest.mark.parametrize("case", ["old", "kohya", "mixed", "component", "half"])
def test_a_file_with_a_tensor_that_lands_nowhere_is_refused_and_nothing_stays(
    case: str, folder: Path, runner_of: Any, tmp_path: Path
) -> None:
    """L85: every tensor of an adapter file lands on a layer of the model, whatever its
    format (PEFT's, diffusers' older ``lora.down``/``lora.up``, kohya's), or the load is
    refused naming one that did not, and nothing of it stays."""
    from safetensors.torch import save_file

    runner = runner_of("sd", load=False)
    before = run_batch(runner, [request("sd", num_steps=2)])[0]
    tensors, named = _landing_nowhere(loras("sd", folder))[case]
    path = tmp_path / f"{case}.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(ot.AdapterError) as caught:
        runner.load_adapter(case, path)
    assert caught.value.reason == "invalid"
    assert named in str(caught.value)
    assert runner.adapters() == ()
    pipe = runner._pipeline
    assert not any(
        "omni_trio" in name
        for part in (pipe.unet, pipe.text_encoder)
        for module in part.modules()
        for name in getattr(module, "lora_A", {})
    )
    assert torch.equal(run_batch(runner, [request("sd", num_steps=2)])[0], before)


def test_older_and_kohya_files_whose_tensors_all_land_load(folder: Path, runner_of: Any) -> None:
    """L85: diffusers converts its older format and kohya's to PEFT keys; a file in
    either whose every tensor lands loads, and changes the output."""
    from safetensors.torch import load_file

    runner = runner_of("sd", load=False)
    plain = run_batch(runner, [request("sd", num_steps=2)])[0]
    peft = load_file(str(loras("sd", folder)["ink"]))
    unet = {key: value for key, value in peft.items() if key.startswith("unet.")}
    for name, tensors in (("old", _old_format(unet)), ("kohya", _kohya(unet))):
        runner.load_adapter(name, tensors)
        output = run_batch(runner, [request("sd", num_steps=2, adapters={name: 1.0})])[0]
        assert not torch.equal(output, plain), name
        runner.unload_adapter(name)


def test_dora_is_refused(folder: Path, runner_of: Any, tmp_path: Path) -> None:
    """L85: DoRA's magnitude is not applied per row: refused at load, not run wrong."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    pipe = _pipe("sd", 0)
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q"], use_dora=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
        unet = inject_adapter_in_model(config, copy.deepcopy(pipe.unet), adapter_name="d")
    state = get_peft_model_state_dict(unet, adapter_name="d")
    runner = runner_of("sd", load=False)
    with pytest.raises(ot.AdapterError, match="DoRA"):
        runner.load_adapter("dora", {f"unet.{key}": value for key, value in state.items()})
    assert runner.adapters() == ()


def test_residency_evicts_the_least_recently_used_unheld_and_reloads(
    folder: Path, runner_of: Any
) -> None:
    """L87: at most 2 loaded: a third load evicts the least recently used one no request
    holds; a request naming the evicted one reloads it, with the same output."""
    runner = runner_of("sd", load=False, max_loaded_adapters=2)
    steps = {"num_steps": 2}
    files = loras("sd", folder, 3)
    runner.load_adapter("ink", files["ink"])
    runner.load_adapter("film", files["film"])
    first = run_batch(runner, [request("sd", adapters={"ink": 0.7}, **steps)])[0]  # ink used last
    runner.load_adapter("dust", files["dust"])
    loaded = {info.name: info.loaded for info in runner.adapters()}
    assert loaded == {"dust": True, "film": False, "ink": True}
    held = runner.prepare(request("sd", adapters={"dust": 1.0}, **steps), "held")
    again = run_batch(runner, [request("sd", adapters={"film": 0.7}, **steps)])[0]  # reloads film
    loaded = {info.name: info.loaded for info in runner.adapters()}
    assert loaded == {"dust": True, "film": True, "ink": False}  # dust held: ink went
    expected = own_call("sd", folder, request("sd", adapters={"film": 0.7}, **steps))
    assert (again - expected).abs().max().item() < TOLERANCE
    assert torch.equal(run_batch(runner, [request("sd", adapters={"ink": 0.7}, **steps)])[0], first)
    runner.discard(held)


def test_no_room_while_every_loaded_adapter_is_held(folder: Path, runner_of: Any) -> None:
    """L87: a bound of bytes; a load that cannot fit while requests hold the rest is refused."""
    files = loras("sd", folder)
    runner = runner_of("sd", load=False, max_loaded_adapters=1)
    runner.load_adapter("ink", files["ink"])
    state = runner.prepare(request("sd", adapters={"ink": 1.0}), "a")
    with pytest.raises(ot.AdapterError) as caught:
        runner.load_adapter("film", files["film"])
    assert caught.value.reason == "full"
    assert [info.name for info in runner.adapters()] == ["ink"]
    runner.discard(state)
    size = runner.adapters()[0].bytes
    small = runner_of("sd", load=False, max_adapter_bytes=size)
    small.load_adapter("ink", files["ink"])
    with pytest.raises(ot.AdapterError, match="no room"):
        small.load_adapter("film", files["film"])  # alone it is over the bytes


def test_unload_of_a_held_adapter_is_refused(folder: Path, runner_of: Any) -> None:
    """L85, L87: an in-flight request keeps its adapters: unloading one it holds is refused;
    unloaded, a request admitted before fails in prepare, never runs without it."""
    runner = runner_of("sd")
    state = runner.prepare(request("sd", adapters={"ink": 1.0}), "a")
    with pytest.raises(ot.AdapterError) as caught:
        runner.unload_adapter("ink")
    assert caught.value.reason == "in-use"
    assert [i.holders for i in runner.adapters() if i.name == "ink"] == [1]
    runner.discard(state)
    runner.unload_adapter("ink")
    assert "ink" not in runner.adapter_names()
    with pytest.raises(ot.AdapterError, match="unloaded after"):
        runner.prepare(request("sd", adapters={"ink": 1.0}), "b")
    assert runner.live_states == 0


@pytest.mark.anyio
async def test_admission_refuses_unknown_names_and_too_many(runner_of: Any) -> None:
    """L85, L4: unknown adapters or more than ``max_adapters`` are refused, naming ``adapters``."""
    runner = runner_of("sd", max_adapters=2)
    assert runner.capabilities.max_adapters == 2
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            for adapters in ({"nope": 1.0}, {"ink": 1.0, "film": 1.0, "dust": 1.0}):
                with pytest.raises(ot.InvalidRequestError) as caught:
                    engine.submit(request("sd", adapters=adapters))
                assert caught.value.field == "adapters"
            output = await engine.generate(request("sd", adapters={"ink": 0.8}))
    assert output.images.shape[0] == 1


@pytest.mark.anyio
async def test_load_while_serving_and_preemption_keep_outputs(folder: Path, runner_of: Any) -> None:
    """L85, L61: a load while a request steps, and a preemption with exact resume, change
    no output: the resumed request equals its uninterrupted run bitwise."""
    files = loras("sd", folder)
    gated = GatedDiffusers(_pipe("sd", 0))
    gated.load_adapter("ink", files["ink"])
    low_request = request("sd", adapters={"ink": 0.9})
    high_request = request("sd", adapters={"ink": 0.2}, priority=5, seed=9)
    options = ot.EngineConfig(max_batch_size=1)
    try:
        with anyio.fail_after(BUDGET):
            async with ot.open_engine(gated, options) as engine:
                low = engine.submit(low_request, request_id="low")
                await gated.wait_arrived(1)
                high = engine.submit(high_request, request_id="high")
                loading = anyio.Event()

                async def load() -> None:
                    await engine.load_adapter("film", files["film"])
                    loading.set()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(load)
                    gated.release(1)
                    await gated.wait_arrived(2)
                    assert engine.statistics().preemptions == 1
                    gated.open_gate()
                async with high, low:
                    resumed = await low.result()
                    await high.result()
                assert loading.is_set() and "film" in {i.name for i in engine.adapters()}
                assert probe_engine(engine).workers[0] is not None
    finally:
        gated.close()
    uninterrupted = run_batch(runner_of("sd"), [low_request])[0]
    assert torch.equal(resumed.images.float(), uninterrupted)


@pytest.mark.anyio
async def test_an_abort_inside_a_step_releases_the_adapters(runner_of: Any) -> None:
    """L85, L71: a request left at a cancel point inside a step lets go of its adapters,
    and the next request's output is the one it has alone."""
    runner = runner_of("sd")
    after = request("sd", adapters={"film": 0.5}, num_steps=2, seed=2)
    gate = ModuleGate(runner._pipeline.unet.down_blocks[0], at=2)
    try:
        with anyio.fail_after(BUDGET):
            async with ot.open_engine(runner) as engine:
                handle = engine.submit(request("sd", adapters={"ink": 1.0}), request_id="r")
                await gate.wait_arrived()
                assert [i.holders for i in runner.adapters() if i.name == "ink"] == [1]
                async with anyio.create_task_group() as tg:
                    tg.start_soon(engine.abort, "r")
                    await anyio.lowlevel.checkpoint()
                    gate.release()
                await handle.aclose()
                output = await engine.generate(after)
                assert all(info.holders == 0 for info in runner.adapters())
                assert runner.live_states == 0
                again = await engine.generate(after)
    finally:
        gate.remove()
    assert torch.equal(output.images, again.images)


@pytest.mark.anyio
async def test_several_workers_load_all_or_nothing(folder: Path, runner_of: Any) -> None:
    """L85: an engine of two workers loads into each runner's own copy; when one refuses,
    the other unloads it again; requests run on either with their adapters."""
    first = runner_of("sd", load=False)
    second = DiffusersRunner(_pipe("sd", 1))
    files = loras("sd", folder)
    second.load_adapter("ink", files["ink"])  # the second refuses "ink": loaded already
    try:
        with anyio.fail_after(BUDGET):
            async with ot.open_engine([first, second]) as engine:
                with pytest.raises(ot.AdapterError) as caught:
                    await engine.load_adapter("ink", files["ink"])
                assert caught.value.reason == "exists"
                assert "ink" not in first.adapter_names()
                await engine.load_adapter("film", files["film"])
                assert {i.name for i in engine.adapters()} == {"film", "ink"}
                with pytest.raises(ot.InvalidRequestError):
                    engine.submit(request("sd", adapters={"ink": 1.0}))  # the first lacks it
                r = request("sd", adapters={"film": 0.6}, num_steps=2)
                async with anyio.create_task_group() as tg:
                    for index in range(2):
                        tg.start_soon(engine.generate, dataclasses.replace(r, seed=index))
                await engine.unload_adapter("film")
                assert {i.name for i in engine.adapters()} == {"ink"}
    finally:
        second.close()


def test_an_evicted_adapter_whose_file_is_gone_fails_its_request(
    folder: Path, runner_of: Any, tmp_path: Path
) -> None:
    """L87: a reload that cannot be done fails the request in ``prepare``: it never runs
    without its adapter, and holds nothing after."""
    files = loras("sd", folder)
    copied = tmp_path / "ink.safetensors"
    copied.write_bytes(files["ink"].read_bytes())
    runner = runner_of("sd", load=False, max_loaded_adapters=1)
    runner.load_adapter("ink", copied)
    runner.load_adapter("film", files["film"])  # evicts ink
    copied.unlink()
    with pytest.raises(ot.AdapterError, match="is gone"):
        runner.prepare(request("sd", adapters={"film": 1.0, "ink": 1.0}), "a")
    assert runner.live_states == 0
    assert all(info.holders == 0 for info in runner.adapters())


def test_a_symlink_loop_is_refused_as_invalid(runner_of: Any, tmp_path: Path) -> None:
    """L85: a path that cannot be resolved (a symlink loop) is an ``AdapterError``, not the
    ``RuntimeError`` of resolving it."""
    loop = tmp_path / "loop.safetensors"
    loop.symlink_to(loop)
    runner = runner_of("sd", load=False)
    with pytest.raises(ot.AdapterError, match="cannot be resolved") as caught:
        runner.load_adapter("loop", loop)
    assert caught.value.reason == "invalid"
    assert runner.adapters() == ()


def _no_adapter_in(pipe: Any) -> bool:
    """No LoRA layer of ``pipe`` holds an adapter of a runner's, none carries the
    runners' forward, and no component's PEFT config names one."""
    parts = [pipe.unet, pipe.text_encoder]
    return (
        wrapped_layers(pipe) == 0
        and not any(
            "omni_trio" in name
            for part in parts
            for module in part.modules()
            for name in getattr(module, "lora_A", {})
        )
        and not any(
            "omni_trio" in name for part in parts for name in getattr(part, "peft_config", {})
        )
    )


@pytest.mark.anyio
async def test_a_load_after_the_engine_closed_is_refused_and_touches_nothing(
    folder: Path, runner_of: Any
) -> None:
    """L85, L30: once the engine closed, its runners' pipeline is its owner's again: a load
    is an ``EngineClosedError`` (the closed runner itself refuses too), nothing of it
    reaches the pipeline, and the pipeline's own call gives what it gave before."""
    runner = runner_of("sd", load=False)
    pipe = runner._pipeline
    r = request("sd", num_steps=2)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            await engine.generate(r)
        before = reference("sd", r, pipeline=pipe)
        with pytest.raises(ot.EngineClosedError):
            await engine.load_adapter("ink", loras("sd", folder)["ink"])
        with pytest.raises(ot.EngineClosedError):
            await engine.unload_adapter("ink")
    with pytest.raises(ot.AdapterError, match="closed"):
        runner.load_adapter("ink", loras("sd", folder)["ink"])
    assert runner.adapters() == () and engine.adapters() == ()
    assert _no_adapter_in(pipe)
    assert torch.equal(reference("sd", r, pipeline=pipe), before)


def test_a_load_too_big_for_the_bytes_evicts_nothing(folder: Path, runner_of: Any) -> None:
    """L87: a load that cannot fit the bytes even with every idle adapter evicted is
    refused (``full``) and evicts none of them; one that fits evicts only the least
    recently used adapters that make room."""
    files = loras("sd", folder, 3)  # ink and dust of rank 4, film of rank 8: twice the bytes
    measure = runner_of("sd", load=False)
    measure.load_adapter("ink", files["ink"])
    size = measure.adapters()[0].bytes
    measure.close()
    runner = runner_of("sd", load=False, max_adapter_bytes=2 * size - 1)
    runner.load_adapter("ink", files["ink"])
    with pytest.raises(ot.AdapterError, match="no room") as caught:
        runner.load_adapter("film", files["film"])
    assert caught.value.reason == "full"
    assert [(i.name, i.loaded) for i in runner.adapters()] == [("ink", True)]
    roomy = runner_of("sd", load=False, max_adapter_bytes=2 * size)
    for name in ("dust", "ink"):
        roomy.load_adapter(name, files[name])  # dust used least recently
    roomy.load_adapter("again", files["ink"])
    assert {i.name: i.loaded for i in roomy.adapters()} == {
        "again": True,
        "dust": False,
        "ink": True,
    }
