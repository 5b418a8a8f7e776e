"""An engine's adapters across its runners (L85, L87): admission's check, loads, listing.

Every runner of an engine loads its own copy of an adapter (capabilities agree, so
either every runner takes adapters or none does). ``RunnerAdapters`` is the engine's
view of them: the names a request may use are those every runner has; a load is all
or nothing; an unload is refused while a request holds the adapter anywhere. Loads
and unloads run in anyio's worker threads: a runner's load takes its model lock and
so waits for the step under way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
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

    Raises:
        TypeError: the capabilities declare ``max_adapters`` and a runner has no
            ``load_adapter``.
    """

    def __init__(self, runners: Sequence[Runner[Any]], capabilities: RunnerCapabilities) -> None:
        self._runners: list[AdapterRunner[Any]] = []
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
        missing = unknown_adapters(names, (r.adapter_names() for r in self._runners))
        if missing:
            known = ", ".join(sorted(self._runners[0].adapter_names())) if self._runners else ""
            raise InvalidRequestError(
                f"no adapter named {', '.join(map(repr, missing))} is loaded"
                f" (loaded: {known or 'none'})",
                field="adapters",
            )

    async def load(self, name: str, source: str | os.PathLike[str] | Mapping[str, Any]) -> None:
        """Load ``source`` as ``name`` into every runner, all or nothing (``load_adapter``)."""
        runners = self._loading(name)
        done: list[AdapterRunner[Any]] = []
        try:
            for runner in runners:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(runner.load_adapter, name, source)
                done.append(runner)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for runner in done:
                    await anyio.to_thread.run_sync(runner.unload_adapter, name)
            raise

    async def unload(self, name: str) -> None:
        """Unload ``name`` from every runner that has it (``Engine.unload_adapter``)."""
        runners = [r for r in self._loading(name) if name in r.adapter_names()]
        held = sum(i.holders for r in runners for i in r.adapters() if i.name == name)
        if not runners or held:
            raise AdapterError(
                f"adapter {name!r} is held by {held} live request(s); unload it when they are done"
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
        for runner in self._runners:
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

    def _loading(self, name: str) -> list[AdapterRunner[Any]]:
        if not self._runners:
            raise AdapterError(
                "this engine's runners take no adapters", reason="invalid", name=name
            )
        return self._runners
