"""HTTP plumbing under the teacher client: credentials in URLs, loopback hosts, bounded response bodies.

``read_body`` reads a streamed ``httpx`` response and decodes its ``Content-Encoding`` itself
(identity, gzip, deflate) with ``zlib``'s ``max_length``, so at most ``max_bytes + 1`` decoded bytes
ever exist in memory: a gzip bomb costs no more than an honest reply of the cap's size. httpx's own
decoders inflate each network chunk completely (a 64 KiB chunk of zeros becomes ~64 MiB).
"""

from __future__ import annotations

import ipaddress
import socket
import zlib
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = [
    "ACCEPT_ENCODING",
    "BodyDecodeError",
    "BodyTooLarge",
    "SplitURL",
    "is_loopback",
    "read_body",
    "split_credentials",
]

ACCEPT_ENCODING = "gzip, deflate"
"""The only encodings :func:`read_body` decodes, so the only ones the client asks for."""


class BodyTooLarge(Exception):
    """The decoded body passed ``max_bytes`` (``.limit``)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"response body exceeds {limit} bytes (after decompression)")
        self.limit = limit


class BodyDecodeError(Exception):
    """The body's content encoding is unknown or its compressed stream is broken."""


@dataclass(frozen=True)
class SplitURL:
    """A URL without its ``user:password@`` part, and that part (``None`` if absent)."""

    url: str
    username: str | None
    password: str | None


def split_credentials(url: str) -> SplitURL:
    """Take ``user:password@`` out of ``url`` (it would otherwise show in logs and error messages)."""
    parsed = httpx.URL(url)
    if not parsed.userinfo:
        return SplitURL(url, None, None)
    return SplitURL(str(parsed.copy_with(username=None, password=None)), parsed.username, parsed.password)


def is_loopback(host: str) -> bool:
    """True for a literal loopback address (127.0.0.0/8, ``::1``) and for ``localhost`` when every address it
    resolves to is one (traffic that never leaves the machine). Other names, ``*.localhost`` included, are not
    trusted: what they resolve to is up to the resolver."""
    host = host.strip("[]").lower().rstrip(".")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host != "localhost":
        return False
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addresses)


def _decoder(encoding: str) -> Any:
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(zlib.MAX_WBITS | 16)
    if encoding == "deflate":
        return zlib.decompressobj(zlib.MAX_WBITS | 32)  # zlib or gzip header, detected
    raise BodyDecodeError(f"unsupported Content-Encoding {encoding!r} (asked for {ACCEPT_ENCODING})")


async def read_body(response: httpx.Response, max_bytes: int, *, truncate: bool = False) -> bytes:
    """The decoded body of a streamed ``response``, at most ``max_bytes`` bytes.

    Past the cap: ``BodyTooLarge``, or with ``truncate`` the first ``max_bytes`` bytes (for error
    snippets). ``Content-Length`` above the cap fails before reading. Raises ``BodyDecodeError`` for an
    unknown encoding or a broken compressed stream.
    """
    declared = response.headers.get("Content-Length", "")
    encoded = bool(response.headers.get("Content-Encoding", "").strip())
    if not truncate and not encoded and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(max_bytes)
    decoders = [d for d in map(_decoder, response.headers.get("Content-Encoding", "").split(",")) if d is not None]
    if len(decoders) > 1:
        raise BodyDecodeError("stacked Content-Encodings are not supported")
    decoder = decoders[0] if decoders else None
    out = bytearray()
    async for chunk in response.aiter_raw():
        data = chunk
        while data:
            room = max_bytes + 1 - len(out)
            if decoder is None:
                piece, data = data[:room], b""
            else:
                try:
                    piece = decoder.decompress(data, room)
                except zlib.error as err:
                    raise BodyDecodeError(f"broken compressed body ({err})") from None
                if not piece and decoder.unconsumed_tail == data:
                    raise BodyDecodeError("compressed body makes no progress")
                data = decoder.unconsumed_tail
            out += piece
            if len(out) > max_bytes:
                if truncate:
                    return bytes(out[:max_bytes])
                raise BodyTooLarge(max_bytes)
            if decoder is not None and decoder.eof:
                data = b""
    if decoder is not None and not decoder.eof and not truncate:
        raise BodyDecodeError("compressed body ended early")
    return bytes(out)
