"""The quick start's simulated users: they ask the served model the tiny model's coding
tasks through the inference Service (the capture sidecar in front of vLLM), with the
official ``openai`` client, and tell the feedback service later how it went.

A user's verdict is the rule a real one would apply: an answer that is exactly the task's
answer (the function, or a valid call of the ``run_tests`` tool) is kept (``edit_persisted``
1.0); anything else is thrown away (0.0) and followed by a dissatisfied message. The
signals are the ones the feedback service takes (docs/writing-shards.md, "Feedback"),
each with an ``event_id`` of its own derived from the interaction, so a retried post is
never counted twice.

Two kinds of traffic:

- **replayed** traffic carries the time it replays in :data:`CLOCK_HEADER`, which the
  sidecars read when their ``RTRL_CAPTURE_CLOCK_HEADER`` names it (the quick start's
  kubelet sets it: ``rtrl-capture --clock-header``, for simulations only). A day's
  traffic a few hours back is sealed at once (a served hour is sealed only once its
  feedback is final: an hour, plus the longest maturity, plus the seal's delay), so the
  first cycle has something to train on within minutes;
- **live** traffic carries no such header: the sidecar stamps it with its own clock, as in
  production, and its feedback is observed now.
"""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from .quickstart_manifests import ORG_HEADER, SESSION_HEADER, USER_HEADER
from .tinymodel import CASES, TOOLS, Case

CLOCK_HEADER = "X-Rtrl-Simulated-Time"
INTERACTION_HEADER = "X-Rtrl-Interaction-Id"
MODEL = "composer"  # the example Deployment's --served-model-name
ORGS = ("acme", "globex", "initech")
# When a user's verdict is observed, after the answer was served.
EDIT_AFTER = timedelta(hours=1)
FOLLOWUP_AFTER = timedelta(minutes=2)
FEEDBACK_BATCH = 500


@dataclass(frozen=True)
class Served:
    """One answer a user got: its id (the sidecar's), when it was served, and whether it
    was what the user wanted."""

    interaction_id: str
    served_at: datetime
    case: str
    good: bool
    replayed: bool


def good_answer(case: Case, message: Any) -> bool:
    """Whether the reply ``message`` (the client's ``choices[0].message``) is ``case``'s
    answer: the text itself, or exactly its one valid tool call."""
    calls = list(message.tool_calls or [])
    if case.name == "tool_call":
        if len(calls) != 1:
            return False
        call = calls[0].function
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            return False
        return bool(call.name == "run_tests" and arguments == {"path": "tests/test_math.py"})
    if case.name == "text":
        return not calls and (message.content or "") == case.answer
    return False  # the other tasks' answers are a schema violation or a malformed call


class Users:
    """Users asking through ``endpoints`` (a function returning the OpenAI base URLs of the
    Service's ready pods, one picked per request as kube-proxy does) and posting feedback
    to ``feedback_url`` with ``token``."""

    def __init__(
        self,
        endpoints: Callable[[], Sequence[str]],
        feedback_url: str,
        token: str,
        *,
        seed: int = 0,
        users: int = 24,
    ) -> None:
        self.endpoints = endpoints
        self.feedback_url = feedback_url
        self.token = token
        self.users = users
        self.random = random.Random(seed)
        self.failures = 0  # live requests or posts that failed (keep_asking)

    def ask(self, user: int, *, at: datetime | None = None) -> Served:
        """One request of ``user`` (a task chosen at random), served now or, replayed, at
        ``at``."""
        import openai

        case = self.random.choice(CASES)
        urls = self.endpoints()
        if not urls:
            raise RuntimeError("the Service has no ready endpoint")
        headers = {
            USER_HEADER: f"user-{user}",
            SESSION_HEADER: f"user-{user}-session-{self.random.randrange(3)}",
            ORG_HEADER: ORGS[user % len(ORGS)],
        }
        if at is not None:
            headers[CLOCK_HEADER] = at.isoformat()
        extra: dict[str, Any] = {"tools": TOOLS} if case.tools else {}
        url = self.random.choice(urls)
        with openai.OpenAI(base_url=url, api_key="unused", timeout=120) as client:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=list(case.messages),  # type: ignore[arg-type]
                max_tokens=96,
                temperature=1.0,
                extra_headers=headers,
                **extra,
            )
        answer = raw.parse()
        interaction = raw.headers[INTERACTION_HEADER]
        good = good_answer(case, answer.choices[0].message)
        served = at if at is not None else datetime.now(UTC)
        return Served(interaction, served, case.name, good, replayed=at is not None)

    def replay(
        self, start: datetime, span: timedelta, count: int, workers: int = 4
    ) -> list[Served]:
        """``count`` requests spread over ``span`` from ``start`` (each stamped with its
        replayed time), ``workers`` at a time."""
        step = span / max(1, count)
        moments = [(i % self.users, start + i * step) for i in range(count)]
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(lambda m: self.ask(m[0], at=m[1]), moments))

    def events(self, served: Served, now: datetime) -> list[dict[str, Any]]:
        """The user's two signals on ``served``: observed when a user would (replayed), or
        now (live)."""

        def at(after: timedelta) -> str:
            moment = served.served_at + after if served.replayed else now
            return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")

        return [
            {"event_id": f"{served.interaction_id}-edit", "interaction_id": served.interaction_id,
             "signal": "edit_persisted", "value": 1.0 if served.good else 0.0,
             "observed_at": at(EDIT_AFTER)},
            {"event_id": f"{served.interaction_id}-followup",
             "interaction_id": served.interaction_id, "signal": "dissatisfied_followup",
             "value": not served.good, "observed_at": at(FOLLOWUP_AFTER)},
        ]  # fmt: skip

    def post_feedback(self, served: Iterable[Served]) -> int:
        """Post every signal of ``served`` (in requests of up to :data:`FEEDBACK_BATCH`
        events); the number the service accepted. A refusal raises with its answer."""
        now = datetime.now(UTC)
        events = [e for s in served for e in self.events(s, now)]
        accepted = 0
        for i in range(0, len(events), FEEDBACK_BATCH):
            body = json.dumps({"events": events[i : i + FEEDBACK_BATCH]}).encode()
            request = urllib.request.Request(self.feedback_url, data=body, method="POST")
            request.add_header("Authorization", f"Bearer {self.token}")
            request.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    answer = json.loads(response.read())
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:2000]
                raise RuntimeError(f"the feedback service answered {exc.code}: {detail}") from None
            accepted += int(answer.get("accepted", 0))
        return accepted

    def keep_asking(
        self,
        stop: threading.Event,
        post: Callable[[list[Served]], object],
        *,
        every: float = 2.0,
        batch: int = 20,
    ) -> None:
        """Live traffic until ``stop``: a request about every ``every`` seconds, their
        feedback ``post``ed ``batch`` at a time. A failed request (a pod rolling, the
        canary's start) is counted in :attr:`failures` and the next one goes on."""
        pending: list[Served] = []
        user = 0
        while not stop.is_set():
            try:
                pending.append(self.ask(user % self.users))
                user += 1
                if len(pending) >= batch:
                    post(pending)
                    pending = []
            except Exception:
                self.failures += 1
            stop.wait(every)
