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
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import boto3
import botocore.exceptions
from botocore.config import Config

from coordinator.backends.errors import BackendUnavailable, log_outage
from coordinator.blobs import BlobStore
from protocol.files import fsync_dir
from protocol.integrity import hex_of, is_content_id

log = logging.getLogger(__name__)

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
        with self._unavailable_as_503("open the bucket"):
            try:
                self.s3.head_bucket(Bucket=self.bucket)
            except botocore.exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket"):
                    raise
                self.s3.create_bucket(Bucket=self.bucket)

    def key(self, digest: str) -> str:
        return self.prefix + digest

    # writes: upload first, then the local cache ----------------------------------------------

    def adopt(self, tmp: Path, digest: str | None = None, sync: bool = True) -> str:
        with self._digests_guard:
            received = self._received_digests.get(tmp)
        digest = digest or received or super().digest_of(tmp)
        with self._unavailable_as_503(f"store blob {digest[:19]}"):
            self.s3.upload_file(str(tmp), self.bucket, self.key(digest))
        return super().adopt(tmp, digest, sync)

    def delete(self, digest: str) -> None:
        with self._unavailable_as_503(f"delete blob {digest[:19]}"):
            self.s3.delete_object(Bucket=self.bucket, Key=self.key(digest))
        super().delete(digest)

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
                    if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
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
        with self._unavailable_as_503("list blobs"):
            pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix)
            for page in pages:
                for item in page.get("Contents", []):
                    name = item["Key"][len(self.prefix):]
                    if is_content_id(name) and item["LastModified"].timestamp() < cutoff:
                        yield name

    def remote_size(self, digest: str) -> int:
        """Bytes of the blob in the bucket (0 if absent)."""
        with self._unavailable_as_503(f"read blob {digest[:19]}"):
            try:
                return int(self.s3.head_object(Bucket=self.bucket, Key=self.key(digest))["ContentLength"])
            except botocore.exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
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
        if isinstance(exc, retryable) or server_side or upload:
            log_outage(log, self.url, "blob backend S3 %s failed to %s: %s", self.url, self.action, exc)
            raise BackendUnavailable(f"the coordinator's object store (S3 {self.url}) could not {self.action}; "
                                     "nothing was recorded, try again", backend="s3") from None
        return False
