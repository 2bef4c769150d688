"""The HTTP service: ``POST /v1/feedback``, ``/healthz``, ``/readyz``, ``/metrics``.

Answers of ``POST /v1/feedback`` (bodies are JSON):

- 202 ``{"accepted": n, "duplicates": d}``: every event of the request is in the events
  store (``d`` of them were already, by an earlier request with the same event ids);
- 400 ``{"error": ..., "problems": [{"field": "events[3].observed_at", "message": ...}]}``:
  nothing of the request was stored (all-or-nothing; fix the named fields and resend);
- 401: no or no accepted bearer token (nothing was read);
- 409: an event id this service already stored with other content;
- 413: the body is over ``--max-body-bytes``;
- 503: the events store failed; nothing is known to be stored: retry with the same event
  ids (safe: the seal step deduplicates by them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rtrl_serving.feedback.commit import CommitFailedError, ConflictError, GroupCommitter
from rtrl_serving.feedback.events import Limits, RequestProblemsError, parse_request
from rtrl_serving.feedback.metrics import Metrics
from rtrl_serving.feedback.tokens import Tokens

log = logging.getLogger("rtrl.feedback")

COMMITTER: web.AppKey[GroupCommitter] = web.AppKey("committer", GroupCommitter)
TOKENS: web.AppKey[Tokens] = web.AppKey("tokens", Tokens)
METRICS: web.AppKey[Metrics] = web.AppKey("metrics", Metrics)
LIMITS: web.AppKey[Limits] = web.AppKey("limits", Limits)
CLOCK: web.AppKey[Callable[[], datetime]] = web.AppKey("clock")


def _json(status: int, doc: dict[str, Any], **headers: str) -> web.Response:
    return web.json_response(doc, status=status, headers=headers or None)


async def post_feedback(request: web.Request) -> web.Response:
    app = request.app
    metrics = app[METRICS]

    def answer(status: int, doc: dict[str, Any], **headers: str) -> web.Response:
        metrics.requests.labels(code=str(status)).inc()
        return _json(status, doc, **headers)

    if not app[TOKENS].check(request.headers.get("Authorization")):
        metrics.rejected.labels(reason="unauthorized").inc()
        return answer(
            401,
            {"error": "unauthorized: send Authorization: Bearer <a token of the feedback Secret>"},
            **{"WWW-Authenticate": 'Bearer realm="rtrl-feedback"'},
        )
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        metrics.rejected.labels(reason="too_large").inc()
        return answer(413, {"error": f"body too large: {exc.text}"})
    try:
        events = parse_request(body, now=app[CLOCK](), limits=app[LIMITS])
    except RequestProblemsError as exc:
        for problem in exc.problems:
            metrics.rejected.labels(reason=problem.field.rpartition(".")[2].split("[")[0]).inc()
        return answer(
            400,
            {
                "error": "no event of this request was stored: " + str(exc.problems[0].field)
                + ": " + exc.problems[0].message,
                "problems": [p.as_dict() for p in exc.problems],
            },
        )  # fmt: skip
    try:
        duplicates = await app[COMMITTER].submit(events)
    except ConflictError as exc:
        metrics.rejected.labels(reason="conflict").inc(len(events))
        return answer(
            409,
            {
                "error": f"{exc}: an event id names one event; nothing of this request was stored",
                "problems": [{"field": exc.field, "message": "already used for another event"}],
            },
        )
    except CommitFailedError as exc:
        metrics.rejected.labels(reason="store_failed").inc(len(events))
        log.warning("feedback write failed: %s", exc)
        return answer(
            503,
            {"error": "the events store failed; retry with the same event ids"},
            **{"Retry-After": "1"},
        )
    metrics.accepted.inc(len(events))
    metrics.duplicates.inc(duplicates)
    return answer(202, {"accepted": len(events), "duplicates": duplicates})


async def healthz(request: web.Request) -> web.Response:
    return _json(200, {"ok": True})


async def readyz(request: web.Request) -> web.Response:
    tokens, committer = request.app[TOKENS], request.app[COMMITTER]
    tokens.reload()
    problems = []
    if not tokens.loaded:
        problems.append(tokens.error or "no token loaded")
    if not committer.running:
        problems.append("not committing (shutting down)")
    request.app[METRICS].ready.set(0 if problems else 1)
    if problems:
        return _json(503, {"ready": False, "problems": problems})
    return _json(200, {"ready": True})


async def metrics_page(request: web.Request) -> web.Response:
    data = generate_latest(request.app[METRICS].registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(
    committer: GroupCommitter,
    tokens: Tokens,
    *,
    limits: Limits | None = None,
    metrics: Metrics | None = None,
    max_body_bytes: int = 1 << 20,
    clock: Callable[[], datetime] | None = None,
) -> web.Application:
    """The application; the committer starts with it and drains on its cleanup (SIGTERM:
    requests in flight are answered after their write, then the process exits)."""
    app = web.Application(client_max_size=max_body_bytes)
    app[COMMITTER] = committer
    app[TOKENS] = tokens
    app[METRICS] = metrics or Metrics()
    app[LIMITS] = limits or Limits()
    app[CLOCK] = clock or (lambda: datetime.now(UTC))
    if committer.on_commit is None:
        committer.on_commit = app[METRICS].committed
    app.router.add_post("/v1/feedback", post_feedback)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_page)

    async def lifecycle(app: web.Application) -> Any:
        await committer.start()
        yield
        await committer.close()

    app.cleanup_ctx.append(lifecycle)
    return app
