"""An engine's adapters across its runners (L85, L87): admission's check, loads, listing.

Every runner of an engine loads its own copy of an adapter (capabilities agree, so
either every runner takes adapters or none does). ``RunnerAdapters`` is the engine's
view of them: the names a request may use are those every live runner has (a dead
worker's runner counts no more, L43); a load is all or nothing; an unload is refused
while a request holds the adapter anywhere. Loads and unloads run in anyio's worker
threads: a runner's load takes its model lock and so waits for the step under way.
One load or unload of a name at a time: another of the same name meanwhile is
refused (``in-use``), so an unload never meets a load half done across the runners.

A runner whose load raises a ``BaseException`` that is not an ``Exception`` (a
parallel group that broke) is a worker that died (L23): ``lost`` is told, which
ends the worker as if its own thread had raised it, and the load goes on with the
other runners, all or nothing among them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import anyio
import anyio.to_thread

from ._adapters import AdapterError, AdapterInfo, unknown_adapters
from ._errors import InvalidRequestError
from ._request import GenerationRequest
from ._runner import AdapterRunner, Runner, RunnerCapabilities

__all__ = ["RunnerAdapters"]


class RunnerAdapters:
    """The adapters of an engine's runners.

    Args:
        runners: the runners, in the order of the engine's workers.
        capabilities: their shared capabilities.
        alive: the indices of the workers alive now (all when ``None``).
        lost: told ``(index, exc)`` when runner ``index``'s load raised ``exc``, a
            ``BaseException`` that is not an ``Exception``; it ends that worker and
            returns the error the load raises (``EngineDeadError`` when no worker is
            left), or ``None`` to go on with the others. When ``None``, such an
            exception propagates.

    Raises:
        TypeError: the capabilities declare ``max_adapters`` and a runner has no
            ``load_adapter``.
    """

    def __init__(
        self,
        runners: Sequence[Runner[Any]],
        capabilities: RunnerCapabilities,
        *,
        alive: Callable[[], Collection[int]] | None = None,
        lost: Callable[[int, BaseException], Exception | None] | None = None,
    ) -> None:
        self._runners: list[AdapterRunner[Any]] = []
        self._alive = alive
        self._lost = lost
        # The names with a load or an unload in flight (the event loop's thread only).
        self._busy: set[str] = set()
        if capabilities.max_adapters:
            for runner in runners:
                if not callable(getattr(runner, "load_adapter", None)):
                    raise TypeError(
                        f"{type(runner).__name__} declares max_adapters but has no load_adapter"
                    )
                self._runners.append(cast("AdapterRunner[Any]", runner))

    def check_request(self, request: GenerationRequest) -> None:
        """L85: every adapter a request names is loaded in every runner (or evicted, L87).

        Raises:
            InvalidRequestError: a name no runner has, naming ``adapters``.
        """
        if not request.adapters:
            return
        names = [name for name, _ in request.adapter_pairs]
        live = [runner for _, runner in self._live()]
        missing = unknown_adapters(names, (r.adapter_names() for r in live))
        if missing:
            known = ", ".join(sorted(live[0].adapter_names())) if live else ""
            raise InvalidRequestError(
                f"no adapter named {', '.join(map(repr, missing))} is loaded"
                f" (loaded: {known or 'none'})",
                field="adapters",
            )

    async def load(self, name: str, source: str | os.PathLike[str] | Mapping[str, Any]) -> None:
        """Load ``source`` as ``name`` into every live runner, all or nothing (``load_adapter``).

        Raises:
            AdapterError: a runner refused it (the others that loaded it unloaded it
                again), or a load or unload of ``name`` is in flight (``in-use``).
            Exception: what ``lost`` returned.
        """
        with self._claim(name):
            done: list[AdapterRunner[Any]] = []
            try:
                for index, runner in self._loading(name):
                    with anyio.CancelScope(shield=True):
                        broke = await anyio.to_thread.run_sync(_load, runner, name, source)
                    if broke is None:
                        done.append(runner)
                    elif self._lost is None:
                        raise broke
                    else:
                        error = self._lost(index, broke)
                        if error is not None:
                            raise error
            except BaseException:
                with anyio.CancelScope(shield=True):
                    for runner in done:
                        await anyio.to_thread.run_sync(runner.unload_adapter, name)
                raise

    async def unload(self, name: str) -> None:
        """Unload ``name`` from every live runner that has it (``Engine.unload_adapter``)."""
        with self._claim(name):
            runners = [r for _, r in self._loading(name) if name in r.adapter_names()]
            held = sum(i.holders for r in runners for i in r.adapters() if i.name == name)
            if not runners or held:
                raise AdapterError(
                    f"adapter {name!r} is held by {held} live request(s);"
                    " unload it when they are done"
                    if held
                    else f"no adapter {name!r} is loaded",
                    reason="in-use" if held else "unknown",
                    name=name,
                )
            for runner in runners:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(runner.unload_adapter, name)

    def infos(self) -> tuple[AdapterInfo, ...]:
        """The adapters the runners know, by name (holders summed over the runners)."""
        merged: dict[str, AdapterInfo] = {}
        for _, runner in self._live():
            for info in runner.adapters():
                seen = merged.get(info.name)
                if seen is not None:
                    info = AdapterInfo(
                        name=info.name,
                        bytes=max(seen.bytes, info.bytes),
                        holders=seen.holders + info.holders,
                        loaded=seen.loaded and info.loaded,
                        source=info.source,
                    )
                merged[info.name] = info
        return tuple(merged[name] for name in sorted(merged))

    def _live(self) -> list[tuple[int, AdapterRunner[Any]]]:
        """The runners of live workers, with their workers' indices."""
        alive = None if self._alive is None else self._alive()
        return [(i, r) for i, r in enumerate(self._runners) if alive is None or i in alive]

    def _loading(self, name: str) -> list[tuple[int, AdapterRunner[Any]]]:
        if not self._runners:
            raise AdapterError(
                "this engine's runners take no adapters", reason="invalid", name=name
            )
        return self._live()

    @contextmanager
    def _claim(self, name: str) -> Iterator[None]:
        """Inside, ``name`` is this task's to load or unload; refused if another's is."""
        if name in self._busy:
            raise AdapterError(
                f"adapter {name!r} is being loaded or unloaded now; try again when that is done",
                reason="in-use",
                name=name,
            )
        self._busy.add(name)
        try:
            yield
        finally:
            self._busy.discard(name)


def _load(
    runner: AdapterRunner[Any], name: str, source: str | os.PathLike[str] | Mapping[str, Any]
) -> BaseException | None:
    """``runner.load_adapter`` in a worker thread; a ``BaseException`` that is not an
    ``Exception`` (the runner broke, L23) is returned, not raised."""
    try:
        runner.load_adapter(name, source)
    except Exception:
        raise
    except BaseException as exc:
        return exc
    return None
