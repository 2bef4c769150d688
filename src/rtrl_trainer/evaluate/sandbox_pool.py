"""Sandbox servers in a pool: a suite's tasks run ``workers`` at a time, each on a server
of its own (a server runs one task at a time), results in the order of the tasks."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from rtrl_trainer.evaluate.sandbox import Sandbox
from rtrl_trainer.evaluate.sandbox_types import Result, SandboxError

_T = TypeVar("_T")


@contextlib.contextmanager
def pool(size: int, **options: Any) -> Iterator[queue.SimpleQueue[Sandbox]]:
    """``size`` sandbox servers (started in parallel) in a queue: a worker takes one, runs
    a task, puts it back. ``options`` go to :class:`Sandbox`."""
    sandboxes: queue.SimpleQueue[Sandbox] = queue.SimpleQueue()
    started: list[Sandbox] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def start() -> None:
        try:
            box = Sandbox(**options)
        except BaseException as exc:
            errors.append(exc)
            return
        with lock:
            started.append(box)

    try:
        threads = [threading.Thread(target=start) for _ in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise SandboxError(f"a sandbox server did not start: {errors[0]}")
        for box in started:
            sandboxes.put(box)
        yield sandboxes
    finally:
        for box in started:  # all servers exit at once, then wait for each
            box._hang_up()
        for box in started:
            box.close()


def map_in_pool(
    size: int,
    items: Sequence[_T],
    run: Callable[[Sandbox, _T], Result],
    *,
    done: Callable[[], object] | None = None,
    **options: Any,
) -> list[Result]:
    """``run(sandbox, item)`` for every item, ``size`` at a time, results in order;
    ``done()`` after each item (for a progress count)."""
    from concurrent.futures import ThreadPoolExecutor

    size = max(1, min(size, len(items)))
    with pool(size, **options) as boxes:
        if size <= 1:
            box = boxes.get()
            results = []
            for item in items:
                results.append(run(box, item))
                if done is not None:
                    done()
            return results

        def one(item: _T) -> Result:
            box = boxes.get()
            try:
                return run(box, item)
            finally:
                boxes.put(box)
                if done is not None:
                    done()

        with ThreadPoolExecutor(max_workers=size) as executor:
            return list(executor.map(one, items))
