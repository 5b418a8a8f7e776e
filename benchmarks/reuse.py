"""``reuse``: the prompt-embedding cache (L94) and the result cache (L95, L96) on a trace
that repeats itself, against the same trace with both caches off.

Three parts, each on the tiny SD (one CLIP), SDXL (two CLIPs) and Flux (CLIP and T5)
at ``SIZE`` px and ``STEPS`` steps, where the text encoders are a noticeable share of a
request:

- **replay**: a trace of ``REQUESTS`` requests from two tenants, replayed by
  ``CLIENTS`` clients that each send the next request when their last one is answered
  (a closed loop): prompts drawn from a Zipf mix of ``PROMPTS`` with one fixed negative
  prompt (Flux takes none), each with a new seed, except ``REPEAT_SHARE`` of them,
  exact repeats (seed and all) of an earlier request of the same tenant, and
  ``CROSS_SHARE``, another tenant's earlier request sent as one's own. The same trace
  with both caches on (a 64 MiB prompt cache, a result cache of ``RESULT_BYTES``, scope
  ``"tenant"``) and both off (``prompt_cache_bytes=0``, no result cache), each run on a
  fresh engine and runner, the order alternating, ``REPEATS`` runs each: throughput,
  p50 and p99 latency, the text encoders' time per request (the prompt cache's
  statistics, ``encode_s`` and ``saved_s``, over the trace's requests), both caches'
  hit rates and the bytes they hold at the end; and the hits that crossed tenants (a
  hit whose tenant had not sent that request before), which scope ``"tenant"`` must
  keep at 0; and once, on tiny SD, scope ``"global"`` as the count's control (its
  crossings hit).
- **costs**: one request at a time on the runner alone (no engine). A prompt-cache hit
  (the cache's ``encoded`` call, its key, lookup and copy) against a miss's encode,
  each text timed inside the call (``PromptScope.encoded`` wrapped for the run); the
  caches' bookkeeping on a miss, timed directly: the prompt cache's key, lookup and
  kept copy (the miss call less its encode), the result cache's key (``result_key``
  over the request) and its kept copy of the output (``keep_output``), against one
  step of the request alone (the smallest step there is: a batch's is longer).
- **HTTP**: the app in-process (httpx's ASGI transport) over tiny SD, 64 x 64 PNGs: an
  exact repeat of a seeded request, again and again, each a hit (its header says so),
  with a miss (a new seed) now and then beside them: each hit's wall time, and the
  process's CPU time (which other work on a shared machine does not add); and the
  runner's calls (prepares, decodes) during the hits, which must be 0.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import httpx

from omni_trio import EngineConfig, GenerationRequest, ResultCache, open_engine
from omni_trio._results import ResultScope, keep_output, result_key
from omni_trio.runners import DiffusersRunner
from omni_trio.runners._prompts import PROMPT_CACHE_BYTES, PromptScope

from .common import Options, fmt, md_table, p99, shared_pipeline, spread
from .plot import PEER_COLORS, bar_with_range, figure

__all__ = ["make_trace", "plot_reuse", "run_reuse", "table_reuse", "timed_encodings"]

#: The tiny models, and whether each takes a negative prompt (Flux's family does not).
MODELS = {"sd": True, "sdxl": True, "flux": False}
SIZE = 64
STEPS = 4
#: Guidance: SD and SDXL run classifier-free guidance (their negative prompt encoded
#: too); Flux embeds its guidance and encodes its prompt alone.
GUIDANCE = {"sd": 5.0, "sdxl": 5.0, "flux": 3.5}
#: The texts fit the tiny CLIPs' 32 tokens (a longer one is cut, with a warning).
NEGATIVE = "blurry, low quality, watermark"
SUBJECTS = ("a lighthouse", "a red fox", "an old tram", "a teapot", "a sailing boat", "a cat")
PLACES = ("on a cliff", "in the snow", "in the rain", "on a table")
#: The prompt mix, most popular first: a template's subjects and places.
PROMPTS = tuple(f"{subject} {place}" for place in PLACES for subject in SUBJECTS)
ZIPF_S = 1.1
REPEAT_SHARE = 0.2
CROSS_SHARE = 0.1
TENANTS = ("acme", "globex")
CLIENTS = 4
#: A repeat copies a request at least this many places earlier (most likely answered).
REPEAT_DISTANCE = 2 * CLIENTS
REQUESTS = 96
REPEATS = 5
RESULT_BYTES = 256 * 2**20
#: Each prompt-cache lookup, key and result-cache key timed this many times.
COST_REPEATS = 30
HTTP_HITS = 300
HTTP_MISSES = 10
PATH = "/v1/images/generations"
HEADER = "x-omni-trio-result-cache"
#: A warm-up request without a seed (never kept), of a prompt not in the trace.
WARM_UP = "warm-up"

Encode = Callable[[str], Any]


def make_trace(kind: str, requests: int, seed: int = 0) -> list[GenerationRequest]:
    """The trace of ``kind``'s requests (see the module's docstring), in sending order.

    ``REPEAT_SHARE`` of the places (and ``CROSS_SHARE``), drawn among those at least
    ``REPEAT_DISTANCE`` from the start, copy an earlier new request: as it was (its
    tenant's exact repeat), or sent by the other tenant (each new request at most once).
    """
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** ZIPF_S for rank in range(len(PROMPTS))]
    drawn = rng.sample(
        range(REPEAT_DISTANCE, requests), round((REPEAT_SHARE + CROSS_SHARE) * requests)
    )
    repeats = set(drawn[: round(REPEAT_SHARE * requests)])
    crosses = set(drawn) - repeats
    trace: list[GenerationRequest] = []
    fresh: list[int] = []  # the places of the new requests
    for index in range(requests):
        earlier = [trace[place] for place in fresh if place <= index - REPEAT_DISTANCE]
        if index in repeats:
            trace.append(rng.choice(earlier))
            continue
        if index in crosses:
            sent = {_said(request) for request in trace}
            unprobed = [r for r in earlier if _said(replace(r, tenant=_other(r))) not in sent]
            if unprobed:
                other = rng.choice(unprobed)
                trace.append(replace(other, tenant=_other(other)))
                continue
        prompt = rng.choices(PROMPTS, weights)[0]
        trace.append(_request(kind, prompt, 10_000 + index, rng.choice(TENANTS)))
        fresh.append(index)
    return trace


def _other(request: GenerationRequest) -> str:
    """The tenant that is not ``request``'s."""
    return TENANTS[1 - TENANTS.index(str(request.tenant))]


def _request(kind: str, prompt: str, seed: int, tenant: str | None = None) -> GenerationRequest:
    return GenerationRequest(
        prompt=prompt,
        negative_prompt=NEGATIVE if MODELS[kind] else None,
        num_steps=STEPS,
        height=SIZE,
        width=SIZE,
        guidance_scale=GUIDANCE[kind],
        seed=seed,
        tenant=tenant,
    )


def _said(request: GenerationRequest) -> tuple[Any, ...]:
    """What a trace's request says, its tenant first (the fields that vary in a trace)."""
    return (request.tenant, request.prompt, request.negative_prompt, request.seed)


def _tenancy(trace: Sequence[GenerationRequest], hits: Sequence[bool]) -> dict[str, int]:
    """The trace's repeats of its tenant's own, another tenant's, and the hits of each.

    A hit of a request its tenant had not sent before crossed tenants.
    """
    sent: set[tuple[Any, ...]] = set()
    fields: set[tuple[Any, ...]] = set()
    counts = {"own_repeats": 0, "own_hits": 0, "cross_repeats": 0, "cross_hits": 0}
    for request, hit in zip(trace, hits, strict=True):
        said = _said(request)
        if said in sent:
            counts["own_repeats"] += 1
            counts["own_hits"] += hit
        else:
            counts["cross_repeats"] += said[1:] in fields
            counts["cross_hits"] += hit
        sent.add(said)
        fields.add(said[1:])
    return counts


async def _replay(
    pipe: Any, trace: Sequence[GenerationRequest], scope: ResultScope | None
) -> dict[str, Any]:
    """``trace`` through a fresh engine, both caches on (the result cache's ``scope``) or
    both off (``None``)."""
    cached = scope is not None
    runner = DiffusersRunner(pipe, prompt_cache_bytes=PROMPT_CACHE_BYTES if cached else 0)
    config = EngineConfig(
        result_cache=None if scope is None else ResultCache(max_bytes=RESULT_BYTES, scope=scope)
    )
    latencies = [0.0] * len(trace)
    hits = [False] * len(trace)
    order = iter(range(len(trace)))
    async with open_engine(runner, config) as engine:
        warm = trace[0]
        await engine.generate(replace(warm, prompt=WARM_UP, seed=None, tenant=None))
        runner.clear_prompt_cache()  # the trace starts cold
        before = runner.prompt_cache_statistics()

        async def client() -> None:
            for index in order:  # the clients share one iterator: the trace's order
                begun = time.perf_counter()
                output = await engine.generate(trace[index])
                latencies[index] = time.perf_counter() - begun
                hits[index] = output.metrics.result_cache_hit

        started = time.perf_counter()
        async with anyio.create_task_group() as group:
            for _ in range(CLIENTS):
                group.start_soon(client)
        wall = time.perf_counter() - started
        after = runner.prompt_cache_statistics()
        results = engine.statistics().result_cache
    texts = (after.hits - before.hits) + (after.misses - before.misses)
    return {
        "throughput_rps": len(trace) / wall,
        "p50_s": statistics.median(latencies),
        "p99_s": p99(latencies),
        "encode_s_per_request": (after.encode_s - before.encode_s) / len(trace),
        "saved_s_per_request": (after.saved_s - before.saved_s) / len(trace),
        "prompt_hits": after.hits - before.hits,
        "prompt_hit_rate": (after.hits - before.hits) / texts if texts else 0.0,
        "prompt_bytes": after.bytes,
        "prompt_entries": after.entries,
        "result_hits": 0 if results is None else results.hits,
        "result_hit_rate": 0.0 if results is None else results.hits / len(trace),
        "result_bytes": 0 if results is None else results.bytes,
        "result_entries": 0 if results is None else results.entries,
        **_tenancy(trace, hits),
    }


def _replays(options: Options, kind: str, trace: list[GenerationRequest], repeats: int) -> Any:
    """``repeats`` runs each way, the order alternating; medians, and each pair's ratio."""
    pipe = shared_pipeline(kind)
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for repeat in range(repeats):
        for mode in ("on", "off") if repeat % 2 == 0 else ("off", "on"):
            runs[mode].append(options.run(_replay, pipe, trace, "tenant" if mode == "on" else None))
    modes = {}
    for mode, results in runs.items():
        summary: dict[str, Any] = {
            key: statistics.median(r[key] for r in results) for key in results[0]
        }
        summary["throughput_rps"] = spread([r["throughput_rps"] for r in results])
        summary["cross_hits_all_runs"] = sum(r["cross_hits"] for r in results)
        modes[mode] = summary
    ratios = [
        on["throughput_rps"] / off["throughput_rps"]
        for on, off in zip(runs["on"], runs["off"], strict=True)
    ]
    return {
        "kind": kind,
        "modes": modes,
        "throughput_ratio": statistics.median(ratios),
        "p50_ratio": modes["on"]["p50_s"] / modes["off"]["p50_s"],
    }


@contextmanager
def timed_encodings() -> Iterator[list[tuple[bool, float, float]]]:
    """Note every prompt-cache call inside: (hit, the call's seconds, its encode's seconds).

    ``PromptScope.encoded`` is wrapped for the block (then put back); the encode's
    seconds are what the cache itself timed of the text encoders (0 on a hit).
    """
    noted: list[tuple[bool, float, float]] = []
    original = PromptScope.encoded

    def spy(self: PromptScope, family: Any, text: str, encode: Encode) -> Any:
        hits, encode_s = self.hits, self.encode_s
        started = time.perf_counter()
        tensors = original(self, family, text, encode)
        seconds = time.perf_counter() - started
        noted.append((self.hits > hits, seconds, self.encode_s - encode_s))
        return tensors

    PromptScope.encoded = spy  # type: ignore[method-assign]
    try:
        yield noted
    finally:
        PromptScope.encoded = original  # type: ignore[method-assign]


def _per_call(call: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``call``: the median of 5 rounds of ``calls`` calls."""
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        rounds.append((time.perf_counter() - started) / calls)
    return statistics.median(rounds)


def _costs(kind: str, repeats: int) -> dict[str, Any]:
    """A prompt-cache hit vs a miss's encode; the caches' bookkeeping on a miss vs a step."""
    runner = DiffusersRunner(shared_pipeline(kind))
    request = _request(kind, PROMPTS[0], 7)
    missed: list[float] = []  # the bookkeeping of one request's misses
    try:
        with timed_encodings() as calls:
            for repeat in range(repeats):
                runner.clear_prompt_cache()
                for label in ("miss", "hit"):
                    first = len(calls)
                    runner.discard(runner.prepare(request, f"{label}-{repeat}"))
                    if label == "miss":
                        missed.append(sum(call - encode for _, call, encode in calls[first:]))
        steps: list[float] = []
        whole: list[float] = []  # a request that misses, prepare to decode
        for _ in range(3):
            runner.clear_prompt_cache()
            begun = time.perf_counter()
            state = runner.prepare(request, "steps")
            for _ in range(request.denoise_steps):
                started = time.perf_counter()
                runner.step([state])
                steps.append(time.perf_counter() - started)
            images = runner.decode(state)
            whole.append(time.perf_counter() - begun)
            runner.discard(state)
        model = runner.result_fingerprint()
    finally:
        runner.close()
    hit_s = [call for hit, call, _ in calls if hit]
    encode_s = [encode for hit, _, encode in calls if not hit]
    key_s = _per_call(lambda: result_key(request, model=model, adapters={}, scope="tenant"), 200)
    copy_s = _per_call(lambda: keep_output(images, None), 200)
    step_s = statistics.median(steps)
    bookkeeping_s = statistics.median(missed) + key_s + copy_s
    hit = statistics.median(hit_s)
    encode = statistics.median(encode_s)
    return {
        "kind": kind,
        "texts_per_request": len(calls) // (2 * repeats),
        "encode_ms": encode * 1e3,
        "hit_us": hit * 1e6,
        "hit_p99_us": p99(hit_s) * 1e6,
        "hit_pct_of_encode": 100 * hit / encode,
        "prompt_bookkeeping_us": statistics.median(missed) * 1e6,
        "key_us": key_s * 1e6,
        "copy_us": copy_s * 1e6,
        "step_ms": step_s * 1e3,
        "bookkeeping_us": bookkeeping_s * 1e6,
        "bookkeeping_pct_of_step": 100 * bookkeeping_s / step_s,
        "request_ms": statistics.median(whole) * 1e3,
        "bookkeeping_pct_of_request": 100 * bookkeeping_s / statistics.median(whole),
    }


def _runner_calls(runner: DiffusersRunner) -> int:
    """The runner's prepares (each encodes a text at least) and decodes so far."""
    prompts = runner.prompt_cache_statistics()
    return prompts.hits + prompts.misses + runner.decodes


async def _http(kind: str, hits: int, misses: int) -> dict[str, Any]:
    """Exact repeats over HTTP, in-process: each a hit; a miss now and then beside them."""
    from omni_trio.serve import ServeConfig, Service

    runner = DiffusersRunner(shared_pipeline(kind))
    service = Service(
        runner,
        engine_config=EngineConfig(result_cache=ResultCache(max_bytes=RESULT_BYTES)),
        config=ServeConfig(
            model_name=f"tiny-{kind}",
            default_width=SIZE,
            default_height=SIZE,
            default_steps=STEPS,
        ),
    )
    body: dict[str, Any] = {"prompt": PROMPTS[0], "seed": 7, "guidance_scale": GUIDANCE[kind]}
    if MODELS[kind]:
        body["negative_prompt"] = NEGATIVE
    hit_s: list[float] = []
    hit_cpu_s: list[float] = []  # CPU time: what other work on the machine does not add
    miss_s: list[float] = []
    answered = touched = 0
    every = max(1, hits // misses)
    transport = httpx.ASGITransport(app=service.app)
    async with (
        service.app.router.lifespan_context(service.app),
        httpx.AsyncClient(transport=transport, base_url="http://bench") as client,
    ):
        for warm in range(2):  # the route's first call, and the first miss kept
            (await client.post(PATH, json={**body, "seed": warm + 1})).raise_for_status()
        (await client.post(PATH, json=body)).raise_for_status()  # the entry the hits read
        for index in range(hits):
            calls = _runner_calls(runner)
            cpu, started = time.process_time(), time.perf_counter()
            response = await client.post(PATH, json=body)
            hit_s.append(time.perf_counter() - started)
            hit_cpu_s.append(time.process_time() - cpu)
            touched += _runner_calls(runner) - calls
            answered += response.status_code == 200 and response.headers.get(HEADER) == "hit"
            if index % every == 0:
                started = time.perf_counter()
                fresh = await client.post(PATH, json={**body, "seed": 100 + index})
                miss_s.append(time.perf_counter() - started)
                fresh.raise_for_status()
    return {
        "kind": kind,
        "hits": hits,
        "answered_as_hits": answered,
        "runner_calls_during_hits": touched,
        "hit_p50_ms": statistics.median(hit_s) * 1e3,
        "hit_p99_ms": p99(hit_s) * 1e3,
        "hit_max_ms": max(hit_s) * 1e3,
        "hit_cpu_p50_ms": statistics.median(hit_cpu_s) * 1e3,
        "hit_cpu_p99_ms": p99(hit_cpu_s) * 1e3,
        "miss_p50_ms": statistics.median(miss_s) * 1e3,
        "misses": len(miss_s),
    }


def run_reuse(options: Options) -> dict[str, Any]:
    """The replay, the costs and the HTTP hits; headline figures in the summary."""
    quick = options.quick
    requests, repeats = (24, 1) if quick else (REQUESTS, REPEATS)
    cost_repeats = 3 if quick else COST_REPEATS
    http_hits, http_misses = (10, 2) if quick else (HTTP_HITS, HTTP_MISSES)
    replays = []
    costs = []
    traces = {}
    for kind in MODELS:
        trace = make_trace(kind, requests)
        traces[kind] = len(trace)
        replays.append(_replays(options, kind, trace, repeats))
        costs.append(_costs(kind, cost_repeats))
    # The control: scope "global" shares every tenant's entries, so the same trace's
    # requests sent as the other tenant's hit; the count of crossings sees them.
    control = options.run(_replay, shared_pipeline("sd"), make_trace("sd", requests), "global")
    http = options.run(_http, "sd", http_hits, http_misses)
    by_kind = {item["kind"]: item for item in replays}
    summary = {
        "throughput_ratio_on_over_off": {k: v["throughput_ratio"] for k, v in by_kind.items()},
        "p50_ratio_on_over_off": {k: v["p50_ratio"] for k, v in by_kind.items()},
        "encode_ms_per_request_on": {
            k: v["modes"]["on"]["encode_s_per_request"] * 1e3 for k, v in by_kind.items()
        },
        "encode_ms_per_request_off": {
            k: v["modes"]["off"]["encode_s_per_request"] * 1e3 for k, v in by_kind.items()
        },
        "prompt_hit_rate": {k: v["modes"]["on"]["prompt_hit_rate"] for k, v in by_kind.items()},
        "result_hit_rate": {k: v["modes"]["on"]["result_hit_rate"] for k, v in by_kind.items()},
        "prompt_hit_pct_of_encode": max(c["hit_pct_of_encode"] for c in costs),
        "prompt_hit_pct_of_encode_by_model": {c["kind"]: c["hit_pct_of_encode"] for c in costs},
        "bookkeeping_pct_of_step": max(c["bookkeeping_pct_of_step"] for c in costs),
        "bookkeeping_pct_of_step_by_model": {
            c["kind"]: c["bookkeeping_pct_of_step"] for c in costs
        },
        "http_hit_p50_ms": http["hit_p50_ms"],
        "http_hit_p99_ms": http["hit_p99_ms"],
        "http_hit_runner_calls": http["runner_calls_during_hits"],
        "http_hits_not_answered_as_hits": http["hits"] - http["answered_as_hits"],
        "cross_tenant_hits": sum(v["modes"]["on"]["cross_hits_all_runs"] for v in replays),
        "cross_tenant_hits_scope_global": control["cross_hits"],
    }
    return {
        "config": {
            "models": list(MODELS),
            "size": SIZE,
            "steps": STEPS,
            "requests": requests,
            "prompts": len(PROMPTS),
            "zipf_s": ZIPF_S,
            "repeat_share": REPEAT_SHARE,
            "cross_share": CROSS_SHARE,
            "tenants": list(TENANTS),
            "clients": CLIENTS,
            "repeats": repeats,
            "cost_repeats": cost_repeats,
            "prompt_cache_bytes": PROMPT_CACHE_BYTES,
            "result_cache_bytes": RESULT_BYTES,
            "backend": options.backend,
        },
        "replay": replays,
        "costs": costs,
        "http": http,
        "control": control,
        "summary": summary,
    }


def _verdict(met: bool) -> str:
    return "met" if met else "**missed**"


def _mib(value: float) -> str:
    return fmt(value / 2**20, 2)


def table_reuse(result: dict[str, Any]) -> str:
    """The replay per model and mode, the costs per model, the HTTP hits."""
    config = result["config"]
    first = result["replay"][0]["modes"]["on"]
    parts = [
        f"A trace of {config['requests']} requests ({config['prompts']} prompts, Zipf"
        f" s={config['zipf_s']:g}, one negative prompt, Flux none; {first['own_repeats']:.0f}"
        f" exact repeats of the tenant's own, {first['cross_repeats']:.0f} of the other"
        f" tenant's; tenants {', '.join(config['tenants'])}) replayed by {config['clients']}"
        f" clients in a closed loop, {config['size']} px, {config['steps']} steps; both caches"
        f" on (scope tenant) vs both off, {config['repeats']} runs each, interleaved; medians."
        " Encoder time is the text encoders' per request of the trace (hits included);"
        " bytes are what each cache holds at the end.\n",
    ]
    rows = []
    for item in result["replay"]:
        for mode in ("on", "off"):
            m = item["modes"][mode]
            rps = m["throughput_rps"]
            on = mode == "on"
            rows.append(
                [
                    f"{item['kind']}, caches {mode}",
                    fmt(rps["median"], 1),
                    f"{item['throughput_ratio']:.2f}x" if on else "1.00x",
                    fmt(m["p50_s"] * 1e3, 1),
                    fmt(m["p99_s"] * 1e3, 1),
                    fmt(m["encode_s_per_request"] * 1e3, 2),
                    fmt(m["saved_s_per_request"] * 1e3, 2) if on else "-",
                    fmt(m["prompt_hit_rate"] * 100, 0) + " %" if on else "-",
                    (
                        f"{m['result_hit_rate'] * 100:.0f} % ({m['own_hits']:.0f} of"
                        f" {m['own_repeats']:.0f} repeats)"
                    )
                    if on
                    else "-",
                    _mib(m["prompt_bytes"]) if on else "-",
                    _mib(m["result_bytes"]) if on else "-",
                    f"{m['cross_hits_all_runs']:.0f}" if on else "-",
                ]
            )
    parts.append(
        md_table(
            [
                "model",
                "req/s",
                "vs off",
                "p50 ms",
                "p99 ms",
                "encoder ms/req",
                "saved ms/req",
                "prompt hits",
                "result hits",
                "prompt MiB",
                "result MiB",
                "cross-tenant hits",
            ],
            rows,
        )
    )
    parts.append(
        f"\n**Costs**, one request at a time on the runner ({config['cost_repeats']} each;"
        " medians): a prompt-cache hit (key, lookup, copy) per text against a miss's encode"
        " of that text; the bookkeeping of a request that misses both caches, timed"
        " directly: the prompt cache's key, lookup and kept copy (the miss calls less their"
        " encodes), the result cache's key (a SHA-256 of the request) and its copy of the"
        " output; against one step of the request alone, and against the whole request"
        " (its misses' encodes, its steps, its decode):\n"
    )
    rows = [
        [
            c["kind"],
            str(c["texts_per_request"]),
            fmt(c["encode_ms"], 2),
            fmt(c["hit_us"], 1),
            f"{c['hit_pct_of_encode']:.2f} %",
            _verdict(c["hit_pct_of_encode"] <= 5.0),
            fmt(c["prompt_bookkeeping_us"], 1),
            fmt(c["key_us"], 1),
            fmt(c["copy_us"], 1),
            fmt(c["step_ms"], 2),
            f"{c['bookkeeping_pct_of_step']:.2f} %",
            _verdict(c["bookkeeping_pct_of_step"] <= 1.0),
            f"{c['bookkeeping_pct_of_request']:.2f} %",
        ]
        for c in result["costs"]
    ]
    parts.append(
        md_table(
            [
                "model",
                "texts",
                "miss encode ms",
                "hit µs",
                "hit / miss",
                "≤ 5 %",
                "prompt µs",
                "key µs",
                "copy µs",
                "step ms",
                "bookkeeping / step",
                "≤ 1 %",
                "/ request",
            ],
            rows,
        )
    )
    h = result["http"]
    parts.append(
        f"\n**An exact repeat over HTTP** (tiny {h['kind']}, {SIZE} x {SIZE} PNG, the app"
        f" in-process through httpx's ASGI transport): {h['hits']} repeats,"
        f" {h['answered_as_hits']} answered as hits; {h['misses']} misses (new seeds)"
        " beside them. Wall time, and the process's CPU time (what other work on a shared"
        " machine does not add):\n"
    )
    rows = [
        [
            fmt(h["hit_p50_ms"], 2),
            fmt(h["hit_p99_ms"], 2),
            fmt(h["hit_max_ms"], 2),
            _verdict(h["hit_p99_ms"] <= 5.0),
            f"{h['hit_cpu_p50_ms']:.2f} / {h['hit_cpu_p99_ms']:.2f}",
            str(h["runner_calls_during_hits"]),
            _verdict(h["runner_calls_during_hits"] == 0),
            fmt(h["miss_p50_ms"], 1),
        ]
    ]
    parts.append(
        md_table(
            [
                "hit p50 ms",
                "hit p99 ms",
                "max",
                "p99 ≤ 5 ms",
                "CPU p50 / p99 ms",
                "runner calls",
                "target 0",
                "miss p50 ms",
            ],
            rows,
        )
    )
    parts.append(
        "\n**Tenants**: the trace's requests sent as the other tenant's (each an earlier"
        " request of one tenant, seed and all) and the hits among them; scope global, once"
        " on tiny SD, is the control (it shares entries, so its crossings are counted):\n"
    )
    cross = result["summary"]["cross_tenant_hits"]
    sent = sum(item["modes"]["on"]["cross_repeats"] for item in result["replay"])
    control = result["control"]
    rows = [
        [
            "tenant",
            f"{len(result['replay']) * config['repeats']}",
            f"{sent * config['repeats']:.0f}",
            f"{cross:.0f}",
            _verdict(cross == 0),
        ],
        [
            "global (control)",
            "1",
            f"{control['cross_repeats']:.0f}",
            f"{control['cross_hits']:.0f}",
            "-",
        ],
    ]
    parts.append(
        md_table(
            ["scope", "runs", "sent as the other tenant", "cross-tenant hits", "target 0"], rows
        )
    )
    return "\n".join(parts)


def plot_reuse(result: dict[str, Any], path: Path) -> None:
    """Throughput, and the text encoders' time per request, caches on vs off, per model."""
    kinds = [item["kind"] for item in result["replay"]]
    labels = [f"{kind} {mode}" for kind in kinds for mode in ("on", "off")]
    colors = [PEER_COLORS["omni_trio"], PEER_COLORS["naive"]] * len(kinds)
    modes = [item["modes"][mode] for item in result["replay"] for mode in ("on", "off")]
    with figure(path, columns=2, title="reuse: a trace with repeats, caches on vs off") as (a, b):
        bar_with_range(
            a, labels, [m["throughput_rps"] for m in modes], colors=colors, ylabel="requests/s"
        )
        a.tick_params(axis="x", labelrotation=45)
        b.bar(labels, [m["encode_s_per_request"] * 1e3 for m in modes], color=colors)
        b.set_ylabel("text encoders, ms per request")
        b.tick_params(axis="x", labelrotation=45)
        b.grid(axis="y", alpha=0.3)
