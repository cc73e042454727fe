"""Blobs in an S3-compatible object store (``--blobs s3://bucket/prefix``), with a local read cache.

The object store is the truth; the data dir's ``blobs/`` becomes a cache of it plus the temp files
of bodies on their way in. A blob is acknowledged only once the store has it: ``adopt`` uploads
the fsynced temp file under ``prefix/<content id>`` first and only then moves it into the cache,
so a replica killed at any moment leaves either an uploaded blob (an orphan if its row was never
committed; removed by age, see ``orphan_age``) or nothing. Reads go through ``path``, which fetches
a blob missing from the cache (written by another replica) into it first. Large pulls can skip the
coordinator altogether: ``presigned_url`` gives a short-lived GET URL the API answers with a redirect.

Endpoint and credentials are boto3's usual ones (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, ~/.aws), so the same code talks to AWS S3, MinIO or
moto's server. A store that cannot be reached is ``BackendUnavailable`` (503 + Retry-After), one
log line naming it.

A bucket that disappears while we run (the object store restarted empty, or someone deleted it) is
created again by the first request that finds it gone (at most once per BUCKET_RECHECK_S), and that
request goes on: pushes used to get 503 "NoSuchBucket" until the coordinator was restarted, since
the bucket was only made at start. The store then calls ``on_lost`` so that the blobs the manifest
still names are put back from this replica's cache (``restore``; coordinator/storage/expert_store.py repairs).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Literal, TypeVar
from urllib.parse import urlsplit

import boto3
import botocore.exceptions
from botocore.config import Config

from coordinator.storage.backends.errors import BackendUnavailable, log_outage
from coordinator.storage.blobs import BlobStore
from protocol.files import fsync_dir
from protocol.integrity import hex_of, is_content_id

log = logging.getLogger(__name__)
T = TypeVar("T")

BUCKET_RECHECK_S = 5.0
"""A missing bucket is looked for (and made again) at most this often: a store that keeps failing is not hammered."""
ORPHAN_AGE_S = 3600.0
"""Unrecorded blobs younger than this are left alone at start: another replica may be about to record them."""
PRESIGN_SECONDS = 300


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (bucket, "some/prefix/"); ValueError naming the expected form."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ValueError(f"--blobs must look like s3://bucket/prefix, got {url!r}")
    prefix = parts.path.strip("/")
    return parts.netloc, prefix + "/" if prefix else ""


class S3BlobStore(BlobStore):
    """BlobStore whose blobs live in a bucket; ``root`` holds the local cache and temp files."""

    def __init__(self, root: Path, url: str, orphan_age: float = ORPHAN_AGE_S) -> None:
        super().__init__(root)
        self.url = url
        self.bucket, self.prefix = parse_s3_url(url)
        self.orphan_age = orphan_age
        self.s3 = boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None,
                               config=Config(retries={"max_attempts": 3, "mode": "standard"},
                                             connect_timeout=5, read_timeout=60))
        self._bucket_guard = threading.Lock()
        self._open_bucket()
        self._bucket_checked, self._bucket_there = time.monotonic(), True

    def key(self, digest: str) -> str:
        return self.prefix + digest

    @property
    def location(self) -> str:
        return f"{self.url} (--blobs)"

    # the bucket: made at start, and again when it is found gone --------------------------------

    def _open_bucket(self) -> bool:
        """Make sure the bucket exists; True if it had to be created."""
        with self._unavailable_as_503("open the bucket"):
            try:
                self.s3.head_bucket(Bucket=self.bucket)
                return False
            except botocore.exceptions.ClientError as exc:
                if error_code(exc) not in ("404", "NoSuchBucket"):
                    raise
            try:
                self.s3.create_bucket(Bucket=self.bucket)
            except botocore.exceptions.ClientError as exc:
                if error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise  # another replica made it a moment ago: fine
            return True

    def _bucket_lost(self) -> bool:
        """A request found the bucket gone: make it again (at most once per BUCKET_RECHECK_S); True if it exists now."""
        with self._bucket_guard:
            if time.monotonic() - self._bucket_checked < BUCKET_RECHECK_S:
                return self._bucket_there  # looked moments ago (another request): no second look yet
            self._bucket_checked, self._bucket_there = time.monotonic(), False
            created = self._open_bucket()  # BackendUnavailable if the store does not answer
            self._bucket_there = True
        if created:
            log.error("blob backend S3 %s: bucket %r was gone (the object store lost its data?); created it again; "
                      "blobs the manifest names are re-uploaded from this replica's cache", self.url, self.bucket)
            if self.on_lost is not None:
                self.on_lost()
        return True

    def _in_bucket(self, action: str, call: Callable[[], T]) -> T:
        """``call()``; if it finds no bucket, the bucket is made again and ``call()`` tried once more."""
        with self._unavailable_as_503(action):
            try:
                return call()
            except Exception as exc:
                if error_code(exc) != "NoSuchBucket" or not self._bucket_lost():
                    raise
            return call()

    # writes: upload first, then the local cache ----------------------------------------------

    def adopt(self, tmp: Path, digest: str | None = None, sync: bool = True) -> str:
        with self._digests_guard:
            received = self._received_digests.get(tmp)
        digest = digest or received or super().digest_of(tmp)
        key = self.key(digest)
        self._in_bucket(f"store blob {digest[:19]}", lambda: self.s3.upload_file(str(tmp), self.bucket, key))
        return super().adopt(tmp, digest, sync)

    def delete(self, digest: str) -> None:
        key = self.key(digest)
        self._in_bucket(f"delete blob {digest[:19]}", lambda: self.s3.delete_object(Bucket=self.bucket, Key=key))
        super().delete(digest)

    def missing(self, digests: Iterable[str]) -> set[str]:
        """Those of ``digests`` not in the bucket (one listing of the prefix, whatever their number)."""
        wanted = set(digests)
        if not wanted:
            return set()
        return wanted - set(self._listed())

    def restore(self, digest: str) -> bool:
        """Upload a blob the bucket lost from this replica's cache, if the cache holds it whole (its hash checked)."""
        cached = super().path(digest)
        if not cached.is_file() or not self.verify(digest):
            return False
        key = self.key(digest)
        self._in_bucket(f"restore blob {digest[:19]}", lambda: self.s3.upload_file(str(cached), self.bucket, key))
        return True

    # reads: the cache, filled from the bucket --------------------------------------------------

    def path(self, digest: str) -> Path:
        local = super().path(digest)
        if not local.is_file() and is_content_id(digest):
            self._fetch(digest, local)
        return local

    def exists(self, digest: str) -> bool:
        try:
            self.s3.head_object(Bucket=self.bucket, Key=self.key(digest))
            return True
        except botocore.exceptions.ClientError:
            return False

    def _fetch(self, digest: str, local: Path) -> None:
        """Download a blob into the cache (temp file, then rename); absent in the bucket: leave it absent."""
        tmp = self.new_temp()
        try:
            with self._unavailable_as_503(f"read blob {digest[:19]}"):
                try:
                    self.s3.download_file(self.bucket, self.key(digest), str(tmp))
                except botocore.exceptions.ClientError as exc:
                    if error_code(exc) in ("404", "NoSuchKey"):
                        self._bucket_lost()  # (a HEAD cannot tell a missing bucket from a missing key)
                        return  # pruned: the caller's open() raises FileNotFoundError, as for a local blob
                    raise
            local.parent.mkdir(exist_ok=True)
            os.replace(tmp, local)
            fsync_dir(local.parent)
        finally:
            tmp.unlink(missing_ok=True)

    def digests(self) -> Iterator[str]:
        """Blobs in the bucket old enough that no replica can still be recording them."""
        cutoff = time.time() - self.orphan_age
        return iter([name for name, modified in self._listed().items() if modified < cutoff])

    def _listed(self) -> dict[str, float]:
        """Every blob under the prefix, with the time it was written."""
        def listing() -> dict[str, float]:
            found = {}
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
                for item in page.get("Contents", []):
                    name = item["Key"][len(self.prefix):]
                    if is_content_id(name):
                        found[name] = item["LastModified"].timestamp()
            return found
        return self._in_bucket("list blobs", listing)

    def remote_size(self, digest: str) -> int:
        """Bytes of the blob in the bucket (0 if absent)."""
        with self._unavailable_as_503(f"read blob {digest[:19]}"):
            try:
                return int(self.s3.head_object(Bucket=self.bucket, Key=self.key(digest))["ContentLength"])
            except botocore.exceptions.ClientError as exc:
                if error_code(exc) in ("404", "NoSuchKey"):
                    return 0
                raise

    def presigned_url(self, digest: str, seconds: int = PRESIGN_SECONDS) -> str:
        """A GET URL for the blob valid for ``seconds`` (no credentials needed by whoever follows it)."""
        return self.s3.generate_presigned_url("get_object", Params={"Bucket": self.bucket, "Key": self.key(digest)},
                                              ExpiresIn=seconds)

    def cache_path(self, digest: str) -> Path:
        return self.root / hex_of(digest)[:2] / digest

    def _unavailable_as_503(self, action: str):
        return _S3Errors(self.url, action)


def error_code(exc: BaseException) -> str | None:
    """The S3 error code of ``exc``, also when boto3 wrapped it (upload_file's S3UploadFailedError keeps the
    ClientError as its context), else None."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, botocore.exceptions.ClientError):
            return seen.response.get("Error", {}).get("Code")
        seen = seen.__cause__ or seen.__context__
    return None


class _S3Errors:
    """Context manager: the store unreachable or failing -> BackendUnavailable, one log line naming it."""

    def __init__(self, url: str, action: str) -> None:
        self.url, self.action = url, action

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> Literal[False]:  # raises BackendUnavailable, never swallows
        if exc is None:
            return False
        retryable = (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectionClosedError,
                     botocore.exceptions.ReadTimeoutError, botocore.exceptions.ConnectTimeoutError)
        server_side = isinstance(exc, botocore.exceptions.ClientError) and \
            str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")).startswith("5")
        upload = type(exc).__name__ == "S3UploadFailedError"
        no_bucket = error_code(exc) == "NoSuchBucket"  # gone, and made again moments ago by another request
        if isinstance(exc, retryable) or server_side or upload or no_bucket:
            log_outage(log, self.url, "blob backend S3 %s failed to %s: %s", self.url, self.action, exc)
            raise BackendUnavailable(f"the coordinator's object store (S3 {self.url}) could not {self.action}; "
                                     "nothing was recorded, try again", backend="s3") from None
        return False
