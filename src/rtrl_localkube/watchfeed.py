"""Watching kinds of the real API server from a test process: list, then watch from the
list's resourceVersion, and again after every end (a watch times out, a restarting server
cuts it, a 410 Gone asks for a new list), each event handed to a callback. Each watch has
its own connection, so stopping one stops nothing else (``ControlPlane.close_watches``
ends every watch of the control plane)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

Feed = Callable[[str, str, dict[str, Any]], None]  # kind, event type, object


class Server(Protocol):
    """What a watch needs of a control plane (``rtrl_localkube.controlplane.ControlPlane``)."""

    url: str
    ca_file: Any
    admin_token: str

    def request(self, method: str, path: str, body: Any = None) -> Any: ...


class Watch(threading.Thread):
    """One kind's list-then-watch loop, as the admin, until :meth:`stop`; a listed object is
    fed as ADDED (the callback must take an object it has seen before in its stride)."""

    def __init__(self, server: Server, kind: str, path: str, feed: Feed) -> None:
        super().__init__(name=f"watch-{kind}", daemon=True)
        self.server, self.kind, self.path, self.feed = server, kind, path, feed
        self.stopped = threading.Event()
        self.synced = threading.Event()
        self.conn: http.client.HTTPSConnection | None = None
        self.error = ""

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                listed = self.server.request("GET", self.path)
                for item in listed.get("items") or []:
                    self.feed(self.kind, "ADDED", item)
                self.synced.set()
                self._watch(str(listed["metadata"]["resourceVersion"]))
            except Exception as exc:  # a restarting API server: list and watch again
                if not self.stopped.is_set():
                    self.error = repr(exc)
                    self.stopped.wait(0.2)

    def _watch(self, rv: str) -> None:
        host, port = urllib.parse.urlsplit(self.server.url).netloc.split(":")
        context = ssl.create_default_context(cafile=os.fspath(self.server.ca_file))
        self.conn = conn = http.client.HTTPSConnection(host, int(port), context=context, timeout=90)
        if self.stopped.is_set():
            return
        query = urllib.parse.urlencode(
            {"watch": "1", "resourceVersion": rv, "timeoutSeconds": "60",
             "allowWatchBookmarks": "true"}
        )  # fmt: skip
        try:
            auth = {"Authorization": f"Bearer {self.server.admin_token}"}
            conn.request("GET", f"{self.path}?{query}", headers=auth)
            for line in conn.getresponse():
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                    self.feed(self.kind, event["type"], event["object"])
                elif event.get("type") == "ERROR":
                    return  # 410 Gone: list again
        finally:
            conn.close()

    def stop(self) -> None:
        self.stopped.set()
        conn = self.conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def watch_kinds(server: Server, paths: Mapping[str, str], feed: Feed) -> Iterator[None]:
    """Watch every ``kind -> list path`` of ``paths`` into ``feed`` while the block runs;
    every kind has been listed before the block starts."""
    watches = [Watch(server, kind, path, feed) for kind, path in paths.items()]
    for w in watches:
        w.start()
    try:
        for w in watches:
            if not w.synced.wait(30):
                raise RuntimeError(f"could not list {w.kind}: {w.error}")
        yield
    finally:
        for w in watches:
            w.stop()
        for w in watches:
            w.join(5)
