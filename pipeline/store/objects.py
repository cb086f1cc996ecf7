"""Object stores with conditional writes: a local directory, or S3 through boto3.

``put(key, data, if_match=etag)`` succeeds only if the object still has that ETag;
``put(key, data, if_none_match=True)`` only if it does not exist. Anything else raises
PreconditionFailed, so two writers can never both win a race.
"""

from __future__ import annotations

import fcntl
import hashlib
from pathlib import Path
from typing import Protocol

from pipeline.store.fs import atomic_write_local
from pipeline.store.s3 import StoreUnavailable, boto3_s3, refused, unreachable
from schemas.config import S3Config

__all__ = ["LocalStore", "ObjectStore", "PreconditionFailed", "S3Store", "StoreUnavailable", "open_store"]


class PreconditionFailed(RuntimeError):
    """The object changed (or appeared) since it was read."""


_CREDENTIAL_CODES = (
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "ExpiredToken",
    "InvalidToken",
    "403",
)


def _s3_error(uri: str, key: str, e: Exception) -> Exception | None:
    """A clear StoreUnavailable for refused credentials or an unreachable endpoint; None otherwise."""
    from botocore.exceptions import ClientError, ConnectionError, EndpointConnectionError

    if isinstance(e, ClientError):
        code = e.response["Error"]["Code"]
        if code in _CREDENTIAL_CODES or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 403:
            return refused(uri, key, code)
        return None
    if isinstance(e, EndpointConnectionError | ConnectionError):
        return unreachable(uri, e)
    return None


class ObjectStore(Protocol):
    uri: str

    def get(self, key: str) -> tuple[bytes, str] | None: ...
    def put(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str: ...
    def list(self, prefix: str) -> list[str]: ...
    def delete(self, key: str, *, if_match: str | None = None) -> None: ...


class LocalStore:
    """A directory; conditional writes are serialised with a per-key flock."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        self.uri = str(self.root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if self.root not in p.parents:
            raise ValueError(f"registry key {key!r} escapes the registry root")
        return p

    def get(self, key: str) -> tuple[bytes, str] | None:
        p = self._path(key)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            return None
        return data, hashlib.sha256(data).hexdigest()

    def put(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str:
        p = self._path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        lock = p.parent / f".{p.name}.lock"
        with open(lock, "a+") as lf:
            fcntl.flock(lf, fcntl.LOCK_EX)
            cur = self.get(key)
            if if_none_match and cur is not None:
                raise PreconditionFailed(f"{key} already exists")
            if if_match is not None and (cur is None or cur[1] != if_match):
                raise PreconditionFailed(f"{key} changed since it was read")
            atomic_write_local(p, data)
        return hashlib.sha256(data).hexdigest()

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        p = self._path(key)
        lock = p.parent / f".{p.name}.lock"
        if not p.parent.exists():
            return
        with open(lock, "a+") as lf:
            fcntl.flock(lf, fcntl.LOCK_EX)
            cur = self.get(key)
            if cur is None:
                return
            if if_match is not None and cur[1] != if_match:
                raise PreconditionFailed(f"{key} changed since it was read")
            p.unlink()

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix
        if not base.exists():
            return []
        return sorted(
            str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file() and not p.name.startswith(".")
        )


class S3Store:
    """s3://bucket/prefix through boto3; S3 conditional writes (If-Match / If-None-Match)."""

    def __init__(self, uri: str, s3: S3Config | None = None):
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        self.uri, self.bucket, self.prefix = uri, bucket, prefix.strip("/")
        self.client = boto3_s3(s3)  # credentials from the environment / AWS chain, never stored

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def get(self, key: str) -> tuple[bytes, str] | None:
        from botocore.exceptions import ClientError

        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as e:
            if e.response["Error"]["Code"] in ("NoSuchKey", "404"):
                return None
            raise _s3_error(self.uri, key, e) or e from None
        except Exception as e:
            raise _s3_error(self.uri, key, e) or e from None
        return r["Body"].read(), r["ETag"]

    def put(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str:
        from botocore.exceptions import ClientError

        kw: dict = {}
        if if_match is not None:
            kw["IfMatch"] = if_match
        if if_none_match:
            kw["IfNoneMatch"] = "*"
        try:
            r = self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **kw)
        except ClientError as e:
            code = e.response["Error"]["Code"]
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise PreconditionFailed(f"{key}: {code}") from None
            raise _s3_error(self.uri, key, e) or e from None
        except Exception as e:
            raise _s3_error(self.uri, key, e) or e from None
        return r["ETag"]

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        from botocore.exceptions import ClientError

        kw = {"IfMatch": if_match} if if_match is not None else {}
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key), **kw)
        except ClientError as e:
            code = e.response["Error"]["Code"]
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("NoSuchKey",) or status == 404:
                return
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise PreconditionFailed(f"{key}: {code}") from None
            raise _s3_error(self.uri, key, e) or e from None
        except Exception as e:
            raise _s3_error(self.uri, key, e) or e from None

    def list(self, prefix: str) -> list[str]:
        out = []
        strip = len(self.prefix) + 1 if self.prefix else 0
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix)
            ):
                out += [o["Key"][strip:] for o in page.get("Contents", [])]
        except Exception as e:
            raise _s3_error(self.uri, prefix, e) or e from None
        return sorted(out)


def open_store(uri: str, s3: S3Config | None = None) -> ObjectStore:
    return S3Store(uri, s3) if uri.startswith("s3://") else LocalStore(uri)
