"""Bearer tokens from a mounted Secret: one token per line, several during a rotation.

Kubernetes updates a mounted Secret's files in place (an atomic symlink swap), so the file
is read again when its modification time or inode changes, checked at most once a second:
a rotated token is accepted, and a retired one refused, without a restart. A token is
compared with every accepted one in constant time (:func:`hmac.compare_digest`, no early
exit), and never appears in a log line, an error or a metric.
"""

from __future__ import annotations

import hmac
import os
import threading
import time
from pathlib import Path

RECHECK_S = 1.0


class TokenFileError(Exception):
    """The token file cannot be read or holds no token (its content is never shown)."""


class Tokens:
    """The accepted tokens of ``path``; :meth:`check` tells whether a request's token is
    one of them."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._tokens: tuple[bytes, ...] = ()
        self._stamp: tuple[int, int, int] | None = None
        self._checked = 0.0
        self.error: str | None = None
        self.reload(force=True)

    def reload(self, *, force: bool = False) -> None:
        """Read the file again if it changed (or ``force``). A file that became unreadable
        or empty accepts no token any more (fail closed: emptying the Secret revokes every
        token) and sets :attr:`error`, which makes the pod unready."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._checked < RECHECK_S:
                return
            self._checked = now
            try:
                info = os.stat(self.path)
                stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
                if stamp == self._stamp and not force:
                    return
                text = self.path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
                self._tokens, self._stamp = (), None
                self.error = f"token file {self.path}: {reason}"
                return
            tokens = tuple(line.strip().encode() for line in text.splitlines() if line.strip())
            if not tokens:
                self._tokens, self._stamp = (), stamp
                self.error = f"token file {self.path}: holds no token"
                return
            self._tokens, self._stamp, self.error = tokens, stamp, None

    @property
    def loaded(self) -> bool:
        return bool(self._tokens)

    def check(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header carries an accepted bearer token."""
        self.reload()
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        given = token.strip().encode()
        accepted = False
        for known in self._tokens:
            # every token compared, whatever matched: the time says nothing of which
            accepted |= hmac.compare_digest(given, known)
        return accepted
