"""Interaction ids: UUIDv7 (RFC 9562), so an id carries the millisecond it was served.

The capture proxy mints the id and returns it to the client (``X-Rtrl-Interaction-Id``);
feedback names it. Because the serving time is in the id, the feedback service files each
event under the hour its interaction was served without looking anything up, and the seal
of one hour reads exactly one feedback partition. An id that is not a UUIDv7 cannot have
come from the proxy, and is refused where it enters (a 400 naming ``interaction_id``).
"""

from __future__ import annotations

import os
import re
import time
from datetime import UTC, datetime

_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


class InteractionIdError(ValueError):
    """Not an interaction id the capture proxy could have minted."""


def new_interaction_id(now: datetime | None = None) -> str:
    """A fresh UUIDv7 for a completion served at ``now`` (default: the clock), lower-case
    with dashes: 48 bits of Unix milliseconds, then 74 random bits."""
    ms = int(now.timestamp() * 1000) if now is not None else time.time_ns() // 1_000_000
    if not 0 <= ms < 1 << 48:
        raise InteractionIdError(f"time {now} cannot be encoded in a UUIDv7")
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms << 80) | (0x7 << 76) | ((rand >> 62) & 0xFFF) << 64 | (0b10 << 62)
    value |= rand & ((1 << 62) - 1)
    text = f"{value:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def served_at(interaction_id: str) -> datetime:
    """When the interaction ``interaction_id`` was served (UTC, to the millisecond).

    Raises :class:`InteractionIdError` for anything that is not a lower- or upper-case
    UUIDv7 with dashes."""
    if not isinstance(interaction_id, str) or not _UUID.match(interaction_id.lower()):
        raise InteractionIdError(
            f"{str(interaction_id)[:80]!r} is not an interaction id (a UUIDv7 such as the "
            "X-Rtrl-Interaction-Id header of the response)"
        )
    ms = int(interaction_id.replace("-", "")[:12], 16)
    return datetime.fromtimestamp(ms / 1000, UTC)
