"""What must hold of the operator's work whatever happens to the operator: kills at any
write, restarts, API-server restarts, store faults. The crash suite (tests/e2e/test_crash_*)
checks them after every restart and at the end, and the chaos soak (bench/) counts them.

Two kinds:

- **Safety**, over the whole history, kept by a :class:`Ledger` that sees every watch event
  of the namespace's Jobs, Checkpoints, Deployments and RLCycles (:func:`watching`):

  - ``duplicate-job``: a Job created twice (same name and Checkpoint uid, another uid: a
    Job deleted and recreated counts), or a Job created while another Job of the same
    Checkpoint and step (``rtrl.io/step``) had not finished;
  - ``duplicate-checkpoint``: a Checkpoint name created twice, two Checkpoints of one
    RLCycle for the same cycle number, or a cycle's Checkpoint created while another cycle
    of the RLCycle was still running;
  - ``lost-checkpoint``: a Checkpoint of an RLCycle deleted although its RLCycle still
    exists, unless it was still staging (insufficient data ends a cycle that way) or it
    had finished and at least ``spec.historyLimit`` Checkpoints remain (history pruning);
  - ``unevaluated-serving``: the target Deployment (or a canary Deployment) pointed at the
    URI of an RLCycle's Checkpoint before that Checkpoint's eval verdict was Passed (by
    resourceVersion: etcd's revisions are one global order).

- **Status** (:func:`status_problems`), of one RLCycle against its children at one moment,
  meaningful once the operator has settled (it finished a round with nothing to write):
  ``serving`` is what the target Deployment serves, the phase agrees with the candidate
  Checkpoint's phase and with the step Job that phase waits for, an idle RLCycle has no
  running Job and no canary, ``canaryWeight`` is the canary's share.

Usage::

    ledger = Ledger()
    with watching(ledger, controlplane, namespace):
        ...  # kill, restart, wait
        assert not ledger.violations()
        assert not status_problems(rlcycle, checkpoints, jobs, deployments)

Objects are plain dicts as the API returns them (camelCase).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rtrl.core.api.checkpoint import CheckpointPhase, Verdict
from rtrl.core.api.names import LABEL_ARM, LABEL_CHECKPOINT_UID, LABEL_RLCYCLE, LABEL_STEP
from rtrl.core.api.names import RUNNING_PHASES as RUNNING
from rtrl.core.api.reasons import JobCondition
from rtrl.core.api.rlcycle import RLCyclePhase
from rtrl.planning.manifests.canary import env_value
from rtrl.planning.manifests.names import canary_name, same_uri
from rtrl_localkube.watchfeed import Server, watch_kinds

WATCHED = {
    "RLCycle": "/apis/rtrl.io/v1alpha1/namespaces/{ns}/rlcycles",
    "Checkpoint": "/apis/rtrl.io/v1alpha1/namespaces/{ns}/checkpoints",
    "Job": "/apis/batch/v1/namespaces/{ns}/jobs",
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
}

# The RLCycle phases of a running cycle, and the Checkpoint phases each may show.
CYCLE_PHASES: dict[str, tuple[CheckpointPhase | None, ...]] = {
    RLCyclePhase.STAGING: (None, CheckpointPhase.PENDING, CheckpointPhase.STAGING),
    RLCyclePhase.TRAINING: (CheckpointPhase.TRAINING,),
    RLCyclePhase.EVALUATING: (CheckpointPhase.EVALUATING,),
    RLCyclePhase.CANARY: (CheckpointPhase.EVALUATED, CheckpointPhase.CANARY),
    RLCyclePhase.PROMOTING: (CheckpointPhase.CANARY,),
    RLCyclePhase.ROLLING_BACK: (CheckpointPhase.CANARY,),
}
STEP_OF_PHASE: dict[str, str] = {
    RLCyclePhase.STAGING: "stage",
    RLCyclePhase.TRAINING: "train",
    RLCyclePhase.EVALUATING: "eval",
}
QUIET_PHASES = (RLCyclePhase.IDLE, RLCyclePhase.SUSPENDED, RLCyclePhase.PINNED)
FINISHED_JOB = (
    JobCondition.COMPLETE,
    JobCondition.FAILED,
    JobCondition.SUCCESS_CRITERIA_MET,
    JobCondition.FAILURE_TARGET,
)


@dataclass(frozen=True)
class Violation:
    """One invariant broken: which (``invariant``) and what was seen (``message``)."""

    invariant: str
    message: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message}"


def _meta(obj: Mapping[str, Any]) -> dict[str, Any]:
    return dict(obj.get("metadata") or {})


def _rv(obj: Mapping[str, Any]) -> int:
    value = str(_meta(obj).get("resourceVersion") or "0")
    return int(value) if value.isdigit() else 0


def job_finished(job: Mapping[str, Any]) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") in FINISHED_JOB and c.get("status") == "True" for c in conditions)


@dataclass
class Ledger:
    """The history of one namespace's objects, fed with watch events (:meth:`feed`), and the
    safety invariants over it (:meth:`violations`). Thread-safe: the watch threads feed it
    while a test reads it."""

    found: list[Violation] = field(default_factory=list)
    # kind -> uid -> the object's latest state (deleted ones stay, under ``gone``)
    objects: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    gone: dict[str, set[str]] = field(default_factory=dict)
    # Checkpoint URI -> the resourceVersion at which its eval first read Passed
    passed_at: dict[str, int] = field(default_factory=dict)
    owned_uris: set[str] = field(default_factory=set)
    served: list[tuple[str, str, int]] = field(default_factory=list)  # (deployment, uri, rv)
    deleted: list[tuple[str, str]] = field(default_factory=list)  # (rlcycle, what) to judge
    events: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def feed(self, kind: str, event_type: str, obj: dict[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED) of a Job, Checkpoint, Deployment or
        RLCycle; a listed object is fed as ADDED (an object seen before is not added twice)."""
        uid = str(_meta(obj).get("uid") or "")
        if not uid:
            return
        with self._lock:
            self.events += 1
            known = self.objects.setdefault(kind, {})
            new = uid not in known
            if event_type == "DELETED":
                self.gone.setdefault(kind, set()).add(uid)
                previous = known.get(uid, obj)
                known[uid] = obj
                if kind == "Checkpoint":
                    self._checkpoint_deleted(previous)
                return
            if new:
                added = getattr(self, f"_{kind.lower()}_added", None)
                if added is not None:
                    added(obj)
            known[uid] = obj
            if kind == "Checkpoint":
                self._checkpoint_seen(obj)
            elif kind == "Deployment":
                self._deployment_seen(obj)

    def live(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            gone = self.gone.get(kind, set())
            return [o for uid, o in self.objects.get(kind, {}).items() if uid not in gone]

    def created(self, kind: str) -> list[str]:
        """The names of every object of ``kind`` seen, in the order first seen (uids
        distinct: a name recreated appears twice)."""
        with self._lock:
            return [_meta(o)["name"] for o in self.objects.get(kind, {}).values()]

    def violations(self, rlcycle_gone: Callable[[str], bool] | None = None) -> list[Violation]:
        """Every safety violation so far, including a serving that is judged only now (its
        Checkpoint's eval may have arrived on another watch after the Deployment's event).
        ``rlcycle_gone``: a direct read of whether an RLCycle is deleted or being deleted, for
        a Checkpoint whose deletion arrived before its RLCycle's (the watches of two kinds
        keep no common order): garbage collection took it, as the watch will show."""
        with self._lock:
            out = list(self.found)
            # garbage collection takes an RLCycle's children
            lost = [(rlc, what) for rlc, what in self.deleted if not self._rlcycle_went(rlc)]
            for deployment, uri, rv in self.served:
                if uri in self.owned_uris and not (0 < self.passed_at.get(uri, 0) < rv):
                    out.append(
                        Violation(
                            "unevaluated-serving",
                            f"Deployment {deployment} pointed at {uri} (resourceVersion {rv}) "
                            "before its Checkpoint's eval passed",
                        )
                    )
        # read outside the lock (the watches feed the ledger meanwhile), once per RLCycle
        gone = {rlc: rlcycle_gone(rlc) for rlc, _ in lost} if rlcycle_gone else {}
        out += [Violation("lost-checkpoint", what) for rlc, what in lost if not gone.get(rlc)]
        return out

    # --- the rules, each run under the lock ---------------------------------------------
    def _live(self, kind: str) -> list[dict[str, Any]]:
        gone = self.gone.get(kind, set())
        return [o for uid, o in self.objects.get(kind, {}).items() if uid not in gone]

    def _job_added(self, job: dict[str, Any]) -> None:
        meta = _meta(job)
        labels = meta.get("labels") or {}
        key = (meta["name"], labels.get(LABEL_CHECKPOINT_UID))
        for other in self.objects.get("Job", {}).values():
            ometa = _meta(other)
            olabels = ometa.get("labels") or {}
            if (ometa["name"], olabels.get(LABEL_CHECKPOINT_UID)) == key:
                self.found.append(Violation("duplicate-job", f"Job {meta['name']} created again"))
                return
        step, ck_uid = labels.get(LABEL_STEP), labels.get(LABEL_CHECKPOINT_UID)
        if step is None or ck_uid is None:
            return
        for other in self._live("Job"):
            olabels = _meta(other).get("labels") or {}
            same = olabels.get(LABEL_STEP) == step and olabels.get(LABEL_CHECKPOINT_UID) == ck_uid
            if same and not job_finished(other) and not _meta(other).get("deletionTimestamp"):
                self.found.append(
                    Violation(
                        "duplicate-job",
                        f"Job {meta['name']} created while {_meta(other)['name']} (the same "
                        f"step {step}) was still running",
                    )
                )

    def _checkpoint_added(self, ck: dict[str, Any]) -> None:
        name = _meta(ck)["name"]
        spec = ck.get("spec") or {}
        for other in self.objects.get("Checkpoint", {}).values():
            if _meta(other)["name"] == name:
                self.found.append(
                    Violation("duplicate-checkpoint", f"Checkpoint {name} created again")
                )
                return
        rlc = spec.get("rlCycle")
        if not rlc:
            return
        for other in self._live("Checkpoint"):
            ospec = other.get("spec") or {}
            if ospec.get("rlCycle") != rlc:
                continue
            if ospec.get("cycle") == spec.get("cycle"):
                self.found.append(
                    Violation(
                        "duplicate-checkpoint",
                        f"Checkpoints {_meta(other)['name']} and {name} are both cycle "
                        f"{spec.get('cycle')} of RLCycle {rlc}",
                    )
                )
            elif (other.get("status") or {}).get("phase") in RUNNING:
                self.found.append(
                    Violation(
                        "duplicate-checkpoint",
                        f"Checkpoint {name} created while {_meta(other)['name']} of RLCycle "
                        f"{rlc} was still running",
                    )
                )

    def _checkpoint_seen(self, ck: dict[str, Any]) -> None:
        uri = str((ck.get("spec") or {}).get("uri") or "").rstrip("/")
        if (ck.get("spec") or {}).get("rlCycle"):
            self.owned_uris.add(uri)
        verdict = (((ck.get("status") or {}).get("eval")) or {}).get("verdict")
        if verdict == Verdict.PASSED and uri not in self.passed_at:
            self.passed_at[uri] = _rv(ck)

    def _checkpoint_deleted(self, ck: dict[str, Any]) -> None:
        """Judged in :meth:`violations`: whether its RLCycle went arrives on another watch."""
        spec, status = ck.get("spec") or {}, ck.get("status") or {}
        rlc_name = spec.get("rlCycle")
        if not rlc_name:
            return  # registered by hand: not the operator's to keep
        phase = status.get("phase")
        if (
            phase in (None, CheckpointPhase.PENDING, CheckpointPhase.STAGING)
            and "data" not in status
        ):
            return  # insufficient data: the attempt leaves no Checkpoint
        remaining = [
            c for c in self._live("Checkpoint") if (c.get("spec") or {}).get("rlCycle") == rlc_name
        ]
        rlcycle = next((r for r in self._live("RLCycle") if _meta(r)["name"] == rlc_name), {})
        limit = int(((rlcycle.get("spec") or {}).get("historyLimit")) or 0)
        if phase not in RUNNING and len(remaining) >= limit:
            return  # pruned beyond spec.historyLimit
        self.deleted.append(
            (
                str(rlc_name),
                f"Checkpoint {_meta(ck)['name']} (phase {phase}) of RLCycle {rlc_name} was "
                f"deleted with {len(remaining)} Checkpoint(s) left (historyLimit {limit})",
            )
        )

    def _rlcycle_went(self, name: str) -> bool:
        """Whether RLCycle ``name`` was deleted (or marked for deletion) at some point."""
        return any(
            _meta(r)["name"] == name
            and (uid in self.gone.get("RLCycle", set()) or _meta(r).get("deletionTimestamp"))
            for uid, r in self.objects.get("RLCycle", {}).items()
        )

    def _deployment_seen(self, dep: dict[str, Any]) -> None:
        name = _meta(dep)["name"]
        for rlc in self._live("RLCycle"):
            target = (rlc.get("spec") or {}).get("target") or {}
            if name not in (target.get("deployment"), canary_name(str(target.get("deployment")))):
                continue
            container = str(target.get("container") or "")
            uri = env_value(dep, container, str(target.get("checkpointEnv") or "MODEL_URI"))
            if uri:
                self.served.append((name, uri.rstrip("/"), _rv(dep)))


# --- watching a namespace ------------------------------------------------------------------
@contextlib.contextmanager
def watching(ledger: Ledger, server: Server, namespace: str) -> Iterator[Ledger]:
    """Feed ``ledger`` with the namespace's RLCycles, Checkpoints, Jobs and Deployments (as
    the admin) while the block runs; every kind is listed before the block starts."""
    paths = {kind: path.format(ns=namespace) for kind, path in WATCHED.items()}
    with watch_kinds(server, paths, ledger.feed):
        yield ledger


# --- the status against the children -------------------------------------------------------
def status_problems(
    rlcycle: Mapping[str, Any],
    checkpoints: Sequence[Mapping[str, Any]],
    jobs: Sequence[Mapping[str, Any]],
    deployments: Sequence[Mapping[str, Any]],
) -> list[Violation]:
    """Where ``rlcycle``'s status disagrees with its children (the lists: what exists in its
    namespace now). Holds once the operator has finished a round with nothing to write."""
    name = _meta(rlcycle)["name"]
    spec, st = rlcycle.get("spec") or {}, rlcycle.get("status") or {}
    target = spec.get("target") or {}
    phase = st.get("phase")
    out: list[str] = []
    deps = {_meta(d)["name"]: d for d in deployments if not _meta(d).get("deletionTimestamp")}
    dep = deps.get(str(target.get("deployment")))
    canary = deps.get(canary_name(str(target.get("deployment"))))
    owned = [c for c in checkpoints if (c.get("spec") or {}).get("rlCycle") == name]
    running = [c for c in owned if (c.get("status") or {}).get("phase") in RUNNING]
    mine = [
        j
        for j in jobs
        if (_meta(j).get("labels") or {}).get(LABEL_RLCYCLE) == name
        and not _meta(j).get("deletionTimestamp")
    ]
    if dep is not None and phase != RLCyclePhase.INVALID:
        uri = env_value(dict(dep), str(target.get("container")), str(target.get("checkpointEnv")))
        serving = sorted(
            (c for c in checkpoints if same_uri((c.get("spec") or {}).get("uri"), uri)),
            key=lambda c: (int((c.get("spec") or {}).get("cycle") or 0), _meta(c)["name"]),
        )
        want = _meta(serving[-1])["name"] if serving else None
        if st.get("serving") != want and phase not in (
            RLCyclePhase.ROLLING_BACK,
            RLCyclePhase.PROMOTING,
        ):
            out.append(f"status.serving is {st.get('serving')}, the target serves {want}")
    if phase in QUIET_PHASES:
        busy = [_meta(j)["name"] for j in mine if not job_finished(j)]
        if busy:
            out.append(f"phase {phase} with Jobs still running: {busy}")
        if running:
            out.append(f"phase {phase} with {_meta(running[-1])['name']} still running")
        if canary is not None:
            out.append(f"phase {phase} with the canary Deployment still there")
        if int(st.get("canaryWeight") or 0):
            out.append(f"phase {phase} with canaryWeight {st.get('canaryWeight')}")
    if phase in CYCLE_PHASES:
        candidate = next((c for c in owned if _meta(c)["name"] == st.get("candidate")), None)
        if candidate is None:
            out.append(f"phase {phase}: status.candidate {st.get('candidate')} does not exist")
        else:
            ck_phase = (candidate.get("status") or {}).get("phase")
            if ck_phase not in CYCLE_PHASES[phase]:
                out.append(f"phase {phase}, but candidate {st['candidate']} is {ck_phase}")
            step = STEP_OF_PHASE.get(str(phase))
            uid = _meta(candidate).get("uid")
            ck_jobs = [
                j for j in mine if (_meta(j).get("labels") or {}).get(LABEL_CHECKPOINT_UID) == uid
            ]
            has_step = any((_meta(j).get("labels") or {}).get(LABEL_STEP) == step for j in ck_jobs)
            if step and ck_phase == phase and not has_step:
                out.append(f"phase {phase}, but {st['candidate']} has no {step} Job")
    if phase == RLCyclePhase.CANARY and canary is None:
        out.append("phase Canary with no canary Deployment")
    if canary is not None:
        arm = ((canary.get("spec") or {}).get("template") or {}).get("metadata") or {}
        if (arm.get("labels") or {}).get(LABEL_ARM) != "canary":
            out.append("the canary Deployment's pods are not labelled as the canary arm")
        if phase == RLCyclePhase.CANARY and int(st.get("canaryWeight") or 0) <= 0:
            out.append("phase Canary with canaryWeight 0")
    if owned:
        top = max(int((c.get("spec") or {}).get("cycle") or 0) for c in owned)
        if int(st.get("cycle") or 0) < top:
            out.append(f"status.cycle {st.get('cycle')} is behind Checkpoint cycle {top}")
    return [Violation("status", f"RLCycle {name}: {problem}") for problem in out]


__all__ = ["Ledger", "Violation", "job_finished", "status_problems", "watching"]
