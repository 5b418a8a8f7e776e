"""Turn a runner's exception into a request's failure without trusting the exception.

A runner's exception is data (L22): it may come from any code, so its ``repr()`` or
``str()`` may raise, return megabytes or text that is not UTF-8, and its traceback
holds the frames (and tensors) of the call that raised it. So the engine thread that
catches it, and only that thread, does two things once, before the event loop sees
it:

- ``describe``: format it, defensively (whatever formatting raises is swallowed),
  bounded and UTF-8-safe. The request's error carries that text, so ``str()`` of a
  ``RequestFailedError`` or ``EngineDeadError`` never runs the runner's code, and
  the event loop never formats a runner's exception.
- ``detach``: clear the frames of its traceback, and of the tracebacks of its
  ``__cause__``/``__context__`` chain, so it keeps no runner locals (a batch, its
  tensors) alive; and unlink the frames that are still running (the engine's own,
  which caught it), so it keeps no engine alive either.
"""

from __future__ import annotations

import itertools
import traceback
from dataclasses import dataclass
from types import TracebackType

from ._imagecheck import OutputViolation

__all__ = ["Failure", "describe", "detach", "failure", "format_traceback"]

#: Longest text taken from an exception's ``str()``.
DETAIL_CHARS = 1000
#: Longest traceback text kept for the log (its start and its end are kept).
TRACEBACK_CHARS = 20_000
#: Most exceptions of one chain (causes, contexts, group members) that ``detach`` visits.
_CHAIN_LIMIT = 256


@dataclass(frozen=True, slots=True)
class Failure:
    """Why one request failed: the message, formatted already, and the cause.

    One exception may fail several requests (a batch step fails them all):
    ``request_ids`` names them all, and only the first one's ``traceback`` is
    set, so the log shows each failure once.
    """

    message: str
    cause: Exception
    request_ids: tuple[str, ...] = ()
    traceback: str = ""


def _type_name(exc: BaseException) -> str:
    try:
        name = type(exc).__name__
    except BaseException:
        return "exception"
    return name if isinstance(name, str) else "exception"


def _utf8(text: str) -> str:
    # Lone surrogates become escapes, so the text always encodes as UTF-8.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def describe(exc: BaseException) -> str:
    """Return ``"Type: text"`` for ``exc``, as a traceback shows it; never raises.

    The text is ``str(exc)``, cut at ``DETAIL_CHARS`` characters, lone surrogates
    escaped (it always encodes as UTF-8). If ``str()``
    raises anything, even a ``BaseException``, the text says so instead:
    formatting an error must never become a second error.
    """
    name = _type_name(exc)
    try:
        text = str.__str__(str(exc))  # exact: a str subclass's methods never run
    except BaseException:
        text = "<exception str() failed>"
    # Cut first (the text may be huge), escape, cut again (escapes are longer).
    shown = _utf8(text[:DETAIL_CHARS])[:DETAIL_CHARS]
    if len(shown) < len(text):
        shown += f"... (cut from {len(text)} characters)"
    return _utf8(f"{name}: {shown}" if shown else name)


def format_traceback(exc: BaseException) -> str:
    """Return the traceback of ``exc`` as ``traceback`` prints it, bounded; never raises.

    Formatting runs the exception's own ``str()`` (and reads its chain), so it
    happens once, in the thread that caught it; a log handler then prints this
    text instead of formatting the exception on the event loop.
    """
    try:
        text = "".join(traceback.format_exception(exc))
    except BaseException:  # a hostile chain or str(): say what we can
        return describe(exc)
    if len(text) > TRACEBACK_CHARS:
        half = TRACEBACK_CHARS // 2
        text = f"{text[:half]}\n... (cut from {len(text)} characters) ...\n{text[-half:]}"
    return _utf8(text).rstrip("\n")


def _cleared(tb: TracebackType | None) -> TracebackType | None:
    """Clear each frame of ``tb``; return the chain without the frames still running."""
    kept: list[TracebackType] = []
    while tb is not None:
        try:
            tb.tb_frame.clear()
        except RuntimeError:
            pass  # still running: the engine frame that caught it (or another thread's)
        else:
            kept.append(tb)
        tb = tb.tb_next
    for entry, following in itertools.pairwise(kept):
        entry.tb_next = following
    if not kept:
        return None
    kept[-1].tb_next = None
    return kept[0]


def detach(exc: BaseException) -> None:
    """Let ``exc`` keep no frame's locals alive: clear its tracebacks (chain included).

    Best effort on a hostile exception: what cannot be read is left as it is;
    never raises (a dying engine calls it too).
    """
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending and len(seen) < _CHAIN_LIMIT:
        error = pending.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        try:
            error.__traceback__ = _cleared(error.__traceback__)
            pending.extend(e for e in (error.__cause__, error.__context__) if e is not None)
            if isinstance(error, BaseExceptionGroup):
                pending.extend(error.exceptions)
        except BaseException:  # a hostile attribute (a property that raises)
            continue


def failure(
    request_id: str, error: Exception, call: str, batch: tuple[str, ...] | None = None
) -> Failure:
    """Describe how the runner's ``call`` failed request ``request_id`` with ``error``.

    Detaches ``error`` (see ``detach``) and formats the message once, here; the
    traceback too, for the first request of ``batch`` (every request ``error``
    failed; default: this one alone).
    """
    detach(error)
    if type(error) is OutputViolation:
        what = str(error)  # the engine's own message (a runner's InvalidOutputError is not)
    else:
        what = f"the runner's {call} raised {describe(error)}"
    ids = batch if batch else (request_id,)
    text = format_traceback(error) if request_id == ids[0] else ""
    return Failure(_utf8(f"request {request_id!r} failed: {what}"), error, ids, text)
