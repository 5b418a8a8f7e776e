"""One request over several ranks behind the server (L48, L49): ``serve --cfg-parallel``,
``--ulysses`` and ``--ring`` become ``ServiceOptions.parallel``, and the service's one
worker is a ``ParallelRunner``.

Pure calls in this process for the options; one service on tiny SD over two gloo ranks,
its app run in its own lifespan (as in ``test_app``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import anyio
import pytest
import torch

from omni_trio.cli._errors import UsageError
from omni_trio.cli._options import service_options
from omni_trio.cli._serve import add_serve_arguments
from omni_trio.parallel import ParallelRunner
from omni_trio.runners import tiny_lora
from omni_trio.serve._options import ServiceOptions, build_service
from tests.support.core import BUDGET
from tests.support.parallel import children, new_children
from tests.support.runners import tiny
from tests.support.serve import PATH, metric, png_size, serving


def parse(*argv: str) -> argparse.Namespace:
    """``serve``'s arguments, parsed as the command parses them."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_rank_options_become_service_options() -> None:
    """L49: each rank option gives ``(layout, ranks)``; none gives ``None``; the options
    exclude each other, ``--workers`` and the fake model; a rank count is 2 to 64. With
    ``--ray`` every replica gets it (one group each)."""
    assert service_options(parse("--model", "tiny-sd")).parallel is None
    replicas = parse("--model", "tiny-flux", "--ray", "--replicas", "2", "--ulysses", "2")
    assert service_options(replicas).parallel == ("ulysses", 2)
    for option, layout in (("--cfg-parallel", "cfg"), ("--ulysses", "ulysses"), ("--ring", "ring")):
        assert service_options(parse("--model", "tiny-flux", option, "2")).parallel == (layout, 2)
    with pytest.raises(UsageError, match=r"^--cfg-parallel: one worker over 2 ranks"):
        service_options(parse("--model", "tiny-sd", "--cfg-parallel", "2", "--workers", "2"))
    with pytest.raises(UsageError, match=r"^--ring: the fake model runs in one process"):
        service_options(parse("--model", "fake", "--ring", "2"))
    for argv in (["--cfg-parallel", "1"], ["--cfg-parallel", "2", "--ulysses", "2"]):
        with pytest.raises(SystemExit):
            parse("--model", "tiny-sd", *argv)


def test_split_by_load_needs_a_token_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """L48: ``--split-by-load`` goes with ``--ulysses`` or ``--ring`` to the one
    ``ParallelRunner`` as ``by_load``; without a token split, or with the CFG split,
    it is one clear line."""
    assert service_options(parse("--model", "tiny-flux")).split_by_load is False
    for option, layout in (("--ulysses", "ulysses"), ("--ring", "ring")):
        options = service_options(parse("--model", "tiny-flux", option, "2", "--split-by-load"))
        assert options.parallel == (layout, 2) and options.split_by_load is True
    with pytest.raises(UsageError, match=r"^--split-by-load: needs the token split .* --ring$"):
        service_options(parse("--model", "tiny-flux", "--split-by-load"))
    with pytest.raises(UsageError, match=r"^--split-by-load: splits tokens by load; use"):
        service_options(parse("--model", "tiny-sd", "--cfg-parallel", "2", "--split-by-load"))
    built: list[dict[str, object]] = []

    class Recorded:
        """What ``load_model`` builds in place of the ranks: the keywords it was given."""

        def __init__(self, factory: object, **options: object) -> None:
            built.append(options)
            self.pipeline = object()

    monkeypatch.setattr("omni_trio.parallel.ParallelRunner", Recorded)
    from omni_trio.serve._models import _parallel_runner

    _parallel_runner(lambda: None, ("ring", 2), None, by_load=True)
    assert built == [{"devices": None, "cfg": 1, "ulysses": 1, "ring": 2, "by_load": True}]


@pytest.mark.anyio
async def test_a_service_over_two_ranks_serves_and_reaps_them(tmp_path: Path) -> None:
    """L48, L49 (L88): ``ServiceOptions(parallel=("cfg", 2))`` serves tiny SD through one
    worker over two ranks, which ``/metrics`` shows as a group of two whose every call of
    the request's steps was split by rows; an adapter given at start is loaded on every
    rank, listed, and a request names it; the service's shutdown reaps the ranks."""
    before = children()
    threads = torch.get_num_threads()
    ink = tiny_lora(tiny("sd"), tmp_path, "ink", seed=1)
    options = ServiceOptions(model="tiny-sd", parallel=("cfg", 2), adapters=(("ink", str(ink)),))
    loaded = options.load_model()
    try:
        [runner] = loaded.runners
        service = build_service(options, model=loaded)
        assert isinstance(runner, ParallelRunner) and runner.world_size == 2
        ranks = set(runner.pids)
        with anyio.fail_after(BUDGET):
            async with serving(service) as client:
                body = {"prompt": "a flower", "size": "64x64", "adapters": {"ink": 0.5}}
                answer = await client.post(PATH, json=body)
                assert answer.status_code == 200, answer.text
                assert png_size(answer.json()["data"][0]["b64_json"]) == (64, 64)
                card = (await client.get("/v1/models")).json()["data"][0]
                assert [a["id"] for a in card["adapters"]] == ["ink"]
                reports = await anyio.to_thread.run_sync(runner.report)
                assert [[i.name for i in r.adapters] for r in reports] == [["ink"], ["ink"]]
                text = (await client.get("/metrics")).text
        group = {"group": "0"}
        assert metric(text, "omni_trio_group_ranks", **group) == 2
        calls = {
            way: metric(text, "omni_trio_group_calls_total", **group, way=way)
            for way in ("rows", "tokens")
        }
        assert calls == {"rows": loaded.steps, "tokens": 0}
        assert not ranks & children() and not new_children(before)
        assert "cfg over 2 ranks" in loaded.description
    finally:
        torch.set_num_threads(threads)
