"""One codec of ``GenerationRequest``: to a record of plain data and back, every field.

A request leaves the process or outlives it in three places, and each reads the
same record:

- the durable video jobs keep it as JSON (``serve``'s job store, L77): a restart
  submits exactly the request that was accepted, adapters and all;
- a parallel group's plan carries a joining request to every rank (pickled);
- a checkpoint's envelope names the request it belongs to by a digest of the
  fields that decide its output (``request_fingerprint``, L78), so a checkpoint
  is restored only into the request that made it; a result cache's key (L95) is
  made of the same fields (``output_record``).

``request_record`` walks ``dataclasses.fields(GenerationRequest)``: a field added
to the request is carried by all three at once (a plain value as it is; a field
of another type needs its entry in ``_ENCODE`` and ``_DECODE``, and the codec's
test fails until it has one).

Images (``image``, ``mask``: CPU ``float32`` tensors once admitted) are written
one of three ways: ``"tensor"`` keeps the tensor (for pickle), ``"text"`` makes
JSON text that decodes to the same tensor bit for bit (a PNG when the tensor is
exactly 8-bit levels, as every uploaded picture is; its float32 bytes otherwise),
``"digest"`` a SHA-256 of its shape and bytes (for the fingerprint).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeAlias

from ._request import GenerationRequest
from ._sampling import parse_sampler, sampler_record
from ._stepcache import StepCache, parse_step_cache

__all__ = [
    "ImageMode",
    "output_record",
    "request_fingerprint",
    "request_from_record",
    "request_record",
]

#: How ``request_record`` writes an image: see the module's docstring.
ImageMode: TypeAlias = Literal["tensor", "text", "digest"]

#: Fields that do not change a request's output: its place, its previews, its owner.
NOT_OUTPUT = frozenset({"priority", "deadline_s", "preview_every", "tenant"})

_IMAGES = ("image", "mask")


def request_record(request: GenerationRequest, *, images: ImageMode = "text") -> dict[str, Any]:
    """Every field of ``request`` as plain data (JSON data with ``images="text"``, when the
    request's ``extra`` values are JSON data, as an HTTP body's are)."""
    record: dict[str, Any] = {}
    for item in dataclasses.fields(request):
        value = getattr(request, item.name)
        if value is None:
            record[item.name] = None
        elif item.name in _IMAGES:
            record[item.name] = _IMAGE_WRITERS[images](value)
        else:
            record[item.name] = _ENCODE.get(item.name, _plain)(value)
    return record


def request_from_record(record: Mapping[str, Any]) -> GenerationRequest:
    """The request ``request_record`` wrote (``images`` ``"text"`` or ``"tensor"``), validated
    again as any request is. Fields a record lacks take their defaults (a record of an
    earlier version).

    Raises:
        InvalidRequestError: a field's value is refused (``field`` names it).
        ValueError: the record names a field ``GenerationRequest`` does not have, or an
            image is unreadable.
    """
    unknown = sorted(set(record) - _FIELDS)
    if unknown:
        raise ValueError(f"not a request record: unknown fields {unknown[:3]}")
    fields: dict[str, Any] = {}
    for name, value in record.items():
        if value is None:
            fields[name] = None
        elif name in _IMAGES:
            fields[name] = _read_image(value)
        else:
            fields[name] = _DECODE.get(name, _plain)(value)
    return GenerationRequest(**fields)


def output_record(request: GenerationRequest) -> dict[str, Any]:
    """The fields that decide ``request``'s output as plain data, its images as digests:
    every field but its priority, deadline, previews and tenant (``NOT_OUTPUT``). A
    checkpoint's fingerprint (L78) and a result cache's key (L95) are made of it."""
    record = request_record(request, images="digest")
    for name in NOT_OUTPUT:
        del record[name]
    return record


def request_fingerprint(request: GenerationRequest) -> str:
    """A digest of the fields that decide ``request``'s output (L78): not its priority,
    deadline, previews or tenant."""
    record = output_record(request)
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


_FIELDS = frozenset(item.name for item in dataclasses.fields(GenerationRequest))


def _plain(value: Any) -> Any:
    return value


def _cache_record(cache: StepCache) -> dict[str, Any]:
    return dataclasses.asdict(cache)


_ENCODE: dict[str, Callable[[Any], Any]] = {
    "extra": dict,
    "cache": _cache_record,
    "sampler": sampler_record,
    "adapters": lambda pairs: [[name, scale] for name, scale in pairs],
}

_DECODE: dict[str, Callable[[Any], Any]] = {
    "cache": parse_step_cache,
    "sampler": parse_sampler,
    "adapters": lambda pairs: [tuple(pair) for pair in pairs],
}


# -- images ----------------------------------------------------------------------


def _image_text(tensor: Any) -> dict[str, Any]:
    """``{"png": base64}`` when the tensor is exactly 8-bit levels; else its float32 bytes."""
    import torch

    levels = (tensor * 255).round().clamp(0, 255).to(torch.uint8)
    if torch.equal(levels.to(torch.float32) / 255, tensor):
        import PIL.Image

        planes = levels.permute(1, 2, 0).contiguous().numpy()
        picture = PIL.Image.fromarray(planes[:, :, 0] if planes.shape[2] == 1 else planes)
        data = io.BytesIO()
        picture.save(data, format="PNG")
        return {"png": base64.b64encode(data.getvalue()).decode("ascii")}
    raw = tensor.contiguous().numpy().astype("<f4").tobytes()
    return {"float32": base64.b64encode(raw).decode("ascii"), "shape": list(tensor.shape)}


def _image_digest(tensor: Any) -> str:
    digest = hashlib.sha256(repr(list(tensor.shape)).encode())
    digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


_IMAGE_WRITERS: dict[ImageMode, Callable[[Any], Any]] = {
    "tensor": _plain,
    "text": _image_text,
    "digest": _image_digest,
}


def _read_image(value: Any) -> Any:
    """The tensor an image's record holds (a tensor is itself; a bare string is the PNG
    text of an earlier version's job record)."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, str):
        value = {"png": value}
    if not isinstance(value, Mapping):
        raise ValueError(f"not an image record: {type(value).__name__}")
    if "png" in value:
        import PIL.Image

        with PIL.Image.open(io.BytesIO(base64.b64decode(value["png"]))) as picture:
            levels = np.asarray(picture.convert("L" if picture.mode in ("L", "1") else "RGB"))
        tensor = torch.from_numpy(np.array(levels, copy=True))
        tensor = tensor[None] if tensor.ndim == 2 else tensor.permute(2, 0, 1)
        return tensor.to(torch.float32) / 255
    shape = [int(size) for size in value["shape"]]
    array = np.frombuffer(base64.b64decode(value["float32"]), dtype="<f4")
    return torch.from_numpy(array.copy()).reshape(shape)
