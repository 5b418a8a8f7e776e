"""The prompt-embedding cache of ``DiffusersRunner`` (L94): keyed, bounded, never shared.

Determinism: tiny pipelines with seeded weights (``tests.support.runners.tiny``), on the
CPU, one torch thread where outputs are compared bitwise; encodes are counted by a
forward hook on a text encoder, never timed. The engine tests hold the worker at a
gated step (``GatedDiffusers``): where a suspension or an abort lands needs no timing.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from PIL import Image

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_lora
from omni_trio.runners._family import RequestState
from omni_trio.serve import ServeConfig, Service
from omni_trio.serve._metrics import ServeMetrics
from omni_trio.testing import probe, wait_until
from tests.support.core import BUDGET
from tests.support.runners import GatedDiffusers, request, tiny
from tests.support.serve import metric, serving

#: The families that encode text, and the image-to-video ones (their prompts too).
TEXT_KINDS = ("sd", "sdxl", "sd3", "flux", "qwen-image", "wan", "ltx")
I2V_KINDS = ("wan-i2v", "ltx-i2v")


@pytest.fixture
def runners() -> Iterator[Callable[..., DiffusersRunner]]:
    """``runners(kind, **options)``: a runner over the kind's tiny pipeline; closed after."""
    made: list[DiffusersRunner] = []

    def make(kind: str, **options: Any) -> DiffusersRunner:
        runner = DiffusersRunner(tiny(kind), **options)
        made.append(runner)
        return runner

    yield make
    for runner in made:
        runner.close()


def text_tensors(state: RequestState) -> dict[str, torch.Tensor]:
    """The state's text conditioning (what the family encoded), by its ``cond`` names."""
    names = (
        "encoder_hidden_states",
        "text_embeds",
        "pooled_projections",
        "encoder_attention_mask",
    )
    found = {name: state.cond[name] for name in names if name in state.cond}
    if "txt_ids" in state.shared:
        found["txt_ids"] = state.shared["txt_ids"]
    return found


def own_encoding(kind: str, r: ot.GenerationRequest) -> dict[str, torch.Tensor]:
    """What the pipeline's own ``encode_prompt`` gives for ``r`` (its prompt, negative
    prompt, guidance and image count in one call), as the family lays it out in ``cond``."""
    pipe = tiny(kind)
    cfg = r.guidance_scale > 1
    n = r.num_images
    device = pipe.device

    def rows(negative: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        return torch.cat([negative, positive]) if cfg else positive

    base = kind.removesuffix("-i2v")
    with torch.no_grad():
        if base == "sd":
            p, q = pipe.encode_prompt(r.prompt, device, n, cfg, r.negative_prompt)
            return {"encoder_hidden_states": rows(q, p)}
        if base in ("sdxl", "sd3"):
            options: dict[str, Any] = {"prompt_2": None, "prompt_3": None} if base == "sd3" else {}
            p, q, pooled, q_pooled = pipe.encode_prompt(
                prompt=r.prompt,
                device=device,
                num_images_per_prompt=n,
                do_classifier_free_guidance=cfg,
                negative_prompt=r.negative_prompt,
                **options,
            )
            pooled_name = "text_embeds" if base == "sdxl" else "pooled_projections"
            return {"encoder_hidden_states": rows(q, p), pooled_name: rows(q_pooled, pooled)}
        if base == "flux":
            p, pooled, ids = pipe.encode_prompt(
                prompt=r.prompt, prompt_2=None, device=device, num_images_per_prompt=n
            )
            return {"encoder_hidden_states": p, "pooled_projections": pooled, "txt_ids": ids}
        if base == "qwen-image":
            p, _ = pipe.encode_prompt(prompt=r.prompt, device=device, num_images_per_prompt=n)
            if not (cfg and r.negative_prompt is not None):
                return {"encoder_hidden_states": p}
            q, _ = pipe.encode_prompt(
                prompt=r.negative_prompt, device=device, num_images_per_prompt=n
            )
            longest = max(p.shape[1], q.shape[1])
            padded = [
                torch.cat([t, t.new_zeros(n, longest - t.shape[1], t.shape[2])], 1) for t in (q, p)
            ]
            return {"encoder_hidden_states": torch.cat(padded)}
        options = {
            "prompt": r.prompt,
            "negative_prompt": r.negative_prompt,
            "do_classifier_free_guidance": cfg,
            "num_videos_per_prompt": n,
            "device": device,
        }
        if base == "wan":
            p, q = pipe.encode_prompt(**options, max_sequence_length=512)
            return {"encoder_hidden_states": rows(q, p).to(pipe.transformer.dtype)}
        p, mask, q, q_mask = pipe.encode_prompt(**options, max_sequence_length=128)
        return {"encoder_hidden_states": rows(q, p), "encoder_attention_mask": rows(q_mask, mask)}


def picture(size: int) -> Image.Image:
    return Image.new("RGB", (size, size), (200, 40, 30))


def cases(kind: str) -> list[ot.GenerationRequest]:
    """Guided with and without a negative prompt, several images, unguided; edits and
    image to video with their image."""
    base = request(kind.removesuffix("-i2v"))
    image: dict[str, Any] = {"image": picture(base.height)} if kind in I2V_KINDS else {}
    made = [
        dataclasses.replace(base, negative_prompt=None, **image),
        dataclasses.replace(base, negative_prompt="dull", num_images=2, **image),
        dataclasses.replace(base, guidance_scale=1.0, negative_prompt=None, **image),
    ]
    if kind == "flux":  # no negative prompt
        made[1] = dataclasses.replace(made[1], negative_prompt=None)
    if kind in ("sd", "sdxl"):
        made.append(dataclasses.replace(base, image=picture(base.height), strength=0.6))
    return made


@pytest.mark.parametrize("kind", [*TEXT_KINDS, *I2V_KINDS])
def test_a_hit_equals_a_miss_and_the_pipelines_own_encoding(
    kind: str, runners: Callable[..., DiffusersRunner]
) -> None:
    """L94: every family that encodes text (edits and image to video too), guided with and
    without a negative prompt, several images, unguided: the miss and then the hit equal
    the pipeline's own ``encode_prompt`` of the whole request, bitwise, dtype and shape."""
    runner = runners(kind)
    for r in cases(kind):
        expected = own_encoding(kind, r)
        for attempt in ("miss", "hit"):
            state = runner.prepare(r, "r")
            got = text_tensors(state)
            metrics = state.prompts
            runner.discard(state)
            assert set(got) == set(expected), (r, attempt)
            for name, tensor in expected.items():
                assert got[name].dtype == tensor.dtype, (r, attempt, name)
                assert torch.equal(got[name], tensor), (r, attempt, name)
            assert metrics is not None
            if attempt == "hit":
                assert metrics.misses == 0 and metrics.hits > 0
    stats = runner.prompt_cache_statistics()
    # Three texts at most ("a red flower", "dull", "" for the guided request without one).
    assert stats.misses == stats.entries <= 3 and stats.hits > stats.misses


def run(runner: DiffusersRunner, r: ot.GenerationRequest) -> torch.Tensor:
    """``r`` prepared, stepped to its end and decoded, no engine."""
    state = runner.prepare(r, "r")
    try:
        for _ in range(r.denoise_steps):
            runner.step([state])
        return runner.decode(state).float().cpu()
    finally:
        runner.discard(state)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("kind", TEXT_KINDS)
def test_a_request_with_the_cache_equals_one_without(
    kind: str, runners: Callable[..., DiffusersRunner]
) -> None:
    """L94: a request's output from a hit equals its output from a runner that keeps
    nothing (``prompt_cache_bytes=0``), bitwise, on every family that encodes text."""
    r = request(kind, num_steps=2)
    if kind != "flux":
        r = dataclasses.replace(r, negative_prompt="dull")
    cached, uncached = runners(kind), runners(kind, prompt_cache_bytes=0)
    missed = run(cached, r)
    hit = run(cached, r)
    without = run(uncached, r)
    assert cached.prompt_cache_statistics().hits >= 1
    assert uncached.prompt_cache_statistics().entries == 0
    assert torch.equal(hit, without) and torch.equal(missed, without)


@pytest.mark.parametrize("kind", ["flux", "sd"])
def test_nothing_a_request_does_to_its_tensors_reaches_the_cache(
    kind: str, runners: Callable[..., DiffusersRunner]
) -> None:
    """L94: a hit is never shared by reference: a request that writes into its text
    tensors (after a miss, after a hit) leaves the next hit equal to the computed
    encoding. One image, unguided: the request's tensors are the encode's own."""
    runner = runners(kind)
    r = request(kind, guidance_scale=1.0)
    expected = own_encoding(kind, r)
    for _ in range(3):
        state = runner.prepare(r, "r")
        got = text_tensors(state)
        runner.discard(state)
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), name
            got[name].fill_(7)  # in place: the cache must not see it
    assert runner.prompt_cache_statistics().hits == 2


def test_the_byte_bound_keeps_the_least_recently_used_out(
    runners: Callable[..., DiffusersRunner],
) -> None:
    """L94: bounded in bytes: a new entry puts out the least recently used ones until it
    fits; one larger than the bound is not kept; 0 keeps nothing; a negative bound is
    refused."""
    unguided = request("sd", guidance_scale=1.0)

    def texts(runner: DiffusersRunner, *prompts: str) -> tuple[int, int]:
        before = runner.prompt_cache_statistics()
        for prompt in prompts:
            runner.discard(runner.prepare(dataclasses.replace(unguided, prompt=prompt), "r"))
        after = runner.prompt_cache_statistics()
        return after.hits - before.hits, after.misses - before.misses

    probe_runner = runners("sd")
    texts(probe_runner, "p1")
    entry = probe_runner.prompt_cache_statistics().bytes  # every "pN" entry has this size
    runner = runners("sd", prompt_cache_bytes=2 * entry + entry // 2)  # room for two
    assert texts(runner, "p1", "p2", "p1") == (1, 2)  # p1 used last, p2 least recently
    assert texts(runner, "p3") == (0, 1)  # p2 out
    stats = runner.prompt_cache_statistics()
    assert (stats.entries, stats.bytes, stats.evictions) == (2, 2 * entry, 1)
    assert texts(runner, "p1", "p3") == (2, 0)
    assert texts(runner, "p2") == (0, 1)  # it was put out: encoded again

    small = runners("sd", prompt_cache_bytes=entry - 1)
    assert texts(small, "p1", "p1") == (0, 2)
    assert small.prompt_cache_statistics().entries == 0
    none = runners("sd", prompt_cache_bytes=0)
    assert texts(none, "p1", "p1") == (0, 2)
    assert none.prompt_cache_statistics().bytes == 0
    with pytest.raises(ValueError, match="prompt_cache_bytes"):
        runners("sd", prompt_cache_bytes=-1)


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny SD LoRAs: ``ink`` has text-encoder layers, ``flat`` the UNet's only."""
    folder = tmp_path_factory.mktemp("prompt_loras")
    return {
        "ink": tiny_lora(tiny("sd"), folder, "ink", seed=1),
        "flat": tiny_lora(tiny("sd"), folder, "flat", seed=2, text=False),
        "film": tiny_lora(tiny("sd"), folder, "film", seed=3),
    }


def encoding(runner: DiffusersRunner, **adapters: float) -> tuple[torch.Tensor, int, int]:
    """An unguided SD request's text rows with ``adapters``, its hits and misses."""
    state = runner.prepare(request("sd", guidance_scale=1.0, adapters=adapters), "r")
    rows = text_tensors(state)["encoder_hidden_states"]
    runner.discard(state)
    assert state.prompts is not None
    return rows, state.prompts.hits, state.prompts.misses


def test_a_text_encoders_adapter_splits_the_key_and_takes_its_entries_when_it_leaves(
    runners: Callable[..., DiffusersRunner], lora_files: dict[str, Path]
) -> None:
    """L94: the adapters a request holds that touch a text encoder, with their scales, are
    in the key (an adapter of the UNet alone is not); unloading one drops the entries
    encoded with it, and so does its eviction; reloaded, it encodes again, the same."""
    runner = runners("sd")
    runner.load_adapter("ink", lora_files["ink"])
    runner.load_adapter("flat", lora_files["flat"])
    plain, _, _ = encoding(runner)
    assert encoding(runner, flat=0.8)[1:] == (1, 0)  # the UNet's adapter: the same entry
    inked, hits, misses = encoding(runner, ink=0.8)
    assert (hits, misses) == (0, 1) and not torch.equal(inked, plain)
    assert encoding(runner, ink=0.5)[1:] == (0, 1)  # another scale, another entry
    again, hits, _ = encoding(runner, ink=0.8, flat=0.3)
    assert hits == 1 and torch.equal(again, inked)
    assert runner.prompt_cache_statistics().entries == 3

    runner.unload_adapter("flat")  # no entry was keyed with it
    assert runner.prompt_cache_statistics().entries == 3
    runner.unload_adapter("ink")
    stats = runner.prompt_cache_statistics()
    assert (stats.entries, stats.dropped) == (1, 2)
    assert encoding(runner)[1:] == (1, 0)
    runner.load_adapter("ink", lora_files["ink"])  # a fresh load: a fresh key
    reloaded, hits, misses = encoding(runner, ink=0.8)
    assert (hits, misses) == (0, 1) and torch.equal(reloaded, inked)

    # An eviction (one adapter loaded at most) takes the evicted one's entries too.
    bounded = runners("sd", max_loaded_adapters=1)
    bounded.load_adapter("ink", lora_files["ink"])
    encoding(bounded, ink=0.8)
    encoding(bounded)
    bounded.load_adapter("film", lora_files["film"])  # puts ink out of the model
    assert next(a for a in bounded.adapters() if a.name == "ink").loaded is False
    stats = bounded.prompt_cache_statistics()
    assert (stats.entries, stats.dropped) == (1, 1)
    back, hits, misses = encoding(bounded, ink=0.8)  # reloaded in prepare
    assert (hits, misses) == (0, 1) and torch.equal(back, inked)


class _Encodes:
    """Counts the calls of a module's forward."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.count = 0
        self._handle = module.register_forward_pre_hook(self._called)

    def _called(self, module: torch.nn.Module, args: object) -> None:
        self.count += 1

    def remove(self) -> None:
        self._handle.remove()


@pytest.mark.anyio
async def test_a_negative_prompt_is_encoded_once_for_every_prompt_of_a_batch() -> None:
    """L94: three requests with different prompts and one negative prompt, batched: four
    encodes (six without the cache), and each output is the uncached runner's."""
    requests = [
        request("sd", prompt=f"a flower, {colour}", negative_prompt="blurry", num_steps=2, seed=i)
        for i, colour in enumerate(("red", "blue", "green"))
    ]
    encodes = _Encodes(tiny("sd").text_encoder)
    outputs: dict[int, list[torch.Tensor]] = {}
    try:
        with anyio.fail_after(BUDGET):
            for size in (2**20, 0):
                runner = DiffusersRunner(tiny("sd"), prompt_cache_bytes=size)
                encodes.count = 0
                async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=3)) as engine:
                    handles = [engine.submit(r) for r in requests]
                    outputs[size] = []
                    for handle in handles:
                        async with handle:
                            outputs[size].append((await handle.result()).images)
                    stats = runner.prompt_cache_statistics()  # the engine closes it
                if size:
                    assert encodes.count == 4
                    assert (stats.hits, stats.misses, stats.entries) == (2, 4, 4)
                else:
                    assert encodes.count == 6
    finally:
        encodes.remove()
    # Which steps the three share depends on when each joined: batching's float noise
    # (L9), not the cache's (a hit is bitwise, above).
    for cached, uncached in zip(outputs[2**20], outputs[0], strict=True):
        torch.testing.assert_close(cached, uncached, atol=1e-4, rtol=0)


@pytest.mark.anyio
async def test_an_aborted_and_a_preempted_request_leave_the_cache_consistent() -> None:
    """L94: a request aborted after its encoding, and one suspended for another (L61) and
    resumed, leave the cache holding what a fresh encode gives: the resumed request and
    the later ones equal the uncached runner's outputs bitwise, and a last request's
    text rows, all hits, equal the pipeline's own encoding."""
    pipe = tiny("sd")
    cut = request("sd", prompt="cut", negative_prompt="blurry", num_steps=3, seed=3)
    low = request("sd", prompt="low", negative_prompt="blurry", num_steps=3, seed=1)
    high = request("sd", prompt="high", negative_prompt="blurry", num_steps=2, priority=1)
    again = dataclasses.replace(cut, seed=4)
    last = dataclasses.replace(low, num_images=2, num_steps=1)
    options = ot.EngineConfig(max_batch_size=1)
    expected: dict[str, torch.Tensor] = {}
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(pipe, prompt_cache_bytes=0), options) as e:
            for name, r in (("low", low), ("high", high), ("again", again), ("last", last)):
                expected[name] = (await e.generate(r)).images
        runner = GatedDiffusers(pipe)
        try:
            async with ot.open_engine(runner, options) as engine:
                aborted = engine.submit(cut, request_id="cut")
                await runner.wait_arrived(1)  # encoded, its first step held

                async def release_once_cut() -> None:
                    await wait_until(lambda: probe(aborted).cancel_reason is not None)
                    runner.release(1)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(release_once_cut)
                    assert await engine.abort("cut") is True
                await aborted.aclose()
                assert aborted.status is ot.RequestStatus.ABORTED

                first = engine.submit(low, request_id="low")
                await runner.wait_arrived(2)
                second = engine.submit(high, request_id="high")
                runner.release(1)
                await runner.wait_arrived(3)  # low suspended: high's first step
                assert engine.statistics().preemptions == 1
                runner.open_gate()
                async with second:
                    assert torch.equal((await second.result()).images, expected["high"])
                async with first:
                    resumed = await first.result()
                assert resumed.metrics.preemptions == 1
                assert torch.equal(resumed.images, expected["low"])
                later = await engine.generate(again)
                assert torch.equal(later.images, expected["again"])
                stats = runner.prompt_cache_statistics()
                # cut, blurry, low, high encoded once each; blurry twice and cut's two
                # texts hits.
                assert (stats.misses, stats.entries, stats.hits) == (4, 4, 4)
                final = await engine.generate(last)  # two hits, two images of each
                assert runner.prompt_cache_statistics().misses == 4
                assert torch.equal(final.images, expected["last"])
        finally:
            runner.close()
    assert runner.live_states == 0


def test_each_runner_keeps_its_own_cache_and_frees_it(
    runners: Callable[..., DiffusersRunner],
) -> None:
    """L94: a cache per runner (several workers each have their own, over one pipeline
    too); ``clear_prompt_cache()`` drops every entry (the hook for a change of weights),
    ``close()`` frees the cache and keeps nothing after."""
    first, second = runners("sd"), runners("sd")
    r = request("sd")
    for runner in (first, second, first):
        runner.discard(runner.prepare(r, "r"))
    assert first.prompt_cache_statistics().hits == 2
    assert second.prompt_cache_statistics().hits == 0
    assert second.prompt_cache_statistics().entries == 2
    first.clear_prompt_cache()
    stats = first.prompt_cache_statistics()
    assert (stats.entries, stats.bytes, stats.dropped) == (0, 0, 2)
    assert second.prompt_cache_statistics().entries == 2
    second.close()
    stats = second.prompt_cache_statistics()
    assert (stats.entries, stats.bytes, stats.max_bytes) == (0, 0, 0)


def test_metrics_export_the_runners_caches(runners: Callable[..., DiffusersRunner]) -> None:
    """L94: ``/metrics`` reads every runner's prompt cache at scrape time, summed: hits,
    misses, evictions, the encoders' seconds and those saved, the bytes held now (a
    runner without a cache adds nothing)."""
    first, second = runners("sd"), runners("sd")
    metrics = ServeMetrics(lambda: None, lambda: False)
    metrics.add_prompt_caches([first, second, object()])
    r = request("sd")
    for runner in (first, first, second):
        runner.discard(runner.prepare(r, "r"))
    text = metrics.render()[0].decode()

    def value(name: str) -> float:
        found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        assert found is not None, name
        return float(found.group(1))

    assert value("omni_trio_prompt_cache_hits_total") == 2
    assert value("omni_trio_prompt_cache_misses_total") == 4
    assert value("omni_trio_prompt_cache_evictions_total") == 0
    held = first.prompt_cache_statistics().bytes + second.prompt_cache_statistics().bytes
    assert value("omni_trio_prompt_cache_bytes") == held > 0
    assert value("omni_trio_prompt_cache_encode_seconds_total") > 0
    assert value("omni_trio_prompt_cache_saved_seconds_total") > 0


@pytest.mark.anyio
async def test_a_servers_metrics_read_its_runners_caches() -> None:
    """L94: a server's ``/metrics`` has its runners' prompt caches: the same request again
    is two hits (its prompt and the empty negative prompt it guides against), no miss;
    each answer's ``omni_trio.prompt_cache`` says what the cache did for its texts."""
    runner = DiffusersRunner(tiny("sd"))
    config = ServeConfig(model_name="tiny-sd", default_width=64, default_height=64)
    service = Service(runner, config=dataclasses.replace(config, default_steps=2))
    body = {"prompt": "a red flower", "seed": 1}
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            counts, answered = [], []
            for _ in range(2):
                response = await client.post("/v1/images/generations", json=body)
                assert response.status_code == 200, response.text
                answered.append(response.json()["omni_trio"]["prompt_cache"])
                text = (await client.get("/metrics")).text
                counts.append(
                    [
                        metric(text, f"omni_trio_prompt_cache_{name}_total")
                        for name in ("hits", "misses")
                    ]
                )
    assert counts[1][0] - counts[0][0] == 2 and counts[1][1] == counts[0][1]
    assert [(figures["hits"], figures["misses"]) for figures in answered] == [(0, 2), (2, 0)]
    assert answered[0]["encode_s"] > 0 and answered[0]["saved_s"] == 0
    assert answered[1]["encode_s"] == 0 and answered[1]["saved_s"] == answered[0]["encode_s"]


@pytest.mark.anyio
async def test_each_requests_metrics_say_what_the_cache_did_for_its_texts() -> None:
    """L94: a request's own ``RequestMetrics.prompt_cache`` counts its texts: the first of
    two requests with one negative prompt misses both its texts; the second (two images,
    each text counted once) hits the negative prompt, with the seconds its entry took
    saved, and misses its prompt. A result-cache hit (L95) encodes nothing: ``None``."""
    first = request("sd", prompt="a red fox", negative_prompt="blurry", num_steps=1)
    second = request("sd", prompt="a grey cat", negative_prompt="blurry", num_steps=1)
    second = dataclasses.replace(second, num_images=2)
    config = ot.EngineConfig(result_cache=ot.ResultCache(max_bytes=2**24))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(tiny("sd")), config) as engine:
            outputs = [await engine.generate(r) for r in (first, second, first)]
    missed, hit, repeat = (out.metrics.prompt_cache for out in outputs)
    assert missed is not None and hit is not None
    assert (missed.hits, missed.misses, missed.saved_s) == (0, 2, 0.0)
    assert missed.encode_s > 0
    assert (hit.hits, hit.misses) == (1, 1)
    assert 0 < hit.saved_s < missed.encode_s and hit.encode_s > 0
    assert outputs[2].metrics.result_cache_hit and repeat is None
