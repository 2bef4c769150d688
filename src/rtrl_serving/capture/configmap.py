"""The routing table's ConfigMap followed through the Kubernetes API (``--adapters-configmap``).

The kubelet brings a changed ConfigMap into a pod's volume on its next sync of the pod (its
sync period, a minute by default, plus its cache's): a route the operator writes would reach
the sidecar a minute or two later. Watched through the API, it arrives as the write's event,
well under a second. The mounted volume (``--adapters``) stays the fallback: while the watch
has never read the ConfigMap (no token, no RBAC to get, list and watch it, the API out of
reach) the sidecar follows the volume, and says why once; once read, the watch's copy is the
table, kept through reconnects.

In the pod: the API from ``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT``, the
ServiceAccount's token (read again on every connection: projected tokens rotate) and CA from
its mount, the namespace from ``POD_NAMESPACE`` or the mount. The ServiceAccount needs
``get``, ``list`` and ``watch`` on that one ConfigMap (``resourceNames``); the list and the
watch select it by ``metadata.name``, which is what lets such a Role allow them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from rtrl_serving.capture.table import SUFFIXES, Snapshot

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
WATCH_TIMEOUT_S = 290  # the API server ends a watch after this; it is started again
MAX_BACKOFF_S = 30.0
FORBIDDEN_RETRY_S = 60.0  # RBAC granted later is picked up


class WatchError(Exception):
    """The API answered what the watch cannot go on from; the message says what."""


class ConfigMapWatch:
    """One ConfigMap's data, as the API server has it now."""

    def __init__(
        self,
        name: str,
        *,
        namespace: str | None = None,
        api: str | None = None,
        service_account: Path = SERVICE_ACCOUNT,
    ) -> None:
        self.name = name
        self.service_account = service_account
        self.namespace = (
            namespace or os.environ.get("POD_NAMESPACE") or _read(service_account / "namespace")
        )
        host, port = (
            os.environ.get("KUBERNETES_SERVICE_HOST"),
            os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
        )
        self.api = api or (f"https://{host}:{port}" if host else None)
        self.data: dict[str, str] | None = None  # None: never read
        self.problem: str | None = None  # why it is not (or no longer) following the API
        self.events = 0  # changes seen (the first read included)

    def snapshot(self) -> Snapshot | None:
        """The table's files as the ConfigMap holds them (its keys that are table files),
        in the form :func:`~rtrl_serving.capture.table.parse` reads; None until read."""
        if self.data is None:
            return None
        where = Path(f"configmap/{self.namespace}/{self.name}")
        return tuple(
            (where / key, value.encode())
            for key, value in sorted(self.data.items())
            if key.endswith(SUFFIXES) and not key.startswith(".")
        )

    async def run(self) -> None:
        """Follow the ConfigMap until cancelled: list it, watch from there, again on any
        end or error (backing off), never raising."""
        if self.api is None or not self.namespace:
            self._fail("not in a pod: KUBERNETES_SERVICE_HOST or the namespace is unknown")
            return
        backoff = 1.0
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self._tls()),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=10, sock_read=WATCH_TIMEOUT_S + 30
            ),
        ) as session:
            while True:
                try:
                    version = await self._list(session)
                    backoff = 1.0
                    await self._watch(session, version)
                except WatchError as exc:
                    self._fail(str(exc))
                    await asyncio.sleep(FORBIDDEN_RETRY_S if "403" in str(exc) else backoff)
                    backoff = min(MAX_BACKOFF_S, backoff * 2)
                except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
                    self._fail(f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(backoff)
                    backoff = min(MAX_BACKOFF_S, backoff * 2)

    # --- the API -------------------------------------------------------------------------

    def _url(self, **query: str) -> str:
        selector = quote(f"metadata.name={self.name}", safe="")
        extra = "".join(f"&{k}={quote(v, safe='')}" for k, v in query.items())
        where = f"{self.api}/api/v1/namespaces/{self.namespace}/configmaps"
        return f"{where}?fieldSelector={selector}{extra}"

    def _headers(self) -> dict[str, str]:
        token = _read(self.service_account / "token")
        if not token:
            raise WatchError(f"no ServiceAccount token at {self.service_account / 'token'}")
        return {"Authorization": f"Bearer {token}", "Accept": "application/json"}

    async def _list(self, session: aiohttp.ClientSession) -> str:
        async with session.get(self._url(), headers=self._headers()) as resp:
            if resp.status != 200:
                raise WatchError(f"list ConfigMap {self.namespace}/{self.name}: HTTP {resp.status}")
            doc = await resp.json(content_type=None)
        items = doc.get("items") or []
        self._take(items[0] if items else None)
        return str((doc.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, session: aiohttp.ClientSession, version: str) -> None:
        url = self._url(watch="1", resourceVersion=version, allowWatchBookmarks="true",
                        timeoutSeconds=str(WATCH_TIMEOUT_S))  # fmt: skip
        async with session.get(url, headers=self._headers()) as resp:
            if resp.status != 200:
                raise WatchError(
                    f"watch ConfigMap {self.namespace}/{self.name}: HTTP {resp.status}"
                )
            async for line in resp.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind = event.get("type")
                if kind == "ERROR":  # e.g. 410 Gone: too old a version; list again
                    return
                if kind in ("ADDED", "MODIFIED"):
                    self._take(event.get("object"))
                elif kind == "DELETED":
                    self._take(None)

    def _take(self, obj: dict[str, Any] | None) -> None:
        data = {str(k): str(v) for k, v in ((obj or {}).get("data") or {}).items()}
        if self.problem is not None or self.data is None:
            log.info("adapter routing: following ConfigMap %s/%s through the API",
                     self.namespace, self.name)  # fmt: skip
        self.problem = None
        if data != self.data:
            self.data = data
            self.events += 1

    def _tls(self) -> ssl.SSLContext | bool:
        ca = self.service_account / "ca.crt"
        return ssl.create_default_context(cafile=str(ca)) if ca.is_file() else True

    def _fail(self, why: str) -> None:
        if why != self.problem:
            where = "its last copy" if self.data is not None else "the mounted table"
            log.warning("adapter routing: ConfigMap %s/%s through the API: %s; following %s",
                        self.namespace, self.name, why, where)  # fmt: skip
        self.problem = why


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
