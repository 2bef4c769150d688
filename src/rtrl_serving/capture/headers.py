"""Which headers the proxy passes on: the client's to the engine, the engine's back to the
client, less those that describe one hop rather than the message; and the one it reads, the
serving time a simulation sets."""

from __future__ import annotations

from datetime import UTC, datetime

import aiohttp
from aiohttp import web
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


def served_at(headers: CIMultiDictProxy[str], name: str | None) -> datetime:
    """The request's serving time: now, or what header ``name`` says (ISO 8601 or Unix
    seconds; a simulation's clock). A value that is neither is the client's 400."""
    value = headers.get(name) if name else None
    if not value:
        return datetime.now(UTC)
    try:
        moment = (
            datetime.fromtimestamp(float(value), UTC)
            if value.replace(".", "", 1).isdigit()
            else datetime.fromisoformat(value)
        )
    except ValueError:
        raise web.HTTPBadRequest(
            text=f"{name}: {value[:64]!r} is neither ISO 8601 nor Unix seconds\n"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
