"""History: at most ``spec.historyLimit`` Checkpoints of an RLCycle are kept. The oldest
finished ones go first; the serving one, the pinned one, the candidate, the running ones
and their parents are never pruned (their stored files are kept either way)."""

from __future__ import annotations

from rtrl.core.api.names import API_VERSION
from rtrl.core.api.names import RUNNING_PHASES as RUNNING
from rtrl.core.api.reasons import Reason

from .actions import Delete
from .reading import meta, phase
from .round import Round


def prune_history(r: Round) -> None:
    """Delete the Checkpoints beyond the limit, and forget them for the rest of the round."""
    limit = r.spec.history_limit
    finished = [c for c in r.owned if phase(c) not in RUNNING]
    if len(r.owned) <= limit:
        return
    protected = {meta(r.serving)["name"], r.spec.pin, r.old.get("candidate")}
    protected |= {meta(c)["name"] for c in r.owned if phase(c) in RUNNING}
    for name in list(protected):
        found = r.checkpoint(name) if name else None
        if found is not None:
            protected.add((found.get("spec") or {}).get("parent"))
    excess = len(r.owned) - limit
    for ck in finished:  # oldest first
        if excess <= 0:
            break
        name = meta(ck)["name"]
        if name in protected:
            continue
        r.act(Delete(API_VERSION, "Checkpoint", name))
        r.event(
            Reason.CHECKPOINT_PRUNED,
            f"{name} deleted: more than historyLimit={limit} "
            "Checkpoints (its stored files are kept)",
        )
        excess -= 1
    r.owned = [
        c
        for c in r.owned
        if not any(
            isinstance(a, Delete) and a.kind == "Checkpoint" and a.name == meta(c)["name"]
            for a in r.out.actions
        )
    ]
