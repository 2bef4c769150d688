"""The Checkpoints' informer (``rtrl.kube.informer``) on the real API server: a listing in
pages, then every change in its order, and a watch the server can no longer resume (410
Gone) listed again."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rtrl.kube import informer as informer_module
from rtrl.kube.client import KubeClient
from rtrl.kube.informer import Event, Informer
from rtrl_localkube.api import KubeAPI

RTRL = "rtrl.io/v1alpha1"


def checkpoint(name: str) -> dict[str, Any]:
    return {
        "apiVersion": RTRL,
        "kind": "Checkpoint",
        "metadata": {"name": name, "labels": {"rtrl.io/rlcycle": "composer"}},
        "spec": {"uri": f"s3://bucket/composer/checkpoints/{name}/"},
    }


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop in a thread, as kopf's runs beside the informer's thread."""
    running = asyncio.new_event_loop()
    thread = threading.Thread(target=running.run_forever, daemon=True)
    thread.start()
    yield running
    running.call_soon_threadsafe(running.stop)
    thread.join(5)
    running.close()


class Seen:
    """What the informer handed over, on the loop: batches of (type, name)."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[str | None, str]]] = []
        self.loops: set[asyncio.AbstractEventLoop] = set()

    def __call__(self, batch: list[Event]) -> None:
        self.loops.add(asyncio.get_running_loop())
        self.batches.append([(t, o["metadata"]["name"]) for t, o in batch])
        assert all(o["kind"] == "Checkpoint" and o["apiVersion"] == RTRL for _, o in batch)

    def events(self) -> list[tuple[str | None, str]]:
        return [e for batch in self.batches for e in batch]


def wait_for(what: Callable[[], bool], seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def listed(informer: Informer, loop: asyncio.AbstractEventLoop) -> None:
    asyncio.run_coroutine_threadsafe(informer.listed.wait(), loop).result(timeout=30)


def test_a_listing_comes_in_pages_then_each_change_in_its_order(
    kube: KubeAPI, release: str, loop: asyncio.AbstractEventLoop, monkeypatch: Any
) -> None:
    monkeypatch.setattr(informer_module, "PAGE", 2)
    for k in range(5):
        kube.create(checkpoint(f"composer-{k}"))
    seen = Seen()
    informer = Informer(KubeClient(kube.api_client), "Checkpoint", kube.namespace, seen, loop)
    informer.start()
    try:
        listed(informer, loop)
        assert [len(b) for b in seen.batches] == [2, 2, 1]  # a page at a time
        assert sorted(seen.events()) == [(None, f"composer-{k}") for k in range(5)]
        assert seen.loops == {loop}  # handled on the loop, not in the informer's thread

        kube.patch(RTRL, "Checkpoint", "composer-1", {"metadata": {"labels": {"a": "b"}}})
        kube.delete(RTRL, "Checkpoint", "composer-2")
        kube.create(checkpoint("composer-5"))
        kube.patch(RTRL, "Checkpoint", "composer-5", {"metadata": {"labels": {"a": "c"}}})
        wait_for(lambda: len(seen.events()) >= 9)
        assert seen.events()[5:] == [
            ("MODIFIED", "composer-1"),
            ("DELETED", "composer-2"),
            ("ADDED", "composer-5"),
            ("MODIFIED", "composer-5"),
        ]
        assert informer.listings == 1
    finally:
        informer.stop()


def test_a_watch_the_server_cannot_resume_is_listed_again(
    kube: KubeAPI, release: str, loop: asyncio.AbstractEventLoop, monkeypatch: Any
) -> None:
    """The first listing's resourceVersion is long compacted away (as after an API server
    restart): the server answers the watch with 410 Gone, and the informer lists again."""
    kube.create(checkpoint("composer-0"))
    lists = []
    real = Informer._list

    def first_too_old(self: Informer) -> str:
        version = real(self)
        lists.append(version)
        return "1" if len(lists) == 1 else version

    monkeypatch.setattr(Informer, "_list", first_too_old)
    seen = Seen()
    informer = Informer(KubeClient(kube.api_client), "Checkpoint", kube.namespace, seen, loop)
    informer.start()
    try:
        wait_for(lambda: informer.listings == 2)
        assert seen.events() == [(None, "composer-0"), (None, "composer-0")]
        kube.create(checkpoint("composer-1"))  # and it watches from the new listing
        wait_for(lambda: ("ADDED", "composer-1") in seen.events())
    finally:
        informer.stop()
