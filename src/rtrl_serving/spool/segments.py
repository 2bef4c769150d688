"""The spool directory on disk: its writer id, its segment files and their numbering.

Layout (an ``emptyDir`` in a pod: it survives a container's restart, not the pod's)::

    writer-id              the writer id of every event file this spool uploads
    last-segment           the highest segment number ever opened here
    segments/<n>.open      the segment being appended to (at most one)
    segments/<n>.seg       closed segments, whole and fsynced, waiting to be shipped
    ship/                  Parquet files being written for an upload (scratch)

Segment numbers only grow (``last-segment`` is written, fsynced, before a segment is
created), and the event files of segment ``n`` are named from ``n`` alone, so a segment
shipped twice (a crash after its upload, before its deletion) replaces its own files, and a
restarted container continues its own numbering under the same writer id.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
from pathlib import Path

OPEN_SUFFIX = ".open"
CLOSED_SUFFIX = ".seg"
_SEGMENT = re.compile(r"^(\d{12})\.(open|seg)$")
_UNSAFE = re.compile(r"[^a-z0-9-]+")
WRITER_BASE_MAX = 100


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (POSIX needs the directory synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``, durably: temp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def writer_base(name: str) -> str:
    """``name`` (a pod name, a host name) as the start of a writer id: lower-case letters,
    digits and dashes, no leading or trailing dash."""
    base = _UNSAFE.sub("-", name.lower()).strip("-")[:WRITER_BASE_MAX].strip("-")
    return base or "writer"


class SegmentDir:
    """One spool directory: its writer id and the naming and listing of its segments."""

    def __init__(self, root: Path, writer_name: str | None = None) -> None:
        self.root = Path(root)
        self.segments = self.root / "segments"
        self.ship = self.root / "ship"
        for path in (self.root, self.segments, self.ship):
            path.mkdir(parents=True, exist_ok=True)
        self.writer = self._writer_id(writer_name or socket.gethostname())
        self._last = self._read_last()

    def _writer_id(self, name: str) -> str:
        path = self.root / "writer-id"
        with contextlib.suppress(FileNotFoundError):
            stored = path.read_text(encoding="utf-8").strip()
            if stored and writer_base(stored) == stored:
                return stored
        # A random suffix: two pods of the same name (a StatefulSet's replacement, a pod
        # name reused after deletion) must never write the same event file names.
        writer = f"{writer_base(name)}-{secrets.token_hex(3)}"
        write_atomic(path, writer + "\n")
        return writer

    def _read_last(self) -> int:
        last = -1
        with contextlib.suppress(FileNotFoundError, ValueError):
            last = int((self.root / "last-segment").read_text(encoding="utf-8"))
        for number, _ in self.listing():
            last = max(last, number)
        return last

    def listing(self) -> list[tuple[int, str]]:
        """(number, suffix) of every segment file, by number."""
        found = []
        for entry in os.listdir(self.segments):
            match = _SEGMENT.match(entry)
            if match:
                found.append((int(match[1]), "." + match[2]))
        return sorted(found)

    def path(self, number: int, suffix: str) -> Path:
        return self.segments / f"{number:012d}{suffix}"

    def closed(self) -> list[int]:
        """Numbers of the closed segments, oldest first."""
        return [n for n, suffix in self.listing() if suffix == CLOSED_SUFFIX]

    def next_number(self) -> int:
        """A segment number never used in this directory, made durable before it is used."""
        self._last += 1
        write_atomic(self.root / "last-segment", f"{self._last}\n")
        return self._last

    def close_segment(self, number: int) -> Path:
        """Rename segment ``number`` from open to closed, durably."""
        closed = self.path(number, CLOSED_SUFFIX)
        os.replace(self.path(number, OPEN_SUFFIX), closed)
        fsync_dir(self.segments)
        return closed

    def disk_bytes(self) -> int:
        """Bytes held by segment files (open and closed)."""
        total = 0
        for number, suffix in self.listing():
            with contextlib.suppress(FileNotFoundError):
                total += self.path(number, suffix).stat().st_size
        return total
