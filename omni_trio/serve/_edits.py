"""``POST /v1/images/edits``: an OpenAI-style multipart form to an image-to-image job.

The form has what OpenAI's images edit API sends: ``image`` (one PNG, JPEG or
WebP file; ``image[]`` with one file is the same), an optional ``mask`` file,
``prompt``, ``n``, ``size``, ``response_format``, ``stream``, ... and the fields of
``/v1/images/generations`` (``num_inference_steps``, ``guidance_scale``, ``seed``,
``negative_prompt``, ``priority``, ...), plus ``strength`` (0 < strength <= 1).
Form values are text: each is read as its field's type (``"3"`` for an integer,
``"0.6"`` for a number, ``"true"``/``"false"`` for ``stream``; ``_forms`` reads
and types the parts, as for ``/v1/videos``), then checked by the same model and
mapped to the same errors as a generation body (L76).

Images:

- the mask follows OpenAI where it has an alpha channel: its fully transparent
  pixels are repainted; a mask without one is grey levels, white repainted;
- with no mask, an image with fully transparent pixels is inpainted there (as
  OpenAI uses an image's transparency as its mask); any other image is varied
  whole (image-to-image, ``strength`` of it);
- ``size`` (``WxH``) resizes the image and the mask (Lanczos, as diffusers
  resizes); without it (or ``auto``) the output keeps the image's size, each side
  rounded to the nearest multiple the model takes (a 100x100 image makes 104x104
  on Stable Diffusion, whose sides are multiples of 8), or the model's fixed size.
  (OpenAI's ``auto`` lets the model choose; keeping the image's size is what an
  edit of a photo wants, and costs no upscale.)

Nothing is decoded before everything that can refuse the edit without its pixels
has: the fields, each upload's header (its format, its declared size against
``UploadLimits``, a mask's size against the image's), and the request against
the engine's limits and the runner's rules (``Admission``: sizes, ``n``, steps;
whether it takes images). A request the engine refuses costs no decode, resize
or float copy (L4, amended). Decoding and the request's construction run in a
worker thread, never on the event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio.to_thread

from .._errors import InvalidRequestError
from ._asgi import Scope, header
from ._errors import ApiError, api_error_from, invalid
from ._forms import check_known, form_value, read_form
from ._schema import (
    DEADLINE_HEADER,
    KNOWN_FIELDS,
    GenerationBody,
    ImageJob,
    job_from_body,
    parse_size,
    shown,
    validate_body,
)
from ._upload import UploadLimits, decode, read_header

if TYPE_CHECKING:
    from PIL import Image

    from .._runner import RunnerCapabilities
    from ._config import Admission, ServeConfig

__all__ = ["EDIT_FIELDS", "parse_edit_form"]

#: Fields of the edit form beyond a generation body's: files, and ``strength``.
EDIT_FIELDS = frozenset({"image", "image[]", "mask", "strength", "input_fidelity", "markup"})
_FILES = frozenset({"image", "image[]", "mask", "markup"})

#: Every part the form may have.
_PARTS = KNOWN_FIELDS | EDIT_FIELDS


def _fields(parts: list[tuple[str, str | bytes]]) -> tuple[dict[str, object], dict[str, bytes]]:
    """The form's text fields (typed) and files, each given once."""
    values: dict[str, object] = {}
    files: dict[str, bytes] = {}
    for name, value in parts:
        check_known(name, _PARTS)
        if name in values or name in files or (name in ("image", "image[]") and "image" in files):
            raise invalid(f"{name}: given more than once; this server edits one image", name)
        if name in _FILES:
            if not isinstance(value, bytes):
                raise invalid(f"{name}: must be a file", name, "invalid_type")
            files["image" if name == "image[]" else name] = value
        elif isinstance(value, bytes):
            raise invalid(f"{name}: must be a form field, not a file", name, "invalid_type")
        else:
            values[name] = form_value(name, value)
    if "markup" in files:
        raise invalid("markup: is not supported by this server", "markup", "unsupported_value")
    if "image" not in files:
        raise invalid("image: an image file is required", "image", "missing_required_parameter")
    return values, files


def _transparent(image: Image.Image) -> Image.Image | None:
    """White where ``image`` is fully transparent (mode ``L``), if it has transparency."""
    if image.mode not in ("RGBA", "LA", "PA") and "transparency" not in image.info:
        return None
    alpha = image.convert("RGBA").getchannel("A")
    return alpha.point(lambda level: 255 if level == 0 else 0)


def _output_size(
    size: str | None, image: tuple[int, int], capabilities: RunnerCapabilities | None
) -> tuple[int, int]:
    """The output's ``(width, height)``: ``size``, or without one the image's, fitted.

    Fitted: each side of the image rounded to the nearest multiple of the
    runner's ``size_multiple`` (ties up; one multiple at least), or the runner's
    fixed size if it has one.
    """
    if size is not None and size != "auto":
        return parse_size(size)
    if capabilities is None:
        return image
    if capabilities.fixed_size is not None:
        height, width = capabilities.fixed_size
        return width, height
    step = capabilities.size_multiple
    width, height = (max(step, (side + step // 2) // step * step) for side in image)
    return width, height


def _admit(
    parsed: GenerationBody,
    config: ServeConfig,
    admission: Admission,
    deadline_header: str | None,
    size: tuple[int, int],
    image: tuple[int, int],
) -> None:
    """Refuse the edit as the engine would, from its fields and its image's header (L4).

    Nothing is decoded yet: a size, ``n`` or step count the engine refuses costs
    no decode, resize or copy. Without a ``size``, a size the engine refuses is
    the image's: the error names ``image`` and says to send a ``size``.
    """
    if not admission.takes_images:
        raise invalid("image: this runner does not take an input image", "image")
    probe = job_from_body(parsed, config, deadline_header=deadline_header, size=size).request
    try:
        admission.check(probe)
    except InvalidRequestError as exc:
        if parsed.size not in (None, "auto") or exc.field not in ("height", "width"):
            raise api_error_from(exc) from None
        raise invalid(
            f"image: without a size, its {image[0]}x{image[1]} makes a {size[0]}x{size[1]}"
            f" output, and {exc}; send a size (WIDTHxHEIGHT) to resize it",
            "image",
        ) from None


def _build(
    values: dict[str, object],
    files: dict[str, bytes],
    parsed: GenerationBody,
    config: ServeConfig,
    limits: UploadLimits,
    admission: Admission,
    deadline_header: str | None,
) -> ImageJob:
    """Check the uploads' headers, then decode, size and build the job (a worker thread's work)."""
    from PIL import Image

    image = read_header(files["image"], "image", limits)
    given = read_header(files["mask"], "mask", limits) if "mask" in files else None
    if given is not None and given.size != image.size:
        raise invalid(
            f"mask: is {given.size[0]}x{given.size[1]}, the image"
            f" {image.size[0]}x{image.size[1]}: they must be the same size",
            "mask",
        )
    width, height = _output_size(parsed.size, image.size, admission.capabilities)
    sized = parsed.size not in (None, "auto")
    if sized and (width, height) != image.size and width * height > limits.max_pixels:
        raise ApiError(
            413,
            f"size: {width}x{height} is more than the {limits.max_pixels} pixels this server takes",
            param="size",
            code="image_too_large",
        )
    _admit(parsed, config, admission, deadline_header, (width, height), image.size)
    decode(image, "image")
    mask: Image.Image | None = None
    if given is not None:
        decode(given, "mask")
        mask = _transparent(given) or given.convert("L")
    else:
        found = _transparent(image)
        if found is not None and found.getextrema()[1] == 255:
            mask = found
    try:
        picture = image.convert("RGB")
    except (ValueError, OSError):
        raise invalid(
            f"image: its mode {image.mode!r} cannot be read as RGB", "image", "invalid_image"
        ) from None
    if (width, height) != image.size:
        picture = picture.resize((width, height), Image.Resampling.LANCZOS)
        if mask is not None:
            mask = mask.resize((width, height), Image.Resampling.LANCZOS)
    edit: dict[str, Any] = {"image": picture, "mask": mask}
    if "strength" in values:
        edit["strength"] = values["strength"]
    return job_from_body(
        parsed,
        config,
        deadline_header=deadline_header,
        edit=edit,
        size=(width, height),
        events="image_edit",
    )


async def parse_edit_form(
    scope: Scope, body: bytes, config: ServeConfig, limits: UploadLimits, admission: Admission
) -> ImageJob:
    """Parse and check an edit form; decode its images in a thread; build the job.

    The fields are checked before any image is decoded, and so are the images'
    headers and the request against the engine's limits (``admission``).

    Raises:
        ApiError: 400 naming the field at fault, 413 for an image over the pixel limit.

    Cancellation:
        Safe: a decode already running in its thread finishes and is dropped.
    """
    values, files = _fields(await read_form(scope, body, limits))
    parsed = validate_body({k: v for k, v in values.items() if k not in EDIT_FIELDS})
    if "strength" in values:
        strength = values["strength"]
        if not isinstance(strength, float) or not 0.0 < strength <= 1.0:
            raise invalid(f"strength: must be > 0 and <= 1, got {shown(strength)}", "strength")
    deadline_header = header(scope, DEADLINE_HEADER)
    return await anyio.to_thread.run_sync(
        _build, values, files, parsed, config, limits, admission, deadline_header
    )
