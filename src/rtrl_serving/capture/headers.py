"""Which headers the proxy passes on: the client's to the engine, the engine's back to the
client, less those that describe one hop rather than the message."""

from __future__ import annotations

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

# Headers that describe one hop, not the message (RFC 9110 7.6.1), and those aiohttp sets.
_HOP = frozenset(
    h.lower()
    for h in ("Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
              "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length")
)  # fmt: skip


def forward_headers(headers: CIMultiDictProxy[str], *, plain: bool) -> CIMultiDict[str]:
    """The client's headers for the engine; ``plain`` drops Accept-Encoding (the proxy
    reads captured responses, which must not be compressed)."""
    skip = _HOP | {"accept-encoding"} if plain else _HOP
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in skip)


def response_headers(upstream: aiohttp.ClientResponse) -> list[tuple[str, str]]:
    return [(k, v) for k, v in upstream.headers.items() if k.lower() not in _HOP]
