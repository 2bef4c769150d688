"""The simulated users as clients of a deployment: they ask the model through the capture
sidecar of their arm over HTTP and send their feedback to ``rtrl-feedback``.

What a real client does, and nothing more: ``POST /v1/completions`` (token-id prompts: the
demo's model has no tokenizer) with the user, organisation and session in the headers the
RLCycle's ``spec.capture.headers`` names, reading the completion's token ids
(``return_token_ids``) and the ``X-Rtrl-Interaction-Id`` the sidecar answers with; then the
signals :func:`rtrl_demo.sim.judge` draws, each as a feedback event naming that id, POSTed
with a bearer token. The log-probs never pass through this module: the sidecar asks the
engine for them and records them itself.

The demo runs in simulated time, so each request carries its simulated serving time in the
sidecar's ``--clock-header`` (a simulation aid a production pod never sets), and each
feedback event the simulated time the user's reaction was observed (``observed_at``: the
serving time plus the sim's feedback delay).

Each interaction draws its judgement from a generator seeded by its own seed, so a run's
outcomes do not depend on the order in which concurrent responses arrive.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import aiohttp

from . import sim

INTERACTION_HEADER = "X-Rtrl-Interaction-Id"
# rtrl-feedback takes at most 1,000 events a request (its --max-events default)
FEEDBACK_BATCH = 1000
# Requests in flight: as many as the model server batches (engine.MAX_BATCH), so a batch
# is not cut short by the client (bench/demo_tick.py --concurrency 64 256 512).
CONCURRENCY = 512
RETRIES = 5


class RequestFailedError(RuntimeError):
    """A request the inlet refused or could not serve; the message says which and why."""


@dataclass(frozen=True)
class Headers:
    """Header names of ``spec.capture.headers`` and the sidecar's clock header."""

    user: str = "X-Rtrl-User"
    session: str = "X-Rtrl-Session"
    org: str = "X-Rtrl-Org"
    clock: str = "X-Rtrl-Simulated-Time"


@dataclass(frozen=True)
class Visit:
    """One interaction to simulate: who asks what, when, through which arm."""

    user: sim.User
    task: sim.Task
    created: datetime
    arm: int
    seed: int


@dataclass
class Served:
    """What the user got and what they made of it."""

    visit: Visit
    interaction_id: str
    completion: list[int]
    signals: dict[str, Any]
    observed_at: datetime


def iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def feedback_events(served: Served) -> list[dict[str, Any]]:
    """One feedback event per signal the user reported (a signal the sim leaves None, an
    edit that was never proposed, is not reported), ids stable across retries."""
    out = []
    for signal, value in served.signals.items():
        if value is None:
            continue
        out.append(
            {
                "event_id": f"{served.interaction_id}:{signal}",
                "interaction_id": served.interaction_id,
                "signal": signal,
                "value": value,
                "observed_at": iso(served.observed_at),
            }
        )
    return out


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[dict[str, Any], Mapping[str, str]]:
    """POST ``body``; retried (same body) on connection errors and 502/503, as a client of a
    deployment retries. Any other non-2xx is an :class:`InletError` with the server's words."""
    data = json.dumps(body)
    for attempt in range(RETRIES):
        try:
            async with session.post(
                url, data=data, headers={"Content-Type": "application/json", **headers}
            ) as resp:
                text = await resp.text()
                if resp.status in (502, 503) and attempt + 1 < RETRIES:
                    await asyncio.sleep(0.2 * 2**attempt)
                    continue
                if resp.status // 100 != 2:
                    raise RequestFailedError(f"POST {url}: {resp.status}: {text[:500]}")
                return json.loads(text), resp.headers
        except aiohttp.ClientConnectionError as exc:
            if attempt + 1 == RETRIES:
                raise RequestFailedError(f"POST {url}: {exc}") from exc
            await asyncio.sleep(0.2 * 2**attempt)
    raise AssertionError("unreachable")


async def _visit(
    session: aiohttp.ClientSession, proxy: str, model: str | None, visit: Visit, names: Headers
) -> Served:
    body: dict[str, Any] = {
        "prompt": visit.task.prompt,
        "max_tokens": sim.MAX_NEW_TOKENS,
        "seed": visit.seed,
        "return_token_ids": True,
    }
    if model:
        body["model"] = model
    headers = {
        names.user: visit.user.user_id,
        names.org: visit.user.org,
        names.session: f"{visit.user.user_id}-{visit.created:%Y%m%d%H}",
        names.clock: iso(visit.created),
    }
    doc, got = await _post(session, f"{proxy}/v1/completions", body, headers)
    ids = got.get(INTERACTION_HEADER, "")
    if not ids:
        raise RequestFailedError(f"{proxy}: no {INTERACTION_HEADER} in the response")
    completion = [int(t) for t in doc["choices"][0]["token_ids"]]
    rng = random.Random(f"judge:{visit.seed}")
    signals = sim.judge(visit.task, visit.user, completion, rng)
    delay = min(rng.expovariate(1 / sim.FEEDBACK_DELAY_MEAN_S), sim.FEEDBACK_DELAY_MAX_S)
    return Served(visit, ids.split(",", maxsplit=1)[0], completion, signals,
                  visit.created + timedelta(seconds=delay))  # fmt: skip


async def _run(
    visits: Sequence[Visit],
    proxies: Sequence[tuple[str, str | None]],
    feedback: str,
    token: str,
    *,
    names: Headers,
    concurrency: int,
) -> list[Served]:
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(visit: Visit) -> Served:
            async with limit:
                proxy, model = proxies[visit.arm]
                return await _visit(session, proxy, model, visit, names)

        served = await asyncio.gather(*(one(v) for v in visits))
        events = [e for s in served for e in feedback_events(s)]
        auth = {"Authorization": f"Bearer {token}"}
        for start in range(0, len(events), FEEDBACK_BATCH):
            batch = events[start : start + FEEDBACK_BATCH]
            await _post(session, f"{feedback}/v1/feedback", {"events": batch}, auth)
    return list(served)


def interact(
    visits: Sequence[Visit],
    proxies: Sequence[tuple[str, str | None]],
    feedback: str,
    token: str,
    *,
    names: Headers | None = None,
    concurrency: int = CONCURRENCY,
) -> list[Served]:
    """Serve every visit through its arm's sidecar (``proxies[arm]``: base URL and the
    served model's name), then POST all their feedback; return what each user got."""
    return asyncio.run(
        _run(visits, proxies, feedback, token, names=names or Headers(), concurrency=concurrency)
    )
