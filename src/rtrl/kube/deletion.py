"""The round of an RLCycle being deleted that carries rtrl's finalizer
(``rtrl.io/restore-traffic``, :mod:`rtrl.planning.traffic`): what the operator changed
outside its own objects is given back, then the finalizer removed, and the API server's
garbage collector takes the rest.

The reconciler (:func:`rtrl.kube.reconcile.reconcile_once`) runs this round instead of its
usual one once the RLCycle has a ``deletionTimestamp``; kopf starts no daemon for an object
being deleted, so :func:`rtrl.kube.watch.give_back_soon` starts that reconciler for it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from rtrl.core.api.policy import TenancyPolicy
from rtrl.planning import plan

from .apply import apply
from .cached_client import CachingClient
from .client import KubeError
from .observe import observe

# When the round looks again after giving traffic back: the next one finds the RLCycle gone
# (its DELETED event wakes it sooner), or still held after a write that failed.
AGAIN_SECONDS = 1.0


def give_back(kube: CachingClient, rlcycle: dict[str, Any], policy: TenancyPolicy) -> float:
    """Observe, plan (:func:`rtrl.planning.traffic.finalize`), apply. No status, Event
    only from the plan, no notifications: the RLCycle is going. Seconds to look again."""
    observed = observe(kube, rlcycle, policy)
    decided = plan(observed, datetime.now(UTC))
    apply(kube, rlcycle, decided.actions)
    if kube.write_failed:
        raise KubeError("a write met a conflict; the next round reads live")
    return AGAIN_SECONDS
