"""Reading ahead on a thread: the same items in the same order, the producer's error
raised in the consumer, and nothing left running when the consumer stops early."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from rtrl_trainer.read_ahead import read_ahead


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_items_arrive_in_order_and_the_thread_ends() -> None:
    assert list(read_ahead(range(1000), "ahead-order")) == list(range(1000))
    assert list(read_ahead([], "ahead-order")) == []
    assert not _threads("ahead-order")


def test_the_producer_runs_one_item_ahead_on_its_own_thread() -> None:
    produced: list[tuple[int, str]] = []

    def items() -> Iterator[int]:
        for i in range(5):
            produced.append((i, threading.current_thread().name))
            yield i

    stream = read_ahead(items(), "ahead-depth")
    assert next(stream) == 0
    deadline = time.monotonic() + 10
    while len(produced) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    # One handed over, one waiting in the queue, one produced and waiting to be handed over;
    # no more.
    assert [i for i, _ in produced] == [0, 1, 2]
    assert {name for _, name in produced} == {"ahead-depth"}
    assert list(stream) == [1, 2, 3, 4]


def test_a_producer_error_follows_the_items_before_it() -> None:
    def items() -> Iterator[int]:
        yield 1
        yield 2
        raise OSError("the store went away")

    got: list[int] = []
    with pytest.raises(OSError, match="the store went away"):
        for item in read_ahead(items(), "ahead-error"):
            got.append(item)
    assert got == [1, 2]
    assert not _threads("ahead-error")


def test_a_consumer_that_stops_early_stops_and_closes_the_producer() -> None:
    closed = threading.Event()

    def items() -> Iterator[int]:
        try:
            yield from range(1_000_000)
        finally:
            closed.set()

    stream = read_ahead(items(), "ahead-close")
    assert next(stream) == 0
    stream.close()
    assert closed.is_set()
    assert not _threads("ahead-close")

    with pytest.raises(ZeroDivisionError):
        for item in read_ahead(range(10), "ahead-close"):
            1 / (item - 3)  # the consumer's own error at item 3
    assert not _threads("ahead-close")
