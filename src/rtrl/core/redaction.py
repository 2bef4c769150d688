"""The secrets a URL can carry, hidden in any text: the userinfo of
``scheme://user:password@host`` and the values of a presigned query (``X-Amz-Signature``,
``X-Amz-Credential``, ``X-Amz-Security-Token``, SigV2's ``Signature`` and
``AWSAccessKeyId``).

One function that every message which may quote a URL goes through: store errors, a store
URI or endpoint refused as an argument, a field of an RLCycle refused by its pattern, the
last line a CLI prints. It imports nothing, so that the API types (pure) and the store
share it.
"""

from __future__ import annotations

import re

# Secrets a URL can carry: userinfo (``http://KEY:SECRET@host``) and the signature,
# credential and token of a presigned query string (SigV4, and SigV2's names).
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s@'\"]*@")
_SIGNED_QUERY = re.compile(
    r"(?i)\b(X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|Signature|AWSAccessKeyId)"
    r"=[^&\s'\"#]*"
)
REDACTED = "***"


def redact(text: str) -> str:
    """``text`` with the secrets of any URL in it replaced by ``***``: the userinfo of
    ``scheme://user:password@host`` and presigned query values (``X-Amz-Signature``,
    ``X-Amz-Credential``, ``X-Amz-Security-Token``). Store errors end up in logs, events
    and status, which more people read than may read the storage Secret."""
    text = _USERINFO.sub(rf"\1{REDACTED}@", text)
    return _SIGNED_QUERY.sub(rf"\1={REDACTED}", text)
