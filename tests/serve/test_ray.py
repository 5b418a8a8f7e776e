"""Ray Serve: replicas, the HTTP API through Serve's proxy, handle calls, aborts, shutdown.

Determinism rules:
- one local Ray cluster (loopback, usage stats off) serves the module's in-process
  tests with two applications of the fake model: ``cluster``, 2 replicas, Ray sending
  each 2 requests at a time and queueing 6 more; and ``solo``, 1 replica, for the tests
  that read a busy replica's metrics (Ray routes a request to the less busy replica, so
  with two, a busy one is never reached); four tests deploy one of their own:
  ``videos`` (2 replicas of a fake video model sharing one job store, L79), which kills
  a replica (SIGKILL) mid-job: Ray starts another, and the job is taken over once its
  lease (2 s) lapsed; ``groups`` (L49); ``traced`` (L99), 1 replica whose environment
  sends its spans over OTLP/HTTP to a receiver the test runs on 127.0.0.1 (read once
  they came: its spans are exported every 100 ms); and ``held`` (L47), 1 replica whose every step
  waits at a gate (a Ray actor, ``tests.support.ray``) until the test opens it, so its
  requests are held as long as the test needs, and the gate says how many are held;
  each test leaves the applications idle, and a test that starts an endless or held
  request ends it whatever happens;
- requests that must overlap take seconds (hundreds of 10 ms steps), so that they
  overlap however slowly the threads that send them start;
- "mid-way" is a step count read from the replicas' own ``/metrics`` or progress
  events; which replica answered is its ``X-Omni-Trio-Replica`` header, and a
  replica's metrics are read until every replica has answered;
- every wait is a bounded poll; pytest-timeout bounds each test;
- a Ray process is a descendant of the process that started the cluster, found
  in /proc; none may be alive afterwards.

``ReplicaIngress`` (cancellation as a disconnect) is also tested alone, without Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.util
import os
import signal
import sqlite3
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

import omni_trio as ot
from omni_trio.cli._ray import RAY_ENVIRONMENT
from omni_trio.serve._ray_ingress import REPLICA_HEADER, Message, ReplicaIngress
from omni_trio.testing import FakeRunner
from tests.support.cli import ROOT, alive, descendants
from tests.support.serve import PATH, free_port, metric, poll_until

if TYPE_CHECKING:
    from tests.support.otlp import Receiver

HAVE_RAY = importlib.util.find_spec("ray") is not None

STEP_S = 0.01
#: The video application's step and lease: a job of 300 steps runs 6 s, so a replica is
#: killed mid-way; a dead replica's job is taken over 2 s after its last renewal.
VIDEO_STEP_S = 0.02
VIDEO_LEASE_S = 2.0
#: Steps of a request that must still run when the test ends it: 1,000 s of steps,
#: so however slow the machine, it is cut off by the test, never finished.
ENDLESS = 100_000
REPLICAS = 2
#: Requests Ray sends the solo replica at a time: more than any test sends it at once.
SOLO_ONGOING = 32
#: The held replica's bounds: Ray sends it 2 requests at a time (its engine's 2 workers
#: take one each, so both reach the gate) and its proxy queues 3 more; 3 beyond those
#: are refused.
HELD_ONGOING = 2
HELD_QUEUED = 3
HELD_REFUSED = 3


# -- ReplicaIngress alone ------------------------------------------------------


def test_a_cancelled_request_reads_as_a_disconnect_and_waits_for_the_app() -> None:
    """L51 under Ray Serve: a native cancellation of the request's task reaches the app as
    ``http.disconnect``; the call returns only after the app did, then re-raises."""
    events: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        message = await receive()
        events.append(message["type"])
        await asyncio.sleep(0.05)  # the release the app waits for
        events.append("released")

    async def receive() -> Message:
        await asyncio.Event().wait()  # the proxy never says: it cancels
        raise AssertionError

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def main() -> None:
        ingress = ReplicaIngress(app, replica_id="r1")
        task = asyncio.ensure_future(ingress({"type": "http"}, receive, send))
        while not sent:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert events == ["http.disconnect", "released"]

    asyncio.run(asyncio.wait_for(main(), 10))
    assert (REPLICA_HEADER.lower().encode(), b"r1") in sent[0]["headers"]


@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
def test_a_factory_deployment_takes_no_rank_layout() -> None:
    """L49: ``parallel`` names a layout for a named model's replicas; a factory returns its
    own ``ParallelRunner``: given both, a ``ValueError`` before anything deploys."""
    with warnings.catch_warnings():
        # Ray Serve's own pydantic models use fields pydantic 2 deprecates.
        warnings.simplefilter("ignore", DeprecationWarning)
        from omni_trio.serve.ray import deployment

    with pytest.raises(ValueError, match=r"^parallel, split_by_load: for a named model"):
        deployment(FakeRunner, parallel=("ulysses", 2))


@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
@pytest.mark.parametrize("model", ["tiny-wan", "factory"])
def test_replicas_sharing_a_database_are_not_pinned_to_the_head_node(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L98 under Ray Serve: replicas that share their jobs through PostgreSQL (``jobs_db``)
    run on any node; those that share a folder run on the head node, which holds it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import omni_trio.serve.ray as ray_serve

    placed: dict[str, bool] = {}

    def application(make: Any, **options: Any) -> None:
        placed[options["name"]] = options["shares_jobs"]
        if model != "factory":  # a named model's options travel, to be built on the replica
            assert make.args[0].jobs_db == (
                "postgresql://j@db/j" if options["name"] == "db" else None
            )

    monkeypatch.setattr(ray_serve, "application", application)
    named: Any = model if model != "factory" else functools.partial(FakeRunner, frames=(4, 1))
    ray_serve.deployment(named, jobs_db="postgresql://j@db/j", jobs_dir="/jobs", name="db")
    ray_serve.deployment(named, jobs_dir="/jobs", name="folder")
    assert placed == {"db": False, "folder": True}


def _bound_options(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, dict[str, Any]]:
    """``deployment``, made to note what it binds (the service factory's arguments) instead
    of binding it: no cluster starts."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import omni_trio.serve.ray as ray_serve

    bound: dict[str, Any] = {}

    def application(make: Any, **options: Any) -> None:
        bound["make"], bound["args"] = make, make.args

    monkeypatch.setattr(ray_serve, "application", application)
    return ray_serve.deployment, bound


@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
def test_a_factorys_replica_is_traced_as_its_environment_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L99 under Ray Serve: a factory's replica reads the ``OTEL_*`` of its environment, as a
    named model's does (``build_service``): off without them, on with an exporter. Nothing
    deploys: the bound service factory is called here, as a replica calls it."""
    deployment, bound = _bound_options(monkeypatch)
    deployment(FakeRunner)
    assert not bound["make"]().tracing.enabled
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    tracing = bound["make"]().tracing
    try:
        assert tracing.enabled
    finally:
        tracing.shutdown()


@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
def test_a_model_spec_deploys_as_serves_model_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """L89 under Ray Serve: ``deployment(ModelSpec(...))`` carries the spec's fields in the
    replicas' ``ServiceOptions`` (serve's model options), and a replica builds the very
    same spec from them; ``warm_up_sizes`` travel too. Nothing deploys: the bound
    application's arguments are read."""
    from omni_trio.runners import ModelSpec
    from omni_trio.serve import _options

    deployment, bound = _bound_options(monkeypatch)
    spec = ModelSpec(
        source="tiny-org/tiny-flux",
        revision="v1",
        variant="fp16",
        dtype="bf16",
        attention_backend="native",
        compile="blocks",
        compile_cache="/compiled",
        quantization="int8-weight",
        quantize_components=("transformer",),
    )
    deployment(spec, warm_up=True, warm_up_sizes=[(64, 64), (64, 128)])
    options = bound["args"][0]
    carried = {name: getattr(options, field) for name, field in _options.SPEC_FIELDS.items()}
    assert carried == {name: getattr(spec, name) for name in _options.SPEC_FIELDS}
    # Every field of a spec is carried, or refused (the next test): a new one needs either.
    refused = {"component_dtypes", "offline"}
    assert set(_options.SPEC_FIELDS) == {f.name for f in dataclasses.fields(spec)} - refused
    assert (options.warm_up, options.warm_up_sizes) == (True, ((64, 64), (64, 128)))

    class Loaded(Exception):
        pass

    def load_model(model: ModelSpec, **_: Any) -> None:
        assert model == spec
        raise Loaded

    monkeypatch.setattr(_options, "load_model", load_model)
    with pytest.raises(Loaded):
        _options.build_service(options)  # as a replica starts


@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
def test_a_spec_field_a_served_model_does_not_take_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L89 under Ray Serve: a spec's per-component dtypes (serve has one dtype) and its
    ``offline`` (a replica reads HF_HUB_OFFLINE in its own environment) are refused by
    name before anything deploys, as are warm-up sizes without the warm-up; a factory's
    replicas get the warm-up in their HTTP configuration."""
    from omni_trio.runners import ModelSpec

    deployment, bound = _bound_options(monkeypatch)
    refused = {
        r"^component_dtypes: not served": ModelSpec(
            source="tiny-sd", component_dtypes=(("vae", "fp32"),)
        ),
        r"^offline: not served: a replica honours HF_HUB_OFFLINE": ModelSpec(
            source="tiny-sd", offline=True
        ),
    }
    for message, spec in refused.items():
        with pytest.raises(ValueError, match=message):
            deployment(spec)
    with pytest.raises(ValueError, match=r"^warm_up_sizes: only with warm_up=True"):
        deployment(ModelSpec(source="tiny-sd"), warm_up_sizes=[(64, 64)])
    with pytest.raises(TypeError, match=r"^model: a name, a folder, a hub id, a ModelSpec"):
        deployment(Path("folder"))
    assert "args" not in bound
    deployment(FakeRunner, warm_up=True, warm_up_sizes=[(32, 32)])
    http = bound["args"][2]
    assert (http.warm_up, http.warm_up_sizes) == (True, ((32, 32),))


@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
def test_the_model_spec_snippet_binds_its_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """L89: docs/snippets/ray_model_spec.py (docs/scaling.md) binds replicas whose options
    are its spec's, warmed up at its sizes; nothing deploys."""
    _, bound = _bound_options(monkeypatch)
    snippet = ROOT / "docs" / "snippets" / "ray_model_spec.py"
    namespace: dict[str, Any] = {}
    exec(compile(snippet.read_text(), str(snippet), "exec"), namespace)
    options = bound["args"][0]
    assert (options.model, options.dtype, options.compile) == ("tiny-flux", "bf16", "blocks")
    assert (options.warm_up, options.warm_up_sizes) == (True, ((64, 64),))


# -- one cluster for the rest ----------------------------------------------------


@dataclass
class Cluster:
    """One Serve application of the module's cluster: its URL, its handle, its replicas."""

    url: str
    handle: Any
    replicas: int = REPLICAS
    folder: Path | None = None

    def post(self, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.url + PATH, json=body, timeout=60)

    def per_replica(self, path: str) -> dict[str, str]:
        """GET ``path`` until every replica answered once; their bodies by replica id."""
        return {r: a.text for r, a in self.answers_per_replica(path).items()}

    def answers_per_replica(self, path: str) -> dict[str, httpx.Response]:
        """GET ``path`` until every replica answered once; their answers by replica id."""
        answers: dict[str, httpx.Response] = {}
        deadline = time.monotonic() + 30
        while len(answers) < self.replicas:
            assert time.monotonic() < deadline, f"only {set(answers)} answered {path}"
            answer = httpx.get(self.url + path, timeout=10)
            answers.setdefault(answer.headers[REPLICA_HEADER], answer)
        return answers

    def total(self, name: str, **labels: str) -> float:
        """The sum over the replicas of one sample of their /metrics."""
        return sum(metric(text, name, **labels) for text in self.per_replica("/metrics").values())

    def wait_idle(self) -> None:
        def idle() -> bool:
            texts = self.per_replica("/metrics").values()
            return all(
                metric(t, "omni_trio_requests_running") == 0
                and metric(t, "omni_trio_requests_waiting") == 0
                for t in texts
            )

        poll_until(idle, timeout=30, what="every replica to be idle")


@pytest.fixture(scope="module")
def apps() -> Iterator[tuple[Cluster, Cluster]]:
    """A local Ray cluster on loopback with the module's two applications; no process left."""
    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    with warnings.catch_warnings():
        # Ray Serve's own pydantic models use fields pydantic 2 deprecates.
        warnings.simplefilter("ignore", DeprecationWarning)
        import ray
        from ray import serve

        from omni_trio.serve.ray import deployment

    port = free_port()
    # Processes this session started before (multiprocessing's resource tracker, which the
    # parallel tests start and which lives as long as pytest) are not Ray's to end.
    before = descendants(os.getpid())
    # Eight replicas of one CPU each (Ray Serve's default): the two applications' three,
    # and the video, groups, traced and held tests' own (each deleted after its test).
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=8, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})

        def app(replicas: int, *, ongoing: int, waiting: int) -> Any:
            return deployment(
                "fake",
                step_seconds=STEP_S,
                num_replicas=replicas,
                engine_config=ot.EngineConfig(
                    max_batch_size=1, max_waiting=waiting, max_steps=ENDLESS
                ),
                # Defaults unlike GenerationRequest's (512x512, 30 steps): a handle call
                # that leaves them out must get these, as HTTP does.
                serve_config=ot.serve.ServeConfig(
                    model_name="fake", default_width=64, default_height=32, default_steps=4
                ),
                max_ongoing_requests=ongoing,
                max_queued_requests=6,
                graceful_shutdown_timeout_s=5.0,
            )

        # The pair's engines hold what Ray may send them (2 at a time, and Ray's count
        # of them lags), so their 429 never races Ray's bound. Ray sends the solo
        # replica more than a test ever sends it.
        pair = serve.run(app(REPLICAS, ongoing=2, waiting=4), name="images", route_prefix="/")
        solo = serve.run(app(1, ongoing=SOLO_ONGOING, waiting=2), name="solo", route_prefix="/solo")
        url = f"http://127.0.0.1:{port}"
        yield Cluster(url, pair), Cluster(url + "/solo", solo, replicas=1)
        serve.shutdown()
    finally:
        started = descendants(os.getpid()) - before
        ray.shutdown()
    # Ray's raylet, GCS and workers take a few seconds to exit on a busy 2-core machine; a
    # process of Ray's still alive after a minute is a leak.
    poll_until(lambda: not alive(started), timeout=60, what="every Ray process to exit")


@pytest.fixture
def cluster(apps: tuple[Cluster, Cluster]) -> Cluster:
    """The application of two replicas."""
    return apps[0]


@pytest.fixture
def solo(apps: tuple[Cluster, Cluster]) -> Cluster:
    """The application of one replica."""
    return apps[1]


@pytest.fixture
def videos(apps: tuple[Cluster, Cluster], tmp_path: Path) -> Iterator[Cluster]:
    """A third application, for its one test (its start counts in that test's budget, not
    in the first test's): two replicas of a fake video model sharing one job store (L79)."""
    from ray import serve

    from omni_trio.serve.ray import deployment

    folder = tmp_path / "jobs"
    handle = serve.run(
        deployment(
            functools.partial(
                FakeRunner, frames=(4, 1), checkpoints=True, step_seconds=VIDEO_STEP_S
            ),
            num_replicas=REPLICAS,
            engine_config=ot.EngineConfig(max_height=64, max_width=64, max_steps=ENDLESS),
            serve_config=ot.serve.ServeConfig(
                model_name="fake-video", default_width=16, default_height=16
            ),
            jobs_dir=folder,
            checkpoint_every_s=0.0,
            jobs_lease_s=VIDEO_LEASE_S,
            graceful_shutdown_timeout_s=5.0,
        ),
        name="videos",
        route_prefix="/videos",
    )
    try:
        yield Cluster(apps[0].url + "/videos", handle, folder=folder)
    finally:
        serve.delete("videos")


@pytest.fixture
def held(apps: tuple[Cluster, Cluster]) -> Iterator[tuple[Cluster, Any]]:
    """A fifth application, for its one test: 1 replica whose engine's 2 workers hold
    every step at a gate (``tests.support.ray``), and the gate. The gate is opened
    whatever happens, then the application deleted."""
    import ray
    from ray import serve

    from omni_trio.serve.ray import deployment
    from tests.support.ray import held_runners, start_gate

    gate = start_gate()
    try:
        handle = serve.run(
            deployment(
                functools.partial(held_runners, gate, HELD_ONGOING),
                # The engine takes every request Ray sends it (2 running, room for 2
                # waiting): Ray's bound is the one this application reaches.
                engine_config=ot.EngineConfig(max_batch_size=1, max_waiting=HELD_ONGOING),
                serve_config=ot.serve.ServeConfig(
                    model_name="fake", default_width=64, default_height=32, default_steps=4
                ),
                max_ongoing_requests=HELD_ONGOING,
                max_queued_requests=HELD_QUEUED,
                graceful_shutdown_timeout_s=5.0,
            ),
            name="held",
            route_prefix="/held",
        )
        try:
            yield Cluster(apps[0].url + "/held", handle, replicas=1), gate
        finally:
            ray.get(gate.open.remote(), timeout=30)
            serve.delete("held")
    finally:
        ray.kill(gate)


def rank_processes() -> set[int]:
    """The live processes below this one that multiprocessing spawned (a group's ranks)."""
    found = set()
    for pid in descendants(os.getpid()):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in command:
            found.add(pid)
    return alive(found)


@pytest.fixture
def groups(apps: tuple[Cluster, Cluster]) -> Iterator[tuple[Cluster, set[int]]]:
    """A fourth application, for its one test: two replicas of tiny Flux, each one worker
    over two Ulysses ranks (``parallel``, as ``serve --ray --replicas 2 --ulysses 2``),
    and the rank processes it started."""
    from ray import serve

    from omni_trio.serve.ray import deployment

    before = rank_processes()
    handle = serve.run(
        deployment(
            "tiny-flux",
            parallel=("ulysses", 2),
            num_replicas=REPLICAS,
            engine_config=ot.EngineConfig(max_batch_size=2),
            graceful_shutdown_timeout_s=20.0,
        ),
        name="groups",
        route_prefix="/groups",
    )
    try:
        yield Cluster(apps[0].url + "/groups", handle), rank_processes() - before
    finally:
        serve.delete("groups")


@pytest.fixture
def traced(apps: tuple[Cluster, Cluster]) -> Iterator[tuple[Cluster, Receiver]]:
    """A sixth application, for its one test: 1 replica of the fake model whose tracing is
    configured by its environment alone (``OTEL_*`` through Ray's ``runtime_env``, as a
    deployment would set it), exporting to a receiver on 127.0.0.1; and the receiver."""
    from ray import serve

    from omni_trio.serve.ray import deployment
    from tests.support.otlp import receiving

    with receiving() as receiver:
        environment = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: the spans leave soon after the answer
        }
        handle = serve.run(
            deployment(
                "fake",
                step_seconds=STEP_S,
                ray_actor_options={"runtime_env": {"env_vars": environment}},
                graceful_shutdown_timeout_s=5.0,
            ),
            name="traced",
            route_prefix="/traced",
        )
        try:
            yield Cluster(apps[0].url + "/traced", handle, replicas=1), receiver
        finally:
            serve.delete("traced")


@pytest.mark.timeout(300)
@pytest.mark.ray
@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
def test_replicas_are_parallel_groups_behind_one_proxy(
    groups: tuple[Cluster, set[int]],
) -> None:
    """L49: several groups behind one server: each replica's one worker runs requests over
    two Ulysses ranks of its own (a process holds one torch.distributed group, a replica
    is a process); both replicas answer through the proxy, each shows a group of two in
    its /metrics, and deleting the application reaps every rank."""
    app, ranks = groups
    assert len(ranks) == REPLICAS  # rank 1 of each replica's group (rank 0 is the replica)
    body = {"prompt": "a flower", "size": "64x64", "num_inference_steps": 4}
    served: dict[str, int] = {}
    deadline = time.monotonic() + 120
    while len(served) < REPLICAS:
        assert time.monotonic() < deadline, f"only {set(served)} answered"
        answer = app.post(body)
        assert answer.status_code == 200, answer.text
        served[answer.headers[REPLICA_HEADER]] = len(answer.json()["data"])
    assert set(served.values()) == {1}
    for text in app.per_replica("/metrics").values():
        assert metric(text, "omni_trio_group_ranks", group="0") == 2
        assert metric(text, "omni_trio_group_calls_total", group="0", way="tokens") > 0
    from ray import serve

    serve.delete("groups")
    poll_until(lambda: not alive(ranks), timeout=60, what="every replica's ranks to exit")


@pytest.mark.timeout(120)
@pytest.mark.ray
@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
def test_two_replicas_share_concurrent_requests(cluster: Cluster) -> None:
    """L45: concurrent requests spread over both replicas (each takes 2 at most); all succeed."""
    answers: list[httpx.Response] = []

    def one() -> None:
        # One second each: the four overlap, and one replica holds two at most.
        answers.append(cluster.post({"prompt": "a flower", "num_inference_steps": 100}))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert len({a.headers[REPLICA_HEADER] for a in answers}) == REPLICAS
    cluster.wait_idle()


@pytest.mark.timeout(120)
@pytest.mark.ray
@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
def test_the_openai_sdk_works_through_the_proxy(cluster: Cluster) -> None:
    """L45, L50 through Ray Serve: the OpenAI SDK generates and lists the model."""
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0, timeout=30)
    with client:
        result = client.images.generate(
            model="fake", prompt="a flower", n=2, size="64x64", response_format="b64_json"
        )
        assert result.data is not None and len(result.data) == 2
        assert [m.id for m in client.models.list()] == ["fake"]


@pytest.mark.timeout(120)
@pytest.mark.ray
@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
def test_a_disconnect_aborts_within_one_step(solo: Cluster) -> None:
    """L46, L51 through Ray Serve: a streaming client that leaves mid-way is counted
    ``disconnected`` by its replica, which ran at most one step for it afterwards."""
    cluster = solo
    gone = cluster.total("omni_trio_requests_total", outcome="disconnected")
    after = cluster.total("omni_trio_steps_after_abort_total")
    body = {"prompt": "a flower", "num_inference_steps": ENDLESS, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", cluster.url + PATH, json=body) as answer,
    ):
        for line in answer.iter_lines():
            if line.startswith("data:") and '"step":3' in line:
                break
    poll_until(
        lambda: cluster.total("omni_trio_requests_total", outcome="disconnected") == gone + 1,
        timeout=30,
        what="the disconnect to be counted",
    )
    cluster.wait_idle()
    assert cluster.total("omni_trio_steps_after_abort_total") - after <= 1


@pytest.mark.timeout(120)
@pytest.mark.ray
@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
def test_a_cancelled_handle_call_aborts_and_releases(solo: Cluster) -> None:
    """L46, L11 through a handle: ``DeploymentResponse.cancel()`` aborts the running request at
    its next step boundary; its replica then holds nothing and runs no more steps for it. A
    dict that leaves fields out gets the service's defaults, as HTTP (64x32, 4 steps). The
    replica's /metrics counts handle calls as it counts HTTP requests."""
    from ray.serve.exceptions import RequestCancelledError

    cluster = solo
    requests = "omni_trio_requests_total"
    completed = cluster.total(requests, outcome="completed")
    aborted = cluster.total(requests, outcome="aborted")
    output = cluster.handle.generate.remote(
        {"prompt": "a flower", "num_steps": 3, "width": 64, "height": 64}
    ).result(timeout_s=30)
    assert isinstance(output, ot.GenerationOutput) and tuple(output.images.shape) == (1, 3, 64, 64)
    defaults = cluster.handle.generate.remote({"prompt": "a flower"}).result(timeout_s=30)
    assert tuple(defaults.images.shape) == (1, 3, 32, 64)
    assert defaults.metrics.steps_done == 4
    after = cluster.total("omni_trio_steps_after_abort_total")
    steps = cluster.total("omni_trio_engine_steps_total")
    response = cluster.handle.generate.remote(
        ot.GenerationRequest(prompt="a flower", num_steps=ENDLESS, width=64, height=64)
    )
    try:
        poll_until(
            lambda: cluster.total("omni_trio_engine_steps_total") >= steps + 3,
            timeout=30,
            what="the request to run 3 steps",
        )
    finally:
        response.cancel()  # whatever happened: the endless request must not run on
    with pytest.raises(RequestCancelledError):
        response.result(timeout_s=30)
    cluster.wait_idle()
    ran = cluster.total("omni_trio_engine_steps_total")
    assert ran < steps + ENDLESS
    assert cluster.total("omni_trio_steps_after_abort_total") - after <= 1
    assert cluster.total("omni_trio_engine_steps_total") == ran  # nothing runs on
    assert cluster.total(requests, outcome="completed") == completed + 2
    assert cluster.total(requests, outcome="aborted") == aborted + 1


@pytest.mark.timeout(120)
@pytest.mark.ray
@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
def test_backpressure_answers_at_once_never_hangs(held: tuple[Cluster, Any]) -> None:
    """L47: a replica held full (``max_ongoing_requests``, 2, each at a gate) and its
    proxy's queue held full (``max_queued_requests``, 3): each further request is answered
    503 at once, while every admitted one is still held (no place frees, so none of the
    answers waited for one). Opened, the gate lets the 5 admitted run: 5 answered 200,
    3 refused, none refused by the engine, and the replica is idle.

    The replica's 2 are sent one at a time, each held at the gate before the next is
    sent: the proxy then knows the replica full, so it only asks it, never sends it one
    more that it would refuse. A request on its way to a replica is not counted as
    queued, so a burst may let more in than the bounds: of 8 sent at once, fewer than 3
    were refused in 2 of 5 runs; 16 once all got in where the bounds read 10. The 6
    after the 2 may come at once: the proxy counts a request as queued in the same step
    that checks the bound, so exactly 3 are refused."""
    import ray

    app, gate = held
    body = {"prompt": "a flower", "num_inference_steps": 4}
    admitted = HELD_ONGOING + HELD_QUEUED
    answers: dict[int, httpx.Response] = {}
    lock = threading.Lock()
    threads: list[threading.Thread] = []

    def send(index: int) -> None:
        def post() -> None:
            answer = app.post(body)
            with lock:
                answers[index] = answer

        thread = threading.Thread(target=post)
        thread.start()
        threads.append(thread)

    try:
        for index in range(HELD_ONGOING):
            send(index)
            # Held in the replica: its worker's first step waits at the gate.
            ray.get(gate.wait_arrived.remote(index + 1), timeout=30)
        for index in range(HELD_ONGOING, admitted + HELD_REFUSED):
            send(index)
        poll_until(lambda: len(answers) >= HELD_REFUSED, timeout=30, what="the refusals")
        with lock:
            refused = dict(answers)  # the admitted are held: no other answer can come now
        assert len(refused) == HELD_REFUSED, {i: a.status_code for i, a in refused.items()}
        assert {a.status_code for a in refused.values()} == {503}, [
            a.text for a in refused.values()
        ]
        assert ray.get(gate.arrived.remote(), timeout=30) == HELD_ONGOING
    finally:
        ray.get(gate.open.remote(), timeout=30)  # whatever happened: nothing stays held
        for thread in threads:
            thread.join(60)
    codes = sorted(a.status_code for a in answers.values())
    assert codes == [200] * admitted + [503] * HELD_REFUSED, [a.text for a in answers.values()]
    app.wait_idle()
    assert app.total("omni_trio_requests_total", outcome="completed") == admitted
    assert app.total("omni_trio_requests_total", outcome="queue_full") == 0


@pytest.mark.timeout(300)  # its application's start (two replicas), then the job
@pytest.mark.ray
@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
def test_any_replica_serves_any_job_and_a_dead_replicas_job_is_resumed(videos: Cluster) -> None:
    """L79: two replicas share one job store. Every replica reads a job one of them runs;
    its replica is killed (SIGKILL) mid-way; the job is taken over and resumed from its
    last checkpoint (the live replicas run fewer steps than the job has), completes, and
    every replica serves the same MP4; deleted through one, it is 404 on every replica."""
    folder = videos.folder
    assert folder is not None
    steps = 300
    answer = httpx.post(
        videos.url + "/v1/videos",
        json={"prompt": "a fox", "seed": 1, "num_frames": 5, "num_inference_steps": steps},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    job_id = answer.json()["id"]

    def row() -> tuple[str | None, int | None]:
        with sqlite3.connect(folder / "jobs.sqlite3") as db:
            found = db.execute(
                "SELECT owner, checkpoint_step FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
        assert found is not None
        return found[0], found[1]

    poll_until(lambda: (row()[1] or 0) >= 2, timeout=30, what="a checkpoint of step 2")
    seen = videos.answers_per_replica(f"/v1/videos/{job_id}")
    assert {a.status_code for a in seen.values()} == {200}
    assert {a.json()["id"] for a in seen.values()} == {job_id}
    owner, _ = row()
    assert owner is not None
    os.kill(int(owner.split(":")[1]), signal.SIGKILL)

    def completed() -> bool:
        try:
            answer = httpx.get(f"{videos.url}/v1/videos/{job_id}", timeout=10)
        except httpx.HTTPError:
            return False  # the proxy may hold a call to the dead replica until Ray sees it
        return answer.status_code == 200 and answer.json()["status"] == "completed"

    poll_until(completed, timeout=120, what="the job to be resumed and completed")
    assert row()[0] != owner
    ran = videos.total("omni_trio_engine_steps_total")  # the live replicas: not the dead one
    assert 0 < ran < steps
    mp4s = videos.answers_per_replica(f"/v1/videos/{job_id}/content")
    assert {a.status_code for a in mp4s.values()} == {200}
    assert len({a.content for a in mp4s.values()}) == 1
    assert httpx.delete(f"{videos.url}/v1/videos/{job_id}", timeout=10).status_code == 200
    gone = videos.answers_per_replica(f"/v1/videos/{job_id}")
    assert {a.status_code for a in gone.values()} == {404}


@pytest.mark.timeout(120)  # its application's start (one replica), then one request
@pytest.mark.ray
@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
def test_a_replicas_spans_join_the_clients_trace_through_the_proxy(
    traced: tuple[Cluster, Receiver],
) -> None:
    """L99 under Ray Serve: Ray's proxy hands the replica the request's headers, so a
    replica configured by ``OTEL_*`` alone continues the client's ``traceparent``: its
    route's SERVER span is the child of the client's span, and the request's
    ``diffusion_request`` span, in the same trace, the child of the route's."""
    app, receiver = traced
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    answer = httpx.post(
        app.url + PATH,
        json={"prompt": "a fox", "size": "64x32", "num_inference_steps": 2},
        headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text

    def received() -> bool:
        return bool(receiver.named("diffusion_request")) and any(
            span.name.endswith(PATH) for span in receiver.spans
        )

    poll_until(received, timeout=30, what="the replica's spans at the receiver")
    [request] = receiver.named("diffusion_request")
    [route] = [span for span in receiver.spans if span.name.endswith(PATH)]
    assert route.name.startswith("POST ")
    assert (route.trace_id, route.parent) == (trace_id, client_span)
    assert (request.trace_id, request.parent) == (trace_id, route.span_id)
