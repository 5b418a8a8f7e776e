"""``/v1/adapters``: list the loaded adapters; load and unload them as admin actions (L88).

- ``GET /v1/adapters``: the adapters the runners know (``Engine.adapters()``), as
  ``{"object": "list", "data": [{"id", "object": "adapter", "loaded", "bytes",
  "holders"}]}``; ``/v1/models`` lists them on the model's card too.
- ``POST /v1/adapters`` with ``{"name": ..., "path": ...}``: load the file at
  ``path``, relative to the server's adapter folder (``ServeConfig.adapter_dir``),
  into every runner; 201 and the adapter. ``DELETE /v1/adapters/{name}``: unload
  it; refused (409) while a request in flight holds it.

Loading and unloading are admin actions: ``check_admin`` is the one check every
admin route makes (403 unless ``ServeConfig.allow_adapter_admin``, off by default,
and, with keys configured, unless the caller's key is an admin's: ``require_admin``,
L55). A client never names an arbitrary
file: ``adapter_file`` resolves ``path`` inside the folder and refuses an absolute
path, ``..``, anything that resolves outside the folder (a symlink out of it
included), and any file that is not a ``.safetensors``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .._adapters import AdapterError, AdapterInfo
from .._errors import InvalidRequestError, OmniTrioError
from ._asgi import error_response
from ._config import ServeConfig
from ._errors import ApiError, api_error_from, invalid
from ._keys import require_admin

if TYPE_CHECKING:
    from .._engine import Engine

__all__ = ["AdaptersApi", "AdminRoutes", "adapter_card", "adapter_file", "check_admin"]

#: The statuses of refused loads and unloads, by ``AdapterError.reason``.
_STATUS = {"invalid": 400, "unknown": 404, "exists": 409, "in-use": 409, "full": 409}


def check_admin(request: Request, config: ServeConfig, action: str) -> None:
    """Refuse an admin action (an adapter's load or unload, an update of the weights, a
    sleep, a wake) the server or the key does not allow.

    The server must allow them (``config.allow_adapter_admin``), and with keys
    configured the caller's must be an admin key (``require_admin``, L55).

    Raises:
        ApiError: 403 ``admin_not_allowed`` when the server does not allow them,
            403 ``admin_required`` when the key is not an admin's.
    """
    if not config.allow_adapter_admin:
        raise ApiError(
            403,
            f"{action} is not allowed on this server (it allows no admin actions)",
            type="permission_error",
            code="admin_not_allowed",
        )
    require_admin(request.scope, action)


def adapter_file(folder: str, given: str) -> Path:
    """The file ``given`` names inside ``folder``, resolved; a 400 for anything else.

    Raises:
        ApiError: 400 naming ``path``: absolute, with ``..``, outside the folder
            once resolved (symlinks followed), a symlink loop, not a
            ``.safetensors``, or no file.
    """
    relative = PurePosixPath(given)
    if not given or "\\" in given or "\x00" in given:
        raise invalid("path: a file's path relative to the adapter folder", "path")
    if relative.is_absolute() or ".." in relative.parts:
        raise invalid("path: must be relative to the adapter folder, without '..'", "path")
    try:
        root = Path(folder).resolve()
        path = (root / relative).resolve()
    except (OSError, RuntimeError):  # a symlink loop: RuntimeError before Python 3.13
        raise invalid("path: cannot be resolved (a symlink loop?)", "path") from None
    if not path.is_relative_to(root):
        raise invalid("path: resolves outside the adapter folder", "path")
    if path.suffix != ".safetensors":
        raise invalid("path: only .safetensors files are loaded", "path")
    if not path.is_file():
        raise invalid(f"path: no file {str(relative)!r} in the adapter folder", "path")
    return path


def adapter_card(info: AdapterInfo) -> dict[str, object]:
    """One adapter as JSON: its name as ``id``, whether it is loaded, its bytes, holders."""
    return {
        "id": info.name,
        "object": "adapter",
        "loaded": info.loaded,
        "bytes": info.bytes,
        "holders": info.holders,
    }


def _adapter_error(exc: AdapterError) -> ApiError:
    code = {"in-use": "adapter_in_use", "unknown": "adapter_not_found"}.get(
        exc.reason, f"adapter_{exc.reason}"
    )
    return ApiError(_STATUS[exc.reason], str(exc), param="name", code=code)


class AdminRoutes:
    """Routes over the service's engine (``engine()``: the engine, or an ``ApiError``
    while there is none) and its configuration."""

    def __init__(self, *, config: ServeConfig, engine: Callable[[], Engine]) -> None:
        self._config = config
        self._engine = engine


class AdaptersApi(AdminRoutes):
    """The ``/v1/adapters`` routes over the service's engine and configuration."""

    async def list(self, request: Request) -> Response:
        """``GET /v1/adapters``."""
        try:
            infos = self._engine().adapters()
        except ApiError as error:
            return error_response(error)
        return JSONResponse({"object": "list", "data": [adapter_card(i) for i in infos]})

    async def load(self, request: Request) -> Response:
        """``POST /v1/adapters``: ``{"name", "path"}``, the path inside the adapter folder.

        Cancellation: a load under way finishes and is undone (``Engine.load_adapter``).
        """
        try:
            check_admin(request, self._config, "loading an adapter")
            name, given = _load_body(await request.body())
            folder = self._config.adapter_dir
            if folder is None:
                raise ApiError(403, "this server has no adapter folder", code="admin_not_allowed")
            engine = self._engine()
            await engine.load_adapter(name, adapter_file(folder, given))
            # Read with no checkpoint since the load: no unload of it came between.
            card = next((adapter_card(i) for i in engine.adapters() if i.name == name), None)
            if card is None:
                raise AdapterError(f"adapter {name!r} was unloaded", reason="unknown", name=name)
        except ApiError as error:
            return error_response(error)
        except AdapterError as exc:
            return error_response(_adapter_error(exc))
        except InvalidRequestError as exc:
            return error_response(invalid(str(exc), "name"))
        except OmniTrioError as exc:  # shutdown began, the worker died
            return error_response(api_error_from(exc, retry_after_s=self._config.retry_after_s))
        return JSONResponse(card, status_code=201)

    async def unload(self, request: Request) -> Response:
        """``DELETE /v1/adapters/{name}``: refused (409) while a request holds it.

        Cancellation: the unload under way finishes (``Engine.unload_adapter``).
        """
        name = request.path_params["name"]
        try:
            check_admin(request, self._config, "unloading an adapter")
            await self._engine().unload_adapter(name)
        except ApiError as error:
            return error_response(error)
        except AdapterError as exc:
            return error_response(_adapter_error(exc))
        except OmniTrioError as exc:  # shutdown began, the worker died
            return error_response(api_error_from(exc, retry_after_s=self._config.retry_after_s))
        return JSONResponse({"id": name, "object": "adapter", "deleted": True})


def _load_body(body: bytes) -> tuple[str, str]:
    """``{"name": str, "path": str}`` and nothing else, or a 400 naming the field."""
    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise invalid("the body must be a JSON object", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise invalid("the body must be a JSON object", None, "invalid_json")
    unknown = sorted(set(data) - {"name", "path"})
    if unknown:
        raise invalid(f"{unknown[0]}: unknown parameter", unknown[0][:40], "unknown_parameter")
    for field in ("name", "path"):
        if not isinstance(data.get(field), str):
            raise invalid(f"{field}: must be a string", field, "invalid_type")
    return data["name"], data["path"]
