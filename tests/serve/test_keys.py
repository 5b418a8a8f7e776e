"""API keys and tenants over HTTP (L55, L56): who may call, as whom, how much.

Determinism: an instant FakeRunner behind the app, called in-process
(``httpx.ASGITransport``); rates on a virtual clock (``RateLimiter(clock=...)``),
never on time passing. Ray Serve's ingress is tested as its replicas run the app
(``ReplicaIngress`` around ``Service.app``, asyncio only, as Ray runs it), without
a cluster.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import openai
import pytest
from starlette.routing import Route

import omni_trio as ot
from omni_trio.serve import (
    ApiKey,
    ApiKeys,
    ServeConfig,
    Service,
    ServiceOptions,
    TenantLimits,
    VideoConfig,
    load_keys_file,
    require_admin,
)
from omni_trio.serve._keys import CALLER, KeyGate, RateLimiter, check_running_jobs
from omni_trio.serve._ray_ingress import REPLICA_HEADER, ReplicaIngress
from omni_trio.testing import FakeRunner
from tests.support.core import BUDGET
from tests.support.serve import PATH, make_service, metric, serving, stored_rows

SECRET = "sk-acme-0123456789"
ADMIN = "sk-root-9876543210"
WRONG = "sk-nobody-55555"

KEYS = ApiKeys(
    keys=(
        ApiKey.of(SECRET, tenant="acme", weight=2.0, limits=TenantLimits(max_waiting=3)),
        ApiKey.of(ADMIN, tenant="ops", admin=True),
    )
)


def keyed_service(keys: ApiKeys = KEYS) -> Service:
    service, _ = make_service()
    return Service(
        FakeRunner(),
        engine_config=service.engine_config,
        config=service.config,
        keys=keys,
    )


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


BODY = {"prompt": "a flower", "size": "64x64"}

#: Authorization headers that are no valid key: none, wrong, malformed.
BAD_HEADERS: list[dict[str, str]] = [
    {},
    bearer(WRONG),
    {"Authorization": "Bearer"},
    {"Authorization": f"Basic {SECRET}"},
    {"Authorization": f"Bearer {SECRET} extra"},
    {"Authorization": SECRET},
    bearer(SECRET[:-1]),
    bearer(SECRET + "x"),
]


def _routes(service: Service) -> list[tuple[str, str]]:
    found = [("GET", "/v1/unknown"), ("DELETE", "/v1/models")]
    for route in service.app.routes:
        assert isinstance(route, Route)
        path = route.path.replace("{video_id}", "video_1").replace("{model_id:path}", "fake")
        found += [(method, path) for method in sorted(route.methods or ()) if method != "HEAD"]
    return [(m, p) for m, p in found if p != "/health"]


@pytest.mark.anyio
async def test_every_route_but_health_needs_a_key() -> None:
    """L55: with keys, every route and method (an unknown one too) answers 401 with
    OpenAI's error body to no key, a wrong one and a malformed header; ``/health`` is
    open, and nothing is echoed."""
    service = keyed_service(ApiKeys(keys=KEYS.keys, metrics_auth=True))
    routes = _routes(service)
    assert ("POST", PATH) in routes and ("GET", "/metrics") in routes
    async with serving(service) as client:
        assert (await client.get("/health")).status_code == 200
        for method, path in routes:
            for headers in BAD_HEADERS:
                response = await client.request(method, path, headers=headers, json=BODY)
                assert response.status_code == 401, (method, path, headers)
                error = response.json()["error"]
                assert error["code"] == "invalid_api_key"
                assert error["type"] == "invalid_request_error"
                assert response.headers["www-authenticate"].startswith("Bearer")
                assert SECRET[:8] not in response.text and WRONG not in response.text
        two = [("authorization", f"Bearer {SECRET}"), ("authorization", f"Bearer {SECRET}")]
        assert (await client.get("/v1/models", headers=two)).status_code == 401
        assert (await client.get("/v1/models", headers=bearer(SECRET))).status_code == 200


@pytest.mark.anyio
async def test_a_key_runs_requests_as_its_tenant() -> None:
    """L55, L56, L58: a valid key's requests run as its tenant, whose weight and waiting
    bound join the engine's configuration; the tenant is a ``/metrics`` label."""
    service = keyed_service()
    assert dict(service.engine_config.tenant_weights) == {"acme": 2.0, "ops": 1.0}
    assert dict(service.engine_config.tenant_max_waiting) == {"acme": 3}
    async with serving(service) as client:
        response = await client.post(PATH, json=BODY, headers=bearer(SECRET))
        assert response.status_code == 200
        text = (await client.get("/metrics")).text  # open by default
    completed = {"tenant": "acme", "outcome": "completed"}
    assert metric(text, "omni_trio_tenant_requests_total", **completed) == 1.0
    assert metric(text, "omni_trio_tenant_queue_wait_seconds_count", tenant="acme") == 1.0


@pytest.mark.anyio
async def test_without_keys_the_server_is_open_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """L55: without keys nothing changes (no key needed, the default tenant), and the
    log says at start that every route is open."""
    service, _ = make_service()
    with caplog.at_level(logging.INFO, logger="omni_trio.serve"):
        async with serving(service) as client:
            assert (await client.post(PATH, json=BODY)).status_code == 200
            text = (await client.get("/metrics")).text
    assert any("open to anyone" in record.getMessage() for record in caplog.records)
    default = {"tenant": "default", "outcome": "completed"}
    assert metric(text, "omni_trio_tenant_requests_total", **default) == 1.0


@pytest.mark.anyio
async def test_the_openai_sdk_reads_the_401() -> None:
    """L55: the OpenAI SDK raises its ``AuthenticationError`` for a wrong key and works
    with the right one (it sends ``Authorization: Bearer``)."""
    service = keyed_service()
    async with serving(service):
        for key, ok in ((WRONG, False), (SECRET, True)):
            http = httpx2.AsyncClient(
                transport=httpx2.ASGITransport(app=service.app), base_url="http://t"
            )
            sdk = openai.AsyncOpenAI(
                base_url="http://t/v1", api_key=key, http_client=http, max_retries=0
            )
            async with sdk:
                if ok:
                    images = await sdk.images.generate(prompt="a flower", size="64x64")
                    assert images.data and images.data[0].b64_json
                else:
                    with pytest.raises(openai.AuthenticationError) as raised:
                        await sdk.models.list()
                    assert raised.value.status_code == 401
                    assert raised.value.code == "invalid_api_key"


@pytest.mark.anyio
async def test_keys_are_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    """L55: no log record, at any level, holds a key, right or wrong, nor its digest."""
    service = keyed_service()
    with caplog.at_level(logging.DEBUG):
        async with serving(service) as client:
            await client.post(PATH, json=BODY, headers=bearer(SECRET))
            await client.post(PATH, json=BODY, headers=bearer(WRONG))
            await client.get("/v1/models", headers={"Authorization": f"Basic {ADMIN}"})
    text = "\n".join(
        f"{record.getMessage()} {record.__dict__}" for record in caplog.records
    ) + repr(KEYS)
    assert caplog.records
    for secret in (SECRET, ADMIN, WRONG):
        assert secret not in text
        assert hashlib.sha256(secret.encode()).hexdigest() not in text
    assert any(getattr(record, "tenant", None) == "acme" for record in caplog.records)


@pytest.mark.anyio
async def test_a_tenant_over_its_rate_gets_429_with_retry_after() -> None:
    """L56: past its requests per minute (here 1, a bucket of 1) a tenant's generation
    gets 429 ``rate_limited`` with ``Retry-After`` at once; reads are not counted, and
    another tenant is not limited."""
    slow = ApiKey.of(SECRET, tenant="acme", limits=TenantLimits(requests_per_minute=1))
    keys = ApiKeys(keys=(slow, ApiKey.of(ADMIN, tenant="ops")))
    service = keyed_service(keys)
    async with serving(service) as client:
        assert (await client.post(PATH, json=BODY, headers=bearer(SECRET))).status_code == 200
        refused = await client.post(PATH, json=BODY, headers=bearer(SECRET))
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limited"
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert (await client.get("/v1/models", headers=bearer(SECRET))).status_code == 200
        assert (await client.post(PATH, json=BODY, headers=bearer(ADMIN))).status_code == 200
        text = (await client.get("/metrics")).text
    limited = {"tenant": "acme", "outcome": "rate_limited"}
    assert metric(text, "omni_trio_tenant_requests_total", **limited) == 1.0


def test_the_rate_limiter_is_a_bucket_on_its_clock() -> None:
    """L56: GCRA: a burst of ``burst`` at once, then one per ``60 / rate`` seconds; a
    refusal says how long until one fits and costs nothing."""
    now = [100.0]
    limiter = RateLimiter(clock=lambda: now[0])
    limits = TenantLimits(requests_per_minute=30, burst=3)  # one every 2 s
    assert [limiter.admit("a", limits) for _ in range(3)] == [None, None, None]
    assert limiter.admit("a", limits) == pytest.approx(2.0)
    assert limiter.admit("b", limits) is None  # tenants have buckets of their own
    now[0] += 1.0
    assert limiter.admit("a", limits) == pytest.approx(1.0)
    now[0] += 1.0
    assert limiter.admit("a", limits) is None
    assert limiter.admit("a", limits) == pytest.approx(2.0)
    now[0] += 60.0  # a long pause refills the bucket, no more
    assert [limiter.admit("a", limits) for _ in range(4)][-1] == pytest.approx(2.0)
    assert limiter.admit("a", TenantLimits()) is None  # no rate: no limit
    assert TenantLimits(requests_per_minute=600).bucket == 60
    assert TenantLimits(requests_per_minute=5).bucket == 1


def test_running_video_jobs_are_bounded_per_tenant() -> None:
    """L56: a tenant at its ``max_running_jobs`` gets 429 ``tenant_jobs_full``."""
    key = ApiKey.of(SECRET, tenant="acme", limits=TenantLimits(max_running_jobs=2))
    check_running_jobs(key, 1, 1)
    with pytest.raises(ot.serve.ApiError) as refused:
        check_running_jobs(key, 2, 7)
    assert refused.value.status == 429 and refused.value.code == "tenant_jobs_full"
    assert refused.value.headers["Retry-After"] == "7"
    check_running_jobs(ApiKey.of(SECRET, tenant="acme"), 100, 1)  # no bound


def durable_video_service(folder: Path, keys: ApiKeys, runner: FakeRunner) -> Service:
    """A video service with ``keys`` whose jobs live in ``folder`` (L77)."""
    config = ServeConfig(
        model_name="fake-video", default_width=16, default_height=16, default_steps=4
    )
    return Service(
        runner,
        engine_config=ot.EngineConfig(max_height=64, max_width=64, shutdown_grace=0.0),
        config=config,
        video_config=VideoConfig(fps=8.0, jobs_dir=folder, checkpoint_every_s=0.0),
        keys=keys,
    )


async def cut_video_job_of_acme(folder: Path) -> str:
    """The id of an "acme" video job that shutdown cut mid-steps: it runs again after a
    restart on ``folder``."""
    slow = FakeRunner(frames=(4, 1), checkpoints=True, step_seconds=0.02)
    async with serving(durable_video_service(folder, KEYS, slow)) as client:
        body = {"prompt": "a fox", "seed": 1, "num_frames": 5, "num_inference_steps": 200}
        response = await client.post("/v1/videos", json=body, headers=bearer(SECRET))
        assert response.status_code == 200, response.text
        job_id: str = response.json()["id"]
        while slow.steps_run < 1:
            await anyio.sleep(0.005)
    [row] = await stored_rows(folder)
    assert (row.id, row.tenant) == (job_id, "acme")
    assert row.status in ("queued", "in_progress")  # not finished: it runs again
    return job_id


async def resumed_to_its_end(client: httpx.AsyncClient, job_id: str, key: str) -> str:
    """Wait for the resumed job ``job_id`` to finish; ``/metrics`` then."""
    while True:
        job = (await client.get(f"/v1/videos/{job_id}", headers=bearer(key))).json()
        if job["status"] in ("completed", "failed"):
            assert job["status"] == "completed", job
            return (await client.get("/metrics")).text
        await anyio.sleep(0.001)


@pytest.mark.anyio
async def test_a_resumed_video_job_runs_as_its_tenant(tmp_path: Path) -> None:
    """L56, L57, L77: a video job cut by shutdown runs again after the restart as the
    tenant that created it (its fair share, its ``/metrics`` label), not as the default
    tenant."""
    with anyio.fail_after(BUDGET):
        job_id = await cut_video_job_of_acme(tmp_path)
        service = durable_video_service(tmp_path, KEYS, FakeRunner(frames=(4, 1), checkpoints=True))
        async with serving(service) as client:
            text = await resumed_to_its_end(client, job_id, SECRET)
    completed = "omni_trio_tenant_requests_total"
    assert metric(text, completed, tenant="acme", outcome="completed") == 1.0
    assert metric(text, completed, tenant="default", outcome="completed") == 0.0


@pytest.mark.anyio
async def test_a_tenant_the_keys_do_not_name_is_counted_as_other(tmp_path: Path) -> None:
    """L56: the ``tenant`` label is a tenant of the keys, ``default`` or ``other``. Every
    request a route admits runs as its key's tenant, so ``other`` is what a video job of
    a tenant whose keys were taken away counts as when it runs again after the restart:
    no series is made for a name the keys do not hold."""
    ops_only = ApiKeys(keys=(KEYS.keys[1],))
    assert ops_only.tenants == ("ops",)
    with anyio.fail_after(BUDGET):
        job_id = await cut_video_job_of_acme(tmp_path)
        runner = FakeRunner(frames=(4, 1), checkpoints=True)
        async with serving(durable_video_service(tmp_path, ops_only, runner)) as client:
            text = await resumed_to_its_end(client, job_id, ADMIN)
    completed = "omni_trio_tenant_requests_total"
    assert metric(text, completed, tenant="other", outcome="completed") == 1.0
    assert metric(text, "omni_trio_tenant_queue_wait_seconds_count", tenant="other") == 1.0
    assert 'tenant="acme"' not in text
    assert metric(text, completed, tenant="default", outcome="completed") == 0.0


def test_admin_routes_need_an_admin_key() -> None:
    """L55: ``require_admin`` refuses a tenant's key (403 ``admin_required``), lets an
    admin key through, and every caller of an open server."""
    tenant, admin = KEYS.keys
    with pytest.raises(ot.serve.ApiError) as refused:
        require_admin({CALLER: tenant}, "loading an adapter")
    assert refused.value.status == 403 and refused.value.code == "admin_required"
    assert "loading an adapter" in refused.value.message
    require_admin({CALLER: admin})
    require_admin({})


@pytest.mark.anyio
async def test_the_gate_passes_everything_through_without_keys() -> None:
    """L55: a ``KeyGate`` with no keys is the app itself: no key is asked for."""
    seen: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(dict(scope))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    gate: Any = KeyGate(app, keys=ApiKeys())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://t") as c:
        assert (await c.get("/anything")).status_code == 204
    assert CALLER not in seen[0]


# -- keys ----------------------------------------------------------------------


def test_keys_compare_by_digest_and_hide_it() -> None:
    """L55: a key is kept as its SHA-256 digest; ``find`` matches the key exactly; no
    ``repr`` shows a key or its digest; plain keys are admin keys of their own tenants."""
    assert KEYS.find(SECRET) is KEYS.keys[0]
    assert KEYS.find(WRONG) is None and KEYS.find("") is None
    assert SECRET not in repr(KEYS) and KEYS.keys[0].digest.hex() not in repr(KEYS)
    plain = ApiKeys.from_keys(["k-one", "k-two", "k-one"])
    assert [(k.tenant, k.admin) for k in plain.keys] == [("key1", True), ("key2", True)]
    for bad in ("", " k", "a b", "k\n", "clé", "k\u00a0"):
        with pytest.raises(ValueError, match="API key"):
            ApiKey.of(bad, tenant="t")
    with pytest.raises(ValueError, match="disagree"):
        ApiKeys(keys=(ApiKey.of("k1", tenant="t"), ApiKey.of("k2", tenant="t", weight=2)))
    with pytest.raises(ValueError, match="twice"):
        ApiKeys(keys=(ApiKey.of("k1", tenant="t"), ApiKey.of("k1", tenant="u")))


def test_the_keys_travel_to_a_replica_as_digests() -> None:
    """L55: ``ServiceOptions.keys`` pickles (Ray sends a replica its options) and holds
    no key: only digests, which no ``repr`` shows."""
    options = ServiceOptions(model="fake", keys=KEYS)
    data = pickle.dumps(options)
    assert pickle.loads(data) == options
    assert SECRET.encode() not in data and SECRET not in repr(options)


def test_a_keys_file_in_toml_or_json(tmp_path: Path) -> None:
    """L55, L56: a keys file maps each key (or its ``sha256:<hex>``) to a tenant, its
    weight, limits and admin flag; TOML and JSON say the same."""
    hashed = hashlib.sha256(ADMIN.encode()).hexdigest()
    toml = tmp_path / "keys.toml"
    toml.write_text(
        f"""metrics_auth = true

[[keys]]
key = "{SECRET}"
tenant = "acme"
weight = 3
max_waiting = 8
max_running_jobs = 2
requests_per_minute = 120

[[keys]]
key = "sha256:{hashed}"
tenant = "ops"
admin = true
"""
    )
    entries = [
        {
            "key": SECRET,
            "tenant": "acme",
            "weight": 3,
            "max_waiting": 8,
            "max_running_jobs": 2,
            "requests_per_minute": 120,
        },
        {"key": f"sha256:{hashed}", "tenant": "ops", "admin": True},
    ]
    as_json = tmp_path / "keys.json"
    as_json.write_text(json.dumps({"metrics_auth": True, "keys": entries}))
    for path in (toml, as_json):
        keys = load_keys_file(path)
        assert keys.metrics_auth and keys.tenants == ("acme", "ops")
        acme = keys.find(SECRET)
        assert acme is not None and acme.weight == 3.0 and not acme.admin
        assert acme.limits == TenantLimits(
            max_waiting=8, max_running_jobs=2, requests_per_minute=120
        )
        ops = keys.find(ADMIN)
        assert ops is not None and ops.admin
        assert keys.max_waiting() == {"acme": 8}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[keys]]\ntenant = 'a'\n", "needs a key and a tenant"),
        (f"[[keys]]\nkey = '{SECRET}'\ntenant = 'a'\ncolour = 1\n", "unknown fields"),
        (f"[[keys]]\nkey = '{SECRET}'\ntenant = 'a'\nweight = 0\n", "weight"),
        (f"[[keys]]\nkey = '{SECRET}'\ntenant = 'a'\nweight = 1e-20\n", "weight: must be >="),
        (f"[[keys]]\nkey = '{SECRET}'\ntenant = 'a'\nweight = 1001\n", "weight: must be <="),
        (f"[[keys]]\nkey = '{SECRET}'\ntenant = ' '\n", "tenant: must not be blank"),
        (f'[[keys]]\nkey = "{SECRET}"\ntenant = "\\n"\n', "tenant: must have no whitespace"),
        (f"[[keys]]\nkey = '{SECRET}'\ntenant = 'acme '\n", "tenant: must not be blank"),
        ("[[keys]]\nkey = 'sk-clé-1'\ntenant = 'a'\n", "an API key must be printable ASCII"),
        (f"[[keys]]\nkey = '{SECRET}'\ntenant = 'a'\nmax_waiting = 0\n", "max_waiting"),
        ("[[keys]]\nkey = 'sha256:abc'\ntenant = 'a'\n", "64 hex digits"),
        (f"keys = 3\nsecret = '{SECRET}'\n", "list of entries"),
        (f"[[keys]]\nkey = '{SECRET}'\ntenant = 'a'\nadmin = 'yes'\n", "admin"),
        (f"[[keys]\nkey = '{SECRET}'", "not valid TOML"),
    ],
)
def test_a_wrong_keys_file_is_refused_without_its_keys(
    tmp_path: Path, text: str, message: str
) -> None:
    """L55: a wrong entry is refused by its position; the message never holds a key."""
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match="the keys file") as refused:
        load_keys_file(path)
    assert message in str(refused.value)
    assert SECRET not in str(refused.value) and "sk-cl" not in str(refused.value)
    assert "\n" not in str(refused.value)  # one line


def test_keys_hold_through_the_ray_replica_ingress() -> None:
    """L55 under Ray Serve: a replica serves ``Service.app`` behind ``ReplicaIngress``,
    so the key check is the same there: 401 without a key, 200 with one (what
    ``omni_trio.serve.ray.deployment(keys=...)`` builds on every replica)."""
    service = keyed_service()
    ingress = ReplicaIngress(service.app, replica_id="r1")

    async def main() -> tuple[int, int, int]:
        transport = httpx.ASGITransport(app=ingress)
        async with (
            service.lifespan(),
            httpx.AsyncClient(transport=transport, base_url="http://t") as client,
        ):
            missing = await client.post(PATH, json=BODY)
            wrong = await client.get("/v1/models", headers=bearer(WRONG))
            right = await client.post(PATH, json=BODY, headers=bearer(SECRET))
            assert missing.headers[REPLICA_HEADER] == "r1"
            return missing.status_code, wrong.status_code, right.status_code

    assert asyncio.run(asyncio.wait_for(main(), 30)) == (401, 401, 200)


@pytest.mark.anyio
async def test_a_tenant_sees_only_its_own_video_jobs(tmp_path: Path) -> None:
    """L55: a key that is not an admin key sees its tenant's video jobs only: another
    tenant's job is 404 ``video_not_found`` on GET, content, events and DELETE (which
    leaves it be), and the list leaves it out; an admin key sees every job."""
    other = "sk-beta-1111111111"
    keys = ApiKeys(keys=(*KEYS.keys, ApiKey.of(other, tenant="beta")))
    runner = FakeRunner(frames=(4, 1), checkpoints=True)
    with anyio.fail_after(BUDGET):
        async with serving(durable_video_service(tmp_path, keys, runner)) as client:
            body = {"prompt": "a fox", "seed": 1, "num_frames": 5}
            created = await client.post("/v1/videos", json=body, headers=bearer(SECRET))
            assert created.status_code == 200, created.text
            job_id = created.json()["id"]
            path = f"/v1/videos/{job_id}"
            while (await client.get(path, headers=bearer(SECRET))).json()["status"] != "completed":
                await anyio.sleep(0.001)
            for method, url in [
                ("GET", path),
                ("GET", f"{path}/content"),
                ("GET", f"{path}/events"),
                ("DELETE", path),
            ]:
                refused = await client.request(method, url, headers=bearer(other))
                assert refused.status_code == 404, (method, url, refused.text)
                assert refused.json()["error"]["code"] == "video_not_found"
            listed = {
                key: [
                    job["id"]
                    for job in (await client.get("/v1/videos", headers=bearer(key))).json()["data"]
                ]
                for key in (SECRET, other, ADMIN)
            }
            assert listed == {SECRET: [job_id], other: [], ADMIN: [job_id]}
            assert (await client.get(f"{path}/content", headers=bearer(SECRET))).status_code == 200
            assert (await client.get(path, headers=bearer(ADMIN))).status_code == 200
            deleted = await client.delete(path, headers=bearer(ADMIN))
            assert deleted.json()["deleted"] is True
            assert (await client.get(path, headers=bearer(SECRET))).status_code == 404
