"""The engine's result cache (L95, L96): its entries in LRU order, their bound, their files.

``ResultStore`` runs in the event loop's thread: ``Engine.submit`` asks it for a
request's output (``lookup``), and the engine hands it each completed miss's kept
copy (``completed``; the materializer made the copy, off the loop). In memory, an
entry holds its ``KeptOutput``; on disk, an entry holds it only until its file is
written, then only its size, and a hit reads the file (one read, checked whole:
``read_entry``) in the loop's thread.

``run``, a task of ``open_engine``'s group, readies the cache before the engine
admits anything (the folder's files, oldest first by modification time, which a hit
renews; the digests of the adapters the runners loaded before the engine opened),
then writes each kept output to its file, in a worker thread of anyio's, until
``close``: written whole under a temporary name, flushed to the disk, renamed into
place. A write that fails is one warning and keeps nothing; a file that is cut short,
altered or unreadable when a hit reads it is one warning, deleted, and the request
runs as a miss.

The key's adapters are the digests of their weights, known for those loaded
through ``Engine.load_adapter`` (computed once, before the load) and for those the
runners had at the start from a file or folder; a request naming another is never
cached.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread

from ._log import ENGINE
from ._results import (
    CorruptEntryError,
    KeptOutput,
    ResultCache,
    ResultCacheStatistics,
    entry_bytes,
    read_entry,
    result_key,
    source_digest,
)

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectSendStream

    from ._adapters import AdapterInfo
    from ._record import Record
    from ._runner import Runner

__all__ = ["ResultStore", "model_fingerprint"]

#: An entry's file: its key, 64 hex digits.
_ENTRY_FILE = re.compile(r"[0-9a-f]{64}\.bin")


def model_fingerprint(runners: Sequence[Runner[Any]]) -> str:
    """What the runners' ``result_fingerprint()`` say, the same for all.

    Raises:
        ValueError: a runner has none, or two runners name different models.
    """
    found: set[str] = set()
    for runner in runners:
        method = getattr(runner, "result_fingerprint", None)
        if not callable(method):
            raise ValueError(
                f"result_cache: {type(runner).__name__} has no result_fingerprint(), which"
                " names the model its outputs come from; its outputs cannot be kept"
            )
        value = method()
        if not isinstance(value, str) or not value:
            raise TypeError(f"{type(runner).__name__}.result_fingerprint() must return a str")
        found.add(value)
    if len(found) != 1:
        raise ValueError("result_cache: the runners' result_fingerprint() differ")
    return found.pop()


class _Entry:
    """One kept output: its pixels until its file is written (always, in memory), its size."""

    __slots__ = ("kept", "size")

    def __init__(self, kept: KeptOutput | None, size: int) -> None:
        self.kept = kept
        self.size = size


class ResultStore:
    """An engine's result cache (see the module's docstring).

    Args:
        config: its configuration.
        runners: the engine's runners (their ``result_fingerprint()``).
        adapters: the adapters the runners know now (``Engine.adapters``).

    Raises:
        ValueError: the runners name no model (``model_fingerprint``), or the folder
            cannot be made.
    """

    def __init__(
        self,
        config: ResultCache,
        runners: Sequence[Runner[Any]],
        adapters: Callable[[], tuple[AdapterInfo, ...]],
    ) -> None:
        self.config = config
        self.model = self._loaded = model_fingerprint(runners)
        self._adapters = adapters
        # The digest of each adapter's weights, by name.
        self._digests: dict[str, str] = {}
        # Least recently used first.
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._kept = self._evicted = 0
        self._folder = None if config.folder is None else Path(config.folder)
        self._send: MemoryObjectSendStream[str] | None = None
        if self._folder is not None:
            try:
                self._folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ValueError(
                    f"result_cache.folder: cannot make {str(self._folder)!r}: {exc.strerror}"
                ) from None

    # -- admission and completion ----------------------------------------------

    def lookup(self, record: Record) -> KeptOutput | None:
        """Set ``record.result_key``; return the output kept under it, or ``None``."""
        key = record.result_key = result_key(
            record.request, model=self.model, adapters=self._digests, scope=self.config.scope
        )
        entry = None if key is None else self._entries.get(key)
        if key is None or entry is None:
            return None
        kept = entry.kept if entry.kept is not None else self._read(key)
        if kept is not None:
            self._entries.move_to_end(key)
        return kept

    def admitted(self, record: Record, kept: KeptOutput | None) -> None:
        """``record`` was admitted: a hit with ``kept``, else a miss whose output is kept."""
        if record.result_key is None:
            return
        if kept is not None:
            self._hits += 1
            record.result_hit = True
        else:
            self._misses += 1
            record.keep_result = self.config.max_bytes

    def completed(self, record: Record, kept: KeptOutput | None) -> None:
        """Keep ``record``'s output (``kept``: the materializer's copy) under its key.

        Not an output whose step-cache threshold was loosened for its deadline (L84): a
        repeat is owed the request's own threshold's output.
        """
        key = record.result_key
        cache = record.cache_metrics
        if key is None or kept is None or record.result_hit or (cache and cache.loosened):
            return
        if key in self._entries or kept.nbytes > self.config.max_bytes:
            return
        self._entries[key] = _Entry(kept, kept.nbytes)
        self._bytes += kept.nbytes
        self._kept += 1
        self._evict()
        if self._send is not None:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._send.send_nowait(key)

    def statistics(self) -> ResultCacheStatistics:
        """What it did and holds now."""
        return ResultCacheStatistics(
            hits=self._hits,
            misses=self._misses,
            kept=self._kept,
            evicted=self._evicted,
            entries=len(self._entries),
            bytes=self._bytes,
        )

    # -- adapters -------------------------------------------------------------------

    async def digest(self, source: object) -> str | None:
        """The digest of the weights at ``source`` (``source_digest``), in a worker thread;
        ``None`` when they cannot be read (its requests are then never cached).

        Cancellation: waits for the digest under way (a read of the weights).
        """
        try:
            return await anyio.to_thread.run_sync(source_digest, source)
        except (OSError, ValueError, TypeError, RuntimeError):
            return None  # the load reads it too, and says what is wrong with it

    def loaded(self, name: str, digest: str | None) -> None:
        """Adapter ``name`` was loaded from weights with ``digest`` (``None``: unknown)."""
        self._digests.pop(name, None)
        if digest is not None:
            self._digests[name] = digest

    def unloaded(self, name: str) -> None:
        """Adapter ``name`` was unloaded: a later one of that name has its own weights."""
        self._digests.pop(name, None)

    # -- weights in place (L102) ------------------------------------------------------

    def weights_changed(self, key: str, waiting: Iterable[Record]) -> None:
        """The runners' weights were updated, and ``key`` names them: the model in every
        key from now on. The ``waiting`` requests, admitted under the old name, run on
        the new weights: their outputs are not kept."""
        self.model = f"{self._loaded} weights={key}"
        for record in waiting:
            record.result_key = None
            record.keep_result = 0

    # -- the files --------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Ready the cache, then write the kept outputs to their files until ``close``.

        Cancellation:
            Ends at once: a write under way finishes first (whole or not at all), the
            entries not yet written stay in memory.
        """
        sources = {info.name: info.source for info in self._adapters() if info.source}
        digests = await anyio.to_thread.run_sync(_digests, sources)
        for name, digest in digests.items():
            self._digests.setdefault(name, digest)
        if self._folder is None:
            task_status.started()
            return
        for key, size in await anyio.to_thread.run_sync(_scan, self._folder):
            self._entries[key] = _Entry(None, size)
            self._bytes += size
        self._evict()
        self._send, receive = anyio.create_memory_object_stream[str](math.inf)
        task_status.started()
        with receive:
            async for key in receive:
                await self._write(key)

    def close(self) -> None:
        """Make ``run`` return once the outputs kept so far are written."""
        if self._send is not None:
            self._send.close()

    async def _write(self, key: str) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.kept is None:
            return  # put out, or written, since
        assert self._folder is not None
        size = await anyio.to_thread.run_sync(_write_file, self._folder, key, entry.kept)
        if self._entries.get(key) is not entry:
            if size is not None and key not in self._entries:
                _remove(self._path(key))  # put out while it was written
            return
        if size is None:
            self._drop(key)
            return
        entry.kept = None
        self._bytes += size - entry.size
        entry.size = size
        self._evict()

    def _read(self, key: str) -> KeptOutput | None:
        """The entry's file, checked whole; ``None`` (and the entry dropped) if it is not."""
        path = self._path(key)
        try:
            kept = read_entry(path.read_bytes(), key)
        except FileNotFoundError:
            self._drop(key)  # deleted by someone else
            return None
        except (OSError, CorruptEntryError) as exc:
            ENGINE.warning(
                "result cache: %s is unreadable (%s); deleted, the request runs", path, exc
            )
            self._drop(key)
            _remove(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # its place in the LRU order, after a restart too
        return kept

    def _path(self, key: str) -> Path:
        assert self._folder is not None
        return self._folder / f"{key}.bin"

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.size

    def _evict(self) -> None:
        """Put out the least recently used entries until the bound holds."""
        while self._bytes > self.config.max_bytes and self._entries:
            key, entry = self._entries.popitem(last=False)
            self._bytes -= entry.size
            self._evicted += 1
            if entry.kept is None:
                _remove(self._path(key))


# -- in a worker thread -------------------------------------------------------------


def _digests(sources: dict[str, str]) -> dict[str, str]:
    """The digest of each adapter's weights at its source, where they can be read."""
    found = {}
    for name, source in sources.items():
        with contextlib.suppress(OSError):
            digest = source_digest(source)
            if digest is not None:
                found[name] = digest
    return found


def _scan(folder: Path) -> list[tuple[str, int]]:
    """The entries' files as ``(key, size)``, oldest first; temporary files deleted (a write
    that a crash cut: never read)."""
    found = []
    for item in os.scandir(folder):
        if item.name.endswith(".tmp"):
            _remove(Path(item.path))
        elif _ENTRY_FILE.fullmatch(item.name):
            with contextlib.suppress(OSError):
                stat = item.stat()
                found.append((stat.st_mtime_ns, item.name[:64], stat.st_size))
    return [(key, size) for _, key, size in sorted(found)]


def _write_file(folder: Path, key: str, kept: KeptOutput) -> int | None:
    """Write the entry's file atomically; return its size, or ``None`` (a warning)."""
    temporary = folder / f".{key}.{uuid.uuid4().hex}.tmp"
    data = entry_bytes(key, kept)
    try:
        with temporary.open("wb") as writer:
            writer.write(data)
            writer.flush()
            os.fsync(writer.fileno())
        os.replace(temporary, folder / f"{key}.bin")
    except OSError as exc:
        ENGINE.warning("result cache: cannot write to %s (%s); the output is not kept", folder, exc)
        _remove(temporary)
        return None
    _sync_folder(folder)
    return len(data)


def _sync_folder(folder: Path) -> None:
    """Flush the folder's entry of a renamed file (where the system lets a folder open)."""
    with contextlib.suppress(OSError):
        handle = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
