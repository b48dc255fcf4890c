"""moto's S3 server on 127.0.0.1 with one bucket: the S3 endpoint the tests and `benchmarks/allreduce.py` use."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["S3Endpoint", "lock_moto_etag", "moto_s3_server"]


@dataclass(frozen=True)
class S3Endpoint:
    """A running S3 endpoint: ``http://127.0.0.1:port``, its bucket, its credentials (moto takes any) and the fsspec
    options that reach it."""

    host: str
    port: int
    bucket: str
    key: str = "testing"
    secret: str = "testing"

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """s3fs options for this server, or for ``endpoint`` in front of it (e.g. a `wan_proxy.WanProxy` port)."""
        return {
            "key": self.key,
            "secret": self.secret,
            "endpoint_url": endpoint or self.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
        }


def lock_moto_etag() -> None:
    """Make moto compute an object's ETag under the object's lock (idempotent).

    moto (5.2.1 to 5.2.6 at least) reads a key's body under ``FakeKey.lock`` for a GET but computes its ETag lazily,
    by seeking and reading the same buffer *without* the lock, and a PUT's response computes it after the key is
    visible. A GET that lands in that window reads from wherever the ETag's 16 MB reads left the shared file
    position: readers polling for an object over 16 MB got bytes from its middle (`benchmarks/allreduce_wan.py` at
    16M elements and 4 replicas: a payload header "length" of 1.35e19, which the protocol refused and the round
    aborted). S3 itself serves what was written; this makes the stand-in do the same."""
    from moto.s3.models import FakeKey

    unlocked = FakeKey.etag
    if getattr(unlocked.fget, "crf_locked", False):
        return

    def etag(key: Any) -> str:
        with key.lock:
            return str(unlocked.fget(key))

    etag.crf_locked = True  # type: ignore[attr-defined]
    FakeKey.etag = property(etag)  # type: ignore[method-assign,assignment]


@contextmanager
def moto_s3_server(bucket: str = "crf-diloco-test") -> Iterator[S3Endpoint]:
    """Start moto's threaded S3 server on a free port of 127.0.0.1, create ``bucket``, stop it on exit.

    Needs ``moto[server]``, ``boto3`` (both in the workspace's test group) and ``s3fs`` to talk to it."""
    import boto3
    from moto.server import ThreadedMotoServer

    lock_moto_etag()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        found = S3Endpoint(host, port, bucket)
        boto3.client("s3", endpoint_url=found.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=bucket)  # fmt: skip
        yield found
    finally:
        server.stop()
