"""Hypercorn's access log, one line per request: the phantom line of a close that raced
a complete response is dropped, a request that got no answer keeps its line.

In-process: the wrapped app and the logger are called directly, no server runs.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from omni_trio.cli._loadtest import PATH


@pytest.mark.anyio
async def test_hypercorn_access_log_drops_the_line_of_a_close_that_raced_the_response(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Hypercorn logs a status-less access line when the client's close races the end of
    a complete response (pgjones/hypercorn#357; ``curl`` shows it about every other
    request). The wrapped app marks its scope before the response's last send, and the
    access logger drops a status-less line for a marked scope only: a request that got
    no answer keeps its line."""
    import anyio
    from hypercorn.config import Config

    from omni_trio.cli._access import SENT, AccessLogger, marking_sent

    seen_at_send: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": False})

    scope: dict[str, Any] = {"type": "http"}

    async def send(message: Any) -> None:
        seen_at_send.append(scope.get(SENT, False))

    with anyio.fail_after(10):
        await marking_sent(app)(scope, None, send)  # type: ignore[arg-type]
    assert seen_at_send == [False, True]  # marked before the last send, not after
    config = Config()
    config.accesslog = logging.getLogger("hypercorn.access")
    logger = AccessLogger(config)
    request = {
        "type": "http",
        "method": "POST",
        "path": PATH,
        "http_version": "1.1",
        "headers": [],
        "client": ("127.0.0.1", 1),
        "query_string": b"",
        "scheme": "http",
    }
    with caplog.at_level(logging.INFO, "hypercorn.access"):
        await logger.access({**request, SENT: True}, None, 0.1)
        assert caplog.records == []
        await logger.access({**request, SENT: True}, {"status": 200, "headers": []}, 0.1)
        await logger.access(request, None, 0.1)  # never answered: its line stays
    assert [r.getMessage().split('" ')[1].split()[0] for r in caplog.records] == ["200", "-"]
