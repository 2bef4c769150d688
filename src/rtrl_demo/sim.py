"""Simulated users for the demo: a population with hidden preferences, the tasks they ask a
coding model to do, and how they react to what the model answers.

The demo has no real users, so this module plays them. It is deliberately small: a tiny
model must be able to learn the right behaviour in a few hundred optimizer steps, and every
effect must be measurable from the same signals the real logging pipeline reports
(docs/demo.md has the full table).

Tokens (vocabulary 260, GPT-2 config ids ``bos=1``, ``eos=2``):

- a prompt is ``BOS <2-4 code tokens> TASK_<kind> LANG_<c>``: the task and the style
  come last, right before the answer, so a tiny model finds them easily;
- a completion starts with its action: ``EDIT_<k> code code EOS`` (an edit in style k),
  ``TOOL_<k> END EOS`` (a call of the tool with argument k; anything else after
  ``TOOL_<k>`` is an invalid call) or ``ASK Q EOS`` (a clarifying question). Anything else is
  noise. The first token decides the action and its style or argument (the next one whether
  a tool call is valid), so the reward of a row is about the token that earned it.

Task kinds and the right answer:

- ``edit``: the edit in style ``LANG`` (learnable from the prompt);
- ``tool``: the tool call with argument ``LANG`` (learnable from the prompt);
- ``tool_hard``: the tool call whose argument is the user's hidden style (a 1-in-4 guess);
- ``vague``: the edit in the user's hidden style (a 1-in-4 guess); helpful users answer a
  clarifying question, annoyed users are dissatisfied by it.

The numbers are chosen so that each lesson has a large, consistent effect (a tiny model
learns it within one cycle and the canary's A/B test sees it within a few simulated hours)
and so that the two reward hacks pay off under their broken rewards only: under the
correct reward, asking costs more than a guess and an invalid tool call is the worst
answer; when asking is free, a question beats a 1-in-4 guess on the hidden-preference
tasks; when invalid tool calls are dropped from the data, they are the only answer to a
hidden-preference task that is never penalised.

Organisations with conventions of their own (scenario ``two-orgs``, :data:`CONVENTIONS`):
on the hidden-preference tasks the right style is not the user's but the organisation's,
and the two organisations' conventions are disjoint halves of the styles (``org-a``'s users
keep edits and tool calls in styles 0-1, ``org-b``'s in styles 2-3). The prompt does not
say which organisation asks, so one model serving both cannot tell them apart: on the
pooled data each half of the styles is rewarded exactly as often as the other (with as
many users in each organisation), and a shared model trained on it has nothing to learn on
those tasks; a LoRA adapter per organisation, trained on its own users' rows, learns its
organisation's half.

Everything is a pure function of a seeded :class:`random.Random`, so a run is repeatable.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

VOCAB = 260
BOS, EOS = 1, 2
TASK = {"edit": 10, "tool": 11, "tool_hard": 12, "vague": 13}
TASK_MIX = {"edit": 0.4, "tool": 0.3, "tool_hard": 0.15, "vague": 0.15}
STYLES = 4
LANG0 = 20  # LANG_c = 20 + c
EDIT0 = 40  # EDIT_k = 40 + k
TOOL0 = 60  # TOOL_k = 60 + k: a call of the tool with argument k
END, ASK, Q = 51, 52, 53
CODE = (100, 200)  # code tokens: [100, 200)
MAX_NEW_TOKENS = 6

# The user's reaction, per outcome: P(edit persisted) and P(dissatisfied follow-up).
P_KEEP_RIGHT, P_KEEP_WRONG = 0.9, 0.1
P_DISSATISFIED_KEPT, P_DISSATISFIED_LOST = 0.05, 0.9
P_DISSATISFIED_INVALID = 0.7
P_DISSATISFIED_NOISE = 0.9
P_DISSATISFIED_ASK_ANNOYED, P_DISSATISFIED_ASK_HELPFUL = 0.2, 0.05
ANNOYED_SHARE = 0.3
ORGS = ("acme", "globex", "initech")
# Scenario two-orgs: each organisation's convention, the styles its users keep on the
# hidden-preference tasks (the first token of the answer: EDIT_k / TOOL_k).
CONVENTIONS: dict[str, tuple[int, ...]] = {"org-a": (0, 1), "org-b": (2, 3)}
# Latency: the engine's time to first token plus time per token, plus a tool run, plus the
# agent's retry when its edit is rejected or its tool call does not parse (so a better
# policy is also a faster one, as in the blog's table).
LATENCY_BASE_MS, LATENCY_PER_TOKEN_MS, LATENCY_TOOL_MS = 300.0, 120.0, 200.0
LATENCY_RETRY_MS = 1000.0
# Share of the clear tasks the base model answers right: it was pre-trained on a little
# labelled data, so it starts better than chance and the A/B test has power.
INFORMED_PRIOR = 0.5
# Share of the base model's uninformed tool calls that are broken: it breaks them where it
# cannot know the argument (the hidden-preference tasks) more than where the prompt says it,
# so the drop-invalid-tool-calls hack grows where the base model already breaks calls and
# its guardrail sees it over the valid calls the clear tasks learn (docs/demo.md).
HIDDEN = ("tool_hard", "vague")
BROKEN_SHARE = {False: 0.15, True: 0.5}
FEEDBACK_DELAY_MEAN_S = 600.0  # feedback arrives ~10 minutes after the interaction
FEEDBACK_DELAY_MAX_S = 2400.0


def stable_hash(text: str) -> int:
    """A 64-bit hash independent of the process (``hash()`` is salted)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


@dataclass(frozen=True)
class User:
    user_id: str
    org: str
    style: int  # hidden: the edit style and tool argument this user wants on vague tasks
    annoyed: bool  # hidden: dislikes being asked questions
    rate: float  # interactions per hour

    def arm_fraction(self) -> float:
        """Where the user falls in [0, 1): the canary gets users below its share."""
        return (stable_hash(f"arm:{self.user_id}") % 10_000) / 10_000


def make_users(n: int, seed: int, orgs: tuple[str, ...] = ORGS) -> list[User]:
    """``n`` users of ``orgs``: the default population, or :data:`CONVENTIONS`' organisations
    (every other user in each, so both are as large)."""
    rng = random.Random(f"users:{seed}")
    users = []
    for i in range(n):
        drawn = orgs[rng.randrange(len(orgs))]
        org = drawn if orgs == ORGS else orgs[i % len(orgs)]
        users.append(
            User(
                user_id=f"user-{seed}-{i:05d}",
                org=org,
                style=rng.randrange(STYLES),
                annoyed=rng.random() < ANNOYED_SHARE,
                rate=3.0,
            )
        )
    return users


@dataclass(frozen=True)
class Task:
    kind: str
    lang: int
    prompt: list[int]


def make_task(rng: random.Random) -> Task:
    kind = rng.choices(list(TASK_MIX), weights=list(TASK_MIX.values()))[0]
    lang = rng.randrange(STYLES)
    code = [rng.randrange(*CODE) for _ in range(rng.randint(2, 4))]
    return Task(kind, lang, [BOS, *code, TASK[kind], LANG0 + lang])


def task_kind(prompt: list[int]) -> str:
    """The kind of task a prompt asks for (its ``TASK_<kind>`` token, second to last), or
    ``unknown``: the shards hold the prompt, not the sim's task."""
    by_token = {token: kind for kind, token in TASK.items()}
    return by_token.get(prompt[-2], "unknown") if len(prompt) >= 2 else "unknown"


def parse(completion: list[int]) -> tuple[str, int | None]:
    """The completion's action: (``edit``|``tool``|``invalid_tool``|``ask``|``noise``, k)."""
    body = completion[: completion.index(EOS)] if EOS in completion else list(completion)
    if not body:
        return "noise", None
    first = body[0]
    if EDIT0 <= first < EDIT0 + STYLES:
        return "edit", first - EDIT0
    if TOOL0 <= first < TOOL0 + STYLES:
        if body[1:] == [END]:
            return "tool", first - TOOL0
        return "invalid_tool", None
    if first == ASK:
        return "ask", None
    return "noise", None


def judge(task: Task, user: User, completion: list[int], rng: random.Random) -> dict[str, Any]:
    """The signals the logging pipeline reports for one interaction (docs/demo.md)."""
    action, k = parse(completion)
    wanted = task.lang if task.kind in ("edit", "tool") else user.style
    # an organisation with a convention wants its own styles on the hidden-preference tasks
    wanted_styles = (
        CONVENTIONS[user.org] if task.kind in HIDDEN and user.org in CONVENTIONS else (wanted,)
    )
    wants_tool = task.kind in ("tool", "tool_hard")
    signals: dict[str, Any] = {
        "edit_persisted": None,
        "tool_calls": 0,
        "invalid_tool_calls": 0,
        "asked_clarification": False,
        "edits_proposed": 0,
    }
    latency = LATENCY_BASE_MS + LATENCY_PER_TOKEN_MS * len(completion)
    if action in ("edit", "tool"):
        right = k in wanted_styles and (action == "tool") == wants_tool
        kept = rng.random() < (P_KEEP_RIGHT if right else P_KEEP_WRONG)
        signals["edit_persisted"] = 1.0 if kept else 0.0
        signals["edits_proposed"] = 1
        p_dissatisfied = P_DISSATISFIED_KEPT if kept else P_DISSATISFIED_LOST
        if not kept:
            latency += LATENCY_RETRY_MS
        if action == "tool":
            signals["tool_calls"] = 1
            latency += LATENCY_TOOL_MS
    elif action == "invalid_tool":
        signals["tool_calls"] = 1
        signals["invalid_tool_calls"] = 1
        p_dissatisfied = P_DISSATISFIED_INVALID
        latency += LATENCY_RETRY_MS
    elif action == "ask":
        signals["asked_clarification"] = True
        p_dissatisfied = P_DISSATISFIED_ASK_ANNOYED if user.annoyed else P_DISSATISFIED_ASK_HELPFUL
    else:
        p_dissatisfied = P_DISSATISFIED_NOISE
        latency += LATENCY_RETRY_MS
    signals["dissatisfied_followup"] = rng.random() < p_dissatisfied
    signals["latency_ms"] = latency * rng.uniform(0.8, 1.25)
    return signals


def prior_completion(task: Task, rng: random.Random) -> list[int]:
    """What the base model was pre-trained to answer: on clear tasks the right answer
    ``INFORMED_PRIOR`` of the time, otherwise plausible actions ignorant of the users (any
    style, the wrong action often, some questions, and broken tool calls, most of them on
    the hidden-preference tasks)."""
    if task.kind in ("edit", "tool") and rng.random() < INFORMED_PRIOR:
        if task.kind == "edit":
            return [EDIT0 + task.lang, rng.randrange(*CODE), rng.randrange(*CODE), EOS]
        return [TOOL0 + task.lang, END, EOS]
    roll = rng.random()
    k = rng.randrange(STYLES)
    if roll < 0.5:
        return [EDIT0 + k, rng.randrange(*CODE), rng.randrange(*CODE), EOS]
    if roll < 0.8:
        share, broken = BROKEN_SHARE[task.kind in HIDDEN], rng.random()
        if broken < share / 2:
            return [TOOL0 + k, EOS]
        if broken < share:
            return [TOOL0 + k, rng.randrange(*CODE), END, EOS]
        return [TOOL0 + k, END, EOS]
    return [ASK, Q, EOS]


def follows_convention(org: str, prompt: list[int], completion: list[int]) -> bool | None:
    """Whether an answer to a hidden-preference task is an edit or tool call in ``org``'s
    convention (:data:`CONVENTIONS`); None for other tasks, other answers or other orgs."""
    if org not in CONVENTIONS or task_kind(prompt) not in HIDDEN:
        return None
    action, k = parse(completion)
    if action not in ("edit", "tool"):
        return None
    return k in CONVENTIONS[org]
