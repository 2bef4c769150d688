"""The group commit: the events of every request waiting at that moment go to the store
together, one Parquet file per feedback partition, and each request is answered only after
its files were written.

A request's events are durable once :meth:`GroupCommitter.submit` returns; a failed write
raises :class:`CommitFailedError` for every request of the group (the client retries; the seal
step deduplicates by event id, so events of the group that did reach another partition's
file are not counted twice). While one group is being written the next one gathers, so
the number of writes follows the store's latency, not the request rate: under load a write
carries the events of many requests.

Files are named by :func:`rtrl.core.events.event_file_key`: a writer id unique to this
process (the pod's name and a random suffix) and a sequence number fixed before the first
attempt, so the store's own retries of a PUT replace the same object.

Ids of recently committed events are remembered (a bounded map): a retry of a request
that did succeed (its 202 was lost) is acknowledged without writing again, a retry of one
still being written waits for that write, and an event id reused for other content is a
:class:`ConflictError` (409). The map is per process and bounded, so it spares writes; the
seal's deduplication is what guarantees that nothing counts twice.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import secrets
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.parquet as pq

from rtrl.core.events import FEEDBACK_DIR, FEEDBACK_SCHEMA, event_file_key, hour_of
from rtrl.core.store import ObjectStore
from rtrl_serving.feedback.events import FeedbackEvent

DEFAULT_REMEMBERED = 200_000


class CommitFailedError(Exception):
    """The group's write failed: nothing of the request is known to be durable."""


class ConflictError(Exception):
    """An event id this service committed (or is committing) with other content."""

    def __init__(self, index: int, event_id: str) -> None:
        super().__init__(f"events[{index}].event_id: already used for another event")
        self.field = f"events[{index}].event_id"
        self.event_id = event_id


def writer_id(pod: str | None = None) -> str:
    """This process's writer id: the pod's name (``POD_NAME``, else the host name) cut to
    the allowed characters, and 8 random hex digits (a restarted container is a new
    writer, so its sequence numbers cannot collide with its predecessor's)."""
    name = (pod or os.environ.get("POD_NAME") or os.uname().nodename or "rtrl-feedback").lower()
    name = re.sub(r"[^a-z0-9-]+", "-", name).strip("-")[:100] or "rtrl-feedback"
    return f"{name}-{secrets.token_hex(4)}"


def feedback_table(events: Sequence[FeedbackEvent], received_at: datetime) -> pa.Table:
    """The events as a FEEDBACK_SCHEMA table."""
    return pa.Table.from_arrays(
        [
            pa.array([e.event_id for e in events], pa.string()),
            pa.array([e.interaction_id for e in events], pa.string()),
            pa.array([e.signal for e in events], pa.string()),
            pa.array([e.value for e in events], pa.float64()),
            pa.array([e.observed_at for e in events], FEEDBACK_SCHEMA.field("observed_at").type),
            pa.repeat(
                pa.scalar(received_at, FEEDBACK_SCHEMA.field("received_at").type), len(events)
            ),
        ],
        schema=FEEDBACK_SCHEMA,
    )


def parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", write_page_checksum=True)
    return sink.getvalue()


@dataclass
class _Waiting:
    events: list[FeedbackEvent]
    done: asyncio.Future[None]


class GroupCommitter:
    """Commits submitted events to ``store`` in groups; at most ``max_inflight`` groups are
    written at once (each on a thread of its own), the next one gathering meanwhile.
    ``linger_s`` waits that long after the first event of a group for more (0: none; the
    write in flight is what gathers a group under load)."""

    def __init__(
        self,
        store: ObjectStore,
        writer: str,
        *,
        max_inflight: int = 4,
        linger_s: float = 0.0,
        remembered: int = DEFAULT_REMEMBERED,
        clock: Callable[[], datetime] | None = None,
        on_commit: Callable[[int, float, bool], None] | None = None,
    ) -> None:
        self.store = store
        self.writer = writer
        self.max_inflight = max_inflight
        self.linger_s = linger_s
        self.remembered = remembered
        self.clock = clock or (lambda: datetime.now(UTC))
        self.on_commit = on_commit
        self.seq = 0
        self._waiting: list[_Waiting] = []
        self._ids: OrderedDict[str, tuple[tuple[object, ...], asyncio.Future[None]]] = OrderedDict()
        self._wakeup: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._task: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self._executor = ThreadPoolExecutor(max_inflight, thread_name_prefix="feedback-write")
        self._closing = False

    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(self.max_inflight)
        self._task = asyncio.create_task(self._run(), name="feedback-commit")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done() and not self._closing

    async def submit(self, events: Sequence[FeedbackEvent]) -> int:
        """Make ``events`` durable; returns how many were already committed (or being
        committed) by an earlier request. Raises :class:`ConflictError` before anything is
        queued, :class:`CommitFailedError` when the write failed."""
        assert self._wakeup is not None
        if self._closing:
            raise CommitFailedError("the service is shutting down")
        earlier: list[asyncio.Future[None]] = []
        fresh: list[FeedbackEvent] = []
        for index, event in enumerate(events):
            known = self._ids.get(event.event_id)
            if known is None:
                fresh.append(event)
            elif known[0] != event.content:
                raise ConflictError(index, event.event_id)
            else:
                earlier.append(known[1])
        waits = list(earlier)
        if fresh:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            for event in fresh:
                self._remember(event, done)
            self._waiting.append(_Waiting(fresh, done))
            self._wakeup.set()
            waits.append(done)
        results = await asyncio.gather(*(asyncio.shield(w) for w in waits), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise CommitFailedError(str(failed[0])) from failed[0]
        return len(events) - len(fresh)

    def _remember(self, event: FeedbackEvent, done: asyncio.Future[None]) -> None:
        self._ids[event.event_id] = (event.content, done)
        self._ids.move_to_end(event.event_id)
        while len(self._ids) > self.remembered:
            _, (_, oldest) = next(iter(self._ids.items()))
            if not oldest.done():
                break  # never forget an id still being written
            self._ids.popitem(last=False)

    def _forget(self, events: Sequence[FeedbackEvent], done: asyncio.Future[None]) -> None:
        """A failed write: its ids may be submitted again as new."""
        for event in events:
            known = self._ids.get(event.event_id)
            if known is not None and known[1] is done:
                del self._ids[event.event_id]

    async def _run(self) -> None:
        assert self._wakeup is not None and self._slots is not None
        while True:
            if not self._closing:
                await self._wakeup.wait()
            if self.linger_s > 0 and not self._closing:
                await asyncio.sleep(self.linger_s)
            await self._slots.acquire()
            self._wakeup.clear()
            group, self._waiting = self._waiting, []
            if not group:
                self._slots.release()
                if self._closing:
                    return
                continue
            task = asyncio.create_task(self._write(group))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def _write(self, group: list[_Waiting]) -> None:
        assert self._slots is not None
        try:
            received = self.clock()
            partitions: dict[datetime, list[FeedbackEvent]] = defaultdict(list)
            for waiting in group:
                for event in waiting.events:
                    partitions[hour_of(event.served_at)].append(event)
            files = []
            for hour in sorted(partitions):
                files.append((event_file_key(FEEDBACK_DIR, hour, self.writer, self.seq), hour))
                self.seq += 1
            count = sum(len(w.events) for w in group)
            started = time.perf_counter()
            error: BaseException | None = None
            try:
                await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._put, files, partitions, received
                )
            except Exception as exc:  # the store's errors, whatever they are: 503
                error = exc
            elapsed = time.perf_counter() - started
            if self.on_commit is not None:
                self.on_commit(count, elapsed, error is None)
            for waiting in group:
                if waiting.done.done():
                    continue
                if error is None:
                    waiting.done.set_result(None)
                else:
                    self._forget(waiting.events, waiting.done)
                    waiting.done.set_exception(
                        CommitFailedError(f"the events store failed: {error}")
                    )
                    # retrieved by every waiter through shield; mark it seen for the loop
                    waiting.done.exception()
        finally:
            self._slots.release()

    def _put(
        self,
        files: list[tuple[str, datetime]],
        partitions: dict[datetime, list[FeedbackEvent]],
        received: datetime,
    ) -> None:
        for key, hour in files:
            self.store.put_bytes(key, parquet_bytes(feedback_table(partitions[hour], received)))

    async def close(self) -> None:
        """Write what is waiting, wait for the writes in flight, then stop."""
        self._closing = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._task is not None:
            await self._task
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        self._executor.shutdown(wait=True)
