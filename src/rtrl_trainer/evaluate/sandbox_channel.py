"""The evaluator's end of a served completion (:meth:`.sandbox.Sandbox.serve`): framed JSON
calls out on one pipe, replies in on another, every read and write bounded by the task's
wall clock, so a completion that stops answering costs its task, never the evaluator."""

from __future__ import annotations

import json
import os
import select
import time
from typing import Any

from rtrl_trainer.evaluate.sandbox_types import MAX_FRAME, CallTimeout, CandidateGone, Result


class Channel:
    """The evaluator's end of a served completion: :meth:`call` sends plain arguments and
    returns the plain value that came back (or raises what the completion raised)."""

    def __init__(self, calls: int, replies: int, server: int, deadline: float) -> None:
        self._calls = calls
        self._replies = replies
        self._server = server
        self.deadline = deadline
        self._seq = 0
        self.gone = False
        self.result: Result | None = None
        self.calls = 0

    def _frame(self) -> dict[str, Any]:
        """The next frame from the completion, within the deadline."""
        header = self._read(4)
        size = int.from_bytes(header, "big")
        if size > MAX_FRAME:
            raise CandidateGone(f"a reply of {size} bytes (the cap is {MAX_FRAME})")
        body = self._read(size)
        try:
            doc = json.loads(body)
        except ValueError as exc:
            raise CandidateGone(f"a reply that is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise CandidateGone("a reply that is not an object")
        return doc

    def _read(self, n: int) -> bytes:
        chunks: list[bytes] = []
        while n:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise CallTimeout
            ready, _, _ = select.select([self._replies, self._server], [], [], left)
            if self._replies in ready:
                chunk = os.read(self._replies, min(n, 1 << 20))
                if not chunk:
                    raise CandidateGone("the sandbox server is gone")
                chunks.append(chunk)
                n -= len(chunk)
            elif ready:  # the server says the task exited
                self.gone = True
                raise CandidateGone("the completion's process exited")
        return b"".join(chunks)

    def ready(self) -> dict[str, Any]:
        """The completion's first frame: ``{"ready": True}`` or ``{"load_error": ...}``."""
        if self.gone:
            raise CandidateGone("the sandbox server is gone")
        while True:
            doc = self._frame()
            if doc.get("id") == 0:
                return doc

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from rtrl_trainer.evaluate import plain_values

        if self.gone:
            raise CandidateGone("the completion's process exited")
        self._seq += 1
        self.calls += 1
        message = {
            "id": self._seq,
            "args": plain_values.encode(list(args)),
            "kwargs": plain_values.encode(kwargs),
        }
        data = json.dumps(message, allow_nan=False).encode()
        self._write(len(data).to_bytes(4, "big") + data)
        while True:
            doc = self._frame()
            if doc.get("id") == self._seq:
                return doc

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        os.set_blocking(self._calls, False)
        try:
            while view:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise CallTimeout
                _, ready, _ = select.select([], [self._calls], [], left)
                if ready:
                    try:
                        view = view[os.write(self._calls, view) :]
                    except BlockingIOError:
                        continue
        finally:
            os.set_blocking(self._calls, True)
