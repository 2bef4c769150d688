"""The evaluator's end of a served completion (:meth:`.sandbox.Sandbox.serve`): framed JSON
calls out on one pipe, replies in on another, every read and write bounded by the task's
wall clock, so a completion that stops answering costs its task, never the evaluator.

The two pipes are the task's own: made for it, handed to its process, closed when it ends
(:meth:`.sandbox.Sandbox.serve`), so nothing a task sets on them (their size, their flags)
reaches another. A reply is bounded before it is decoded: its size from its header, then
its items and nesting on its raw bytes (:func:`.plain_values.shape_problem`), and all the
frames of a task add up to at most ``MAX_TASK_REPLY_BYTES``. Replies are
read in blocks into a buffer, so a task that puts its reply pipe in packet mode
(``O_DIRECT``) loses nothing either.
"""

from __future__ import annotations

import json
import os
import select
import time
from typing import Any

from rtrl_trainer.evaluate import plain_values
from rtrl_trainer.evaluate.sandbox_types import (
    MAX_REPLY_BYTES,
    MAX_REPLY_DEPTH,
    MAX_REPLY_ITEMS,
    MAX_TASK_REPLY_BYTES,
    CallTimeout,
    CandidateGone,
    Result,
)

_BLOCK = 1 << 16


class Channel:
    """The evaluator's end of a served completion: :meth:`call` sends one call (already
    plain data) and returns the reply that came back: ``{"value": ...}`` or the exception
    the completion raised (``{"raise": name, "message": ...}``)."""

    def __init__(self, calls: int, replies: int, server: int, deadline: float) -> None:
        self._calls = calls
        self._replies = replies
        self._server = server
        self._buffer = bytearray()
        self.deadline = deadline
        self._seq = 0
        self._received = 0  # bytes of every frame, ours or forged: a task's budget
        self.gone = False
        self.result: Result | None = None
        self.calls = 0

    def _frame(self) -> dict[str, Any]:
        """The next frame from the completion, within the deadline and the bounds."""
        self._fill(4)
        size = int.from_bytes(self._buffer[:4], "big")
        if size > MAX_REPLY_BYTES:
            raise CandidateGone(f"a reply of {size} bytes (the cap is {MAX_REPLY_BYTES})")
        self._received += size
        if self._received > MAX_TASK_REPLY_BYTES:
            raise CandidateGone(f"replies of more than {MAX_TASK_REPLY_BYTES} bytes in all")
        self._fill(4 + size)
        body = bytes(self._buffer[4 : 4 + size])
        del self._buffer[: 4 + size]
        problem = plain_values.shape_problem(
            body, max_items=MAX_REPLY_ITEMS, max_depth=MAX_REPLY_DEPTH
        )
        if problem is not None:
            raise CandidateGone(f"a reply {problem}")
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise CandidateGone(f"a reply that is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise CandidateGone("a reply that is not an object")
        return doc

    def _fill(self, n: int) -> None:
        """Read until the buffer holds ``n`` bytes (whole blocks: a packet is never cut)."""
        while len(self._buffer) < n:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise CallTimeout
            ready, _, _ = select.select([self._replies, self._server], [], [], left)
            if self._replies in ready:
                chunk = os.read(self._replies, _BLOCK)
                if not chunk:
                    self.gone = True
                    raise CandidateGone("the completion's process exited")
                self._buffer += chunk
            elif ready:  # the server says the task exited
                self.gone = True
                raise CandidateGone("the completion's process exited")

    def ready(self) -> dict[str, Any]:
        """The completion's first frame: ``{"ready": True}`` or ``{"load_error": ...}``."""
        if self.gone:
            raise CandidateGone("the sandbox server is gone")
        while True:
            doc = self._frame()
            if doc.get("id") == 0:
                return doc

    def call(self, call: bytes) -> dict[str, Any]:
        """Send ``call`` (the JSON of ``[args, kwargs]`` as plain data) and wait for its
        reply."""
        if self.gone:
            raise CandidateGone("the completion's process exited")
        self._seq += 1
        self.calls += 1
        data = b'{"id":%d,"call":%s}' % (self._seq, call)
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
                    except BrokenPipeError:
                        self.gone = True
                        raise CandidateGone("the completion's process exited") from None
        finally:
            os.set_blocking(self._calls, True)
