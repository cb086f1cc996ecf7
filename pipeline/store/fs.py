"""One filesystem abstraction (pyarrow.fs) for local paths and s3:// URIs, and the one atomic
local write every store uses. S3 access is resolved in :mod:`pipeline.store.s3`.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs as pafs

from pipeline.store.s3 import StoreUnavailable, arrow_errors, pyarrow_s3
from schemas.config import S3Config

log = logging.getLogger(__name__)


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def resolve(uri: str, s3: S3Config | None = None) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path) for a local path or s3://bucket/key."""
    if is_s3(uri):
        return pyarrow_s3(s3), uri.removeprefix("s3://").rstrip("/")
    return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())


def join(base: str, *parts: str) -> str:
    """Path join that resolves ``..`` (dataset versions point at their parents' shards)."""
    return posixpath.normpath(posixpath.join(base, *parts))


def exists(fs: pafs.FileSystem, path: str) -> bool:
    with arrow_errors(fs, path):
        return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    with arrow_errors(fs, path), fs.open_input_stream(path) as f:
        return f.read()


def atomic_write_bytes(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Publish ``data`` at ``path`` all at once: readers see the old file or the new one.

    Local: write a temporary sibling, fsync, rename. S3: a single PUT is already atomic.
    """
    if isinstance(fs, pafs.LocalFileSystem):
        atomic_write_local(path, data)
        return
    with arrow_errors(fs, path), fs.open_output_stream(path) as f:
        f.write(data)


class StoreFull(StoreUnavailable):
    """The local disk took no more bytes (ENOSPC)."""


@contextmanager
def full_disk_errors(path: str | os.PathLike) -> Iterator[None]:
    """ENOSPC while writing ``path`` as one line that says what to do."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise StoreFull(
            f"{os.fspath(path)}: no space left on the device: free space and rerun -- committed work "
            "is kept and resumed from, nothing partial was left"
        ) from None


def temporary_path(path: str, directory: str | None = None) -> str:
    """Where ``path`` is written before it is published: a hidden, unique sibling (or a name in
    ``directory``), so a listing tells it from a published file by its name alone."""
    where = os.path.dirname(path) if directory is None else directory
    return os.path.join(where, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")


def remove_unpublished(fs: pafs.FileSystem, directory: str, what: str) -> list[str]:
    """Delete the temporaries (``temporary_path``) a writer killed mid-write left in ``directory``,
    and return the published files. Only for a directory no live writer shares."""
    kept = []
    for path in list_files(fs, directory):
        if path.rsplit("/", 1)[-1].startswith("."):
            log.info("removing %s: %s that was never published", path, what)
            fs.delete_file(path)
        else:
            kept.append(path)
    return kept


def atomic_write_local(path: str | os.PathLike, data: bytes) -> None:
    """A temporary sibling, fsync, rename: a reader or a crash sees the old file or the new one."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = temporary_path(path)
    try:
        with full_disk_errors(path), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):  # a full disk or a kill mid-write leaves no partial sibling behind
            os.remove(tmp)
        raise


def publish_local_file(local_tmp: str, fs: pafs.FileSystem, path: str) -> None:
    """Move a finished local temp file to its final place (rename locally, upload to S3)."""
    if isinstance(fs, pafs.LocalFileSystem):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.replace(local_tmp, path)
        return
    # An S3 multipart upload becomes visible only when it completes: atomic.
    with arrow_errors(fs, path):
        pafs.copy_files(local_tmp, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    os.remove(local_tmp)


def list_files(fs: pafs.FileSystem, path: str) -> list[str]:
    with arrow_errors(fs, path):
        info = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=False))
    return sorted(i.path for i in info if i.type == pafs.FileType.File)


def list_dirs(fs: pafs.FileSystem, path: str) -> list[str]:
    with arrow_errors(fs, path):
        info = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=False))
    return sorted(i.path for i in info if i.type == pafs.FileType.Directory)


def delete_dir(fs: pafs.FileSystem, path: str) -> None:
    """Delete a directory and everything under it (S3: every object under the prefix)."""
    with arrow_errors(fs, path):
        if fs.get_file_info(path).type != pafs.FileType.NotFound:
            fs.delete_dir(path)
