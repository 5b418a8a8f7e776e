"""The result cache's data (L95, L96): its configuration, its key, an output as it is kept.

- ``ResultCache``: the configuration (``EngineConfig.result_cache``): the bound in bytes,
  the folder of a cache on disk, and whose requests may share an entry (``scope``).
- ``ResultCacheStatistics``: what the cache did (``EngineStatistics.result_cache``).
- ``result_key``: the SHA-256 of everything that decides a request's output: the
  model's fingerprint (its runner's ``result_fingerprint()``), every output field of
  the request (``_codec.output_record``: its images as digests, its seed), each
  adapter's scale and the digest of its weights, and with scope ``"tenant"`` the
  tenant. ``None`` for a request that is never cached: no seed, an adapter whose
  weights are not known, an ``extra`` value that is not JSON data, a trajectory asked
  for (L100).
- ``KeptOutput``: an output's pixels as one immutable copy (``keep_output``, made in
  the materializer's thread); each hit gets tensors of its own from it (``tensors``).
- ``entry_bytes`` and ``read_entry``: an entry's file (a header with the payload's
  SHA-256, then the payload), so a cut or altered file is never read as an output.
- ``source_digest``: the digest of an adapter's weights (a file, a folder, a state dict).

Nothing here imports torch at module level, nor an event loop: the engine's threads
make the kept copy, the loop (``_resultstore``) holds the entries.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from ._codec import output_record
from ._validate import check_int, fail_config

if TYPE_CHECKING:
    import torch

    from ._request import GenerationRequest

__all__ = [
    "CorruptEntryError",
    "KeptOutput",
    "ResultCache",
    "ResultCacheStatistics",
    "ResultScope",
    "entry_bytes",
    "keep_output",
    "read_entry",
    "result_key",
    "source_digest",
]

#: Whose requests may share an entry: each tenant's own (``"tenant"``), or all
#: (``"global"``).
ResultScope: TypeAlias = Literal["tenant", "global"]

#: The version of the key's encoding and of the entry files: a change of either
#: misses every entry made before it (nothing is read in an old layout).
_VERSION = 1
#: The first bytes of an entry's file.
_MAGIC = b"omni_trio result\n"
#: How many bytes of a file are hashed at a time.
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultCache:
    """A result cache (L95, L96): an exact repeat of a seeded request gets the earlier output.

    Off by default (``EngineConfig.result_cache`` is ``None``). A request with an
    explicit ``seed`` whose output fields, adapters (by the digest of their weights)
    and model (the runner's ``result_fingerprint()``) equal an earlier completed
    request's gets a copy of that output at ``submit``, without reaching a worker; a
    request without a seed is never answered from it nor kept in it. Aborted and
    failed requests keep nothing.

    Args:
        max_bytes: the most bytes of outputs kept (float32 pixels: a 512 x 512 RGB
            image is 3 MiB); the least recently used go first. An output larger than
            this is not kept.
        folder: keep the outputs as files in this folder (made if missing), so they
            survive a restart; ``None``: in memory. Files are written whole under a
            temporary name and renamed into place; one cut short or altered is never
            read (a warning, and it is deleted). One folder per server: each bounds
            the files it knows.
        scope: ``"tenant"`` (the default): a hit never crosses tenants (the tenant is
            part of the key; L96); ``"global"``: every tenant's repeats share entries,
            which tells one tenant, by a hit's speed, that another made that request.
    """

    max_bytes: int
    folder: str | None = None
    scope: ResultScope = "tenant"

    def __post_init__(self) -> None:
        size = check_int(fail_config, "max_bytes", self.max_bytes, minimum=1, maximum=2**62)
        object.__setattr__(self, "max_bytes", size)
        if self.folder is not None:
            if not isinstance(self.folder, str | os.PathLike):
                fail_config("folder", f"must be a path or None, got {type(self.folder).__name__}")
            folder = os.fspath(self.folder)
            if not isinstance(folder, str) or not folder:
                fail_config("folder", "must be a non-empty str path")
            object.__setattr__(self, "folder", folder)
        if self.scope not in ("tenant", "global"):
            fail_config("scope", f"must be 'tenant' or 'global', got {self.scope!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultCacheStatistics:
    """What a result cache did (L95): counts since the engine opened, and what it holds now.

    ``hits`` counts the admitted requests answered from it, ``misses`` the admitted
    requests it could have answered (a seed, every adapter's weights known) and did
    not; requests it never answers count in neither. ``kept`` counts the outputs put
    in, ``evicted`` those its bound put out; ``entries`` and ``bytes`` are what it
    holds now (on disk, the files' sizes).
    """

    hits: int = 0
    misses: int = 0
    kept: int = 0
    evicted: int = 0
    entries: int = 0
    bytes: int = 0


def result_key(
    request: GenerationRequest,
    *,
    model: str,
    adapters: Mapping[str, str],
    scope: ResultScope,
) -> str | None:
    """The key of ``request``'s output in a result cache, or ``None``: never cached.

    Args:
        request: the request as admitted (its default step-cache policy applied).
        model: the runner's ``result_fingerprint()``.
        adapters: the digest of each loaded adapter's weights, by name.
        scope: with ``"tenant"``, the request's tenant is part of the key.
    """
    if request.seed is None or request.return_trajectory:
        return None  # L100: a trajectory is never kept, so its request never answered
    named = []
    for name, scale in request.adapter_pairs:
        digest = adapters.get(name)
        if digest is None:
            return None
        named.append([name, scale, digest])
    record = output_record(request)
    record["adapters"] = named
    whole: dict[str, Any] = {"v": _VERSION, "model": model, "request": record, "scope": scope}
    if scope == "tenant":
        whole["tenant"] = request.tenant
    try:
        text = json.dumps(whole, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return None  # an ``extra`` value that is not JSON data: nothing to compare it by
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class KeptOutput:
    """An output's pixels as a result cache keeps them: float32 bytes, immutable.

    ``shape`` is the images' ``[N, C, H, W]``, or a video's ``[N, F, C, H, W]``
    (``video``); the images of a video are its first frames, as in every output.
    """

    shape: tuple[int, ...]
    video: bool
    data: bytes

    @property
    def nbytes(self) -> int:
        """The bytes of its pixels."""
        return len(self.data)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A fresh copy as ``(images, video)``: a hit's own tensors, shared with nothing."""
        import numpy as np
        import torch

        array = np.frombuffer(self.data, dtype="<f4").astype(np.float32)  # a copy
        tensor = torch.from_numpy(array).reshape(self.shape)
        if self.video:
            return tensor[:, 0], tensor
        return tensor, None


def keep_output(images: torch.Tensor, video: torch.Tensor | None) -> KeptOutput:
    """A kept copy of an output (CPU float32, as the engine hands them out)."""
    tensor = video if video is not None else images
    data = tensor.contiguous().numpy().astype("<f4", copy=False).tobytes()
    return KeptOutput(tuple(tensor.shape), video is not None, data)


class CorruptEntryError(ValueError):
    """An entry's file is not a whole entry of this key (cut short, altered, another's)."""


def entry_bytes(key: str, kept: KeptOutput) -> bytes:
    """The file of an entry: the magic line, the header's length and JSON, the pixels."""
    header = json.dumps(
        {
            "v": _VERSION,
            "key": key,
            "shape": list(kept.shape),
            "video": kept.video,
            "dtype": "<f4",
            "bytes": kept.nbytes,
            "sha256": hashlib.sha256(kept.data).hexdigest(),
        },
        separators=(",", ":"),
    ).encode()
    return b"".join((_MAGIC, len(header).to_bytes(4, "big"), header, kept.data))


def read_entry(data: bytes, key: str) -> KeptOutput:
    """The output an entry's file holds, checked whole.

    Raises:
        CorruptEntryError: naming what is wrong.
    """
    start = len(_MAGIC) + 4
    if not data.startswith(_MAGIC) or len(data) < start:
        raise CorruptEntryError("not a result cache entry")
    end = start + int.from_bytes(data[len(_MAGIC) : start], "big")
    try:
        header = json.loads(data[start:end])
        shape = tuple(int(size) for size in header["shape"])
        video, size, digest = bool(header["video"]), int(header["bytes"]), header["sha256"]
        fields = (header["v"], header["key"], header["dtype"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptEntryError(f"its header is unreadable ({type(exc).__name__})") from None
    if fields != (_VERSION, key, "<f4") or len(shape) != (5 if video else 4):
        raise CorruptEntryError("its header is of another entry or version")
    payload = data[end:]
    if len(payload) != size or size != 4 * math.prod(shape):
        raise CorruptEntryError(f"it holds {len(payload)} bytes of pixels, its header {size}")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CorruptEntryError("its pixels do not match their SHA-256")
    return KeptOutput(shape, video, payload)


def source_digest(source: object) -> str | None:
    """The SHA-256 of an adapter's weights: a file's bytes, a folder's files (by relative
    path), or a state dict's tensors (by name, dtype, shape, bytes); ``None`` for anything
    else (a hub id; a state dict with a value that is not a tensor). Blocks: reads files.
    """
    digest = hashlib.sha256()
    if isinstance(source, Mapping):
        import torch

        for name in sorted(source, key=str):
            value = source[name]
            if not isinstance(value, torch.Tensor):
                return None
            tensor = value.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{name}\0{value.dtype}\0{list(value.shape)}\0".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()
    if not isinstance(source, str | os.PathLike):
        return None
    path = Path(os.fspath(source))
    if path.is_file():
        files = [("", path)]  # its bytes alone: a copy under another name is the same
    elif path.is_dir():
        files = sorted((str(p.relative_to(path)), p) for p in path.rglob("*") if p.is_file())
    else:
        return None
    for name, file in files:
        digest.update(f"{name}\0".encode())
        with file.open("rb") as reader:
            while chunk := reader.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()
