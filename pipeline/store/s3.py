"""How Strata reaches S3: one resolver from ``S3Config`` and the environment, used by the
pyarrow filesystem (datasets, runs) and by the boto3 client (the registry, leases).

Credentials are never taken from configs: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_SESSION_TOKEN when set, else the usual AWS chain; the endpoint comes from the config or
AWS_ENDPOINT_URL.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from schemas.config import S3Config


@dataclass(frozen=True)
class S3Access:
    endpoint: str | None  # None: AWS's own
    region: str
    access_key: str | None  # None: the AWS credential chain decides
    secret_key: str | None
    session_token: str | None


def s3_access(s3: S3Config | None = None) -> S3Access:
    """Resolved now (not cached): a credential exported after start-up is the one used."""
    s3 = s3 or S3Config()
    key = os.environ.get("AWS_ACCESS_KEY_ID")
    return S3Access(
        s3.endpoint(),
        s3.region,
        key,
        os.environ.get("AWS_SECRET_ACCESS_KEY", "") if key else None,
        os.environ.get("AWS_SESSION_TOKEN") if key else None,
    )


def pyarrow_s3(s3: S3Config | None = None):
    import pyarrow.fs as pafs

    a = s3_access(s3)
    kwargs: dict = {"region": a.region}
    if a.endpoint:
        scheme, _, host = a.endpoint.partition("://")
        kwargs.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
    if a.access_key:
        kwargs.update(access_key=a.access_key, secret_key=a.secret_key, session_token=a.session_token)
    return pafs.S3FileSystem(**kwargs)


def boto3_s3(s3: S3Config | None = None):
    import boto3

    a = s3_access(s3)
    keys = (
        {"aws_access_key_id": a.access_key, "aws_secret_access_key": a.secret_key, "aws_session_token": a.session_token}
        if a.access_key
        else {}
    )
    # A session of its own, so nothing is cached from an earlier client.
    return boto3.session.Session().client("s3", endpoint_url=a.endpoint, region_name=a.region, **keys)


class StoreUnavailable(RuntimeError):
    """The store refused us (credentials) or cannot be reached: one line that says which."""


def unreachable(uri: str, why: object) -> StoreUnavailable:
    return StoreUnavailable(
        f"{uri}: cannot reach the S3 endpoint ({why}); is it running? Re-run once it is back: "
        "every write is atomic, so nothing half-written is left"
    )


def refused(uri: str, key: str, code: str) -> StoreUnavailable:
    return StoreUnavailable(
        f"{uri}: the S3 server refused the request for {key} ({code}): check "
        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for this endpoint"
    )


# How pyarrow's S3 filesystem (the AWS C++ SDK) words the two failures a user can act on.
_ARROW_UNREACHABLE = ("NETWORK_CONNECTION", "Could not connect", "curlCode: 7", "Couldn't connect")
_ARROW_REFUSED = ("ACCESS_DENIED", "InvalidAccessKeyId", "SignatureDoesNotMatch", "HTTP response code: 403")


@contextmanager
def arrow_errors(fs, path: str) -> Iterator[None]:
    """pyarrow S3 errors on ``path`` as StoreUnavailable where they mean an unreachable endpoint
    or refused credentials; anything else (and any local filesystem's error) passes unchanged."""
    import pyarrow.fs as pafs

    try:
        yield
    except OSError as e:
        if not isinstance(fs, pafs.S3FileSystem):
            raise
        text = str(e)
        if any(m in text for m in _ARROW_UNREACHABLE):
            raise unreachable(f"s3://{path}", text.split(";")[-1].strip()[:160]) from None
        if any(m in text for m in _ARROW_REFUSED):
            raise refused(f"s3://{path}", path, "access denied") from None
        raise
