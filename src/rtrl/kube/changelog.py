"""What changed in the watch cache while a request was in flight: how an answer is ordered
against the watch without ordering resourceVersions (Kubernetes defines them opaque).

An answer (to a write or a live read) is at least as new as everything the cache knew when
its request was sent; what the watch delivered of that object while it was in flight is
either older than the answer or is the answer's own version, followed by newer ones. The
cache marks a request when it is sent (:meth:`ChangeLog.begin`) and, when the answer
comes back, asks which changes of that object came after the mark (:meth:`ChangeLog.since`).
Changes are kept only while a request is in flight, from the oldest one's mark on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

Key = tuple[str, str]  # (namespace, name)


@dataclass(slots=True, frozen=True)
class Change:
    """A change of one name in the cache."""

    seq: int  # the cache's change count after it
    kind: str
    key: Key
    uid: str
    rv: str  # "" when the name became empty
    watch: bool  # delivered by the watch (else: an answer)
    before: tuple[str, str, str] | None  # the name's (uid, rv, watched rv) before it


class ChangeLog:
    """The changes since the oldest request in flight; not thread-safe (the cache's lock
    guards it)."""

    def __init__(self) -> None:
        self.seq = 0  # changes so far
        self._inflight: dict[int, int] = {}  # marks of requests in flight -> how many
        self._log: deque[Change] = deque()

    def begin(self) -> int:
        """A request is sent: its mark."""
        self._inflight[self.seq] = self._inflight.get(self.seq, 0) + 1
        return self.seq

    def end(self, mark: int) -> None:
        """Its answer is in (or it failed): changes older than every request left go."""
        left = self._inflight.get(mark, 0) - 1
        if left > 0:
            self._inflight[mark] = left
        else:
            self._inflight.pop(mark, None)
        oldest = min(self._inflight, default=self.seq)
        while self._log and self._log[0].seq <= oldest:
            self._log.popleft()

    def record(self, change: Change) -> None:
        if self._inflight:
            self._log.append(change)

    def since(self, kind: str, namespace: str, mark: int) -> dict[Key, list[Change]]:
        """The changes of ``kind`` in ``namespace`` after ``mark``, by name, in order."""
        out: dict[Key, list[Change]] = {}
        for change in self._log:
            if change.seq > mark and change.kind == kind and change.key[0] == namespace:
                out.setdefault(change.key, []).append(change)
        return out


__all__ = ["Change", "ChangeLog", "Key"]
