"""``cluster``: two servers on one PostgreSQL and one object store vs one server on SQLite.

Every server is a process of ``python -m omni_trio serve`` on 127.0.0.1, started from
this checkout: nodes A and B serve tiny Wan (random weights, one torch thread, a
checkpoint after every step) and share nothing but a PostgreSQL database (``--jobs-db``,
``--jobs-lease 2``; the server is started as the tests start it, tests/support/postgres.py)
and one S3 bucket (``--output-store s3://...`` on moto's S3 server, a process of its own,
tests/support/s3.py) with one signing key; node S serves tiny Wan on SQLite
(``--jobs-dir``, not shared); node F serves the fake model (``--step-seconds 0``) with
the same bucket, for the images.

- create to first step: a job of 8 steps (64x64, 9 frames) posted to A (PostgreSQL) or
  S (SQLite), one at a time, alternating; the time from sending the POST to the first
  poll (every 5 ms, on the same server) that reads its progress above 0;
- a step: one uninterrupted job of 100 steps on A, the median time between two of its
  progress changes;
- URL vs base64: a 1024x1024 PNG of the fake model (1 step), asked with
  ``response_format`` ``url`` (the POST, then a plain GET of the URL: the server reads the
  object from the bucket) or ``b64_json`` (the POST, its JSON decoded and the base64 too),
  alternating on one keep-alive connection;
- the fault matrix: N rounds (20; ``--quick`` none); each posts a job of 100 steps to a
  server picked at random (A or B), SIGKILLs it at a moment drawn uniformly from the
  job's uninterrupted run (and 10 % past it), reads the job's row from the database
  right after the kill (the dead server writes nothing more), restarts the server and
  follows the job on the other: when it was taken over (``resumes`` grew), when its
  progress first went past the row's at the kill (its first resumed step that the dead
  server had not done: an upper bound of the first resumed step), its steps redone
  (``steps_lost``), its end, and its MP4 fetched through a URL. The takeover is timed
  from the lease's expiry as the row held it at the kill (wall clock) and from the kill.
  The next round starts once the restarted server answers.

``--quick`` starts no PostgreSQL and no tiny Wan (each takes 10-30 s to start on a busy
2-core machine): it measures the URL vs base64 figures alone, in a few seconds. Without
PostgreSQL's binaries the full run says so and measures the rest.
"""

from __future__ import annotations

import base64
import itertools
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .common import Options, fmt, md_table, p99
from .plot import figure

__all__ = ["plot_cluster", "run_cluster", "table_cluster"]

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # tests.support: the servers, as the tests start them
    sys.path.insert(0, str(ROOT))
# tests.support is imported where a run needs it, never at import: the docs' renderer
# (tables and plots, with the docs extra alone) has no pytest.

LEASE_S = 2.0
JOB = {"prompt": "a fox", "size": "64x64", "num_frames": 9}
STEPS = 100  # progress is then the step: every step moves it
#: SIGKILLs of the fault matrix.
KILLS = 20
FIRST_STEP_STEPS = 8
IMAGE = {"prompt": "a flower", "size": "1024x1024", "num_inference_steps": 1}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: Seconds a tiny Wan server may take to start beside three others on 2 busy cores.
START_S = 240.0
#: Seconds a job may take to end after a kill (a takeover, its steps, its MP4).
END_S = 120.0


@dataclass(kw_only=True)
class Node:
    """One ``omni-trio serve`` process: started, killed, started again on a new port."""

    name: str
    args: list[str]
    env: dict[str, str]
    logs: Path
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> None:
        from tests.support.cli import free_port

        self.port, self.starts = free_port(), self.starts + 1
        argv = [sys.executable, "-m", "omni_trio", "serve", "--port", str(self.port)]
        argv += ["--no-access-log", "--log-level", "warning", *self.args]
        with (self.logs / f"{self.name}-{self.starts}.log").open("wb") as log:
            self.process = subprocess.Popen(
                argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_up(self, timeout: float = START_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"node {self.name} exited: see {self.logs}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {self.name} did not start in {timeout:g} s")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass(kw_only=True)
class Cluster:
    """The nodes, the database and the bucket of one run."""

    dsn: str | None
    nodes: dict[str, Node] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]


@contextmanager
def _cluster(quick: bool, *, postgres: bool) -> Iterator[Cluster]:
    """Start the object store, the database (``postgres``) and the nodes; stop them all."""
    from tests.support.cli import free_port
    from tests.support.cluster import node_args
    from tests.support.postgres import start_server
    from tests.support.s3 import aws_environment, new_bucket, s3_process

    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cluster-")))
        endpoint = stack.enter_context(s3_process(free_port()))
        bucket = new_bucket(endpoint)
        secret = folder / "url.key"
        secret.write_bytes(os.urandom(32))
        env = aws_environment(endpoint)
        store = f"s3://{bucket}/omni"
        dsn = None
        if postgres:
            server = start_server()
            stack.callback(server.stop)
            dsn = server.dsn(server.database())
        outputs = ["--output-store", store, "--output-secret-file", str(secret)]
        plan = {"F": ["--model", "fake", "--step-seconds", "0", *outputs]}
        if not quick:
            sqlite = ["--model", "tiny-wan", "--torch-threads", "1", "--checkpoint-every", "0"]
            plan["S"] = [*sqlite, "--jobs-dir", str(folder / "jobs")]
            if dsn is not None:
                shared = node_args(dsn=dsn, lease_s=LEASE_S, store=store, secret_file=secret)
                plan["A"] = plan["B"] = shared
        cluster = Cluster(dsn=dsn)
        for name, args in plan.items():
            node = Node(name=name, args=args, env=env, logs=folder)
            cluster.nodes[name] = node
            stack.callback(node.stop)
            node.start()
        for node in cluster.nodes.values():
            node.wait_up()
        yield cluster


def _job(client: httpx.Client, node: Node, job_id: str) -> dict[str, Any]:
    found: dict[str, Any] = client.get(f"{node.url}/v1/videos/{job_id}", timeout=30).json()
    return found


def _post_job(client: httpx.Client, node: Node, steps: int, seed: int) -> str:
    body = {**JOB, "num_inference_steps": steps, "seed": seed}
    answer = client.post(f"{node.url}/v1/videos", json=body, timeout=60)
    answer.raise_for_status()
    job_id: str = answer.json()["id"]
    return job_id


def _until_ended(client: httpx.Client, node: Node, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + END_S
    while (job := _job(client, node, job_id))["status"] not in ("completed", "failed"):
        if time.monotonic() > deadline:
            return job
        time.sleep(0.01)
    return job


def _first_step_ms(client: httpx.Client, node: Node, seed: int) -> float:
    """From sending a job's POST to the first poll that reads its progress above 0."""
    started = time.perf_counter()
    job_id = _post_job(client, node, FIRST_STEP_STEPS, seed)
    while _job(client, node, job_id)["progress"] == 0:
        time.sleep(0.005)
    stepped = time.perf_counter()
    _until_ended(client, node, job_id)
    return (stepped - started) * 1e3


def _step_s(client: httpx.Client, node: Node) -> dict[str, float]:
    """One uninterrupted job of ``STEPS`` on ``node``: its median step, its run."""
    started = time.perf_counter()
    job_id = _post_job(client, node, STEPS, 0)
    changes, progress = [], 0
    while (job := _job(client, node, job_id))["status"] not in ("completed", "failed"):
        if job["progress"] != progress:
            changes.append(time.perf_counter())
            progress = job["progress"]
        time.sleep(0.002)
    gaps = [b - a for a, b in itertools.pairwise(changes)]
    return {"step_s": statistics.median(gaps), "job_s": time.perf_counter() - started}


def _images(client: httpx.Client, node: Node, rounds: int) -> dict[str, Any]:
    """URL vs base64 for a 1024x1024 PNG, alternating; milliseconds."""
    times: dict[str, list[float]] = {"url_post": [], "url_fetch": [], "url": [], "b64": []}
    size = 0
    url = f"{node.url}/v1/images/generations"
    for index in range(rounds + 1):  # the first round warms both paths
        started = time.perf_counter()
        answer = client.post(url, json={**IMAGE, "seed": index, "response_format": "b64_json"})
        png = base64.b64decode(answer.json()["data"][0]["b64_json"])
        b64 = time.perf_counter() - started
        assert png.startswith(PNG_MAGIC)
        started = time.perf_counter()
        answer = client.post(url, json={**IMAGE, "seed": index, "response_format": "url"})
        posted = time.perf_counter()
        fetched = client.get(answer.json()["data"][0]["url"])
        done = time.perf_counter()
        assert fetched.status_code == 200 and fetched.content.startswith(PNG_MAGIC)
        size = len(fetched.content)
        if index:
            times["b64"].append(b64 * 1e3)
            times["url_post"].append((posted - started) * 1e3)
            times["url_fetch"].append((done - posted) * 1e3)
            times["url"].append((done - started) * 1e3)
    return {"png_bytes": size, "rounds": rounds, **times}


def _kill_round(
    client: httpx.Client, cluster: Cluster, rng: random.Random, job_s: float, index: int
) -> dict[str, Any]:
    """One round of the fault matrix: a job on a random server, SIGKILLed at a random moment."""
    from tests.support.cluster import is_mp4, job_row, owner_pid

    assert cluster.dsn is not None
    name = rng.choice(["A", "B"])
    victim, other = cluster[name], cluster["B" if name == "A" else "A"]
    job_id = _post_job(client, victim, STEPS, 100 + index)
    created = time.monotonic()
    moment = rng.uniform(0.0, 1.1 * job_s)
    time.sleep(max(0.0, created + moment - time.monotonic()))
    pid = victim.pid
    victim.kill()
    killed, killed_wall = time.monotonic(), time.time()
    row = job_row(cluster.dsn, job_id)
    assert row is not None
    victim.start()  # at once: its start overlaps the takeover
    record: dict[str, Any] = {
        "round": index,
        "server": name,
        "moment_s": round(moment, 3),
        "status_at_kill": row["status"],
        "progress_at_kill": row["progress"],
        "step_at_kill": row["step"],
        "checkpoint_at_kill": row["checkpoint_step"],
        "owned_by_victim": owner_pid(row["owner"]) == pid,
    }
    taken = stepped = stepped_wall = None
    deadline = killed + END_S
    while (job := _job(client, other, job_id))["status"] not in ("completed", "failed"):
        now, now_wall = time.monotonic(), time.time()
        if taken is None and job["omni_trio"]["resumes"] > row["resumes"]:
            taken = now
        if taken is not None and stepped is None and job["progress"] > row["progress"]:
            stepped, stepped_wall = now, now_wall
        if now > deadline:
            break
        time.sleep(0.01)
    ended = time.monotonic()
    record["outcome"] = job["status"] if job["status"] in ("completed", "failed") else "lost"
    if row["status"] == "completed":
        record["outcome"] = "completed before the kill"
    record["resumes"] = job["omni_trio"]["resumes"]
    record["resumed_from_step"] = job["omni_trio"]["resumed_from_step"]
    record["steps_redone"] = job["omni_trio"]["steps_lost"]
    record["kill_to_takeover_s"] = None if taken is None else round(taken - killed, 3)
    record["kill_to_first_step_s"] = None if stepped is None else round(stepped - killed, 3)
    record["lease_expiry_to_first_step_s"] = (
        None
        if stepped_wall is None or row["lease"] is None
        else round(stepped_wall - row["lease"], 3)
    )
    record["lease_left_at_kill_s"] = (
        None if row["lease"] is None else round(row["lease"] - killed_wall, 3)
    )
    record["kill_to_end_s"] = round(ended - killed, 3)
    if job["status"] == "completed":
        answer = client.get(f"{other.url}/v1/videos/{job_id}/content?response_format=url")
        fetched = client.get(answer.json()["url"], timeout=30)
        record["mp4_by_url"] = fetched.status_code == 200 and is_mp4(fetched.content)
    victim.wait_up()
    return record


def _takeovers(kills: list[dict[str, Any]], step_s: float) -> dict[str, Any]:
    """The figures of the kills that landed while their job ran (taken over)."""
    taken = [k for k in kills if k["lease_expiry_to_first_step_s"] is not None]
    expiry = [k["lease_expiry_to_first_step_s"] for k in taken]
    from_kill = [k["kill_to_first_step_s"] for k in taken]
    live = [k for k in kills if k["status_at_kill"] != "completed"]
    return {
        "taken_over": len(taken),
        "live_at_kill": len(live),
        "lease_expiry_to_first_step_s_p50": statistics.median(expiry) if expiry else 0.0,
        "lease_expiry_to_first_step_s_max": max(expiry, default=0.0),
        "kill_to_first_step_s_p50": statistics.median(from_kill) if from_kill else 0.0,
        "kill_to_first_step_s_max": max(from_kill, default=0.0),
        "steps_redone_max": max((k["steps_redone"] for k in live), default=0),
        "takeover_bound_s": LEASE_S + step_s,
        "lost": sum(k["outcome"] not in ("completed", "completed before the kill") for k in kills),
        "not_by_url": sum(k.get("mp4_by_url") is not True for k in kills),
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    return {"p50": statistics.median(values), "p99": p99(values), "n": float(len(values))}


def run_cluster(options: Options) -> dict[str, Any]:
    """Start the nodes; measure; ``quick``: the images alone."""
    from tests.support.postgres import bin_folder

    postgres = bin_folder() is not None
    if not postgres:
        print(
            "cluster: PostgreSQL's binaries (initdb, pg_ctl) are not installed: the two"
            " shared servers are not measured (apt-get install postgresql)",
            file=sys.stderr,
        )
    kills = 0 if options.quick else KILLS
    result: dict[str, Any] = {"config": {"lease_s": LEASE_S, "steps": STEPS, "kills": kills}}
    rng = random.Random(45)
    with (
        _cluster(options.quick, postgres=postgres and not options.quick) as cluster,
        httpx.Client(timeout=60) as client,
    ):
        images = _images(client, cluster["F"], 5 if options.quick else 40)
        result["images"] = images
        summary: dict[str, Any] = {"png_bytes": images["png_bytes"]}
        for key in ("url_fetch", "url", "b64"):
            spread = _percentiles(images[key])
            summary[f"{key}_p50_ms"], summary[f"{key}_p99_ms"] = spread["p50"], spread["p99"]
        if options.quick:
            result["skipped"] = "--quick starts no PostgreSQL and no tiny Wan"
            return {**result, "summary": {**summary, "skipped_in_quick": 1}}
        first: dict[str, list[float]] = {"S": [], "A": []}
        setups = [n for n in ("S", "A") if n in cluster.nodes]
        for index in range(12):
            for name in setups:
                first[name].append(_first_step_ms(client, cluster[name], index))
        result["first_step_ms"] = {n: v for n, v in first.items() if v}
        summary["sqlite_first_step_p50_ms"] = statistics.median(first["S"])
        summary["sqlite_first_step_p99_ms"] = p99(first["S"])
        if not postgres:
            result["skipped"] = "PostgreSQL's binaries are not installed"
            return {**result, "summary": {**summary, "postgres_measured": 0}}
        summary["postgres_first_step_p50_ms"] = statistics.median(first["A"])
        summary["postgres_first_step_p99_ms"] = p99(first["A"])
        steps = _step_s(client, cluster["A"])
        result["uninterrupted"] = steps
        result["kills"] = [
            _kill_round(client, cluster, rng, steps["job_s"], index) for index in range(kills)
        ]
    takeovers = _takeovers(result["kills"], steps["step_s"])
    result["takeovers"] = takeovers
    summary.update(
        postgres_measured=1,
        step_ms=steps["step_s"] * 1e3,
        lease_s=LEASE_S,
        kills=kills,
        **takeovers,
    )
    return {**result, "summary": summary}


def table_cluster(result: dict[str, Any]) -> str:
    """The setups, the images, then the fault matrix."""
    s = result["summary"]
    parts = []
    if "skipped" in result:
        parts.append(f"Not measured: {result['skipped']} (run without --quick).\n")
    rows = [
        [
            f"1024x1024 PNG ({fmt(s['png_bytes'] / 1e3, 0)} kB, fake model), base64 in the body",
            fmt(s["b64_p50_ms"]),
            fmt(s["b64_p99_ms"]),
        ],
        ["the same as a URL: POST + GET", fmt(s["url_p50_ms"]), fmt(s["url_p99_ms"])],
        [
            "the URL's GET alone (from the bucket)",
            fmt(s["url_fetch_p50_ms"]),
            fmt(s["url_fetch_p99_ms"]),
        ],
    ]
    if "sqlite_first_step_p50_ms" in s:
        rows.append(
            [
                "job create to first step, one server on SQLite",
                fmt(s["sqlite_first_step_p50_ms"]),
                fmt(s["sqlite_first_step_p99_ms"]),
            ]
        )
    if "postgres_first_step_p50_ms" in s:
        rows.append(
            [
                "job create to first step, two servers on PostgreSQL + S3",
                fmt(s["postgres_first_step_p50_ms"]),
                fmt(s["postgres_first_step_p99_ms"]),
            ]
        )
    parts.append(md_table(["what (ms)", "p50", "p99"], rows))
    if s.get("postgres_measured"):
        parts.append(_takeover_table(s))
        parts.append(_matrix(result["kills"]))
    return "\n".join(parts)


def _takeover_table(s: dict[str, Any]) -> str:
    rows = [
        ["a step (tiny Wan 64x64, 9 frames)", f"{fmt(s['step_ms'])} ms"],
        [f"kills (lease {s['lease_s']:g} s)", f"{s['kills']} ({s['live_at_kill']} mid-job)"],
        [
            "lease expiry to the first resumed step, p50 / max",
            f"{fmt(s['lease_expiry_to_first_step_s_p50'])} / "
            f"{fmt(s['lease_expiry_to_first_step_s_max'])} s",
        ],
        [
            "kill to the first resumed step, p50 / max",
            f"{fmt(s['kill_to_first_step_s_p50'])} / {fmt(s['kill_to_first_step_s_max'])} s",
        ],
        ["steps redone, max (checkpoint every step)", f"{s['steps_redone_max']}"],
        ["accepted jobs lost", f"{s['lost']}"],
        ["jobs whose MP4 a URL did not serve", f"{s['not_by_url']}"],
    ]
    return md_table(["takeover", "figure"], rows)


def _matrix(kills: list[dict[str, Any]]) -> str:
    rows = []
    for k in kills:
        checkpoint = k["checkpoint_at_kill"]
        at = f"{k['status_at_kill']}, step {k['step_at_kill']}" + (
            "" if checkpoint is None else f", checkpoint {checkpoint}"
        )
        outcome = k["outcome"]
        if k["resumes"]:
            outcome += f", resumed from step {k['resumed_from_step']}"
        if k.get("mp4_by_url"):
            outcome += "; MP4 by URL"
        rows.append(
            [
                str(k["round"] + 1),
                k["server"],
                f"{k['moment_s']:.2f} s",
                at,
                outcome,
                fmt(k["kill_to_first_step_s"]),
                str(k["steps_redone"]),
            ]
        )
    headers = [
        "#",
        "killed",
        "after its POST",
        "the job at the kill (of 100 steps)",
        "outcome",
        "kill to resumed step (s)",
        "redone",
    ]
    return md_table(headers, rows)


def plot_cluster(result: dict[str, Any], path: Path) -> None:
    """Latencies of the images; the takeover of each kill against its progress."""
    images = result["images"]
    with figure(path, columns=2, title="cluster: outputs as URLs, takeovers") as (left, right):
        left.boxplot([images["b64"], images["url"], images["url_fetch"]])
        left.set_xticks([1, 2, 3], ["base64", "URL: POST+GET", "URL: GET"])
        left.set_ylabel("ms (1024x1024 PNG)")
        left.grid(axis="y", alpha=0.3)
        kills = [k for k in result.get("kills", []) if k["kill_to_first_step_s"] is not None]
        if not kills:
            right.text(0.5, 0.5, "no takeover measured", ha="center")
            return
        progress = [k["progress_at_kill"] for k in kills]
        right.scatter(progress, [k["kill_to_first_step_s"] for k in kills], label="from the kill")
        right.scatter(
            progress,
            [k["lease_expiry_to_first_step_s"] for k in kills],
            label="from the lease's expiry",
        )
        right.axhline(
            result["summary"]["takeover_bound_s"], color="#d62728", label="lease + a step"
        )
        right.set_xlabel("job progress at the kill (%)")
        right.set_ylabel("s to the first resumed step")
        right.legend(fontsize=8)
        right.grid(alpha=0.3)
