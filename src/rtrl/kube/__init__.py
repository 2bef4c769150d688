"""The only code that talks to the Kubernetes API (and reads step results from the store).

``observe`` reads an RLCycle's world into a :class:`rtrl.planning.Observed`; ``apply``
carries out a plan's actions, treating "already exists" and "not found" as done.
:mod:`.reconcile` runs the rounds (observe -> plan -> apply -> status) of each RLCycle's
reconciler, and :mod:`.watch` says what a watch event feeds into the cache and whom it
wakes; neither holds kopf code (``rtrl.handlers`` registers the handlers that call them).
"""

from .apply import apply
from .client import KubeClient, KubeError
from .observe import observe

__all__ = ["KubeClient", "KubeError", "apply", "observe"]
