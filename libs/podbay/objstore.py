"""The object store (S3 through aiobotocore): bounded concurrency and bandwidth, multipart for large objects.

``ObjectStore`` is the seam between promotion logic and S3: every request waits for one of
``s3_concurrency`` slots and for its bytes in a token bucket of ``s3_bandwidth_mib_s`` (shared by uploads
and downloads of the process), objects above ``s3_multipart_threshold_mib`` go up as multipart uploads, and
botocore errors become :class:`~podbay.errors.StorageError` (retryable) at this boundary.
Keys come from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError

from podbay.config import Settings
from podbay.errors import StorageError

__all__ = ["ObjectStore", "ObjectInfo", "RateLimiter", "open_store"]

_MISSING = {"404", "NoSuchKey", "NotFound"}


def _raise_unless_missing(exc: Exception, what: str) -> None:
    """Return when ``exc`` (a botocore or OS error) says the object does not exist; otherwise raise
    ``StorageError("<what> failed: <exc>")`` from it."""
    if isinstance(exc, ClientError) and str(exc.response.get("Error", {}).get("Code")) in _MISSING:
        return
    raise StorageError(f"{what} failed: {exc}") from exc


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    last_modified: datetime


class RateLimiter:
    """A token bucket in bytes per second (0 = unlimited); ``take(n)`` waits until ``n`` bytes may pass.

    The bucket holds at most one second of tokens, and a request larger than that waits in proportion."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = bytes_per_s
        self._tokens = bytes_per_s
        self._last = time.monotonic()
        self._lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        async with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            if self._tokens < 0:
                await asyncio.sleep(-self._tokens / self.rate)
                self._last = time.monotonic()
                self._tokens = 0


class ObjectStore:
    """One bucket. Use :func:`open_store` to create one with its client."""

    def __init__(self, client: Any, bucket: str, *, concurrency: int, bandwidth_mib_s: float,
                 multipart_threshold: int) -> None:
        self.client = client
        self.bucket = bucket
        self.slots = asyncio.Semaphore(concurrency)
        self.limiter = RateLimiter(bandwidth_mib_s * (1 << 20))
        self.multipart_threshold = multipart_threshold

    async def ensure_bucket(self) -> None:
        """Create the bucket unless it exists. ``StorageError``."""
        try:
            await self.client.head_bucket(Bucket=self.bucket)
        except ClientError:
            try:
                await self.client.create_bucket(Bucket=self.bucket)
            except (ClientError, BotoCoreError) as exc:
                raise StorageError(f"cannot create bucket {self.bucket}: {exc}") from exc
        except (BotoCoreError, OSError) as exc:
            raise StorageError(f"object store did not answer: {exc}") from exc

    async def put(self, key: str, data: bytes, metadata: dict[str, str] | None = None) -> None:
        """Store ``data`` at ``key`` (multipart above the threshold). ``StorageError``."""
        await self.limiter.take(len(data))
        async with self.slots:
            try:
                if len(data) <= self.multipart_threshold:
                    await self.client.put_object(Bucket=self.bucket, Key=key, Body=data, Metadata=metadata or {})
                else:
                    await self._multipart(key, data, metadata or {})
            except (ClientError, BotoCoreError, OSError) as exc:
                raise StorageError(f"upload of {key} failed: {exc}") from exc

    async def _multipart(self, key: str, data: bytes, metadata: dict[str, str]) -> None:
        part = self.multipart_threshold
        up = await self.client.create_multipart_upload(Bucket=self.bucket, Key=key, Metadata=metadata)
        upload_id = up["UploadId"]
        try:
            parts = []
            for i, off in enumerate(range(0, len(data), part), start=1):
                r = await self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=i,
                                                  Body=data[off:off + part])
                parts.append({"PartNumber": i, "ETag": r["ETag"]})
            await self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                        MultipartUpload={"Parts": parts})
        except BaseException:
            with contextlib.suppress(Exception):
                await self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    async def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist. ``StorageError``."""
        async with self.slots:
            try:
                r = await self.client.get_object(Bucket=self.bucket, Key=key)
                async with r["Body"] as body:
                    data: bytes = await body.read()
            except (ClientError, BotoCoreError, OSError) as exc:
                _raise_unless_missing(exc, f"download of {key}")
                return None
        await self.limiter.take(len(data))
        return data

    async def head(self, key: str) -> int | None:
        """The object's size in bytes, or None when it does not exist. ``StorageError``."""
        async with self.slots:
            try:
                r = await self.client.head_object(Bucket=self.bucket, Key=key)
                return int(r["ContentLength"])
            except (ClientError, BotoCoreError, OSError) as exc:
                _raise_unless_missing(exc, f"head of {key}")
                return None

    async def delete(self, keys: list[str]) -> None:
        """Delete ``keys`` (missing ones are fine), up to 1,000 per request. ``StorageError``."""
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i:i + 1000]]
            async with self.slots:
                try:
                    await self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
                except (ClientError, BotoCoreError, OSError) as exc:
                    raise StorageError(f"delete failed: {exc}") from exc

    async def list(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        """Every object under ``prefix``. ``StorageError``."""
        try:
            paginator = self.client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                for o in page.get("Contents", []):
                    yield ObjectInfo(o["Key"], int(o["Size"]), o["LastModified"])
        except (ClientError, BotoCoreError, OSError) as exc:
            raise StorageError(f"listing {prefix} failed: {exc}") from exc


@contextlib.asynccontextmanager
async def open_store(settings: Settings) -> AsyncIterator[ObjectStore]:
    """An :class:`ObjectStore` on ``settings.s3_url``/``s3_bucket`` for the lifetime of the context."""
    session = get_session()
    config = AioConfig(s3={"addressing_style": "path"}, retries={"max_attempts": 3, "mode": "standard"},
                       max_pool_connections=max(10, settings.s3_concurrency * 2), connect_timeout=5, read_timeout=60)
    async with session.create_client(
        "s3", endpoint_url=settings.s3_url, region_name=settings.s3_region, config=config,
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "podbay"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "podbay-secret"),
    ) as client:
        yield ObjectStore(client, settings.s3_bucket, concurrency=settings.s3_concurrency,
                          bandwidth_mib_s=settings.s3_bandwidth_mib_s,
                          multipart_threshold=settings.s3_multipart_threshold_mib << 20)
