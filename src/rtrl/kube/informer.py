"""rtrl's own list-and-watch of one kind in one namespace, for a kind kopf should not hold.

kopf keeps a memory of every object of every kind it has a handler for, and while it lists
a kind it starts a worker task for each of its objects. At 1,000 RLCycles a namespace holds
10,000 Checkpoints, and that cost the operator 143 MB of its 359 MB of RSS (``bench/scale.py``,
docs/benchmarks.md), though all it needs of them is the watch cache's copy and a wake-up of
their RLCycle. An :class:`Informer` lists the kind in pages of :data:`PAGE` objects, then
watches it from the list's resourceVersion (with bookmarks, re-opened when the server ends
the stream), and hands each page or event to the operator's event loop, waiting until it is
handled: a page at a time in memory, and the events of one object in their order.

It runs in a thread of its own, with a :class:`KubeClient` of its own. A watch the server
can no longer resume (410 Gone: compacted history, an API server restart) is listed again
from scratch, its objects handed over as a listing's are (type None), which tells the cache
nothing of what was deleted meanwhile (:func:`rtrl.kube.watch.listing` deals with that);
other failures are retried after a back-off, from the last resourceVersion seen.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .client import KubeClient, KubeError, api_version, path

log = logging.getLogger("rtrl.kube")

PAGE = 500  # objects per list request
WATCH_SECONDS = 300  # how long the server is asked to keep a watch open
BACKOFF_SECONDS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # between failed attempts, then the last
QUICK_WATCH_SECONDS = 1.0  # a watch that ended sooner, with no error, counts as a failure

# (type, object): type None for a listed object, else the watch event's
Event = tuple[str | None, dict[str, Any]]


class Informer:
    """Lists and watches ``kind`` in ``namespace`` until :meth:`stop`; ``handle`` runs on
    ``loop`` with each page or event, in order. :attr:`listed` (an asyncio Event of ``loop``)
    is set once the first listing has been handled. Made on ``loop``."""

    def __init__(
        self,
        client: KubeClient,
        kind: str,
        namespace: str,
        handle: Callable[[list[Event]], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.client, self.kind, self.namespace = client, kind, namespace
        self.handle, self.loop = handle, loop
        self.listed = asyncio.Event()  # set on ``loop``
        self.stopped = threading.Event()
        self.listings = 0  # complete listings so far (a re-list after a 410 counts)
        self._thread = threading.Thread(
            target=self._run, name=f"rtrl-watch-{kind}-{namespace}", daemon=True
        )

    def start(self) -> Informer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Hand over nothing more; the thread ends at its next event or page (a watch left
        open ends when the server closes it, or with the process)."""
        self.stopped.set()

    def _run(self) -> None:
        version = ""  # "" : list first
        failures = 0
        while not self.stopped.is_set():
            try:
                if not version:
                    version = self._list()
                    self.listings += 1
                    self._on_loop(self.listed.set)
                opened = time.monotonic()
                version = self._watch(version)
                if not version or time.monotonic() - opened >= QUICK_WATCH_SECONDS:
                    failures = 0
                    continue
                # a watch the server ended at once, again and again, is not re-opened hot
                failures = self._pause(failures, "the watch ended at once")
            except KubeError as exc:
                if exc.status == 410:  # an expired continue token, a watch too old: list
                    version = ""
                failures = self._pause(failures, str(exc))
            except _LoopGoneError:
                return
            except Exception:
                log.exception("watching %s in %s failed", self.kind, self.namespace)
                failures = self._pause(len(BACKOFF_SECONDS), "an internal error")

    def _pause(self, failures: int, why: str) -> int:
        """Wait the back-off of the ``failures``-th failure in a row; the next count."""
        wait = BACKOFF_SECONDS[min(failures, len(BACKOFF_SECONDS) - 1)]
        log.warning("watching %s in %s: %s; again in %ss", self.kind, self.namespace, why, wait)
        self.stopped.wait(wait)
        return failures + 1

    def _list(self) -> str:
        """Every object, a page at a time; the list's resourceVersion."""
        query = {"limit": str(PAGE)}
        while True:
            answer = self.client.request("GET", path(self.kind, self.namespace), query=query)
            answer = answer or {}
            meta = answer.get("metadata") or {}
            items: list[dict[str, Any]] = answer.pop("items", None) or []
            for item in items:  # a list's items may leave out what the list says for all
                item.setdefault("kind", self.kind)
                item.setdefault("apiVersion", api_version(self.kind))
            self._hand_over((None, item) for item in items)
            token = str(meta.get("continue") or "")
            if not token:
                return str(meta.get("resourceVersion") or "")
            query = {"limit": str(PAGE), "continue": token}

    def _watch(self, version: str) -> str:
        """The events since ``version`` until the server ends the stream: the last
        resourceVersion seen, or "" when the watch cannot resume (410 Gone)."""
        for event in self.client.watch(self.kind, self.namespace, version, WATCH_SECONDS):
            if self.stopped.is_set():
                break
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                code = int(obj.get("code") or 0)
                if code == 410:
                    log.info("watching %s in %s: %s; listing again", self.kind,
                             self.namespace, obj.get("message"))  # fmt: skip
                    return ""
                raise KubeError(f"watch {self.kind} in {self.namespace}: {obj.get('message')}",
                                code, str(obj.get("reason") or ""))  # fmt: skip
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                self._hand_over([(str(kind), obj)])
        return version

    def _hand_over(self, events: Iterable[Event]) -> None:
        batch = list(events)
        if batch:
            self._on_loop(self.handle, batch)

    def _on_loop(self, call: Callable[..., None], *args: Any) -> None:
        """``call(*args)`` on the loop, waited for (unless stopped meanwhile)."""
        if self.stopped.is_set():
            raise _LoopGoneError()
        try:
            done = asyncio.run_coroutine_threadsafe(self._called(call, *args), self.loop)
        except RuntimeError:  # the loop is closed: the operator has stopped
            raise _LoopGoneError() from None
        while True:
            try:
                done.result(timeout=1.0)
                return
            except concurrent.futures.TimeoutError:
                if self.stopped.is_set() or self.loop.is_closed():
                    done.cancel()
                    raise _LoopGoneError() from None

    async def _called(self, call: Callable[..., None], *args: Any) -> None:
        if not self.stopped.is_set():
            call(*args)


def stop_all(informers: dict[str, Informer]) -> None:
    """Stop each of ``informers`` and forget them (the operator stops, or starts again)."""
    for informer in informers.values():
        informer.stop()
    informers.clear()


class _LoopGoneError(Exception):
    """The event loop the informer hands over to has stopped."""
