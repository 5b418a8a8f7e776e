"""``omni-trio load``: the Poisson schedule, the summary's arithmetic, the command's errors,
and runs against the real app over a real socket (impatient clients, priorities,
deadlines), and a run stopped by Ctrl-C.

The schedule and the summary are pure: exact values. The run serves the app with
Hypercorn in the test's own event loop (trio or asyncio) on a loopback socket
bound to port 0; its model is a ``GatedRunner`` whose steps wait until every
impatient client has given up, so which clients complete and which give up is
decided by the schedule alone, never by timing. The priority and deadline runs use
``FakeRunner`` and answers that do not depend on timing (a priority over the
server's bound is a 400; a deadline is refused once the test has set the measured
step time). Counts are asserted, not times. The Ctrl-C run is the command in a
subprocess against a server of the test's own that answers the first requests and
holds the rest: the signal is sent once those answers were read and more requests
were sent.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import sniffio

from omni_trio import EngineConfig
from omni_trio.cli import main
from omni_trio.cli._loadtest import PATH, LoadConfig, Tenant, endpoint_url, run_load
from omni_trio.cli._loadtest_command import TENANT_KEYS_VARIABLE
from omni_trio.cli._loadtest_math import (
    DEFAULT_CLASS,
    OUTCOMES,
    RequestRecord,
    format_summary,
    percentile,
    poisson_schedule,
    summarize,
    tenant_counts,
)
from omni_trio.serve import ServeConfig, Service
from omni_trio.testing import FakeRunner, GatedRunner, assume_step_time
from tests.support.cli import BUDGET_S, ROOT, free_port
from tests.support.core import BUDGET
from tests.support.serve import metric, poll_until

# -- the schedule --------------------------------------------------------------------


def test_the_schedule_is_the_same_for_a_seed_and_differs_for_another() -> None:
    """Same seed, same arrivals (times and give-ups); another seed, other times."""
    a = poisson_schedule(rate=10, duration_s=5, seed=7, give_up_fraction=0.3, give_up_s=(1, 2))
    b = poisson_schedule(rate=10, duration_s=5, seed=7, give_up_fraction=0.3, give_up_s=(1, 2))
    c = poisson_schedule(rate=10, duration_s=5, seed=8, give_up_fraction=0.3, give_up_s=(1, 2))
    assert a == b
    assert [x.at_s for x in a] != [x.at_s for x in c]


def test_the_arrival_times_do_not_depend_on_the_give_up_settings() -> None:
    """Three draws per arrival in a fixed order: the give-up settings change who gives up,
    never when requests are sent (so two servers, or two settings, face the same load)."""
    patient = poisson_schedule(rate=4, duration_s=10, seed=1)
    impatient = poisson_schedule(
        rate=4, duration_s=10, seed=1, give_up_fraction=1.0, give_up_s=(0.5, 3.0)
    )
    assert [x.at_s for x in patient] == [x.at_s for x in impatient]
    assert all(x.give_up_s is None for x in patient)
    assert all(x.give_up_s is not None and 0.5 <= x.give_up_s <= 3.0 for x in impatient)


def test_the_schedule_is_a_poisson_process_in_the_window() -> None:
    """Arrivals are in time order within [0, duration), indexed from 0; their count
    is within 5 standard deviations of rate x duration (sqrt of it, for Poisson),
    and the share of impatient clients near the fraction."""
    rate, duration = 50.0, 200.0
    arrivals = poisson_schedule(
        rate=rate, duration_s=duration, seed=3, give_up_fraction=0.3, give_up_s=(0, 1)
    )
    times = [x.at_s for x in arrivals]
    assert times == sorted(times) and times[0] > 0 and times[-1] < duration
    assert [x.index for x in arrivals] == list(range(len(arrivals)))
    expected = rate * duration
    assert abs(len(arrivals) - expected) < 5 * expected**0.5
    impatient = sum(x.give_up_s is not None for x in arrivals) / len(arrivals)
    assert abs(impatient - 0.3) < 0.02


def test_priorities_leave_the_arrivals_and_give_ups_as_they_were() -> None:
    """The priority classes come from a stream of their own: the same seed sends at the
    same moments with the same give-ups with or without them; the classes repeat for
    a seed, and the share holds over many arrivals (0 and 1 are none and all)."""
    common: dict[str, Any] = {
        "rate": 50.0,
        "duration_s": 100.0,
        "seed": 5,
        "give_up_fraction": 0.3,
        "give_up_s": (0.0, 1.0),
    }
    plain = poisson_schedule(**common)
    classed = poisson_schedule(**common, priority=2, priority_share=0.2)
    assert [(a.at_s, a.give_up_s) for a in plain] == [(a.at_s, a.give_up_s) for a in classed]
    assert classed == poisson_schedule(**common, priority=2, priority_share=0.2)
    assert all(a.priority is None for a in plain)
    assert {a.priority for a in classed} == {None, 2}
    share = sum(a.priority == 2 for a in classed) / len(classed)
    assert abs(share - 0.2) < 0.02
    assert all(a.priority == -1 for a in poisson_schedule(**common, priority=-1))
    assert all(a.priority is None for a in poisson_schedule(**common, priority=3, priority_share=0))


def test_a_count_gives_exactly_that_many_arrivals_in_the_window() -> None:
    """``count``: exactly that many arrivals, in time order inside [0, duration), the same
    for a seed and other for another; give-ups and priority classes drawn as without it
    (the share of each close to its fraction over many)."""
    common: dict[str, Any] = {"rate": 1.0, "duration_s": 10.0, "give_up_s": (0.0, 1.0)}
    arrivals = poisson_schedule(
        **common, seed=2, count=2000, give_up_fraction=0.3, priority=1, priority_share=0.2
    )
    times = [a.at_s for a in arrivals]
    assert len(arrivals) == 2000 and [a.index for a in arrivals] == list(range(2000))
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 10.0
    assert abs(sum(a.give_up_s is not None for a in arrivals) / 2000 - 0.3) < 0.05
    assert abs(sum(a.priority == 1 for a in arrivals) / 2000 - 0.2) < 0.05
    again = poisson_schedule(
        **common, seed=2, count=2000, give_up_fraction=0.3, priority=1, priority_share=0.2
    )
    assert again == arrivals
    other = [a.at_s for a in poisson_schedule(**common, seed=3, count=2000)]
    assert other != times
    assert poisson_schedule(**common, seed=2, count=0) == ()
    config = LoadConfig(url="http://h", rate=9.0, duration_s=2.0, slo_s=1.0, count=7)
    assert len(config.schedule()) == 7


def test_tenants_split_the_arrivals_exactly_by_rate_for_a_seed() -> None:
    """``tenants``: the same arrivals (times, give-ups, priorities), each tenant sending its
    share by rate exactly (largest remainders), who sends which a seeded shuffle: the same
    for a seed, other for another."""
    common: dict[str, Any] = {
        "rate": 11.0,
        "duration_s": 10.0,
        "give_up_fraction": 0.3,
        "give_up_s": (0.0, 1.0),
        "priority": 1,
        "priority_share": 0.5,
    }
    tenants = [("heavy", 10.0), ("light", 1.0)]
    split = poisson_schedule(**common, seed=4, count=110, tenants=tenants)
    plain = poisson_schedule(**common, seed=4, count=110)
    assert [dataclasses.replace(a, tenant=None) for a in split] == list(plain)
    assert [a.tenant for a in split].count("heavy") == 100
    assert [a.tenant for a in split].count("light") == 10
    assert split == poisson_schedule(**common, seed=4, count=110, tenants=tenants)
    other = poisson_schedule(**common, seed=5, count=110, tenants=tenants)
    assert [a.tenant for a in other] != [a.tenant for a in split]
    # A Poisson count: the split of whatever count the seed drew.
    drawn = poisson_schedule(**common, seed=4, tenants=tenants)
    sends = {name: [a.tenant for a in drawn].count(name) for name, _ in tenants}
    assert sends == tenant_counts(len(drawn), tenants)
    assert tenant_counts(7, [("a", 1.0), ("b", 1.0), ("c", 1.0)]) == {"a": 3, "b": 2, "c": 2}
    assert tenant_counts(10, [("a", 1.0), ("b", 3.0)]) == {"a": 3, "b": 7}  # 2.5, 7.5: a tie
    assert tenant_counts(0, tenants) == {"heavy": 0, "light": 0}
    config = LoadConfig(
        url="http://h",
        rate=1.0,
        duration_s=1.0,
        slo_s=1.0,
        count=4,
        tenants=(Tenant(name="a", rate=3.0, key="sk-a"), Tenant(name="b")),
    )
    assert [a.tenant for a in config.schedule()].count("a") == 3
    assert config.headers_of("a") == {"Authorization": "Bearer sk-a"}
    assert config.headers_of("b") == {} == config.headers_of(None)
    assert "sk-a" not in repr(config) and "sk-a" not in json.dumps(config.as_json())
    assert config.as_json()["tenants"] == [
        {"name": "a", "rate": 3.0, "keyed": True},
        {"name": "b", "rate": 1.0, "keyed": False},
    ]


# -- the summary -----------------------------------------------------------------------


def rec(index: int, outcome: str, latency: float, **fields: Any) -> RequestRecord:
    """A record sent at ``index`` seconds."""
    if outcome == "completed":
        fields.setdefault("images", 1)
        fields.setdefault("status", 200)
    return RequestRecord(
        index=index, sent_s=float(index), outcome=outcome, latency_s=latency, **fields
    )


def test_percentiles_interpolate_between_ranks() -> None:
    """Linear between the nearest ranks, as numpy's default; none for no values."""
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None


def test_the_summary_counts_goodput_within_the_slo_only() -> None:
    """Goodput: images of requests completed within the SLO, per second of the window;
    throughput: every image; latencies of completed requests only; every outcome
    counted, refusals per status."""
    records = [
        rec(0, "completed", 0.5),
        rec(1, "completed", 1.0, images=2),  # at the SLO: counts
        rec(2, "completed", 3.0),  # late: throughput only
        rec(3, "gave_up", 0.2, give_up_s=0.2),
        rec(4, "refused", 0.01, status=429),
        rec(5, "refused", 0.01, status=429),
        rec(6, "refused", 0.01, status=503),
        rec(7, "error", 0.0, error="ConnectError"),
    ]
    s = summarize(records, duration_s=4.0, slo_s=1.0)
    assert s["requests"] == 8
    assert s["impatient"] == 1
    assert s["counts"] == {"completed": 3, "gave_up": 1, "refused": 3, "error": 1}
    assert s["refused_by_status"] == {"429": 2, "503": 1}
    assert (s["images"], s["good_images"], s["good_requests"]) == (4, 3, 2)
    assert s["goodput_per_s"] == 3 / 4
    assert s["throughput_per_s"] == 4 / 4
    assert s["p50_latency_s"] == 1.0
    assert s["p99_latency_s"] == pytest.approx(1.0 + (3.0 - 1.0) * 0.98)
    assert (s["duration_s"], s["slo_s"]) == (4.0, 1.0)
    json.dumps(s)  # JSON values only


def test_the_summary_splits_by_priority_and_refusals_by_code() -> None:
    """``by_priority``: each class's own counts, goodput and latencies (``default`` for
    requests that sent none); ``refused_by_reason``: the status with the answer's code."""
    records = [
        rec(0, "completed", 0.5, priority=1),
        rec(1, "completed", 3.0, priority=1),  # late
        rec(2, "completed", 0.2),
        rec(3, "refused", 0.01, status=429, code="deadline_unmeetable"),
        rec(4, "refused", 0.01, status=429, code="deadline_unmeetable", priority=1, message="late"),
        rec(5, "refused", 0.01, status=503, code="request_aborted", message="shutting down"),
        rec(6, "refused", 0.01, status=502),
        rec(7, "refused", 0.01, status=429, code="deadline_unmeetable", message="later"),
    ]
    s = summarize(records, duration_s=2.0, slo_s=1.0)
    assert s["refused_by_status"] == {"429": 3, "502": 1, "503": 1}
    assert s["refused_by_reason"] == {
        "429 deadline_unmeetable": 3,
        "502": 1,
        "503 request_aborted": 1,
    }
    # The server's message of the first refusal of each reason that had one.
    assert s["refusal_messages"] == {
        "429 deadline_unmeetable": "late",
        "503 request_aborted": "shutting down",
    }
    assert set(s["by_priority"]) == {"1", DEFAULT_CLASS}
    high, default = s["by_priority"]["1"], s["by_priority"][DEFAULT_CLASS]
    assert (high["requests"], high["completed"], high["good_images"]) == (3, 2, 1)
    assert (high["goodput_per_s"], high["throughput_per_s"]) == (0.5, 1.0)
    assert (high["p50_latency_s"], high["p99_latency_s"]) == (1.75, pytest.approx(2.975))
    assert (default["requests"], default["completed"], default["good_images"]) == (5, 1, 1)
    assert default["p99_latency_s"] == 0.2
    table = format_summary(s)
    assert "  refused (429 deadline_unmeetable)      3\n    late\n  refused (502)" in table
    assert "  priority 1     0.500 images/s goodput (1 of 3 requests), p99 2.975 s\n" in table
    assert "  no priority    0.500 images/s goodput (1 of 5 requests), p99 0.200 s\n" in table
    # Without priorities, no class lines.
    assert "no priority" not in format_summary(summarize(records[2:3], duration_s=1, slo_s=1))


def test_the_summary_of_nothing_completed() -> None:
    """No completion: zero rates, no latencies, every outcome still listed."""
    s = summarize([rec(0, "gave_up", 1.0)], duration_s=2.0, slo_s=1.0)
    assert s["counts"] == dict.fromkeys(OUTCOMES, 0) | {"gave_up": 1}
    assert (s["goodput_per_s"], s["throughput_per_s"]) == (0.0, 0.0)
    assert s["p50_latency_s"] is None and s["p99_latency_s"] is None
    table = format_summary(s)
    assert "latency p50      -" in table and "gave_up" in table


def test_the_table_shows_refusals_per_status() -> None:
    s = summarize([rec(0, "refused", 0.1, status=429)], duration_s=1.0, slo_s=1.0)
    assert "refused (429)         1" in format_summary(s)


def test_the_summary_per_tenant_adds_up_to_the_totals() -> None:
    """``by_tenant``: each tenant's requests, outcomes, refusals by code, latencies and share
    of the completed requests; they add up to the run's totals, which stay as they were."""
    records = [
        rec(0, "completed", 0.5, tenant="heavy"),
        rec(1, "completed", 1.5, tenant="heavy"),
        rec(2, "refused", 0.01, status=429, code="rate_limited", tenant="heavy"),
        rec(3, "refused", 0.01, status=429, code="queue_full", tenant="light"),
        rec(4, "completed", 0.2, tenant="light"),
        rec(5, "gave_up", 0.3, give_up_s=0.3, tenant="light"),
        rec(6, "refused", 0.01, status=429, code="rate_limited", tenant="light"),
    ]
    s = summarize(records, duration_s=2.0, slo_s=1.0)
    assert {k: v for k, v in s.items() if k != "by_tenant"} == {
        k: v
        for k, v in summarize(
            [dataclasses.replace(r, tenant=None) for r in records], duration_s=2.0, slo_s=1.0
        ).items()
        if k != "by_tenant"
    }
    heavy, light = s["by_tenant"]["heavy"], s["by_tenant"]["light"]
    assert list(s["by_tenant"]) == ["heavy", "light"]
    assert (heavy["requests"], heavy["completed"], light["requests"], light["completed"]) == (
        3,
        2,
        4,
        1,
    )
    assert heavy["refused_by_reason"] == {"429 rate_limited": 1}
    assert light["refused_by_reason"] == {"429 queue_full": 1, "429 rate_limited": 1}
    assert light["counts"] == {"completed": 1, "gave_up": 1, "refused": 2, "error": 0}
    assert (heavy["share"], light["share"]) == (2 / 3, 1 / 3)
    assert (heavy["p50_latency_s"], light["p99_latency_s"]) == (1.0, 0.2)
    tenants = s["by_tenant"].values()
    assert sum(t["requests"] for t in tenants) == s["requests"]
    for outcome in OUTCOMES:
        assert sum(t["counts"][outcome] for t in tenants) == s["counts"][outcome]
    merged: dict[str, int] = {}
    for t in tenants:
        for reason, n in t["refused_by_reason"].items():
            merged[reason] = merged.get(reason, 0) + n
    assert merged == s["refused_by_reason"]
    assert sum(t["share"] for t in tenants) == pytest.approx(1.0)
    table = format_summary(s)
    assert (
        "  tenant heavy: 3 requests, 2 completed (66.7% of completed), p50 1.000 s, p99 1.490 s\n"
        "    refused (429 rate_limited)          1\n"
        "  tenant light: 4 requests, 1 completed (33.3% of completed)"
    ) in table
    assert summarize(records[:1], duration_s=1, slo_s=1)["by_tenant"]["heavy"]["share"] == 1.0
    # Nothing completed: every share 0; no tenants: no tenant lines.
    assert summarize(records[2:4], duration_s=1, slo_s=1)["by_tenant"]["light"]["share"] == 0.0
    assert "tenant" not in format_summary(
        summarize([rec(0, "completed", 0.1)], duration_s=1, slo_s=1)
    )


# -- the configuration and the command's errors ------------------------------------------


@pytest.mark.parametrize(
    ("url", "endpoint"),
    [
        ("http://127.0.0.1:8000", f"http://127.0.0.1:8000{PATH}"),
        ("http://127.0.0.1:8000/", f"http://127.0.0.1:8000{PATH}"),
        (f"https://h{PATH}", f"https://h{PATH}"),
        ("http://h/images", f"http://h/images{PATH}"),
    ],
)
def test_a_base_url_gets_the_endpoint_path(url: str, endpoint: str) -> None:
    assert endpoint_url(url) == endpoint


def test_the_body_is_small_and_reproducible() -> None:
    """Size and steps as asked, the arrival's index as its seed; the defaults leave
    the server's own steps."""
    config = LoadConfig(url="http://h", rate=1, duration_s=1, slo_s=1, size="32x32", steps=3)
    assert config.body(5) == {
        "prompt": config.prompt,
        "n": 1,
        "seed": 5,
        "size": "32x32",
        "num_inference_steps": 3,
    }
    assert "num_inference_steps" not in LoadConfig(
        url="http://h", rate=1, duration_s=1, slo_s=1
    ).body(0)
    assert LoadConfig(url="http://h", rate=1, duration_s=1, slo_s=2).give_up_span == (0.0, 4.0)
    scheduled = LoadConfig(url="http://h", rate=1, duration_s=1, slo_s=1, deadline_ms=1500)
    assert scheduled.body(2, priority=-3) == {
        "prompt": scheduled.prompt,
        "n": 1,
        "seed": 2,
        "size": "64x64",
        "deadline_ms": 1500,
        "priority": -3,
    }


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rate": 0.0}, "rate: must be a finite number > 0, got 0.0"),
        ({"slo_s": float("inf")}, "slo_s: must be a finite number > 0, got inf"),
        ({"give_up_fraction": 1.5}, "give_up_fraction: must be from 0 to 1, got 1.5"),
        ({"give_up_s": (2.0, 1.0)}, "give_up_s: must be 0 <= low <= high, got (2.0, 1.0)"),
        ({"deadline_ms": 0}, "deadline_ms: must be >= 1, got 0"),
        ({"priority_share": -0.1}, "priority_share: must be from 0 to 1, got -0.1"),
        ({"count": -1}, "count: must be >= 0, got -1"),
    ],
)
def test_a_config_out_of_range_names_the_field(fields: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"url": "http://h", "rate": 1.0, "duration_s": 1.0, "slo_s": 1.0}
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        LoadConfig(**(arguments | fields))


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["load", "ftp://h"],
            "URL: expected http://HOST[:PORT][/PATH], e.g. http://127.0.0.1:8000, got 'ftp://h'",
        ),
        (
            ["load", "http://:80"],
            "URL: expected http://HOST[:PORT][/PATH], e.g. http://127.0.0.1:8000, got 'http://:80'",
        ),
        # A rate is not seconds (it used to say "expected a number of seconds >= 0").
        (
            ["load", "http://h", "--rate", "-1"],
            "argument --rate: expected a number > 0, got '-1' (see 'omni-trio load --help')",
        ),
        (
            ["load", "http://h", "--duration", "0"],
            "argument --duration: expected a number > 0, got '0' (see 'omni-trio load --help')",
        ),
        (
            ["load", "http://h", "--give-up-fraction", "2"],
            "argument --give-up-fraction: expected a number from 0 to 1, got '2'"
            " (see 'omni-trio load --help')",
        ),
        (
            ["load", "http://h", "--give-up-after", "3:1"],
            "argument --give-up-after: expected MAX or MIN:MAX seconds, got '3:1'"
            " (see 'omni-trio load --help')",
        ),
        (
            ["load", "http://h", "--deadline-ms", "0"],
            "argument --deadline-ms: expected an integer >= 1, got '0'"
            " (see 'omni-trio load --help')",
        ),
        (
            ["load", "http://h", "--priority", "high"],
            "argument --priority: expected an integer, got 'high' (see 'omni-trio load --help')",
        ),
        (
            ["load", "http://h", "--priority-share", "0.5"],
            "--priority-share: give --priority too (the priority that share sends)",
        ),
        (
            ["load", "http://h", "--requests", "0"],
            "argument --requests: expected an integer >= 1, got '0' (see 'omni-trio load --help')",
        ),
        (
            ["load", "http://h", "--requests", "5", "--rate", "2"],
            "--requests: give --rate or --requests, not both",
        ),
        (
            ["load", "http://h", "--give-up-fraction", "0", "--give-up-after", "5"],
            "--give-up-after: applies when some clients give up (--give-up-fraction above 0)",
        ),
        (
            ["load", "http://h", "--tenants", "heavy=10,light"],
            "--tenants: expected NAME=RATE,... e.g. heavy=10,light=1, got 'light'",
        ),
        (
            ["load", "http://h", "--tenants", "heavy=0"],
            "--tenants: tenant 'heavy': expected a number > 0, got '0'",
        ),
        (
            ["load", "http://h", "--tenants", "heavy=ten"],
            "--tenants: tenant 'heavy': expected a finite number, got 'ten'",
        ),
        (
            ["load", "http://h", "--tenants", "heavy=10,light=1,heavy=2"],
            "--tenants: tenant 'heavy' is given twice",
        ),
        (
            ["load", "http://h", "--tenants", "heavy=1", "--tenant-key", "other=sk-secret"],
            "--tenant-key: no tenant 'other' in --tenants (heavy)",
        ),
        (
            ["load", "http://h", "--tenants", "heavy=1", "--tenant-key", "sk-secret"],
            "--tenant-key: expected NAME=KEY (the key not shown)",
        ),
        (
            [
                "load",
                "http://h",
                "--tenants",
                "a=1",
                "--tenant-key",
                "a=k1",
                "--tenant-key",
                "a=k2",
            ],
            "--tenant-key: tenant 'a' has two keys",
        ),
        (
            ["load", "http://h", "--tenant-key", "a=sk-secret"],
            "--tenant-key: give --tenants too (the tenants the keys are for)",
        ),
        (
            ["load", "http://h", "--tenants", "a=1", "--tenant-key", "a=sk secret"],
            "--tenants: tenant 'a': a key must be printable ASCII without spaces",
        ),
        (
            [
                *("load", "http://h", "--tenants", "a=1", "--tenant-key", "a=k"),
                *("--header", "Authorization: Bearer k0"),
            ],
            "--tenant-key: give tenant keys or --header 'Authorization: ...', not both",
        ),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], line: str
) -> None:
    """A bad URL or option: one line on stderr, nothing on stdout, exit 2."""
    with pytest.raises(SystemExit) as exited:
        status = main(args)
        raise SystemExit(status)
    out, err = capsys.readouterr()
    assert (exited.value.code, err, out) == (2, f"omni-trio: error: {line}\n", "")


def test_an_unreachable_server_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listens on the port: one line naming it, before any load; exit 1. The
    ``--json`` file opened before the check is removed again (it did not exist)."""
    port = free_port()
    saved = tmp_path / "load.json"
    assert main(["load", f"http://127.0.0.1:{port}", "--duration", "1", "--json", str(saved)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"omni-trio: error: cannot reach 127.0.0.1:{port}: Connection refused;"
        " is the server running?\n"
    )
    assert not saved.exists()


def test_a_json_path_that_cannot_be_written_fails_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json is opened first: a bad path is a usage error, and no server is contacted
    (the port has no server: its error would be another)."""
    missing = tmp_path / "no-such-folder" / "load.json"
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["load", url, "--json", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert (out, err.count("\n")) == ("", 1)
    assert err.startswith(f"omni-trio: error: --json: cannot write {str(missing)!r}: ")


# -- a run against the app -------------------------------------------------------------


@contextmanager
def serving_in_a_thread(service: Service) -> Iterator[str]:
    """Serve ``service.app`` with Uvicorn in a thread on a free loopback port, for the
    command (which runs its own event loop); yield the base URL once it listens."""
    import uvicorn

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    config = uvicorn.Config(service.app, log_level="warning", ws="none", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]})
    thread.start()
    try:
        deadline = time.monotonic() + BUDGET
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield url
    finally:
        server.should_exit = True
        thread.join(BUDGET)
        listener.close()
    assert not thread.is_alive()


def test_the_command_prints_the_table_and_writes_every_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``omni-trio load`` against the app with an instant model and no give-ups: every
    planned request completes; the table is on stdout, the JSON has every record."""
    service = Service(
        FakeRunner(), config=ServeConfig(model_name="fake", default_width=16, default_height=16)
    )
    saved = tmp_path / "load.json"
    saved.write_text("an earlier, longer file that the run replaces entirely")
    args = ["--rate", "20", "--duration", "0.3", "--seed", "2", "--give-up-fraction", "0"]
    args += ["--size", "16x16", "--steps", "2", "--slo-s", "60", "--json", str(saved)]
    planned = len(poisson_schedule(rate=20, duration_s=0.3, seed=2))
    assert planned > 0
    with serving_in_a_thread(service) as url:
        status = main(["load", url, *args])
    out, err = capsys.readouterr()
    assert (status, err) == (0, "")
    assert out.startswith(f"{planned} requests at 20/s for 0.3 s (seed 2) to {url}{PATH}; ")
    assert f"  {'completed':<16}{planned:>7}\n" in out
    data = json.loads(saved.read_text())
    assert data["summary"]["counts"] == dict.fromkeys(OUTCOMES, 0) | {"completed": planned}
    assert [r["outcome"] for r in data["records"]] == ["completed"] * planned
    assert data["config"]["url"] == f"{url}{PATH}"


@asynccontextmanager
async def serving(service: Service) -> AsyncIterator[str]:
    """Serve ``service.app`` with Hypercorn in this event loop on a free loopback port;
    yield its base URL once /health answers 200; shut it down on exit."""
    from hypercorn.config import Config

    if sniffio.current_async_library() == "trio":
        from hypercorn.trio import serve
    else:
        from hypercorn.asyncio import serve  # type: ignore[assignment]

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{listener.detach()}"]  # Hypercorn owns (and closes) it from now on
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # not stderr
    stop = anyio.Event()
    url = f"http://127.0.0.1:{port}"
    app: Any = service.app
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve(app, config, shutdown_trigger=stop.wait))
        async with httpx.AsyncClient() as client:
            while True:
                try:
                    if (await client.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await anyio.sleep(0.01)
        try:
            yield url
        finally:
            stop.set()


@pytest.mark.anyio
async def test_a_run_against_the_app_counts_every_outcome(tmp_path: Path) -> None:
    """L51: a seeded schedule against the app over a real socket: every impatient client
    gives up (the model's steps wait until they all did), and the server counts each as
    a disconnect; every other client completes with its image. The CLI's pieces
    write the JSON and the table."""
    runner = GatedRunner()
    service = Service(
        runner,
        engine_config=EngineConfig(max_batch_size=64),
        config=ServeConfig(model_name="fake", default_width=16, default_height=16),
    )
    config = LoadConfig(
        url="",  # set below, once the port is known
        rate=20.0,
        duration_s=0.5,
        slo_s=60.0,
        seed=4,
        give_up_fraction=0.5,
        # Long enough for any request to reach the app before its client leaves.
        give_up_s=(0.3, 0.4),
        size="16x16",
        steps=2,
        timeout_s=BUDGET,
    )
    arrivals = config.schedule()
    impatient = sum(a.give_up_s is not None for a in arrivals)
    assert 2 <= impatient <= len(arrivals) - 2  # the seed gives both kinds
    gave_up = 0

    def on_record(record: RequestRecord) -> None:
        nonlocal gave_up
        if record.outcome == "gave_up":
            gave_up += 1
            if gave_up == impatient:
                runner.open_gate()

    with anyio.fail_after(BUDGET):
        async with serving(service) as url:
            config = dataclasses.replace(config, url=endpoint_url(url))
            result = await run_load(config, on_record=on_record)
            async with httpx.AsyncClient() as client:
                while True:
                    text = (await client.get(f"{url}/metrics")).text
                    if (
                        metric(text, "omni_trio_requests_total", outcome="disconnected")
                        >= impatient
                    ):
                        break
                    await anyio.sleep(0.01)
    summary = result.summary()
    patient = len(arrivals) - impatient
    assert summary["counts"] == {
        "completed": patient,
        "gave_up": impatient,
        "refused": 0,
        "error": 0,
    }
    assert [r.index for r in result.records] == list(range(len(arrivals)))
    assert all((r.outcome == "gave_up") == (r.give_up_s is not None) for r in result.records)
    assert summary["good_images"] == summary["images"] == patient
    assert summary["goodput_per_s"] == patient / 0.5
    assert metric(text, "omni_trio_requests_total", outcome="completed") == patient
    assert metric(text, "omni_trio_requests_total", outcome="disconnected") == impatient
    saved = tmp_path / "load.json"
    saved.write_text(json.dumps(result.as_json()))
    assert json.loads(saved.read_text())["summary"] == json.loads(json.dumps(summary))
    assert f"  {'completed':<16}{patient:>7}\n" in format_summary(summary)


def test_the_command_sends_deadlines_and_priorities(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--deadline-ms`` and ``--priority``/``--priority-share``: the header line says
    what was sent, the table has a line per class, and each record carries the
    priority its arrival drew (the schedule's, for that seed and share); ``--requests``
    sends exactly that many."""
    service = Service(
        FakeRunner(), config=ServeConfig(model_name="fake", default_width=16, default_height=16)
    )
    saved = tmp_path / "load.json"
    args = ["--requests", "12", "--duration", "0.5", "--seed", "3", "--give-up-fraction", "0"]
    args += ["--size", "16x16", "--steps", "2", "--slo-s", "60", "--json", str(saved)]
    args += ["--deadline-ms", "60000", "--priority", "0", "--priority-share", "0.5"]
    planned = poisson_schedule(
        rate=24, duration_s=0.5, seed=3, priority=0, priority_share=0.5, count=12
    )
    assert len(planned) == 12
    prioritized = sum(a.priority == 0 for a in planned)
    assert 0 < prioritized < len(planned)  # the seed gives both classes
    with serving_in_a_thread(service) as url:
        status = main(["load", url, *args])
    out, err = capsys.readouterr()
    assert (status, err) == (0, "")
    assert out.startswith(f"12 requests at 24/s for 0.5 s (seed 3) to {url}{PATH}; ")
    assert f"; deadline_ms 60000; {prioritized} send priority 0\n" in out
    assert f"({prioritized} of {prioritized} requests)" in out
    others = len(planned) - prioritized
    assert "  no priority    " in out and f"({others} of {others} requests)" in out
    data = json.loads(saved.read_text())
    assert [r["priority"] for r in data["records"]] == [a.priority for a in planned]
    assert data["summary"]["counts"]["completed"] == len(planned)
    assert (data["config"]["deadline_ms"], data["config"]["priority_share"]) == (60000, 0.5)


@pytest.mark.anyio
async def test_a_priority_over_the_servers_bound_is_refused_for_that_class_only() -> None:
    """L63: the body's priority reaches the server: with ``max_priority`` 0, the clients
    that send priority 1 get a 400 ``invalid_value``, counted by reason and in their
    class; the others complete."""
    service = Service(
        FakeRunner(), config=ServeConfig(model_name="fake", default_width=16, default_height=16)
    )
    config = LoadConfig(
        url="",
        rate=40.0,
        duration_s=0.5,
        slo_s=60.0,
        seed=6,
        give_up_fraction=0.0,
        size="16x16",
        steps=2,
        timeout_s=BUDGET,
        priority=1,
        priority_share=0.5,
    )
    high = sum(a.priority == 1 for a in config.schedule())
    low = len(config.schedule()) - high
    assert high > 0 and low > 0
    with anyio.fail_after(BUDGET):
        async with serving(service) as url:
            result = await run_load(dataclasses.replace(config, url=endpoint_url(url)))
    summary = result.summary()
    assert summary["refused_by_reason"] == {"400 invalid_value": high}
    # The server's own words, not only its code.
    assert "priority" in summary["refusal_messages"]["400 invalid_value"]
    assert summary["by_priority"]["1"]["requests"] == high
    assert summary["by_priority"]["1"]["completed"] == 0
    assert summary["by_priority"][DEFAULT_CLASS]["completed"] == low
    assert all((r.outcome == "refused") == (r.priority == 1) for r in result.records)


@pytest.mark.anyio
async def test_every_request_carries_the_deadline() -> None:
    """L63: ``deadline_ms`` reaches the engine's admission: once the measured step time
    says no request can finish within it, every request is a 429
    ``deadline_unmeetable``, and ``/metrics`` counts each as ``deadline_refused``.

    A 32x32 request holds the worker in its first step (gated): the load's 16x16
    requests can neither join its batch nor preempt it, so each waits behind it (L62).
    """
    runner = GatedRunner()
    service = Service(
        runner, config=ServeConfig(model_name="fake", default_width=16, default_height=16)
    )
    config = LoadConfig(
        url="",
        rate=40.0,
        duration_s=0.3,
        slo_s=60.0,
        seed=1,
        give_up_fraction=0.0,
        size="16x16",
        steps=2,
        timeout_s=BUDGET,
        deadline_ms=1000,
    )
    planned = len(config.schedule())
    assert planned > 0
    with anyio.fail_after(BUDGET):
        async with serving(service) as url:
            engine = service.engine
            assert engine is not None
            async with httpx.AsyncClient() as client, anyio.create_task_group() as tg:

                async def busy() -> None:
                    answer = await client.post(
                        f"{url}{PATH}", json={"prompt": "busy", "size": "32x32"}
                    )
                    assert answer.status_code == 200

                tg.start_soon(busy)
                await runner.wait_arrived(1)
                assume_step_time(engine, 10.0)  # held in a step: nothing overwrites it
                result = await run_load(dataclasses.replace(config, url=endpoint_url(url)))
                text = (await client.get(f"{url}/metrics")).text
                runner.open_gate()
    summary = result.summary()
    assert summary["refused_by_reason"] == {"429 deadline_unmeetable": planned}
    assert metric(text, "omni_trio_requests_total", outcome="deadline_refused") == planned


# -- a run stopped by Ctrl-C -------------------------------------------------------------


class HoldingServer(ThreadingHTTPServer):
    """Answers its first ``answered`` POSTs with one image, holds the others until closed.

    ``received`` counts the POSTs; ``read`` the answers whose client then closed its
    connection (it read the answer: the load client keeps no connection alive).
    ``authorization`` holds each POST's ``Authorization`` header (``None``: none) by
    its body's ``seed`` (the arrival's index); one named in ``refusing`` is answered
    429 with that error code instead of an image, as a server's tenant limit does.
    """

    daemon_threads = True

    def __init__(self, answered: int, refusing: dict[str, str] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _HoldingHandler)
        self.answered = answered
        self.refusing = refusing or {}
        self.received = 0
        self.read = 0
        self.authorization: dict[int, str | None] = {}
        self.lock = threading.Lock()
        self.released = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _HoldingHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HoldingServer

    def do_POST(self) -> None:
        self.close_connection = True
        seed = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["seed"]
        authorization = self.headers.get("Authorization")
        with self.server.lock:
            self.server.received += 1
            self.server.authorization[seed] = authorization
            held = self.server.received > self.server.answered
        if held:
            self.server.released.wait(BUDGET_S)
            return
        status, body = 200, b'{"created": 0, "data": [{"b64_json": ""}]}'
        if authorization in self.server.refusing:
            code = self.server.refusing[authorization]
            status, body = 429, json.dumps({"error": {"code": code, "message": "slow"}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        self.rfile.read(1)  # the end of the stream: the client read the answer and closed
        with self.server.lock:
            self.server.read += 1

    def log_message(self, format: str, *args: Any) -> None:
        pass  # not on the test's stderr


@contextmanager
def holding_server(
    answered: int, refusing: dict[str, str] | None = None
) -> Iterator[HoldingServer]:
    server = HoldingServer(answered, refusing)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield server
    finally:
        server.released.set()
        server.shutdown()
        server.server_close()
        thread.join(BUDGET)


#: How long the load client may take to stop after a signal (it takes well under a second).
STOP_S = 60


def why_it_hangs(process: subprocess.Popen[str]) -> str:
    """What a process that did not stop was doing: its signal masks, every thread's stack."""
    process.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
    _, err = process.communicate(timeout=BUDGET_S)
    return f"it did not stop within {STOP_S} s\n{err}"


def ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT (``SigIgn`` of /proc/PID/status, bit 2)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    raise AssertionError(f"no SigIgn line for {pid}")


@contextmanager
def load_client(
    tmp_path: Path, server: HoldingServer, *, sigint: Any
) -> Iterator[subprocess.Popen[str]]:
    """``omni-trio load`` at 20/s for 600 s against ``server``, started with SIGINT's
    disposition ``sigint``; yielded once it read two answers and one more request waits.

    A child inherits an ignored SIGINT (a handler becomes the default at exec): a test run
    in a background job or under ``nohup`` ignores SIGINT, and so would the client, which
    keeps a signal it was started ignoring ignored. The disposition is set for the start.
    """
    # -X faulthandler: on a hang, SIGABRT makes the client print every thread's stack.
    command = [sys.executable, "-X", "faulthandler", "-m", "omni_trio", "load"]
    command += ["--give-up-fraction", "0", "--rate", "20", "--duration", "600"]
    command += ["--json", str(tmp_path / "load.json"), server.url]
    previous = signal.signal(signal.SIGINT, sigint)
    try:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:

        def two_read_one_held() -> bool:
            assert process.poll() is None, process.communicate()
            with server.lock:
                return server.read == 2 and server.received >= 3

        poll_until(two_read_one_held, timeout=BUDGET_S, what="two answers read, one held")
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=BUDGET_S)


def stopped_by(process: subprocess.Popen[str], signum: signal.Signals) -> tuple[str, str]:
    """Send ``signum``; return the client's stdout and stderr once it exits."""
    process.send_signal(signum)
    try:
        return process.communicate(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{signum.name}: " + why_it_hangs(process))


@pytest.mark.timeout(300)  # a subprocess start, then a stop; on a hang, its stacks
def test_ctrl_c_stops_the_run_and_prints_and_saves_what_ended(tmp_path: Path) -> None:
    """SIGINT during a run: no exception group, exit 130; the summary of the requests
    that ended so far is printed and written to --json, the requests still unanswered
    are cut and counted apart (it used to print a 55-line traceback, exit 1 and leave
    an empty --json file)."""
    with (
        holding_server(answered=2) as server,
        load_client(tmp_path, server, sigint=signal.default_int_handler) as process,
    ):
        out, err = stopped_by(process, signal.SIGINT)
    assert (process.returncode, err) == (130, ""), err
    data = json.loads((tmp_path / "load.json").read_text())
    assert data["summary"]["counts"] == dict.fromkeys(OUTCOMES, 0) | {"completed": 2}
    assert [r["outcome"] for r in data["records"]] == ["completed", "completed"]
    assert data["unanswered"] >= 1 and data["stopped_s"] > 0
    assert out.startswith(f"2 requests at 20/s for the first {data['stopped_s']:.1f} s of 600 s")
    assert f"stopped by SIGINT: {data['unanswered']} request(s) still unanswered were cut" in out
    assert f"  {'completed':<16}{2:>7}\n" in out


@pytest.mark.timeout(300)
def test_a_client_started_ignoring_sigint_keeps_it_ignored_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    """A client started with SIGINT ignored (a background job's, ``nohup``'s) leaves it
    ignored: SIGINT changes nothing, it sends on; SIGTERM stops it as SIGINT would have,
    exit 143 with the summary so far."""
    with (
        holding_server(answered=2) as server,
        load_client(tmp_path, server, sigint=signal.SIG_IGN) as process,
    ):
        assert ignores_sigint(process.pid)
        process.send_signal(signal.SIGINT)
        with server.lock:
            received = server.received
        poll_until(lambda: server.received >= received + 2, timeout=BUDGET_S, what="two more sent")
        assert process.poll() is None
        out, err = stopped_by(process, signal.SIGTERM)
    assert (process.returncode, err) == (143, ""), err
    assert "stopped by SIGTERM: " in out


# -- tenants ---------------------------------------------------------------------------


def test_tenants_send_their_own_keys_and_no_key_is_shown(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--tenants`` with keys from ``--tenant-key`` and the variable: the server sees each
    request's tenant's ``Authorization`` (none for a tenant without a key); the summary
    splits per tenant (the light tenant's 429s by code) and adds up to the totals; no
    key is in the table, the JSON, stderr or any log record."""
    monkeypatch.setenv(TENANT_KEYS_VARIABLE, "light=sk-light-secret")
    caplog.set_level(logging.DEBUG)
    saved = tmp_path / "load.json"
    args = ["--requests", "12", "--duration", "0.2", "--seed", "5", "--give-up-fraction", "0"]
    args += ["--tenants", "heavy=3,light=2,open=1", "--tenant-key", "heavy=sk-heavy-secret"]
    args += ["--json", str(saved)]
    refusing = {"Bearer sk-light-secret": "rate_limited"}
    with holding_server(answered=1000, refusing=refusing) as server:
        status = main(["load", server.url, *args])
        seen = dict(server.authorization)
    out, err = capsys.readouterr()
    assert (status, err) == (0, "")
    data = json.loads(saved.read_text())
    records = data["records"]
    assert [r["tenant"] for r in records].count("heavy") == 6
    assert [r["tenant"] for r in records].count("light") == 4
    headers = {"heavy": "Bearer sk-heavy-secret", "light": "Bearer sk-light-secret", "open": None}
    assert seen == {r["index"]: headers[r["tenant"]] for r in records}
    summary = data["summary"]
    assert summary["counts"] == dict.fromkeys(OUTCOMES, 0) | {"completed": 8, "refused": 4}
    assert summary["refused_by_reason"] == {"429 rate_limited": 4}
    by_tenant = summary["by_tenant"]
    assert [by_tenant[t]["requests"] for t in ("heavy", "light", "open")] == [6, 4, 2]
    assert [by_tenant[t]["completed"] for t in ("heavy", "light", "open")] == [6, 0, 2]
    assert by_tenant["light"]["refused_by_reason"] == {"429 rate_limited": 4}
    assert [by_tenant[t]["share"] for t in ("heavy", "light", "open")] == [0.75, 0.0, 0.25]
    assert sum(t["requests"] for t in by_tenant.values()) == summary["requests"] == 12
    assert data["config"]["tenants"] == [
        {"name": "heavy", "rate": 3.0, "keyed": True},
        {"name": "light", "rate": 2.0, "keyed": True},
        {"name": "open", "rate": 1.0, "keyed": False},
    ]
    assert "; tenants heavy 6 (with a key), light 4 (with a key), open 2\n" in out
    assert "  tenant light: 4 requests, 0 completed (0.0% of completed)" in out
    assert "    refused (429 rate_limited)          4\n" in out
    logged = "\n".join(f"{r.getMessage()} {r.args!r}" for r in caplog.records)
    assert "load: tenants heavy 6 (key), light 4 (key), open 2" in logged
    for text in (out, err, saved.read_text(), logged):
        assert "secret" not in text


def test_a_tenant_key_from_the_variable_is_checked_as_one_from_the_command_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variable's entries: a tenant not in ``--tenants`` or an entry without ``=`` is a
    usage error naming the variable, never showing the key."""
    for value, line in [
        ("other=sk-secret", f"{TENANT_KEYS_VARIABLE}: no tenant 'other' in --tenants (a, b)"),
        ("a=k,sk-secret", f"{TENANT_KEYS_VARIABLE}: expected NAME=KEY (the key not shown)"),
    ]:
        monkeypatch.setenv(TENANT_KEYS_VARIABLE, value)
        assert main(["load", "http://h", "--tenants", "a=1,b=1"]) == 2
        out, err = capsys.readouterr()
        assert (out, err) == ("", f"omni-trio: error: {line}\n")
