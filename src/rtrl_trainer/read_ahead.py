"""Producing the next item of a stream on a thread of its own while the consumer works on
this one.

Decoding a batch of shards is parallel (Arrow decodes its columns on a thread each), but
what a step then does with the batch is mostly one thread's work; reading in line with it
left a CPU idle for that time, about a tenth of the stage step's pass over the shards on
two CPUs. One item ahead is enough: deeper read-ahead measured no faster and holds more
batches in memory.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def read_ahead(items: Iterable[T], name: str, depth: int = 1) -> Iterator[T]:
    """The items of ``items`` in order, produced up to ``depth`` ahead of the consumer on a
    thread named ``name``. An error of the producer is raised in the consumer, after the
    items produced before it; a consumer that stops early (an error of its own, ``close``)
    stops the producer before it returns, so nothing runs on behind its back."""
    handoff: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        iterator = iter(items)
        try:
            for item in iterator:
                while not stop.is_set():
                    try:
                        handoff.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            handoff.put(_DONE)
        except BaseException as exc:
            handoff.put(_Failed(exc))
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()  # a generator's files and handles, released on its own thread

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while (item := handoff.get()) is not _DONE:
            if isinstance(item, _Failed):
                raise item.error
            yield item  # type: ignore[misc]
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting to hand over
            try:
                handoff.get(timeout=0.1)
            except queue.Empty:
                continue
        thread.join()
