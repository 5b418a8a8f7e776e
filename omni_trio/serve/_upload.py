"""Uploaded images: their limits, and files decoded only once sized.

``read_header`` reads a file's header (its format, width and height) and checks
it; ``decode`` decodes the pixels. In between, the caller checks what the
header says against the engine's limits (``_edits``), so a request the engine
would refuse decodes, resizes and copies nothing (L4). Two limits of the upload's
own, both checked before anything is allocated for them:

- ``UploadLimits.max_bytes``: the whole multipart body, refused (413) from its
  ``Content-Length`` or as soon as the bytes read pass it, before parsing (the
  body is ``_asgi.read_body``'s, its parts ``_forms.read_form``'s);
- ``UploadLimits.max_pixels``: each image, refused (413 ``image_too_large``) from
  the width and height its header declares, before a pixel is decoded. A
  decompression bomb (a small file that declares a huge image) allocates nothing.

Only PNG, JPEG and WebP are taken, recognised by their magic bytes; the header
is parsed by Pillow's plugin for that format directly (``PngImageFile`` ...),
which reads the header only, so that this check, not ``Image.open``'s
``MAX_IMAGE_PIXELS`` warning, is the one in force. A file that is cut short or
corrupt fails its ``load()`` and gets a 400 naming its field.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import ApiError, invalid

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["UploadLimits", "decode", "read_header"]


@dataclass(frozen=True, slots=True, kw_only=True)
class UploadLimits:
    """How large an upload to ``/v1/images/edits`` may be.

    Args:
        max_bytes: the whole multipart body (image, mask and fields), in bytes;
            16 MiB by default.
        max_pixels: width x height of each uploaded image, read from its header
            before decoding; 4096 x 4096 by default (Pillow's own bomb limit is
            about 89 million).
        max_fields: the most form parts (fields and files together).

    Raises:
        ValueError: a limit is not an int >= 1.
    """

    max_bytes: int = 16 << 20
    max_pixels: int = 4096 * 4096
    max_fields: int = 64

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_fields"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")


#: How messages name a format Pillow calls otherwise.
_NAMES = {"WEBP": "WebP"}


def _plugin(data: bytes) -> tuple[str, Any] | None:
    """The format of ``data`` by its magic bytes, and Pillow's class for it."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        from PIL import PngImagePlugin

        return "PNG", PngImagePlugin.PngImageFile
    if data.startswith(b"\xff\xd8\xff"):
        from PIL import JpegImagePlugin

        return "JPEG", JpegImagePlugin.JpegImageFile
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        try:
            from PIL import WebPImagePlugin
        except ImportError:  # a Pillow built without libwebp
            return None
        return "WebP", WebPImagePlugin.WebPImageFile
    return None


def read_header(data: bytes, param: str, limits: UploadLimits) -> Image.Image:
    """Read an uploaded image's header and check its declared size; decode nothing.

    Args:
        data: the file's bytes.
        param: the form field it came in, for the error.
        limits: the upload limits.

    Returns:
        The image, lazily opened: its ``size``, ``mode`` and ``info`` are the
        header's, and no pixel is decoded until ``decode``.

    Raises:
        ApiError: 400 ``invalid_image`` (not a PNG, JPEG or WebP file, or a header
            Pillow cannot parse), 413 ``image_too_large`` (more than ``max_pixels``).
    """
    found = _plugin(data)
    if found is None:
        raise invalid(f"{param}: must be a PNG, JPEG or WebP file", param, "invalid_image")
    name, plugin = found
    try:
        image: Image.Image = plugin(io.BytesIO(data))  # the header only: nothing decoded
    except Exception:  # Pillow raises many kinds for a hostile header
        raise invalid(
            f"{param}: could not be read as a {name} file", param, "invalid_image"
        ) from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ApiError(
            413,
            f"{param}: {width}x{height} is more than the {limits.max_pixels} pixels"
            " this server decodes",
            param=param,
            code="image_too_large",
        )
    return image


def decode(image: Image.Image, param: str) -> Image.Image:
    """Decode the pixels of an image ``read_header`` opened.

    Raises:
        ApiError: 400 ``invalid_image``: the data is cut short or corrupt.
    """
    try:
        image.load()
    except Exception:  # truncated data, a corrupt stream, a decoder's own limits
        raise invalid(
            f"{param}: the {_NAMES.get(image.format or '', image.format)} data could not be"
            " decoded (cut short or corrupt)",
            param,
            "invalid_image",
        ) from None
    return image
