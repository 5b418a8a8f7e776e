"""Serve an engine over HTTP: OpenAI-style images, image edits and video jobs, on Starlette.

- ``Service`` / ``create_app(runner, ...)``: the ASGI app, its engine bound to the
  app's lifespan (``ImageService`` is the deprecated old name of ``Service``);
- ``ServeConfig``: the HTTP layer's own settings (model name, defaults, body limit);
- ``OutputConfig``, ``OutputStore``, ``FolderStore``, ``S3Store``,
  ``OutputStoreError``: the output store behind ``response_format: "url"`` (L97): a
  folder or an S3-compatible bucket, signed URLs that expire;
- ``UploadLimits``: how large an edit's upload may be (bytes, pixels);
- ``ApiKeys``, ``ApiKey``, ``TenantLimits``, ``load_keys_file`` (``_keys``): the
  API keys a service accepts, their tenants, weights and limits (L55, L56), and
  ``require_admin``, the check of an admin route;
- ``VideoConfig``: a video model's jobs (``/v1/videos``): fps, how many, how long;
- ``ServiceOptions`` and ``build_service`` (``_options``): the one way a service is
  built from a model's name and settings: ``python -m omni_trio serve`` (the
  command line, ``omni_trio.cli``), ``serve --ray`` and a Ray replica use it, and so
  can an application; ``load_model`` (``_models``: ``MODELS``, ``LoadedModel``,
  ``ModelError``) builds the runners of a named model or a diffusers folder.

See docs/serving.md.

Layout. ``_app`` builds the ``Service``: its routes, lifespan, health and model
cards. The endpoints are siblings that it routes to:

- ``_images``: ``POST /v1/images/generations`` (and edits, given their parser);
- ``_edits``: the edit form to an image job (``POST /v1/images/edits``);
- ``_videos``: the ``/v1/videos`` routes, over ``_video_body`` (the body to a
  request, an ``input_reference`` checked before it is decoded) and the ``jobs``
  package: the jobs' tasks and their bounded store, written through to a durable
  store behind a protocol (L77-L79: SQLite and files under ``--jobs-dir``, the
  checkpoint writer's thread, L78, a shared store's leases); its docstring draws it;
- ``_adapters``: ``/v1/adapters``, the adapters listed, loaded and unloaded as admin
  actions (L88);
- ``_weights``: ``/v1/weights``, ``/v1/sleep``, ``/v1/wake``: the weights updated in
  place from a file of the adapter folder, put to sleep and woken, as admin actions
  (L102, L103);
- ``_files``: ``GET /v1/files/{key}``, an output kept as a signed URL, streamed
  from the output store (L97);
- ``_warmup``: the request the service runs before it answers (L4);
- ``_tracing``: OpenTelemetry spans of the requests, written from their timelines
  once they are terminal (L99).

Beside the app: ``ray`` (public), the Ray Serve deployments of a service (L46, L47),
over ``_ray_ingress``, the ASGI ingress a replica serves through (the key check and
the service's routes in the replica's loop).

Under them, the plumbing they share: ``_asgi`` (the ASGI types, headers, the
body within its limit, JSON and server-sent events, the watched client),
``_forms`` (multipart parts and their typed values), ``_schema`` (a body's
checks), ``_errors`` (OpenAI-style errors, the engine's mapped to them),
``_metrics`` (the Prometheus registry and each request's outcome), ``_encode``
(images to files), ``_upload`` (uploaded images within limits, their headers read
before their pixels), ``_output_store`` (``OutputStore``: the folder and the S3
bucket, blocking, called from worker threads) and ``_output_urls`` (``OutputUrls``:
outputs written, their URLs signed and checked, the sweeper of expired ones; L97),
``_config`` (``ServeConfig``, ``OutputConfig``; ``with_defaults``, the one filling of
a request's defaults, which the Ray handle shares; ``Admission``, the engine's limits
checked before a body costs work) and ``_keys`` (the key check before routing, the
caller's tenant on its requests, the tenants' limits).
An endpoint imports the plumbing, never another endpoint nor ``_app``
(tests/test_layers.py checks it).
"""

from __future__ import annotations

import typing
import warnings

from .. import _exports
from ._app import Service as Service
from ._app import create_app as create_app
from ._asgi import CLIENT_GONE as CLIENT_GONE
from ._config import OutputConfig as OutputConfig
from ._config import ServeConfig as ServeConfig
from ._errors import ApiError as ApiError
from ._keys import ApiKey as ApiKey
from ._keys import ApiKeys as ApiKeys
from ._keys import TenantLimits as TenantLimits
from ._keys import load_keys_file as load_keys_file
from ._keys import require_admin as require_admin
from ._metrics import OUTCOMES as OUTCOMES
from ._models import MODELS as MODELS
from ._models import LoadedModel as LoadedModel
from ._models import ModelError as ModelError
from ._models import load_model as load_model
from ._options import OptionError as OptionError
from ._options import ServiceOptions as ServiceOptions
from ._options import build_service as build_service
from ._output_store import FolderStore as FolderStore
from ._output_store import OutputStore as OutputStore
from ._output_store import OutputStoreError as OutputStoreError
from ._output_store import S3Store as S3Store
from ._upload import UploadLimits as UploadLimits
from .jobs import VideoConfig as VideoConfig

__all__ = [
    "CLIENT_GONE",
    "MODELS",
    "OUTCOMES",
    "ApiError",
    "ApiKey",
    "ApiKeys",
    "FolderStore",
    "LoadedModel",
    "ModelError",
    "OptionError",
    "OutputConfig",
    "OutputStore",
    "OutputStoreError",
    "S3Store",
    "ServeConfig",
    "Service",
    "ServiceOptions",
    "TenantLimits",
    "UploadLimits",
    "VideoConfig",
    "build_service",
    "create_app",
    "load_keys_file",
    "load_model",
    "require_admin",
]

if typing.TYPE_CHECKING:
    # Deprecated: the old name of ``Service``, until 0.3.0 (at run time, __getattr__).
    ImageService = Service


def __getattr__(name: str) -> object:
    """``ImageService``: ``Service`` under its old name, with a ``DeprecationWarning``."""
    if name == "ImageService":
        warnings.warn(
            "omni_trio.serve.ImageService is deprecated and goes in 0.3.0:"
            " use omni_trio.serve.Service",
            DeprecationWarning,
            stacklevel=2,
        )
        return Service
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Reprs, tracebacks and pickles name this package, not its private modules.
_exports.set_public_module(__name__, globals())
