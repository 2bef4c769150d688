"""What the proxy knows about the engine behind it: which checkpoint it loaded, whether that
is the one the pod is meant to serve, its sampling defaults, and whether it is healthy.

The checkpoint check compares the engine's own report (``/v1/models``: the ``root`` of the
served model, the ``--model`` it was started with) with ``RTRL_MODEL_URI`` (what the operator
gave the engine), both normalised (``file://`` and trailing slashes dropped, local paths
normalised). A disagreement, or either being unknown, marks every event
``checkpoint_verified: false``: the seal quarantines such rows and never trains on them. The
check runs at start and every ``verify_interval_s``, so an engine restarted on another
checkpoint is noticed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import aiohttp

from rtrl.core.store import redact
from rtrl_serving.capture.sampling import (
    SamplingDefaults,
    load_defaults,
    probe_outcome,
    probe_request,
)

log = logging.getLogger(__name__)


def normalise_model_uri(uri: str) -> str:
    """A checkpoint location in one spelling: no ``file://``, no trailing ``/``, local paths
    normalised; S3 URIs otherwise as they are (keys are case-sensitive)."""
    text = uri.strip()
    if text.startswith("file:"):
        text = unquote(urlsplit(text).path)
    if "://" not in text:
        text = os.path.normpath(text)
    return text.rstrip("/") or "/"


@dataclass
class EngineState:
    """The latest facts about the engine (read by every request, refreshed in the background)."""

    engine_model: str | None = None  # /v1/models' root
    served_name: str | None = None  # /v1/models' id
    verified: bool = False
    healthy: bool = False
    defaults: SamplingDefaults | None = None
    defaults_verified: bool | None = None  # the probe's verdict; None: not run or failed
    checked_at: float = 0.0


class EngineWatch:
    """Keeps :class:`EngineState` current for one engine base URL."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        engine: str,
        model_uri: str | None,
        generation_config: str,
        override: dict[str, Any],
    ) -> None:
        self.session = session
        self.engine = engine
        self.model_uri = model_uri
        self.generation_config = generation_config
        self.override = override
        self.state = EngineState()
        if model_uri is None:
            log.warning("RTRL_MODEL_URI is not set: no event can be checkpoint_verified")

    async def health(self) -> bool:
        try:
            async with self.session.get(f"{self.engine}/health") as resp:
                await resp.read()
                self.state.healthy = resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            self.state.healthy = False
        return self.state.healthy

    async def refresh(self) -> None:
        """Read ``/v1/models`` and re-check the checkpoint; the sampling defaults and their
        probe the first time the engine answers."""
        try:
            async with self.session.get(f"{self.engine}/v1/models") as resp:
                doc = await resp.json(content_type=None)
            model = (doc.get("data") or [{}])[0]
            root, name = model.get("root") or model.get("id"), model.get("id")
        except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError) as exc:
            log.warning("cannot read the engine's /v1/models: %s", redact(str(exc)))
            return
        state = self.state
        state.engine_model, state.served_name = root, name
        verified = (
            self.model_uri is not None
            and isinstance(root, str)
            and normalise_model_uri(root) == normalise_model_uri(self.model_uri)
        )
        if (state.verified and not verified) or (state.checked_at == 0.0 and not verified):
            log.error("the engine serves %r, not RTRL_MODEL_URI %r: events are unverified",
                      root, self.model_uri)  # fmt: skip
        state.verified = verified
        state.checked_at = time.monotonic()
        if state.defaults is None:
            location = self.model_uri or (root if isinstance(root, str) else None)
            state.defaults = await asyncio.to_thread(
                load_defaults, self.generation_config, location, self.override
            )
            log.info("sampling defaults: %s (%s)", dict(state.defaults.values),
                     state.defaults.source)  # fmt: skip
            state.defaults_verified = await self._probe(state.defaults)

    async def _probe(self, defaults: SamplingDefaults) -> bool | None:
        outcomes = []
        for sampling in (None, defaults.resolve(None)):
            body = probe_request(self.state.served_name, sampling)
            try:
                async with self.session.post(
                    f"{self.engine}/v1/completions",
                    data=json.dumps(body),
                    headers={"Content-Type": "application/json"},
                ) as resp:
                    doc = await resp.json(content_type=None)
                    if resp.status != 200:
                        raise ValueError(f"status {resp.status}: {str(doc)[:200]}")
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                log.warning("the sampling-defaults probe failed: %s", redact(str(exc)))
                return None
            outcomes.append(probe_outcome(doc))
        if outcomes[0] is None or outcomes[0] != outcomes[1]:
            log.error(
                "the engine does not sample with the defaults the proxy read (%s): give the "
                "proxy the engine's --generation-config and --override-generation-config",
                defaults.source,
            )
            return False
        return True
