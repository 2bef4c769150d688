"""Routing an organisation's requests to its LoRA adapter inside the running engine.

The table (:class:`~rtrl.core.api.adapter.AdapterRouting`) is a file, or a directory of
files, one per writer, whose union it is (``--adapters``: a ConfigMap mounted in the pod,
which the kubelet replaces atomically; :mod:`.table`), read again whenever any of them
changes (polled every second). A new table takes effect all at once, and only once every
adapter it names is in the engine: each is downloaded from the store into ``--adapter-dir``
(a volume the engine reads too), its files checked against its manifest, and loaded with
``POST /v1/load_lora_adapter``. A table that cannot be read, or that names an adapter that
cannot be loaded, is refused whole and the previous one stays (counted, logged, retried).
Adapters the table no longer names are unloaded once their last request has ended. So a
promotion or a rollback is a change of the file: requests in flight finish where they
started, new ones go to the new adapter, nothing restarts.

An adapter never runs on a base it was not trained on: its manifest's ``baseDigest`` is
checked against the digest of ``RTRL_MODEL_URI``'s manifest. One trained on another base is
*stale* (the base was promoted and its RLCycle has not retrained it yet): it is not loaded,
and does not hold back the rest of the table; the organisations it would serve get the base
instead (a stale stable: the base; a stale canary: weight 0, all to the stable route),
counted (``rtrl_capture_adapters_stale``) and logged once per table.

A request's route (:func:`choose`): its organisation (``--org-header``); its unit, the user
(``--user-header``), else the session; the unit's bucket, sha256(canary checkpoint id, unit)
mod 100, so a unit stays in one arm for the whole canary and is drawn afresh for the next
one; buckets below the weight get the canary. A request with no unit never gets the canary.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from rtrl.core.api.adapter import AdapterRef, AdapterRouting, base_digest
from rtrl.core.store import open_store, redact
from rtrl.core.store.base import sha256_file
from rtrl_serving.capture.configmap import ConfigMapWatch
from rtrl_serving.capture.table import Snapshot, TableError, parse, snapshot

log = logging.getLogger(__name__)

STABLE, CANARY = "stable", "canary"
# What an adapter's engine needs of its published files (train.json is the trainer's account).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
POLL_S = 1.0
RETRY_S = 10.0  # a refused table is tried again after this (the store may have been down)
CHECK_S = 5.0  # how often the engine's adapters are checked (a restarted engine has none)
# the proxy's session sends no Content-Type of its own (it forwards the client's)
_JSON = {"Content-Type": "application/json"}
NONE: frozenset[str] = frozenset()


class AdapterError(Exception):
    """An adapter the table names cannot be served; the message says which and why."""


class StaleAdapterError(AdapterError):
    """An adapter trained on another base than the engine's: skipped, its orgs get the base."""


@dataclass(frozen=True)
class Route:
    """Where one request goes: an adapter (None: the base) and the org's arm it is in."""

    ref: AdapterRef | None
    arm: str


def bucket(salt: str, unit: str) -> int:
    """The unit's bucket 0..99 for a canary (``salt``: its checkpoint id)."""
    digest = hashlib.sha256(f"{salt}\0{unit}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100


def choose(
    table: AdapterRouting, org: str | None, unit: str | None, stale: frozenset[str] = NONE
) -> Route | None:
    """The route of a request of ``org`` from ``unit``; None where the table says nothing
    of the org (the pod's own checkpoint and arm). An adapter named in ``stale`` is the
    base's route: a stale stable is the base, a stale canary gets no unit."""
    route = table.orgs.get(org) if org is not None else None
    if route is None:
        return None
    if route.canary is None and route.stable is None:
        return None  # named, but nothing of its own: as if not named
    canary = route.canary if route.canary is not None and route.canary.name not in stale else None
    stable = route.stable if route.stable is not None and route.stable.name not in stale else None
    if canary is not None and unit and bucket(canary.checkpoint, unit) < route.weight:
        return Route(canary, CANARY)
    return Route(stable, STABLE)


class AdapterRouter:
    """The sidecar's table, and the adapters it keeps loaded in the engine."""

    def __init__(
        self,
        path: Path,
        directory: Path,
        *,
        engine: str,
        base_uri: str | None,
        endpoint_url: str | None = None,
        watch: ConfigMapWatch | None = None,
    ) -> None:
        self.path = path
        self.watch = watch  # the ConfigMap through the API, ahead of the mounted ``path``
        self.directory = directory
        self.engine = engine
        self.base_uri = base_uri
        self.endpoint_url = endpoint_url
        self.table = AdapterRouting()
        self.stale: frozenset[str] = frozenset()  # the table's adapters of another base
        self.applied = False  # a table from the file is in effect
        self.loaded: set[str] = set()
        self.in_flight: Counter[str] = Counter()
        self.retiring: set[str] = set()  # unnamed by the table, unloaded once idle
        self.tables = Counter[str]()  # "applied" / "refused"
        self.problem: str | None = None  # why the last table was refused
        self._seen: Snapshot | None = None
        self._retry_at = 0.0
        self._check_at = 0.0
        self.reloads = 0  # adapters loaded again after the engine lost them
        self.missing: list[str] = []  # adapters of the table in effect not in the engine
        self._base: str | None = None  # the digest of the engine's base, read once

    # --- requests ------------------------------------------------------------------------

    def route(self, org: str | None, unit: str | None) -> Route | None:
        """The request's route, counted in flight until :meth:`release`."""
        found = choose(self.table, org, unit, self.stale)
        if found is not None and found.ref is not None:
            self.in_flight[found.ref.name] += 1
        return found

    def release(self, found: Route | None) -> None:
        if found is not None and found.ref is not None:
            self.in_flight[found.ref.name] -= 1

    # --- the table -----------------------------------------------------------------------

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Follow the table until cancelled."""
        watching = asyncio.create_task(self.watch.run()) if self.watch is not None else None
        try:
            while True:
                try:
                    await self.refresh(session)
                except Exception:  # a bug must not stop routing: the old table stays
                    log.exception("refreshing the adapter routing table failed")
                await asyncio.sleep(POLL_S)
        finally:
            if watching is not None:  # its session closed before the sidecar's loop ends
                watching.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watching

    async def refresh(self, session: aiohttp.ClientSession) -> bool:
        """Apply the table if any of its files changed (or a refused one is due again);
        whether a new table is now in effect. Then unload what is retired and idle."""
        applied = False
        loop = asyncio.get_running_loop()
        seen = self.watch.snapshot() if self.watch is not None else None
        if seen is None:  # not (yet) through the API: the mounted table
            seen = await asyncio.to_thread(snapshot, self.path)
        if seen is None and not self.applied:
            self.problem = f"{self.path}: no such file"
        due = self.problem is not None and loop.time() >= self._retry_at
        if seen is not None and (seen != self._seen or due):
            self._seen = seen
            try:
                table = parse(seen)
                stale = await self._load_all(session, table)
            except (TableError, AdapterError) as exc:
                self.tables["refused"] += 1
                if str(exc) != self.problem:
                    log.error("adapter routing table refused, the previous one stays: %s", exc)
                self.problem = str(exc)
                self._retry_at = loop.time() + RETRY_S
            else:
                named = set(table.adapters()) - stale.keys()
                self.retiring |= set(self.table.adapters()) - self.stale - named
                self.retiring -= named
                self.table, self.stale = table, frozenset(stale)
                self.applied, self.problem = True, None
                self.missing = sorted(named - self.loaded)
                self.tables["applied"] += 1
                applied = True
                for why in stale.values():
                    log.warning("adapter routing: %s", why)
                log.info("adapter routing: %d org(s), adapters %s, stale %s", len(table.orgs),
                         ", ".join(sorted(named)) or "none",
                         ", ".join(stale) or "none")  # fmt: skip
        for name in sorted(self.retiring):
            if self.in_flight[name] <= 0:
                await self._unload(session, name)
        if self.applied and loop.time() >= self._check_at:
            self._check_at = loop.time() + CHECK_S
            await self._reload_lost(session)
        return applied

    async def _reload_lost(self, session: aiohttp.ClientSession) -> None:
        """Load again what the engine no longer has (a restarted engine container starts
        with no adapter); until then :attr:`missing` names them and the pod is not ready."""
        try:
            async with session.get(f"{self.engine}/v1/models") as resp:
                if resp.status != 200:
                    return
                doc = await resp.json(content_type=None)
        except (aiohttp.ClientError, ValueError):
            return  # the engine is down: its own health says so
        served = {m.get("id") for m in doc.get("data") or [] if isinstance(m, dict)}
        lost = self.loaded - served
        if lost:
            log.warning("the engine lost adapter(s) %s (restarted?): loading them again",
                        ", ".join(sorted(lost)))  # fmt: skip
            self.loaded -= lost
            self.reloads += len(lost)
        try:
            await self._load_all(session, self.table, skip=self.stale)
        except AdapterError as exc:
            log.error("loading the table's adapters again failed: %s", exc)
        self.missing = sorted(set(self.table.adapters()) - self.stale - self.loaded)

    async def _load_all(
        self, session: aiohttp.ClientSession, table: AdapterRouting, skip: frozenset[str] = NONE
    ) -> dict[str, str]:
        """Load the table's adapters the engine lacks; the stale ones left out, by name with
        why (AdapterError for any other that cannot be loaded)."""
        stale: dict[str, str] = {}
        for name, ref in sorted(table.adapters().items()):
            if name in self.loaded or name in skip:
                continue
            try:
                local = await asyncio.to_thread(self._download, ref)
            except StaleAdapterError as exc:
                stale[name] = str(exc)
                continue
            await self._load(session, ref, local)
        return stale

    def _download(self, ref: AdapterRef) -> Path:
        """The adapter's files in ``directory/<name>``, checked; the base checked too."""
        label = f"adapter {ref.name} ({redact(ref.uri)})"
        try:
            store = open_store(ref.uri, endpoint_url=self.endpoint_url)
            manifest = store.committed("")
        except Exception as exc:
            raise AdapterError(f"{label}: {redact(str(exc))}") from None
        if manifest is None:
            raise AdapterError(f"{label}: not committed (no manifest)")
        missing = [n for n in ADAPTER_FILES if n not in manifest.files]
        if missing or manifest.metadata.get("kind") != "adapter":
            raise AdapterError(f"{label}: not an adapter rtrl-job train published")
        self._check_base(label, manifest.metadata)
        target = self.directory / ref.name
        if target.is_dir() and all(
            (target / n).is_file() and sha256_file(target / n) == manifest.files[n]["sha256"]
            for n in ADAPTER_FILES
        ):
            return target  # this pod fetched it before (a restart)
        staging = self.directory / f".{ref.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            for name in ADAPTER_FILES:
                store.get_file(name, staging / name)
                if sha256_file(staging / name) != manifest.files[name]["sha256"]:
                    raise AdapterError(f"{label}: {name} does not match its manifest")
                os.chmod(staging / name, 0o644)  # the engine may run as another user
        except AdapterError:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        except Exception as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise AdapterError(f"{label}: {redact(str(exc))}") from None
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        return target

    def _check_base(self, label: str, metadata: Mapping[str, Any]) -> None:
        """The adapter's base must be the engine's: the same files (their digest); else it
        is stale (a base this pod's engine does not serve)."""
        if metadata.get("baseDigest") != self._base_digest(label):
            raise StaleAdapterError(
                f"{label}: trained on base {redact(str(metadata.get('base')))}, not on the "
                f"engine's {redact(str(self.base_uri))} (other files): stale, not served until "
                "it is trained on this base (it would compute what nobody measured)"
            )

    def _base_digest(self, label: str) -> str:
        """The digest of ``RTRL_MODEL_URI``'s files, read once (a pod's engine serves one
        base for its life: a new base is a new pod)."""
        if self._base is not None:
            return self._base
        if self.base_uri is None:
            raise AdapterError(f"{label}: RTRL_MODEL_URI is not set: the engine's base is unknown")
        where = redact(self.base_uri)
        try:
            base = open_store(self.base_uri, endpoint_url=self.endpoint_url).committed("")
        except Exception as exc:
            raise AdapterError(f"{label}: the engine's base {where}: {redact(str(exc))}") from None
        if base is None:
            raise AdapterError(f"{label}: the engine's base {where} has no manifest")
        self._base = base_digest({n: str(e.get("sha256")) for n, e in base.files.items()})
        return self._base

    async def _load(self, session: aiohttp.ClientSession, ref: AdapterRef, local: Path) -> None:
        body = {"lora_name": ref.name, "lora_path": str(local)}
        try:
            async with session.post(
                f"{self.engine}/v1/load_lora_adapter", data=json.dumps(body), headers=_JSON
            ) as resp:
                text = await resp.text()
                ok = resp.status == 200 or (resp.status == 400 and "already" in text)
        except aiohttp.ClientError as exc:
            raise AdapterError(f"adapter {ref.name}: the engine is unreachable: {exc}") from None
        if not ok:
            raise AdapterError(
                f"adapter {ref.name}: the engine refused it ({resp.status}: {text[:300]})"
            )
        self.loaded.add(ref.name)

    async def _unload(self, session: aiohttp.ClientSession, name: str) -> None:
        body = {"lora_name": name}
        try:
            async with session.post(
                f"{self.engine}/v1/unload_lora_adapter", data=json.dumps(body), headers=_JSON
            ) as resp:
                if resp.status not in (200, 404) and "not found" not in (await resp.text()):
                    return  # tried again at the next refresh
        except aiohttp.ClientError:
            return
        self.loaded.discard(name)
        self.retiring.discard(name)
        self.in_flight.pop(name, None)
        shutil.rmtree(self.directory / name, ignore_errors=True)
