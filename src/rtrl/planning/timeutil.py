"""Times as the Kubernetes API writes them (RFC 3339, UTC, whole seconds, ``Z``)."""

from __future__ import annotations

from datetime import UTC, datetime


def iso(moment: datetime) -> str:
    return whole(moment).strftime("%Y-%m-%dT%H:%M:%SZ")


def whole(moment: datetime) -> datetime:
    """``moment`` as the API keeps it: UTC, whole seconds (what :func:`iso` writes)."""
    return moment.astimezone(UTC).replace(microsecond=0)


def parse_time(text: object) -> datetime | None:
    """An RFC 3339 time from the API, or None when absent or unreadable."""
    if not isinstance(text, str) or not text:
        return None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
