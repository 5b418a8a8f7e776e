"""``omni-trio load URL``: check the server answers, run the load, print the table, save it.

The arguments become a ``LoadConfig`` (``_loadtest``); the run's summary
(``_loadtest_math``) is written as a short table to the stream given (stdout),
and with ``--json`` every record is saved too.

The first SIGINT (Ctrl-C) or SIGTERM stops the run: nothing more is sent, the
requests still unanswered are cut, and the summary of what ended so far is printed
and saved as a whole run's is; the command then exits 130 (143 for SIGTERM), as
shells report a death by that signal. A signal that this process was started
ignoring (a background job's SIGINT) stays ignored.

``--tenants heavy=10,light=1`` splits the run between tenants by relative rate;
their keys come from ``--tenant-key NAME=KEY`` or from ``TENANT_KEYS_VARIABLE``
(``NAME=KEY,...``, so that no key is on the command line; ``--tenant-key`` wins
for a name in both). A mistake is a usage error that never holds a key.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

import anyio

from ._errors import PROG, CommandError, UsageError, exit_status_for
from ._given import Unused, refuse_unused
from ._loadtest import (
    PATH,
    LoadConfig,
    LoadResult,
    Tenant,
    check_reachable,
    endpoint_url,
    run_load,
)
from ._loadtest_math import format_summary, priority_class
from ._types import count, fraction, header, integer, positive, span

__all__ = ["TENANT_KEYS_VARIABLE", "add_load_arguments", "run_load_command"]

#: The variable ``--tenants``' keys may come from: ``NAME=KEY,NAME=KEY``.
TENANT_KEYS_VARIABLE = "OMNI_TRIO_LOAD_TENANT_KEYS"


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``load`` command's arguments to ``parser``."""
    parser.add_argument(
        "url",
        metavar="URL",
        help=f"the server, e.g. http://127.0.0.1:8000 ({PATH} is appended unless given)",
    )
    parser.add_argument(
        "--rate", type=positive, default=None, help="requests per second, mean (default 1)"
    )
    parser.add_argument(
        "--requests",
        type=count(1),
        default=None,
        metavar="N",
        help="exactly N requests over --duration, at Poisson moments (instead of --rate)",
    )
    parser.add_argument(
        "--duration", type=positive, default=30.0, metavar="S", help="seconds (default 30)"
    )
    parser.add_argument(
        "--slo-s",
        type=positive,
        default=10.0,
        metavar="S",
        help="latency objective: images within it count toward the goodput (default 10)",
    )
    parser.add_argument("--seed", type=int, default=0, help="schedule seed (default 0)")
    parser.add_argument(
        "--give-up-fraction",
        type=fraction,
        default=0.3,
        metavar="F",
        help="share of clients that give up, closing their connection (default 0.3)",
    )
    parser.add_argument(
        "--give-up-after",
        type=span,
        default=None,
        metavar="MAX|MIN:MAX",
        help="seconds after sending when they do, uniform in [MIN, MAX] (default 0:2xSLO)",
    )
    parser.add_argument(
        "--size", default="64x64", help="the body's size, WxH (default 64x64; 'auto': the server's)"
    )
    parser.add_argument(
        "--steps", type=count(1), default=None, help="num_inference_steps (default: the server's)"
    )
    parser.add_argument("--prompt", default="a lighthouse at dusk")
    parser.add_argument("--model", default=None, help="the body's model (default: none sent)")
    parser.add_argument(
        "--timeout",
        type=positive,
        default=300.0,
        metavar="S",
        help="seconds a patient client waits before it counts an error (default 300)",
    )
    parser.add_argument(
        "--header",
        type=header,
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="an extra request header (repeatable), e.g. 'Authorization: Bearer ...'",
    )
    parser.add_argument(
        "--deadline-ms",
        type=count(1),
        default=None,
        metavar="MS",
        help="every body's deadline_ms, e.g. the SLO (default: none sent)",
    )
    parser.add_argument(
        "--priority",
        type=integer,
        default=None,
        metavar="P",
        help="the body's priority, sent by --priority-share of the clients (default: none sent)",
    )
    parser.add_argument(
        "--priority-share",
        type=fraction,
        default=None,
        metavar="F",
        help="share of clients that send --priority, drawn per arrival (default 1: all)",
    )
    parser.add_argument(
        "--tenants",
        default=None,
        metavar="NAME=RATE,...",
        help="clients as tenants by relative rate (the total is --rate), e.g. heavy=10,light=1",
    )
    parser.add_argument(
        "--tenant-key",
        action="append",
        default=[],
        metavar="NAME=KEY",
        help=f"a tenant's API key, sent as a Bearer (repeatable; or {TENANT_KEYS_VARIABLE})",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="write every record and the summary (also of a run Ctrl-C stopped)",
    )


def _tenant_rates(spec: str) -> dict[str, float]:
    """``--tenants``' ``NAME=RATE,...`` as names (in order) to rates."""
    rates: dict[str, float] = {}
    for item in spec.split(","):
        name, sep, rate = (part.strip() for part in item.partition("="))
        if not sep or not name:
            raise UsageError(
                f"--tenants: expected NAME=RATE,... e.g. heavy=10,light=1, got {item!r}"
            )
        if name in rates:
            raise UsageError(f"--tenants: tenant {name!r} is given twice")
        try:
            value = positive(rate)
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"--tenants: tenant {name!r}: {exc}") from None
        rates[name] = value
    return rates


def _tenant_keys(entries: list[str], where: str, rates: Mapping[str, float]) -> dict[str, str]:
    """``NAME=KEY`` entries as names to keys; the errors name ``where``, never a key."""
    keys: dict[str, str] = {}
    for entry in entries:
        name, sep, key = entry.partition("=")
        name = name.strip()
        if not sep or not name or not key:
            raise UsageError(f"{where}: expected NAME=KEY (the key not shown)")
        if name not in rates:
            known = ", ".join(rates)
            raise UsageError(f"{where}: no tenant {name!r} in --tenants ({known})")
        if name in keys:
            raise UsageError(f"{where}: tenant {name!r} has two keys")
        keys[name] = key
    return keys


def _tenants(args: argparse.Namespace) -> tuple[Tenant, ...]:
    """``--tenants`` with their keys (``--tenant-key``, else the variable's)."""
    if args.tenants is None:
        if args.tenant_key:
            raise UsageError("--tenant-key: give --tenants too (the tenants the keys are for)")
        return ()
    rates = _tenant_rates(args.tenants)
    variable = os.environ.get(TENANT_KEYS_VARIABLE, "")
    keys = _tenant_keys([e for e in variable.split(",") if e.strip()], TENANT_KEYS_VARIABLE, rates)
    keys |= _tenant_keys(args.tenant_key, "--tenant-key", rates)
    if keys and any(name.lower() == "authorization" for name, _ in args.header):
        raise UsageError(
            "--tenant-key: give tenant keys or --header 'Authorization: ...', not both"
        )
    try:
        return tuple(Tenant(name=n, rate=r, key=keys.get(n)) for n, r in rates.items())
    except ValueError as exc:
        raise UsageError(f"--tenants: {exc}") from None


def _config(args: argparse.Namespace) -> LoadConfig:
    if args.requests is not None and args.rate is not None:
        raise UsageError("--requests: give --rate or --requests, not both")
    rate = 1.0 if args.rate is None else args.rate
    if args.requests is not None:
        rate = args.requests / args.duration
    if args.priority_share is not None and args.priority is None:
        raise UsageError("--priority-share: give --priority too (the priority that share sends)")
    if args.give_up_fraction == 0:
        reason = "applies when some clients give up (--give-up-fraction above 0)"
        refuse_unused(
            args,
            [Unused(dest="give_up_after", option="--give-up-after", reason=reason)],
            from_environment=(),
        )
    try:
        return LoadConfig(
            url=endpoint_url(args.url),
            rate=rate,
            duration_s=args.duration,
            slo_s=args.slo_s,
            seed=args.seed,
            give_up_fraction=args.give_up_fraction,
            give_up_s=args.give_up_after,
            prompt=args.prompt,
            size=None if args.size == "auto" else args.size,
            steps=args.steps,
            model=args.model,
            timeout_s=args.timeout,
            headers=tuple(args.header),
            deadline_ms=args.deadline_ms,
            priority=args.priority,
            priority_share=1.0 if args.priority_share is None else args.priority_share,
            count=args.requests,
            tenants=_tenants(args),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


@contextlib.contextmanager
def _open_json(path: Path) -> Iterator[TextIO]:
    """``path`` opened for writing now, so that a bad one fails before the run, not after.

    Not truncated: a run that fails leaves an earlier file as it was (truncate it
    before writing), and a file that did not exist before is removed again.

    Raises:
        UsageError: it cannot be opened.
    """
    try:
        try:
            fd, created = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), True
        except FileExistsError:
            fd, created = os.open(path, os.O_WRONLY), False
    except OSError as exc:
        raise UsageError(f"--json: cannot write {str(path)!r}: {exc.strerror}") from None
    written = False
    try:
        with open(fd, "w") as file:
            yield file
            written = file.tell() > 0
    finally:
        if created and not written:
            path.unlink(missing_ok=True)


def _signals() -> tuple[signal.Signals, ...]:
    """SIGINT and SIGTERM, less SIGINT where this process was started ignoring it."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    return (signal.SIGTERM,) if ignored else (signal.SIGINT, signal.SIGTERM)


async def _run(config: LoadConfig) -> tuple[LoadResult | None, signal.Signals | None]:
    """Check that the server answers, then run the load; the first signal stops either.

    Returns:
        The result (``None`` when the signal came before the run began) and the
        signal that stopped it, if one did.

    Raises:
        CommandError: the server cannot be reached.
    """
    stop = anyio.Event()
    caught: list[signal.Signals] = []
    reaching = anyio.CancelScope()
    result: LoadResult | None = None
    failure: CommandError | None = None
    with anyio.open_signal_receiver(*_signals()) as signals:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                async for signum in signals:
                    caught.append(signal.Signals(signum))
                    reaching.cancel()
                    stop.set()
                    return

            tg.start_soon(watch)
            try:
                with reaching:
                    await check_reachable(config.url)
                if not caught:
                    result = await run_load(config, stop=stop)
            except CommandError as exc:  # raised here, not as a task group's exception group
                failure = exc
            tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result, caught[0] if caught else None


def _scheduling(config: LoadConfig, summary: Mapping[str, Any]) -> str:
    """The header line's words on ``deadline_ms`` and ``priority``, if any was sent."""
    words = ""
    if config.deadline_ms is not None:
        words += f"; deadline_ms {config.deadline_ms}"
    if config.priority is not None:
        sent = summary["by_priority"].get(priority_class(config.priority), {}).get("requests", 0)
        words += f"; {sent} send priority {config.priority}"
    if config.tenants:
        by_tenant = summary["by_tenant"]
        words += "; tenants " + ", ".join(
            f"{t.name} {by_tenant.get(t.name, {}).get('requests', 0)}"
            + (" (with a key)" if t.key is not None else "")
            for t in config.tenants
        )
    return words


def run_load_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``omni-trio load``: check the server answers, run the load, print and save the result.

    Returns:
        0 once the run is done (whatever its outcomes); 130 (143) when SIGINT
        (SIGTERM) stopped it, after the summary of what ended so far.

    Raises:
        UsageError: a bad URL or option, a ``--json`` path that cannot be written.
        CommandError: the server cannot be reached, or every request was answered
            404 or 405 (the URL is not an images endpoint).
    """
    out = sys.stdout if out is None else out
    config = _config(args)
    with contextlib.ExitStack() as stack:
        saved = None if args.json is None else stack.enter_context(_open_json(args.json))
        result, stopped_by = anyio.run(_run, config, backend="trio")
        if result is None:
            assert stopped_by is not None
            sys.stderr.write(f"{PROG}: interrupted ({stopped_by.name}) before the run began\n")
            return exit_status_for(stopped_by)
        if saved is not None:
            saved.truncate(0)
            saved.write(json.dumps(result.as_json(), indent=2) + "\n")
    summary_ = result.summary()
    low, high = config.give_up_span
    window = f"{config.duration_s:g} s"
    if result.stopped_s is not None:
        window = f"the first {result.window_s:.1f} s of {window}"
    out.write(
        f"{summary_['requests']} requests at {config.rate:g}/s for {window}"
        f" (seed {config.seed}) to {config.url}; {summary_['impatient']} mean to give up"
        f" {low:g} to {high:g} s after sending" + _scheduling(config, summary_) + "\n"
    )
    if stopped_by is not None:
        out.write(
            f"stopped by {stopped_by.name}: {result.unanswered} request(s) still unanswered"
            " were cut and are not counted\n"
        )
    out.write(format_summary(summary_))
    statuses = set(summary_["refused_by_status"])
    if summary_["counts"]["refused"] == summary_["requests"] > 0 and statuses <= {"404", "405"}:
        raise CommandError(
            f"URL: every request was answered {'/'.join(sorted(statuses))}: is {config.url}"
            " an images endpoint?"
        )
    return 0 if stopped_by is None else exit_status_for(stopped_by)
