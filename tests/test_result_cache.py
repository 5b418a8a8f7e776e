"""The result cache (L95, L96): exact seeded repeats answered at admission, never by a worker.

Determinism: fake runners make images from the request alone, so a repeat that runs
makes the same bytes as the kept copy; whether it ran is read from the runner's call
counters (``prepares``, ``steps_run``, ``decodes``), never from time. Gated runners
hold a request in a known place (running, waiting) for the bounds' test. A cache on
disk is written by the engine's writer task, whose writes are done when the engine's
block is left. Each test has a hang budget.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio._record import Record
from omni_trio._results import (
    CorruptEntryError,
    entry_bytes,
    keep_output,
    read_entry,
    result_key,
    source_digest,
)
from omni_trio._resultstore import ResultStore, _write_file
from omni_trio.testing import FakeRunner, GatedRunner
from tests.support.core import BUDGET, req

#: The bytes of one default request's output: 16 x 16 RGB float32.
IMAGE_BYTES = 16 * 16 * 3 * 4


def cached(**fields: Any) -> ot.EngineConfig:
    """An engine config with a result cache of 1 MiB unless ``fields`` say otherwise."""
    config = {"max_bytes": 1 << 20, **fields}
    return ot.EngineConfig(result_cache=ot.ResultCache(**config))


def pixels(output: ot.GenerationOutput) -> bytes:
    return output.images.numpy().tobytes()


def calls(runner: FakeRunner) -> tuple[int, int, int]:
    return runner.prepares, runner.steps_run, runner.decodes


@pytest.mark.anyio
async def test_a_seeded_repeat_is_the_earlier_output_bytewise_and_never_reaches_a_worker() -> None:
    """L95, L96: an exact repeat of a seeded request (its previews aside) is complete when
    ``submit`` returns, streams no step, makes no runner call, equals the first output
    bytewise, shares no tensor with it or with another hit, and says it was a hit."""
    runner = FakeRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, cached()) as engine:
            first = await engine.generate(req())
            expected = pixels(first)
            first.images.fill_(0.0)  # the consumer's tensor is its own
            before = calls(runner)
            async with engine.submit(req(preview_every=1)) as handle:
                assert handle.status is ot.RequestStatus.COMPLETED
                assert [event async for event in handle] == []
                second = await handle.result()
            assert calls(runner) == before == (1, 3, 1)
            assert pixels(second) == expected
            assert second.metrics.result_cache_hit and not first.metrics.result_cache_hit
            assert (second.metrics.steps_done, second.metrics.exec_s) == (0, 0.0)
            second.images.fill_(1.0)
            assert pixels(await engine.generate(req())) == expected
            stats = engine.statistics()
            assert stats.result_cache == ot.ResultCacheStatistics(
                hits=2, misses=1, kept=1, entries=1, bytes=IMAGE_BYTES
            )
            assert (stats.admitted, stats.completed, stats.steps_run) == (3, 3, 3)


@pytest.mark.anyio
async def test_a_request_without_a_seed_is_never_answered_nor_kept() -> None:
    """L95: without an explicit seed a request runs every time and is counted in neither
    hits nor misses."""
    runner = FakeRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, cached()) as engine:
            for _ in range(2):
                assert not (await engine.generate(req(seed=None))).metrics.result_cache_hit
            assert engine.statistics().result_cache == ot.ResultCacheStatistics()
    assert runner.prepares == 2


CHANGES: dict[str, dict[str, Any]] = {
    "prompt": {"prompt": "a tree"},
    "negative_prompt": {"negative_prompt": "blur"},
    "num_steps": {"num_steps": 4},
    "guidance_scale": {"guidance_scale": 5.0},
    "seed": {"seed": 2},
    "num_images": {"num_images": 2},
    "size": {"height": 24, "width": 24},
    "cache": {"cache": ot.StepCache(kind="first-block", threshold=0.1)},
}


@pytest.mark.anyio
@pytest.mark.parametrize("change", CHANGES.values(), ids=list(CHANGES))
async def test_a_request_that_differs_in_an_output_field_misses(change: dict[str, Any]) -> None:
    """L95: every field that decides the output is in the key: one changed runs."""
    runner = FakeRunner(step_cache=True)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, cached()) as engine:
            await engine.generate(req())
            other = await engine.generate(req(**change))
            assert not other.metrics.result_cache_hit
            assert engine.statistics().result_cache == ot.ResultCacheStatistics(
                misses=2, kept=2, entries=2, bytes=IMAGE_BYTES + other.images.numel() * 4
            )
    assert runner.prepares == 2


@pytest.mark.anyio
async def test_priority_deadline_and_previews_do_not_change_the_key() -> None:
    """L95: the fields that only place a request or stream its steps share an entry."""
    runner = FakeRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, cached()) as engine:
            await engine.generate(req())
            for change in ({"priority": 5}, {"deadline_s": 60.0}, {"preview_every": 1}):
                assert (await engine.generate(req(**change))).metrics.result_cache_hit, change
    assert runner.prepares == 1


class Adapting(FakeRunner):
    """A ``FakeRunner`` that takes two adapters a request and keeps their sources (its
    images ignore them: what runs is read from its counters)."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: dict[str, object] = {}

    @property
    def capabilities(self) -> ot.abc.RunnerCapabilities:
        import dataclasses

        return dataclasses.replace(super().capabilities, max_adapters=2)

    def load_adapter(self, name: str, source: str | os.PathLike[str] | Mapping[str, Any]) -> None:
        self.sources[name] = source

    def unload_adapter(self, name: str) -> None:
        del self.sources[name]

    def adapters(self) -> tuple[ot.AdapterInfo, ...]:
        return tuple(
            ot.AdapterInfo(
                name=name,
                bytes=8,
                holders=0,
                loaded=True,
                source=os.fspath(source) if isinstance(source, str | os.PathLike) else None,
            )
            for name, source in sorted(self.sources.items())
        )

    def adapter_names(self) -> frozenset[str]:
        return frozenset(self.sources)


@pytest.mark.anyio
async def test_the_key_holds_each_adapters_scale_and_the_digest_of_its_weights(
    tmp_path: Path,
) -> None:
    """L95: an adapter is in the key by its scale and the digest of its weights: another
    scale, no adapter, or other weights under the same name run; the same weights from
    another file, and a state dict loaded twice, hit."""
    weights = {"a": b"weights A", "b": b"weights B", "copy": b"weights A"}
    for name, data in weights.items():
        (tmp_path / f"{name}.safetensors").write_bytes(data)
    runner = Adapting()
    inked = req(adapters={"ink": 1.0})
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, cached()) as engine:
            await engine.load_adapter("ink", tmp_path / "a.safetensors")
            for request in (inked, inked, req(adapters={"ink": 0.5}), req()):
                await engine.generate(request)
            assert runner.prepares == 3
            for source, prepares in (("b", 4), ("copy", 4), ("a", 4)):
                await engine.unload_adapter("ink")
                await engine.load_adapter("ink", tmp_path / f"{source}.safetensors")
                await engine.generate(inked)
                assert runner.prepares == prepares, source
            for _ in range(2):
                await engine.load_adapter("film", {"w": torch.ones(2)})
                await engine.generate(req(adapters={"film": 1.0}))
                await engine.unload_adapter("film")
            assert runner.prepares == 5
            await engine.load_adapter("film", {"w": torch.zeros(2)})
            await engine.generate(req(adapters={"film": 1.0}))
            assert runner.prepares == 6


@pytest.mark.anyio
async def test_an_adapter_the_runner_had_is_keyed_by_its_file_and_one_of_unknown_weights_never(
    tmp_path: Path,
) -> None:
    """L95: adapters the runners loaded before the engine opened are digested from their
    file when it opens; one whose weights it cannot read (a state dict it never saw) makes
    its requests never cached."""
    (tmp_path / "ink.safetensors").write_bytes(b"ink")
    runner = Adapting()
    runner.load_adapter("ink", tmp_path / "ink.safetensors")
    runner.load_adapter("film", {"w": torch.ones(1)})
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, cached()) as engine:
            for _ in range(2):
                await engine.generate(req(adapters={"ink": 1.0}))
                await engine.generate(req(adapters={"film": 1.0}))
            stats = engine.statistics().result_cache
            assert stats is not None and (stats.hits, stats.misses) == (1, 1)
    assert runner.prepares == 3


class OtherModel(FakeRunner):
    """A fake runner that names another model."""

    def result_fingerprint(self) -> str:
        return "another model"


@pytest.mark.anyio
async def test_another_models_fingerprint_misses_on_a_shared_folder(tmp_path: Path) -> None:
    """L95: the model's fingerprint is in the key: a folder kept by one model answers
    nothing of another, and the first again."""
    config = cached(folder=str(tmp_path))
    counts = []
    with anyio.fail_after(BUDGET):
        for runner in (FakeRunner(), OtherModel(), FakeRunner()):
            async with ot.open_engine(runner, config) as engine:
                await engine.generate(req())
            counts.append(runner.prepares)
    assert counts == [1, 1, 0]


@pytest.mark.anyio
async def test_a_runner_that_names_no_model_is_refused_with_a_result_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L95: without ``result_fingerprint()`` (or with runners naming different models) no
    output could be told apart from another model's: ``open_engine`` refuses, in one line."""
    anonymous = FakeRunner()
    monkeypatch.setattr(anonymous, "result_fingerprint", None)
    with anyio.fail_after(BUDGET):
        for runners, says in (
            ([anonymous], "FakeRunner has no result_fingerprint()"),
            ([FakeRunner(), OtherModel()], "the runners' result_fingerprint() differ"),
        ):
            with pytest.raises(ValueError, match=r"^result_cache: ") as refused:
                async with ot.open_engine(runners, cached()):
                    pass
            assert says in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.anyio
async def test_aborted_and_failed_requests_keep_nothing() -> None:
    """L95: an aborted request and a failed one keep nothing: their repeats run."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, cached()) as engine:
            async with engine.submit(req()) as handle:
                await runner.wait_arrived(1)
                assert handle.abort_nowait()
                runner.open_gate()  # the step in flight ends; the abort lands after it
                with pytest.raises(ot.RequestAbortedError):
                    await handle.result()
            assert not (await engine.generate(req())).metrics.result_cache_hit
            assert runner.prepares == 2
    failing = FakeRunner(fail_at_step=2)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(failing, cached()) as engine:
            for _ in range(2):
                with pytest.raises(ot.RequestFailedError):
                    await engine.generate(req())
            assert engine.statistics().result_cache == ot.ResultCacheStatistics(misses=2)


@pytest.mark.anyio
@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "disk"])
async def test_a_video_is_answered_with_its_frames_and_its_first_frames_as_images(
    on_disk: bool, tmp_path: Path
) -> None:
    """L95: a video's frames are kept; a hit's images are its own video's first frames."""
    config = cached(folder=str(tmp_path) if on_disk else None)
    video = req(num_frames=5)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner(frames=(4, 1)), config) as engine:
            first = await engine.generate(video)
            if not on_disk:
                again = await engine.generate(video)
        if on_disk:  # the next engine's, from the file
            async with ot.open_engine(FakeRunner(frames=(4, 1)), config) as engine:
                again = await engine.generate(video)
    assert again.metrics.result_cache_hit and first.video is not None and again.video is not None
    assert again.video.numpy().tobytes() == first.video.numpy().tobytes()
    assert again.images.data_ptr() == again.video.data_ptr()
    assert torch.equal(again.images, again.video[:, 0])


@pytest.mark.anyio
async def test_a_folder_survives_a_restart_bitwise(tmp_path: Path) -> None:
    """L95: outputs kept on disk answer the next engine's repeats, equal bytewise; the
    folder holds one whole file per entry and no temporary file."""
    config = cached(folder=str(tmp_path / "results"))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner(), config) as engine:
            first = await engine.generate(req())
            second = await engine.generate(req(seed=2))
        names = sorted(path.name for path in (tmp_path / "results").iterdir())
        assert len(names) == 2 and all(name.endswith(".bin") for name in names), names
        runner = FakeRunner()
        async with ot.open_engine(runner, config) as engine:
            outputs = [await engine.generate(req()), await engine.generate(req(seed=2))]
            stats = engine.statistics().result_cache
    assert runner.prepares == 0 and all(output.metrics.result_cache_hit for output in outputs)
    assert [pixels(output) for output in outputs] == [pixels(first), pixels(second)]
    assert stats is not None and (stats.entries, stats.hits) == (2, 2)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _not_an_entry(path: Path) -> None:
    path.write_bytes(b"\x00" * 100)


DAMAGE = {"truncated": _truncate, "altered": _flip_last_byte, "foreign": _not_an_entry}


@pytest.mark.anyio
@pytest.mark.parametrize("damage", DAMAGE.values(), ids=list(DAMAGE))
async def test_a_damaged_file_is_never_read_but_deleted_and_the_request_runs(
    damage: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """L95: a file cut short, altered or not an entry is one warning, deleted, and its
    request runs (and is kept again, whole); a temporary file (a write a crash cut) is
    deleted when the next engine opens, never read."""
    config = cached(folder=str(tmp_path))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner(), config) as engine:
            first = await engine.generate(req())
        (entry,) = [Path(path) async for path in anyio.Path(tmp_path).iterdir()]
        damage(entry)
        (tmp_path / f".{entry.stem}.cut.tmp").write_bytes(b"half")
        runner = FakeRunner()
        with caplog.at_level(logging.WARNING, logger="omni_trio.engine"):
            async with ot.open_engine(runner, config) as engine:
                assert not [path async for path in anyio.Path(tmp_path).glob("*.tmp")]
                again = await engine.generate(req())
        assert runner.prepares == 1 and not again.metrics.result_cache_hit
        assert pixels(again) == pixels(first)
        (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert warning.getMessage().startswith(f"result cache: {entry} is unreadable (")
        assert warning.exc_info is None
        runner = FakeRunner()
        async with ot.open_engine(runner, config) as engine:
            assert (await engine.generate(req())).metrics.result_cache_hit
    assert runner.prepares == 0


@pytest.mark.anyio
@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "disk"])
async def test_the_least_recently_used_outputs_go_first_within_the_bound(
    on_disk: bool, tmp_path: Path
) -> None:
    """L95: the cache holds at most ``max_bytes``: the least recently used entry goes
    first (a hit renews it); an output larger than the bound is not kept. On disk its
    file goes with it."""
    # Two outputs and their files' headers fit; three do not.
    bound = 2 * IMAGE_BYTES + 1024
    config = cached(max_bytes=bound, folder=str(tmp_path) if on_disk else None)
    runner = FakeRunner()
    first, second, third = req(seed=1), req(seed=2), req(seed=3)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            for request in (first, second, first, third):
                await engine.generate(request)
            assert runner.prepares == 3
            stats = engine.statistics().result_cache
            assert stats is not None and (stats.entries, stats.evicted) == (2, 1)
            assert (await engine.generate(first)).metrics.result_cache_hit
            assert not (await engine.generate(second)).metrics.result_cache_hit
            await engine.generate(req(num_images=3))
            await engine.generate(req(num_images=3))
            stats = engine.statistics().result_cache
            assert stats is not None and stats.bytes <= bound
    assert runner.prepares == 6
    if on_disk:
        assert len([path async for path in anyio.Path(tmp_path).iterdir()]) == 2


@pytest.mark.anyio
async def test_scope_tenant_never_crosses_tenants_and_scope_global_shares() -> None:
    """L96: with scope ``tenant`` a hit is the same tenant's (the default tenant is one
    too): 0 cross-tenant hits; with scope ``global`` every tenant's repeats share."""
    tenants = ["a", "b", None, "a", "b", None]
    for scope, expected in (("tenant", [False] * 3 + [True] * 3), ("global", [False] + [True] * 5)):
        runner = FakeRunner()
        with anyio.fail_after(BUDGET):
            async with ot.open_engine(runner, cached(scope=scope)) as engine:
                hits = [
                    (await engine.generate(req(tenant=tenant))).metrics.result_cache_hit
                    for tenant in tenants
                ]
        assert hits == expected, scope


@pytest.mark.anyio
async def test_a_hit_is_admitted_only_where_a_miss_of_its_tenant_would_be() -> None:
    """L96: a hit counts against its tenant's limits: while its tenant has
    ``tenant_max_waiting`` requests waiting, its cached repeat is refused with
    ``QueueFullError`` as a miss would be, though it would wait for nothing; another
    tenant's hit is answered at once. Hits count as admitted and completed."""
    runner = GatedRunner()
    config = ot.EngineConfig(
        max_batch_size=1,
        tenant_max_waiting={"a": 1},
        result_cache=ot.ResultCache(max_bytes=1 << 20, scope="global"),
    )
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            runner.release(3)
            await engine.generate(req(tenant="a"))
            async with engine.submit(req(seed=2, tenant="a")) as running:
                await runner.wait_arrived(4)
                async with engine.submit(req(seed=3, tenant="a")) as waiting:
                    assert waiting.status is ot.RequestStatus.WAITING
                    with pytest.raises(ot.QueueFullError):
                        engine.submit(req(tenant="a"))
                    async with engine.submit(req(tenant="b")) as other:
                        assert other.status is ot.RequestStatus.COMPLETED
                        assert (await other.result()).metrics.result_cache_hit
                    runner.open_gate()
                    await waiting.result()
                await running.result()
            stats = engine.statistics()
            assert (stats.admitted, stats.completed) == (4, 4)
            assert stats.result_cache is not None and stats.result_cache.hits == 1


@pytest.mark.anyio
async def test_an_output_made_under_a_loosened_threshold_is_not_kept() -> None:
    """L95, L84: a step-cache threshold loosened to meet a deadline made an output the
    request's own threshold would not: a repeat is not answered with it."""
    store = ResultStore(ot.ResultCache(max_bytes=1 << 20), [FakeRunner()], lambda: ())
    images = torch.zeros(1, 3, 16, 16)
    for loosened in (True, False):
        record = Record(req(), f"r-{loosened}", (), event_buffer=1)
        assert store.lookup(record) is None
        store.admitted(record, None)
        record.cache_metrics = ot.CacheMetrics(
            kind="first-block",
            calls_computed=3,
            calls_skipped=0,
            blocks_computed=3,
            blocks_skipped=0,
            loosened=loosened,
        )
        store.completed(record, keep_output(images, None))
        assert store.statistics().kept == (0 if loosened else 1)
    await anyio.lowlevel.checkpoint()


def test_a_request_with_extra_values_that_are_not_json_is_never_cached() -> None:
    """L95: an ``extra`` value the key cannot spell exactly is never compared: no key."""
    model = "m"
    assert result_key(req(extra={"k": [1, 2.5]}), model=model, adapters={}, scope="tenant")
    assert result_key(req(extra={"k": object()}), model=model, adapters={}, scope="tenant") is None
    assert (
        result_key(req(extra={"k": float("nan")}), model=model, adapters={}, scope="global") is None
    )


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"max_bytes": 0}, "max_bytes"),
        ({"max_bytes": True}, "max_bytes"),
        ({"max_bytes": 1, "scope": "everyone"}, "scope"),
        ({"max_bytes": 1, "folder": ""}, "folder"),
        ({"max_bytes": 1, "folder": 3}, "folder"),
    ],
)
def test_a_bad_result_cache_is_refused_naming_its_field(fields: dict[str, Any], name: str) -> None:
    """L95: ``ResultCache`` checks its fields when built; ``EngineConfig`` its type."""
    with pytest.raises(ValueError, match=f"^{name}: "):
        ot.ResultCache(**fields)
    with pytest.raises(ValueError, match=r"^result_cache: must be a ResultCache"):
        ot.EngineConfig(result_cache=1 << 20)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_two_identical_requests_in_flight_both_run_and_keep_one_entry() -> None:
    """L95: a repeat admitted before the first completed runs too (nothing is kept yet);
    the second completion finds the entry there and keeps nothing more."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, cached()) as engine:
            async with engine.submit(req()) as first, engine.submit(req()) as second:
                runner.open_gate()
                outputs = [await first.result(), await second.result()]
            stats = engine.statistics().result_cache
    assert not any(output.metrics.result_cache_hit for output in outputs)
    assert pixels(outputs[0]) == pixels(outputs[1])
    assert stats == ot.ResultCacheStatistics(misses=2, kept=1, entries=1, bytes=IMAGE_BYTES)


@pytest.mark.anyio
async def test_a_file_deleted_by_someone_else_is_a_quiet_miss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """L95: an entry whose file is gone (another server's bound put it out) runs, without
    a warning, and is kept again."""
    config = cached(folder=str(tmp_path))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner(), config) as engine:
            await engine.generate(req())
        runner = FakeRunner()
        with caplog.at_level(logging.WARNING, logger="omni_trio.engine"):
            async with ot.open_engine(runner, config) as engine:
                for path in [Path(p) async for p in anyio.Path(tmp_path).iterdir()]:
                    path.unlink()
                assert not (await engine.generate(req())).metrics.result_cache_hit
                stats = engine.statistics().result_cache
    assert runner.prepares == 1 and not caplog.records
    assert stats is not None and (stats.entries, stats.kept) == (1, 1)


def test_an_entry_of_another_key_version_or_shape_is_refused_whole() -> None:
    """L95: a file is read only as the whole entry of its key, in this version."""
    key, other = "a" * 64, "b" * 64
    kept = keep_output(torch.rand(1, 3, 2, 2), None)
    data = entry_bytes(key, kept)
    assert read_entry(data, key) == kept
    magic = data[: data.index(b"\n") + 1]
    start = len(magic) + 4
    header = json.loads(data[start : start + int.from_bytes(data[len(magic) : start], "big")])

    def forged(text: bytes | None = None, **changes: object) -> bytes:
        text = text if text is not None else json.dumps({**header, **changes}).encode()
        return magic + len(text).to_bytes(4, "big") + text + kept.data

    for damaged, says in (
        (entry_bytes(other, kept), "another entry or version"),
        (forged(v=2), "another entry or version"),
        (forged(shape=[3, 2, 2]), "another entry or version"),
        (forged(shape=[1, 3, 2, 1]), "bytes of pixels"),
        (forged(b"{not json"), "header is unreadable"),
        (forged(b'{"v":1}'), "header is unreadable"),
        (data + b"\0", "bytes of pixels"),
        (b"omni", "not a result cache entry"),
    ):
        with pytest.raises(CorruptEntryError, match=says):
            read_entry(damaged, key)


def test_an_adapters_weights_are_digested_by_their_bytes(tmp_path: Path) -> None:
    """L95: a file by its bytes alone, a folder by its files' names and bytes, a state dict
    by its tensors; a hub id, or a state dict with a value that is not a tensor: unknown."""
    for name, data in (("a.bin", b"A"), ("b.bin", b"A"), ("c.bin", b"C")):
        (tmp_path / name).write_bytes(data)
    folder = tmp_path / "lora"
    folder.mkdir()
    (folder / "weights.safetensors").write_bytes(b"A")
    first = source_digest(folder)
    assert source_digest(tmp_path / "a.bin") == source_digest(str(tmp_path / "b.bin"))
    assert source_digest(tmp_path / "a.bin") != source_digest(tmp_path / "c.bin")
    (folder / "config.json").write_text("{}")
    assert first is not None and source_digest(folder) not in (first, None)
    assert source_digest("org/lora") is None and source_digest(3) is None
    assert source_digest({"w": torch.ones(2)}) == source_digest({"w": torch.ones(2)})
    assert source_digest({"w": torch.ones(2)}) != source_digest({"w": torch.ones(2).half()})
    assert source_digest({"w": [1.0]}) is None


@pytest.mark.anyio
async def test_a_folder_that_cannot_be_made_or_written_is_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """L95: a folder that cannot be made refuses the engine in one line; a write that fails
    is one warning and keeps nothing (its temporary file removed)."""
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(ValueError, match=r"^result_cache\.folder: cannot make '.*file/cache'"):
        async with ot.open_engine(FakeRunner(), cached(folder=str(blocker / "cache"))):
            pass
    kept = keep_output(torch.zeros(1, 3, 2, 2), None)
    with caplog.at_level(logging.WARNING, logger="omni_trio.engine"):
        assert _write_file(tmp_path / "gone", "a" * 64, kept) is None
    (warning,) = caplog.records
    assert warning.getMessage().startswith("result cache: cannot write to ")
    assert _write_file(tmp_path, "a" * 64, kept) == len(entry_bytes("a" * 64, kept))
    names = sorted([path.name async for path in anyio.Path(tmp_path).iterdir()])
    assert names == ["a" * 64 + ".bin", "file"]
