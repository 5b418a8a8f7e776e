"""Serve an engine over HTTP: an OpenAI-style images API on Starlette.

- ``create_app(runner, ...)`` / ``ImageService``: the ASGI app, its engine bound to
  the app's lifespan;
- ``ServeConfig``: the HTTP layer's own settings (model name, defaults, body limit);
- ``UploadLimits``: how large an edit's upload may be (bytes, pixels);
- ``VideoConfig``: a video model's jobs (``/v1/videos``): fps, how many, how long;
- ``_options``: ``ServiceOptions`` and ``build_service``, the one way a service is
  built from a model's name and settings: ``python -m omni_trio serve`` (the
  command line, ``omni_trio.cli``), ``serve --ray`` and a Ray replica use it.

See docs/serving.md.
"""

from __future__ import annotations

from .. import _exports
from ._app import ImageService as ImageService
from ._app import create_app as create_app
from ._config import ServeConfig as ServeConfig
from ._errors import ApiError as ApiError
from ._images import CLIENT_GONE as CLIENT_GONE
from ._metrics import OUTCOMES as OUTCOMES
from ._upload import UploadLimits as UploadLimits
from ._video_jobs import VideoConfig as VideoConfig

__all__ = [
    "CLIENT_GONE",
    "OUTCOMES",
    "ApiError",
    "ImageService",
    "ServeConfig",
    "UploadLimits",
    "VideoConfig",
    "create_app",
]

# Reprs, tracebacks and pickles name this package, not its private modules.
_exports.set_public_module(__name__, globals())
