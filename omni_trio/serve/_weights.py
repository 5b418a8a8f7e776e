"""``/v1/weights``, ``/v1/sleep``, ``/v1/wake``: the weights in place and asleep (L102, L103).

- ``GET /v1/weights``: the weights served now, ``{"object": "weights", "version",
  "label", "sleep_level"}``.
- ``POST /v1/weights`` with ``{"path": ..., "policy": "finish" | "abort", "label": ...}``:
  update every runner's weights in place from the ``.safetensors`` file at ``path``,
  relative to the server's adapter folder (``ServeConfig.adapter_dir``, where every admin
  load reads: ``adapter_file`` refuses any path out of it); the answer is the new
  version. ``Engine.update_weights``: the requests in flight finish on the old weights
  first (``finish``, the default) or are aborted (``abort``).
- ``POST /v1/sleep`` with ``{"level": 1 | 2, "policy": "finish" | "suspend", "refuse":
  bool}`` (each optional) and ``POST /v1/wake``: ``Engine.sleep`` and ``Engine.wake``;
  the answers say what was freed and how long it took. While a sleep that refuses lasts,
  the generation routes answer 503 (``sleeping``, with ``Retry-After``).

All three changes are admin actions, as the adapters' loads are (``check_admin``: the
server allows them with ``ServeConfig.allow_adapter_admin``, and with keys configured the
caller's is an admin key, L55). A refusal says why (400 for a file or field that does not
fit, 409 while asleep); a runner's failure is logged and answered without its text (500).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .._errors import OmniTrioError
from .._log import SERVE
from .._weights import SLEEP_POLICIES, UPDATE_POLICIES, WeightsError, WeightVersion
from ._adapters import AdminRoutes, adapter_file, check_admin
from ._asgi import error_response
from ._errors import ApiError, api_error_from, invalid, server_error

__all__ = ["WeightsApi"]

#: The status and code of a refused change, by ``WeightsError.reason``.
_REFUSED = {
    "invalid": (400, "weights_invalid"),
    "unsupported": (400, "weights_unsupported"),
    "asleep": (409, "engine_asleep"),
}


def _card(version: WeightVersion, level: int) -> dict[str, object]:
    return {
        "object": "weights",
        "version": version.number,
        "label": version.label,
        "sleep_level": level,
    }


def _body(data: bytes, fields: dict[str, type]) -> dict[str, Any]:
    """A JSON object of at most ``fields`` (each of its type), or a 400 naming the field."""
    try:
        body = json.loads(data.decode("utf-8")) if data.strip() else {}
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise invalid("the body must be a JSON object", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object", None, "invalid_json")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise invalid(f"{unknown[0]}: unknown parameter", unknown[0][:40], "unknown_parameter")
    for name, kind in fields.items():
        value = body.get(name)
        if value is not None and (
            not isinstance(value, kind) or isinstance(value, bool) != (kind is bool)
        ):
            raise invalid(f"{name}: must be a {kind.__name__}", name, "invalid_type")
    return body


def _choice(body: dict[str, Any], name: str, allowed: tuple[str, ...], default: str) -> str:
    value = body.get(name, default) or default
    if value not in allowed:
        raise invalid(f"{name}: one of {', '.join(allowed)}", name)
    return str(value)


class WeightsApi(AdminRoutes):
    """The weights' routes over the service's engine and configuration."""

    async def show(self, request: Request) -> Response:
        """``GET /v1/weights``."""
        try:
            engine = self._engine()
        except ApiError as error:
            return error_response(error)
        return JSONResponse(_card(engine.weight_version, engine.sleep_level))

    async def update(self, request: Request) -> Response:
        """``POST /v1/weights``: ``{"path", "policy", "label"}``.

        Cancellation: an update under way finishes and is undone (``Engine.update_weights``).
        """
        return await self._act(request, "updating the weights", self._update)

    async def sleep(self, request: Request) -> Response:
        """``POST /v1/sleep``: ``{"level", "policy", "refuse"}``.

        Cancellation: freeing under way finishes and is undone (``Engine.sleep``).
        """
        return await self._act(request, "putting the engine to sleep", self._sleep)

    async def wake(self, request: Request) -> Response:
        """``POST /v1/wake``.

        Cancellation: the wake of the runner under way finishes (``Engine.wake``).
        """
        return await self._act(request, "waking the engine", self._wake)

    async def _act(self, request: Request, action: str, act: Any) -> Response:
        try:
            check_admin(request, self._config, action)
            answer: dict[str, object] = await act(await request.body())
        except ApiError as error:
            return error_response(error)
        except WeightsError as exc:
            return error_response(self._refused(exc, action))
        except OmniTrioError as exc:  # shutdown began, the worker died
            return error_response(api_error_from(exc, retry_after_s=self._config.retry_after_s))
        return JSONResponse(answer)

    async def _update(self, data: bytes) -> dict[str, object]:
        body = _body(data, {"path": str, "policy": str, "label": str})
        if not isinstance(body.get("path"), str):
            raise invalid("path: a .safetensors file in the adapter folder", "path")
        policy = _choice(body, "policy", UPDATE_POLICIES, "finish")
        folder = self._config.adapter_dir
        if folder is None:
            raise ApiError(403, "this server has no adapter folder", code="admin_not_allowed")
        label = body.get("label") or None
        engine = self._engine()
        version = await engine.update_weights(
            adapter_file(folder, body["path"]),
            policy=policy,  # type: ignore[arg-type]  # checked by _choice
            label=label,
        )
        return _card(version, engine.sleep_level)

    async def _sleep(self, data: bytes) -> dict[str, object]:
        body = _body(data, {"level": int, "policy": str, "refuse": bool})
        level = body.get("level", 1)
        if level not in (1, 2):
            raise invalid("level: 1 or 2", "level")
        policy = _choice(body, "policy", SLEEP_POLICIES, "finish")
        report = await self._engine().sleep(
            level,
            policy=policy,  # type: ignore[arg-type]  # checked by _choice
            refuse=bool(body.get("refuse", False)),
        )
        return {
            "object": "sleep",
            "level": report.level,
            "offloaded_bytes": report.offloaded_bytes,
            "dropped_bytes": report.dropped_bytes,
            "kept_bytes": report.kept_bytes,
            "drain_s": report.drain_s,
            "sleep_s": report.sleep_s,
        }

    async def _wake(self, data: bytes) -> dict[str, object]:
        _body(data, {})
        report = await self._engine().wake()
        return {"object": "wake", "level": report.level, "wake_s": report.wake_s}

    @staticmethod
    def _refused(exc: WeightsError, action: str) -> ApiError:
        refused = _REFUSED.get(exc.reason)
        if refused is not None:
            status, code = refused
            return ApiError(status, str(exc), code=code)
        SERVE.error("%s failed: %s", action, exc, exc_info=exc)
        return server_error(
            f"{action} failed on a runner; every runner is as it was (see the server's log)",
            "weights_failed",
        )
