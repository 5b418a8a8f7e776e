"""Where ``response_format: "url"`` outputs are kept (L97): ``OutputStore`` and its two kinds.

An output store keeps files by key: ``FolderStore``, a local folder (a volume the
replicas share), and ``S3Store``, a bucket of any S3-compatible server through
boto3 (the ``s3`` extra). Every method blocks (the disk, the network): the serving
layer (``_output_urls``) calls them from worker threads, never in the event loop.

Keys are paths of safe characters (``KEY``) made by the server, never by a client;
the last part of a key starts with the second its object expires::

    images/img-3f.../1796139679-0.png
    videos/video_00000001.../1796139679-video.mp4

so a sweep lists the keys and deletes the expired ones without reading any object's
metadata, the same way on a folder as on a bucket, and leaves alone what it did not
make (a key without that form).

Objects are written atomically: a folder's by a temporary file in the same folder,
``fsync`` and ``rename`` (a reader sees the whole file or none); a bucket's by one
``PutObject``, which S3 applies whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable

from .jobs._files import write_atomically

__all__ = [
    "CONTENT_TYPES",
    "KEY",
    "FolderStore",
    "OutputStore",
    "OutputStoreError",
    "Reader",
    "S3Store",
    "StoredFile",
    "expiry_of",
    "output_store",
]

_log = logging.getLogger("omni_trio.serve")

#: A key: parts of letters, digits, ``.``, ``_`` and ``-``, none starting with a dot
#: (so no ``..``, no hidden or temporary file), joined by ``/``; at most 512 characters.
KEY = re.compile(r"(?=.{1,512}\Z)[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)*")

#: The expiry that starts the last part of a key: seconds since the epoch.
_EXPIRY = re.compile(r"([0-9]{1,12})-[^/]*\Z")

#: The media type of each extension the server writes.
CONTENT_TYPES = {
    "png": "image/png",
    "jpeg": "image/jpeg",
    "webp": "image/webp",
    "mp4": "video/mp4",
}

#: A temporary file a killed writer left in a folder store is removed by the store's
#: ``open`` once it is this old (seconds; picked without measurement: far longer than
#: any write, so a replica never removes another's write in progress).
STALE_TEMPORARY_S = 3600.0

#: The most keys one S3 ``DeleteObjects`` call takes.
_S3_BATCH = 1000


class OutputStoreError(Exception):
    """The output store failed: it cannot be opened, or a read or write failed.

    The message says which store and what failed, in one line; the cause is chained.
    """


def expiry_of(key: str) -> int | None:
    """The second (since the epoch) the object of ``key`` expires; ``None``: not a key
    the server made."""
    match = _EXPIRY.search(key)
    return None if match is None else int(match[1])


def content_type(key: str) -> str:
    """The media type of ``key``'s object, from its extension."""
    return CONTENT_TYPES.get(key.rpartition(".")[2], "application/octet-stream")


class Reader(Protocol):
    """An object's bytes as they are read: a file, or an S3 object's body."""

    def read(self, size: int = -1, /) -> bytes:
        """Up to ``size`` bytes; ``b""`` at the end."""
        ...

    def close(self) -> None:
        """Let the file or the connection go."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredFile:
    """An object opened for reading: its size and its reader (close it)."""

    size: int
    reader: Reader


@runtime_checkable
class OutputStore(Protocol):
    """Files by key, written atomically, listed and deleted (L97). Every call blocks.

    Any object with these methods is a store; ``FolderStore`` and ``S3Store`` are the
    two this package has. A failure of any call raises ``OutputStoreError``.
    """

    def open(self) -> None:
        """Check the store can be used (make a folder; reach a bucket), before serving."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` under ``key`` atomically, replacing what was there."""
        ...

    def get(self, key: str) -> StoredFile | None:
        """Open ``key``'s object for reading; ``None`` if there is none."""
        ...

    def list_keys(self, prefix: str = "") -> list[str]:
        """The keys that start with ``prefix``, in no given order."""
        ...

    def delete(self, keys: Collection[str]) -> None:
        """Delete these keys' objects; a key with none is no error."""
        ...

    def close(self) -> None:
        """Let go of what the store holds (connections); idempotent."""
        ...


def check_key(key: str) -> str:
    """``key`` if it is one (``KEY``); raises ``ValueError`` otherwise."""
    if not KEY.fullmatch(key):
        raise ValueError(f"not an output key: {key[:40]!r}")
    return key


class FolderStore:
    """An output store in a local folder (or a volume every replica mounts).

    ``key`` is the file ``folder/key``; its parent folders are made as needed, and
    emptied ones are left (a sweep removes files, not folders it may race a write to).

    Args:
        folder: the folder; made by ``open`` if it does not exist.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)

    def __repr__(self) -> str:
        return f"FolderStore({str(self.folder)!r})"

    def _path(self, key: str) -> Path:
        return self.folder / check_key(key)

    def open(self) -> None:
        """Make the folder, and remove the temporary files a killed writer left there."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / f".probe-{os.getpid()}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
            limit = time.time() - STALE_TEMPORARY_S
            for path in self.folder.rglob(".*.tmp"):
                with contextlib.suppress(OSError):
                    if path.stat().st_mtime < limit:
                        path.unlink()
        except OSError as exc:
            raise OutputStoreError(
                f"the output folder {self.folder} cannot be used: {exc.strerror or exc}"
            ) from exc

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, data)
        except OSError as exc:
            raise OutputStoreError(
                f"the output folder {self.folder} cannot keep {key}: {exc.strerror or exc}"
            ) from exc

    def get(self, key: str) -> StoredFile | None:
        path = self._path(key)
        try:
            file: BinaryIO = path.open("rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as exc:
            raise OutputStoreError(
                f"the output folder {self.folder} cannot read {key}: {exc.strerror or exc}"
            ) from exc
        return StoredFile(size=os.fstat(file.fileno()).st_size, reader=file)

    def list_keys(self, prefix: str = "") -> list[str]:
        try:
            return [
                key
                for path in self._files()
                if (key := path.relative_to(self.folder).as_posix()).startswith(prefix)
                and KEY.fullmatch(key)
            ]
        except OSError as exc:
            raise OutputStoreError(
                f"the output folder {self.folder} cannot be listed: {exc.strerror or exc}"
            ) from exc

    def _files(self) -> Iterator[Path]:
        for root, folders, files in os.walk(self.folder):
            folders[:] = [name for name in folders if not name.startswith(".")]
            yield from (Path(root, name) for name in files if not name.startswith("."))

    def delete(self, keys: Collection[str]) -> None:
        for key in keys:
            try:
                self._path(key).unlink(missing_ok=True)
            except OSError as exc:
                raise OutputStoreError(
                    f"the output folder {self.folder} cannot delete {key}: {exc.strerror or exc}"
                ) from exc

    def close(self) -> None:
        pass


class S3Store:
    """An output store in a bucket of an S3-compatible server, through boto3 (``s3`` extra).

    The credentials, the region and the endpoint are boto3's own: the standard
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
    ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL_S3`` (or ``AWS_ENDPOINT_URL``) variables,
    a profile, an instance role. One client serves every thread (boto3's clients are
    thread-safe); it is made by ``open``, so the store itself is plain data until then
    (a Ray replica gets it pickled).

    Args:
        bucket: the bucket, which must exist (``open`` checks it can be reached).
        prefix: the keys' prefix in the bucket (``""``: none; a ``/`` is added).
        endpoint_url: the server (``http://127.0.0.1:9000`` for a MinIO or Ceph on the
            host); ``None``: boto3's (AWS, or the variables').
    """

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"bucket: must be a bucket's name, got {bucket!r}")
        self.bucket = bucket
        self.prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url
        self._client: Any = None

    def __repr__(self) -> str:
        where = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"S3Store({self.bucket!r}, {self.prefix!r}{where})"

    def __getstate__(self) -> dict[str, object]:
        return {"bucket": self.bucket, "prefix": self.prefix, "endpoint_url": self.endpoint_url}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.bucket, self.prefix = state["bucket"], state["prefix"]
        self.endpoint_url, self._client = state["endpoint_url"], None

    @property
    def _where(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def _failed(self, what: str, exc: Exception) -> OutputStoreError:
        return OutputStoreError(f"the output bucket {self._where} {what}: {_reason(exc)}")

    def open(self) -> None:
        """Make the client and check the bucket can be reached with these credentials."""
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise OutputStoreError(
                "an s3:// output store needs boto3: pip install 'omni_trio[s3]'"
            ) from exc
        if self._client is None:
            config = Config(s3={"addressing_style": "path"}) if self.endpoint_url else None
            session = boto3.session.Session()
            self._client = session.client("s3", endpoint_url=self.endpoint_url, config=config)
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            raise self._failed("cannot be reached", exc) from exc

    def _s3(self) -> Any:
        if self._client is None:
            self.open()
        return self._client

    def put(self, key: str, data: bytes) -> None:
        name = self.prefix + check_key(key)
        try:
            self._s3().put_object(
                Bucket=self.bucket,
                Key=name,
                Body=data,
                ContentType=content_type(key),
            )
        except OutputStoreError:
            raise
        except Exception as exc:
            raise self._failed(f"cannot keep {key}", exc) from exc

    def get(self, key: str) -> StoredFile | None:
        name = self.prefix + check_key(key)
        try:
            answer = self._s3().get_object(Bucket=self.bucket, Key=name)
        except OutputStoreError:
            raise
        except Exception as exc:
            if _code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._failed(f"cannot read {key}", exc) from exc
        return StoredFile(size=int(answer["ContentLength"]), reader=answer["Body"])

    def list_keys(self, prefix: str = "") -> list[str]:
        found: list[str] = []
        try:
            pages = self._s3().get_paginator("list_objects_v2")
            for page in pages.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for entry in page.get("Contents", ()):
                    key = str(entry["Key"]).removeprefix(self.prefix)
                    if KEY.fullmatch(key):
                        found.append(key)
        except OutputStoreError:
            raise
        except Exception as exc:
            raise self._failed("cannot be listed", exc) from exc
        return found

    def delete(self, keys: Collection[str]) -> None:
        names = [self.prefix + check_key(key) for key in keys]
        try:
            for start in range(0, len(names), _S3_BATCH):
                batch = [{"Key": name} for name in names[start : start + _S3_BATCH]]
                answer = self._s3().delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
                errors = answer.get("Errors") or ()
                if errors:
                    first = errors[0]
                    raise OutputStoreError(
                        f"the output bucket {self._where} cannot delete {first.get('Key')}:"
                        f" {first.get('Code')} ({len(errors)} keys not deleted)"
                    )
        except OutputStoreError:
            raise
        except Exception as exc:
            raise self._failed("cannot delete", exc) from exc

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()


def _error(exc: Exception) -> dict[str, Any]:
    """A botocore ``ClientError``'s ``Error`` (its ``Code``, ``Message``); ``{}`` for others."""
    response = getattr(exc, "response", None)
    error = response.get("Error") if isinstance(response, dict) else None
    return error if isinstance(error, dict) else {}


def _code(exc: Exception) -> str | None:
    code = _error(exc).get("Code")
    return None if code is None else str(code)


def _reason(exc: Exception) -> str:
    """One line of a boto3 error: its code and message, never a credential."""
    error = _error(exc)
    parts = [str(part) for part in (error.get("Code"), error.get("Message")) if part]
    if parts:
        return " ".join(parts)
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def output_store(location: str | os.PathLike[str]) -> FolderStore | S3Store:
    """The store a location names: ``s3://BUCKET[/PREFIX]`` a bucket (its endpoint from
    ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, as boto3 reads them), anything else a
    folder.

    Raises:
        ValueError: an ``s3://`` location without a bucket.
    """
    text = os.fspath(location)
    if text.startswith("s3://"):
        bucket, _, prefix = text.removeprefix("s3://").partition("/")
        return S3Store(bucket, prefix)
    return FolderStore(text)
