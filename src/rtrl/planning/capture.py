"""Decisions of ``spec.capture``: the ``rtrl-capture`` sidecar in the target Deployment and
its canary, and the seal CronJob (docs/operator.md, "Capture"). An adapter RLCycle
(``spec.adapter``) has neither: its organisation goes through the sidecar the RLCycle of
the base injected, whose routing table it writes (:mod:`.adapter_routes`), and that RLCycle
seals.

Each round, once the environment checked out, the target's pod template is brought to what
the spec says (:func:`keep_capture`): the sidecar injected, changed or taken out with a
compare-and-swap patch, and nothing written when it already matches, so an unchanged spec
never rolls the Deployment. The sidecar's checkpoint follows the engine's: a promotion or a
rollback sets both in the one patch that moves the engine (:func:`sidecar_env_ops`, from
``workload.serve``), so they roll out together; a round that patches the target for that
leaves the sidecar's other changes to the next round. The canary Deployment gets the
sidecar with ``RTRL_ARM=canary`` and the candidate's id and URI when it is created
(:func:`canary_template`), and keeps it while it runs, as it keeps the rest of the template
it was made from: rolling a canary mid-analysis would restart its pods (and a canary not
ready past ``readyTimeout`` is rolled back); the next canary has the new spec. The seal
CronJob is created, replaced when the spec changes it, and deleted with ``spec.capture``.
"""

from __future__ import annotations

from typing import Any

from rtrl.core.api.reasons import Reason

from .actions import Create, Delete, Patch
from .adapter_routes import routes_followed
from .manifests import capture as cap
from .manifests import seal
from .manifests.canary import CHECKPOINT_ID_ENV, set_env_patch
from .reading import meta
from .round import READY_POLL_SECONDS, Round
from .tenancy import job_service_account


def check_capture(r: Round) -> tuple[str, str]:
    """``(reason, message)`` when the sidecar cannot go into the target as the spec says
    (someone else's ``rtrl-capture`` container, a port clash); ``("", "")`` otherwise."""
    if r.spec.capture is None or r.obs.target is None:
        return "", ""
    if r.spec.adapter is not None:  # the sidecar is the base's RLCycle's
        return routes_followed(r.spec, _template(r.obs.target))
    return cap.conflict(r.spec, _template(r.obs.target), r.name)


def _template(deployment: Any) -> dict[str, Any]:
    return dict(((deployment or {}).get("spec") or {}).get("template") or {})


def _engine(template: dict[str, Any], r: Round) -> dict[str, Any]:
    return cap.container(template, r.spec.target.container) or {}


def _grace(template: dict[str, Any]) -> int | None:
    grace = (template.get("spec") or {}).get("terminationGracePeriodSeconds")
    return int(grace) if grace is not None else None


def stable_sidecar(r: Round) -> cap.Sidecar | None:
    """The target's sidecar as the spec says, serving what its engine serves; None without
    ``spec.capture``."""
    if r.spec.capture is None:
        return None
    template = _template(r.obs.target)
    return cap.sidecar(
        r.spec,
        _engine(template, r),
        rlcycle=r.name,
        arm=cap.STABLE,
        checkpoint=str(meta(r.base)["name"]),
        model_uri=str(r.obs.deployment.serving_uri or ""),
        grace=_grace(template),
    )


def canary_sidecar(r: Round, ck: dict[str, Any], template: dict[str, Any]) -> cap.Sidecar | None:
    """The canary's sidecar: the candidate ``ck`` on the canary arm."""
    if r.spec.capture is None:
        return None
    return cap.sidecar(
        r.spec,
        _engine(template, r),
        rlcycle=r.name,
        arm=cap.CANARY,
        checkpoint=str(meta(ck)["name"]),
        model_uri=str(ck["spec"]["uri"]),
        grace=_grace(template),
    )


def canary_template(r: Round, ck: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    """The canary Deployment ``manifest`` (built from the target's template) with the canary
    sidecar, or with the target's sidecar taken out when capture is off."""
    template = manifest["spec"]["template"]
    want = canary_sidecar(r, ck, template)
    manifest["spec"]["template"] = cap.with_sidecar(template, want, r.name)
    return manifest


def canary_service(r: Round, manifest: dict[str, Any]) -> dict[str, Any]:
    """The gatewayapi router's canary Service ``manifest`` (the stable Service's ports),
    its engine port pointed at the sidecar when capture is on: the canary's requests are
    captured whatever the stable Service targets."""
    if r.spec.capture is not None:
        engine = _engine(_template(r.obs.target), r)
        ports = manifest["spec"]["ports"]
        manifest["spec"]["ports"] = cap.capture_ports(ports, r.spec, engine)
    return manifest


def sidecar_env_ops(r: Round, uri: str, checkpoint: str) -> list[dict[str, Any]]:
    """JSON patch ops that point the target's sidecar (one this RLCycle injected) at
    ``checkpoint`` served from ``uri``, for the patch that points the engine there."""
    target = dict(r.obs.target or {})
    template = _template(target)
    if cap.injected_by(template) != r.name or cap.container(template, cap.SIDECAR) is None:
        return []
    values = {CHECKPOINT_ID_ENV: checkpoint, cap.MODEL_URI_ENV: uri}
    return set_env_patch(target, cap.SIDECAR, values)


def keep_capture(r: Round) -> None:
    """The target's sidecar and the seal CronJob as the spec says, at the end of a round
    whose environment checked out."""
    if r.spec.adapter is None:  # an adapter RLCycle's org goes through the base's sidecar
        _keep_target(r)
    _keep_seal(r)


def _keep_target(r: Round) -> None:
    target = r.obs.target
    if target is None:
        return
    name = r.spec.target.deployment
    patch = cap.capture_patch(target, stable_sidecar(r), r.name)
    if patch is None:
        return
    if any(isinstance(a, Patch) and a.kind == "Deployment" and a.name == name
           for a in r.out.actions):  # fmt: skip
        # The round points the engine (and the sidecar) elsewhere: the rest next round,
        # planned from the template that patch leaves.
        r.out.soon(READY_POLL_SECONDS)
        return
    r.act(Patch("apps/v1", "Deployment", name, patch.ops))
    r.event(patch.reason, f"{cap.SIDECAR} in Deployment {name} (stable, {meta(r.base)['name']})")


def _keep_seal(r: Round) -> None:
    stored = r.obs.seal
    if r.spec.capture is None or r.spec.adapter is not None:  # the base's RLCycle seals
        if stored is not None:
            name = str(meta(stored)["name"])
            r.act(Delete("batch/v1", "CronJob", name))
            why = "spec.capture is unset" if r.spec.capture is None else "the base's RLCycle seals"
            r.event(Reason.SEAL_REMOVED, f"CronJob {name} deleted: {why}")
        return
    want = seal.seal_cronjob(r.rlc, r.spec, job_service_account(r.spec, r.obs.policy))
    name = want["metadata"]["name"]
    if stored is None:
        r.act(Create(want))
        r.event(
            Reason.SEAL_SCHEDULED, f"CronJob {name}: rtrl-job seal on {want['spec']['schedule']}"
        )
    elif seal.spec_hash(stored) != seal.spec_hash(want):
        r.act(Patch("batch/v1", "CronJob", name, seal.replace_patch(stored, want)))
        r.event(Reason.SEAL_UPDATED, f"CronJob {name}: rtrl-job seal on {want['spec']['schedule']}")
