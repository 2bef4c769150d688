"""What the spec names must exist before any Job is created: the target Deployment and its
container (and, with spec.capture, room for the sidecar in it), the credentials Secret with
its keys, a pinned Checkpoint, and the Checkpoint the target serves. A problem here makes
the RLCycle ``Invalid`` with the field to fix. A serving Checkpoint registered by hand (the
base model) gets its first status here: it serves, so it reads ``Promoted``."""

from __future__ import annotations

from rtrl.core.api.checkpoint import CheckpointPhase
from rtrl.core.api.reasons import Reason

from .adapter_routes import follow_serving, taken_route
from .capture import check_capture
from .manifests.names import same_uri
from .reading import meta, phase
from .round import Round


def check_environment(r: Round) -> tuple[str, str]:
    """``(reason, message)`` of the first problem, or ``("", "")``; on success the round's
    ``serving`` Checkpoint is set (and ``status.serving``)."""
    spec, dep = r.spec, r.obs.deployment
    target = spec.target
    ns = r.meta.get("namespace")
    if not dep.found:
        return (
            Reason.DEPLOYMENT_NOT_FOUND,
            f"spec.target.deployment: Deployment {target.deployment} not found in namespace {ns}",
        )
    if not dep.has_container:
        return (
            Reason.CONTAINER_NOT_FOUND,
            f"spec.target.container: Deployment {target.deployment} has no container "
            f"{target.container}",
        )
    reason, problem = check_capture(r)
    if reason:
        return reason, problem
    secret = r.obs.secret
    if spec.storage.credentials_secret and secret is not None:
        if not secret.found:
            return (
                Reason.SECRET_NOT_FOUND,
                f"spec.storage.credentialsSecret: Secret {spec.storage.credentials_secret} "
                f"not found in namespace {ns}",
            )
        if secret.missing_keys:
            return (
                Reason.SECRET_INCOMPLETE,
                f"spec.storage.credentialsSecret: Secret {spec.storage.credentials_secret} "
                f"lacks key(s) {', '.join(secret.missing_keys)}",
            )
    if spec.pin and r.checkpoint(spec.pin) is None:
        return (
            Reason.PINNED_CHECKPOINT_NOT_FOUND,
            f"spec.pin: Checkpoint {spec.pin} not found in namespace {ns}",
        )
    if not dep.serving_uri:
        return (
            Reason.CHECKPOINT_ENV_MISSING,
            f"spec.target.checkpointEnv: container {target.container} of Deployment "
            f"{target.deployment} has no value for {target.checkpoint_env}",
        )
    serving = [
        c for c in r.obs.checkpoints if same_uri(c.get("spec", {}).get("uri"), dep.serving_uri)
    ]
    if not serving:
        return (
            Reason.SERVING_CHECKPOINT_UNKNOWN,
            f"spec.target: Deployment {target.deployment} serves {dep.serving_uri}, and no "
            f"Checkpoint in namespace {ns} has that spec.uri; register the base model as "
            "a Checkpoint (see examples/checkpoint-base.yaml)",
        )
    # Several Checkpoints may share a URI (re-registered); the newest cycle wins.
    r.serving = max(
        (dict(c) for c in serving),
        key=lambda c: (int((c.get("spec") or {}).get("cycle") or 0), meta(c)["name"]),
    )
    r.status["serving"] = meta(r.serving)["name"]
    follow_serving(r)
    return taken_route(r)


def mark_serving_base(r: Round) -> None:
    """The serving Checkpoint, when nothing ever wrote its status (the base model, which a
    user registers by hand), becomes ``Promoted`` (reason ``Serving``), as every other
    serving checkpoint reads: ``kubectl get ckpt`` showed it with no phase and ``kubectl
    rtrl`` as ``Pending`` although it is what serves. Once written, it is left to the
    cycles (``Superseded`` by the first promotion, ``Promoted`` again by a rollback)."""
    serving = r.base  # what the Deployment serves (an adapter RLCycle's org: its adapter)
    if phase(serving) is not None or any(meta(c)["name"] == meta(serving)["name"] for c in r.owned):
        return
    r.patch_checkpoint(
        serving,
        phase=CheckpointPhase.PROMOTED,
        reason=Reason.SERVING,
        message=f"serves {r.spec.target.deployment} (RLCycle {r.name}); registered by hand",
    )
