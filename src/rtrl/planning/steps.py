"""The canary's steps: which entry of ``spec.rollout.steps`` a rollout record runs, and what
happens when the steps are edited while a canary runs (a GitOps commit): each record holds
its step's index and a hash of the steps, and a new hash restarts them at the first step,
as Argo Rollouts does (docs/canary.md, "Steps and analyses")."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rtrl.core.api.checkpoint import CheckpointPhase
from rtrl.core.api.reasons import Reason

from .manifests import canary as cn
from .reading import meta
from .records import Record, step_index, written
from .round import Round
from .timeutil import whole

# Checkpoint.status.rollout holds at most 64 records (the CRD): a restart needs one more.
MAX_RECORDS = 63


def steps_hash(r: Round) -> str:
    """What the running canary's steps were, as a hash stored in each record."""
    steps = [s.model_dump(mode="json", by_alias=True) for s in r.spec.rollout.steps]
    return hashlib.sha256(json.dumps(steps, sort_keys=True).encode()).hexdigest()[:16]


def new_record(r: Round, index: int, restarted: str | None = None) -> Record:
    """The record of step ``index`` of the current ``spec.rollout.steps``, starting now."""
    weight = r.spec.rollout.steps[index].weight
    return Record(weight=weight, share=share(r, weight), started_at=whole(r.now), analyses=0,
                  step=index, steps_hash=steps_hash(r), restarted=restarted)  # fmt: skip


def share(r: Round, weight: int) -> float:
    """The share of traffic (percent) ``weight`` gives the canary next to the target as it
    is now, as a record keeps it: with the replicas router it is not the weight (one
    canary pod next to one stable pod is 50%, whatever the step asks)."""
    return round(cn.canary_weight(r.spec, r.obs.target, weight)[1], 2)


def keep_share(r: Round, ck: dict[str, Any], records: list[Record], share: float) -> None:
    """The current step's record says the share the canary has now: written when the
    target's replicas changed since (or the record is an older rtrl's, without one)."""
    if records[-1].share != round(share, 2):
        records[-1].share = round(share, 2)
        r.patch_checkpoint(ck, phase=CheckpointPhase.CANARY, rollout=written(records))


def steps_changed(r: Round, records: list[Record]) -> bool:
    """The steps were edited since the current step started (a record of an older rtrl,
    without a hash, is taken as unchanged)."""
    recorded = records[-1].steps_hash
    return recorded is not None and recorded != steps_hash(r)


def restart_steps(r: Round, ck: dict[str, Any], records: list[Record]) -> str:
    """As Argo Rollouts does on a new step hash: the steps start again at the first one.
    The candidate is the same, so what the analysis has counted stays valid; only the
    canary's share goes back to the new first step's. Returns "" once restarted, or why
    the canary cannot be (its record holds no more steps): the caller rolls it back."""
    if len(records) >= MAX_RECORDS:
        return (f"spec.rollout.steps changed again with {len(records)} canary steps "
                "recorded, the most a Checkpoint holds")  # fmt: skip
    name, ended = meta(ck)["name"], records[-1]
    where = f"{ended.weight}% (step {step_index(records) + 1})"
    first = r.spec.rollout.steps[0]
    what = f"spec.rollout.steps changed at {where}"
    ended.ended_at, ended.reason = whole(r.now), what[:32768]
    records.append(new_record(r, 0, restarted=what))
    r.patch_checkpoint(ck, phase=CheckpointPhase.CANARY, rollout=written(records))
    r.event(
        Reason.ROLLOUT_RESTARTED,
        f"{name}: {what}: the canary restarts at step 1 ({first.weight}%)",
        kind="Checkpoint",
        name=name,
    )
    return ""
