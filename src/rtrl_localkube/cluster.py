"""An in-memory cluster for running the operator's planning core on one machine.

``rtrl demo`` has no Kubernetes. :class:`LocalCluster` holds the objects the operator
would read and write and applies a plan's actions to them the way the API server does:
uids, ``generation`` bumped on spec changes, ``resourceVersion``, "already exists" and
"not found" as no-ops, JSON merge patches and JSON patches (whose failed ``test`` counts as
the 422 the kube layer treats as done), status merges, Events, and garbage collection of
dependents through ``ownerReferences``. It also plays the Deployment controller (every
Deployment rolled out and ready) and reads step results from the store as
``rtrl.kube.observe`` does, so :meth:`LocalCluster.observe` returns exactly the
:class:`~rtrl.planning.Observed` the operator would build. The clock is the caller's.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rtrl.core.api import names
from rtrl.core.api.policy import UNRESTRICTED
from rtrl.core.api.reasons import JobCondition
from rtrl.core.store import read_committed_json
from rtrl.planning import (
    Create,
    Delete,
    DeploymentState,
    Emit,
    JobState,
    Observed,
    Patch,
    PatchStatus,
    results_to_read,
)
from rtrl.planning.actions import Action
from rtrl.planning.manifests.canary import env_value
from rtrl.planning.manifests.seal import seal_name
from rtrl.planning.timeutil import iso, parse_time

from .patch import PatchConflictError, json_patch, merge_patch


class StaleWriteError(Exception):
    """A conditional status write met a newer version (the API server's 409): the plan
    was made from a stale view. One writer never meets it."""


@dataclass(frozen=True)
class Event:
    at: datetime
    kind: str
    name: str
    reason: str
    message: str
    warning: bool


class LocalCluster:
    """One namespace of objects, keyed by (kind, name)."""

    def __init__(self, now: datetime) -> None:
        self.now = now
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[Event] = []
        self._uids = itertools.count(1)
        self._versions = itertools.count(1)

    # The API server ---------------------------------------------------------------------

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, name))

    def list_objects(self, kind: str, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        out = []
        for (k, _), obj in sorted(self.objects.items()):
            have = (obj.get("metadata") or {}).get("labels") or {}
            if k == kind and all(have.get(key) == v for key, v in (labels or {}).items()):
                out.append(obj)
        return out

    def _stamp(self, obj: dict[str, Any]) -> None:
        obj["metadata"]["resourceVersion"] = str(next(self._versions))

    def create(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """Create; None when it already exists (the API's 409, which callers treat as done)."""
        key = (str(manifest["kind"]), str(manifest["metadata"]["name"]))
        if key in self.objects:
            return None
        obj = copy.deepcopy(manifest)
        meta = obj["metadata"]
        meta.update(
            uid=f"uid-{next(self._uids):06d}",
            generation=1,
            creationTimestamp=iso(self.now),
        )
        self._stamp(obj)
        self.objects[key] = obj
        return obj

    def delete(self, kind: str, name: str) -> bool:
        """Delete, and its dependents (ownerReferences), as background deletion would."""
        obj = self.objects.pop((kind, name), None)
        if obj is None:
            return False
        uid = obj["metadata"]["uid"]
        for key, other in list(self.objects.items()):
            owners = (other.get("metadata") or {}).get("ownerReferences") or []
            if any(o.get("uid") == uid for o in owners) and key in self.objects:
                self.delete(*key)
        return True

    def patch(self, kind: str, name: str, patch: dict[str, Any] | list[dict[str, Any]]) -> bool:
        """A merge patch (dict) or JSON patch (list); ``generation`` moves with the spec.
        False when there is no such object; :class:`PatchConflictError` on a failed test."""
        obj = self.objects.get((kind, name))
        if obj is None:
            return False
        patched = json_patch(obj, patch) if isinstance(patch, list) else merge_patch(obj, patch)
        if patched.get("spec") != obj.get("spec"):
            patched["metadata"]["generation"] = int(obj["metadata"].get("generation", 1)) + 1
        self._stamp(patched)
        self.objects[(kind, name)] = patched
        return True

    def patch_status(self, kind: str, name: str, status: dict[str, Any]) -> bool:
        obj = self.objects.get((kind, name))
        if obj is None:
            return False
        obj["status"] = merge_patch(obj.get("status") or {}, status)
        self._stamp(obj)
        return True

    def apply(self, actions: list[Action]) -> None:
        """Carry out a plan as ``rtrl.kube.apply`` does: each action idempotent, a status
        write conditional on the version the plan saw (or on the plan's own earlier write
        of the object)."""
        written: dict[tuple[str, str], str] = {}
        for action in actions:
            if isinstance(action, Create):
                self.create(action.manifest)
            elif isinstance(action, Delete):
                self.delete(action.kind, action.name)
            elif isinstance(action, Patch):
                # the 422: the next plan sees the new state and decides again
                with contextlib.suppress(PatchConflictError):
                    self.patch(action.kind, action.name, action.patch)
            elif isinstance(action, PatchStatus):
                key = (action.kind, action.name)
                seen = written.get(key, action.resource_version)
                obj = self.objects.get(key)
                if seen and obj is not None and obj["metadata"]["resourceVersion"] != seen:
                    held = obj["metadata"]["resourceVersion"]
                    raise StaleWriteError(f"{'/'.join(key)}: version {held}, the plan saw {seen}")
                if self.patch_status(action.kind, action.name, action.status) and seen:
                    written[key] = self.objects[key]["metadata"]["resourceVersion"]
            elif isinstance(action, Emit):
                self.events.append(
                    Event(
                        self.now,
                        action.kind,
                        action.name,
                        action.reason,
                        action.message,
                        action.warning,
                    )
                )

    # Controllers ------------------------------------------------------------------------

    def settle(self) -> None:
        """The Deployment controller: every Deployment rolled out and ready."""
        for (kind, _), dep in self.objects.items():
            if kind != "Deployment":
                continue
            n = int((dep.get("spec") or {}).get("replicas", 1))
            dep["status"] = {
                "observedGeneration": dep["metadata"]["generation"],
                "replicas": n,
                "updatedReplicas": n,
                "readyReplicas": n,
                "availableReplicas": n,
            }

    def finish_job(
        self, name: str, *, succeeded: bool, reason: str = "", message: str = ""
    ) -> None:
        """The Job controller's final status (Complete or Failed)."""
        job = self.objects[("Job", name)]
        cond = {
            "type": JobCondition.COMPLETE if succeeded else JobCondition.FAILED,
            "status": "True",
            "lastTransitionTime": iso(self.now),
            "reason": reason or ("CompletionsReached" if succeeded else "BackoffLimitExceeded"),
            "message": message,
        }
        job["status"] = {
            "conditions": [cond],
            **({"completionTime": iso(self.now), "succeeded": 1} if succeeded else {"failed": 1}),
        }
        self._stamp(job)

    def pending_jobs(self) -> list[dict[str, Any]]:
        jobs = self.list_objects("Job")
        return [j for j in jobs if not (j.get("status") or {}).get("conditions")]

    # What the kube layer observes -------------------------------------------------------

    @staticmethod
    def job_state(job: dict[str, Any]) -> JobState:
        meta = job["metadata"]
        labels = meta.get("labels") or {}
        conds = {c["type"]: c for c in (job.get("status") or {}).get("conditions") or []}
        done = conds.get(JobCondition.COMPLETE) or conds.get(JobCondition.FAILED) or {}
        failed = JobCondition.FAILED in conds
        return JobState(
            name=meta["name"],
            checkpoint=labels.get(names.LABEL_CHECKPOINT),
            checkpoint_uid=labels.get(names.LABEL_CHECKPOINT_UID),
            step=labels.get(names.LABEL_STEP),
            attempt=int(labels.get(names.LABEL_ATTEMPT, "0") or 0),
            succeeded=JobCondition.COMPLETE in conds,
            failed=failed,
            finished_at=parse_time(done.get("lastTransitionTime")),
            reason=str(done.get("reason") or "") if failed else "",
            message=str(done.get("message") or "") if failed else "",
        )

    def _routing(self, spec: dict[str, Any]) -> dict[str, Any] | None:
        """The routing table (``spec.capture.adapters.configMap``) as ``rtrl.kube.observe``
        reads it: not a child (every organisation's RLCycle writes its key, the base's reads
        it)."""
        table = ((spec.get("capture") or {}).get("adapters") or {}).get("configMap")
        if not table:
            return None
        found = self.get("ConfigMap", str(table))
        return copy.deepcopy(found) if found is not None else None

    def observe(self, rlcycle_name: str) -> Observed:
        rlcycle = self.objects[("RLCycle", rlcycle_name)]
        spec = rlcycle.get("spec") or {}
        mine = {names.LABEL_RLCYCLE: rlcycle_name}
        target = spec.get("target") or {}
        dep = self.get("Deployment", str(target.get("deployment")))
        canary = self.get("Deployment", f"{target.get('deployment')}-canary")
        state = DeploymentState(found=False)
        if dep is not None:
            container = str(target.get("container"))
            containers = [c.get("name") for c in dep["spec"]["template"]["spec"]["containers"]]
            env_name = str(target.get("checkpointEnv") or "MODEL_URI")
            state = DeploymentState(
                True, container in containers, env_value(dep, container, env_name)
            )
        observed = Observed(
            rlcycle=copy.deepcopy(rlcycle),
            checkpoints=[copy.deepcopy(c) for c in self.list_objects("Checkpoint")],
            jobs=[self.job_state(j) for j in self.list_objects("Job", mine)],
            services=frozenset(s["metadata"]["name"] for s in self.list_objects("Service", mine)),
            config_maps=frozenset(
                c["metadata"]["name"] for c in self.list_objects("ConfigMap", mine)
            ),
            deployment=state,
            target=copy.deepcopy(dep),
            canary=copy.deepcopy(canary),
            seal=copy.deepcopy(self.get("CronJob", seal_name(rlcycle_name))),
            routing=self._routing(spec),
            secret=None,
            # One machine, one user: the RLCycles' author is the admin.
            policy=UNRESTRICTED,
        )
        wanted = results_to_read(observed)
        if not wanted:
            return observed
        results = {uri: read_committed_json(uri) for uri in wanted}
        return Observed(**{**observed.__dict__, "results": results})
