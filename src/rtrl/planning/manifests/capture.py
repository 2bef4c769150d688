"""The capture sidecar in a serving pod template: the container ``rtrl-capture`` (the proxy
in front of the engine, docs/operator.md "Capture"), its volumes, and the JSON patches that
put it into the target Deployment, keep it as the spec says, and take it out again.

The sidecar is configured by environment only (the sidecar contract, the variables of
``rtrl-capture``): where the engine listens, where events go, which headers name the user,
session and org, the engine's log-prob mode and dtype (read from the engine container's
``--logprobs-mode`` / ``--dtype`` arguments when it has them), and which checkpoint and arm
the pod serves. The last three (:data:`PER_CHECKPOINT`) change with every promotion and
differ between the stable and the canary Deployment; everything else is a function of the
spec and the engine container, whose hash is written on the pod template
(``rtrl.io/capture-hash``) next to the name of the RLCycle that injected it
(``rtrl.io/capture``). A round compares hashes rather than containers: the API server fills
defaults into a stored container (probe timings, ``terminationMessagePath``, canonical
quantities), so a stored sidecar never equals the one planned even when nothing changed.

A template with a container ``rtrl-capture`` but without ``rtrl.io/capture`` naming this
RLCycle holds someone else's sidecar: :func:`conflict` says so and nothing here touches it.

Patches are compare-and-swap: each one ``test``s the containers (and volumes) list it was
planned from and replaces the whole list, so it applies only to the template it was planned
for (a 422 otherwise, and the next round plans again from what is there).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rtrl.core.api.common import parse_duration
from rtrl.core.api.names import ANNOTATION_CAPTURE, ANNOTATION_CAPTURE_HASH
from rtrl.core.api.reasons import Reason
from rtrl.core.api.rlcycle import CaptureSpec, RLCycleSpec

from .adapters import ADAPTERS_TABLE_VOLUME, adapters_conflict, adapters_sidecar
from .canary import CHECKPOINT_ID_ENV, set_env_patch
from .jobs import CONTAINER_SECURITY, credentials_volume, store_env

SIDECAR = "rtrl-capture"  # the container's name and its port's (a Service's targetPort)
SPOOL_VOLUME = "rtrl-capture-spool"
TMP_VOLUME = "rtrl-capture-tmp"
CREDENTIALS_VOLUME = "rtrl-capture-credentials"
VOLUMES = (SPOOL_VOLUME, TMP_VOLUME, CREDENTIALS_VOLUME, ADAPTERS_TABLE_VOLUME)  # rtrl's
SPOOL_MOUNT = "/var/spool/rtrl-capture"
# The sidecar runs as this user (the serving image's); its Secret files are 0444, readable
# without the pod's fsGroup, which is the user's: only the sidecar container mounts them and
# it runs no code but rtrl-capture's (no model-written code, unlike the eval step).
SIDECAR_UID = 1000
SIDECAR_CREDENTIALS_MODE = 0o444

MODEL_URI_ENV = "RTRL_MODEL_URI"
ARM_ENV = "RTRL_ARM"
PER_CHECKPOINT = (ARM_ENV, CHECKPOINT_ID_ENV, MODEL_URI_ENV)
STABLE, CANARY = "stable", "canary"

# The engine's flags that say how it samples and scores, and the sidecar's variables that
# must hold the same (what the captured log-probs are: the sidecar records them per row).
ENGINE_FLAGS = (
    ("--logprobs-mode", "RTRL_CAPTURE_LOGPROBS_MODE"),
    ("--dtype", "RTRL_CAPTURE_SERVING_DTYPE"),
    ("--generation-config", "RTRL_CAPTURE_GENERATION_CONFIG"),
    ("--override-generation-config", "RTRL_CAPTURE_OVERRIDE_GENERATION_CONFIG"),
)
# On SIGTERM the sidecar finishes what is in flight and ships its spool; it is given the
# pod's terminationGracePeriodSeconds less this, so it is done before the kubelet kills it.
DRAIN_MARGIN_SECONDS = 5
_ENV_REFERENCE = re.compile(r"^\$\(([A-Za-z_][A-Za-z0-9_]*)\)$")
_TEMPLATE = "/spec/template"


def engine_flag(container: Mapping[str, Any], flag: str) -> str | None:
    """The value of ``flag`` (``--dtype``) in the container's command and arguments, as
    ``--dtype X`` or ``--dtype=X``; a ``$(VAR)`` value is read from the container's own
    env. None when absent or not known here (a reference to a Secret, a field)."""
    argv = [str(a) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
    value: str | None = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(f"{flag}="):
            value = arg[len(flag) + 1 :]
    if value is None:
        return None
    reference = _ENV_REFERENCE.match(value)
    if reference is None:
        return value
    for env in container.get("env") or []:
        if env.get("name") == reference[1] and "value" in env:
            return str(env["value"])
    return None


def containers(template: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list((template.get("spec") or {}).get("containers") or [])


def container(template: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return next((c for c in containers(template) if c.get("name") == name), None)


def template_annotations(template: Mapping[str, Any]) -> dict[str, str]:
    return dict((template.get("metadata") or {}).get("annotations") or {})


def injected_by(template: Mapping[str, Any]) -> str | None:
    """The RLCycle that injected the template's sidecar (None: none did)."""
    owner = template_annotations(template).get(ANNOTATION_CAPTURE)
    return str(owner) if owner is not None else None


def conflict(spec: RLCycleSpec, template: Mapping[str, Any], rlcycle: str) -> tuple[str, str]:
    """``(reason, message)`` when the sidecar cannot go into ``template`` as the spec says:
    a container ``rtrl-capture`` that this RLCycle did not inject, or a port clash with the
    engine. ``("", "")`` when it can."""
    capture = spec.capture
    assert capture is not None
    owner = injected_by(template)
    if container(template, SIDECAR) is not None and owner != rlcycle:
        who = f"RLCycle {owner}" if owner else "someone other than rtrl"
        return (
            Reason.CAPTURE_CONTAINER_CONFLICT,
            f"spec.capture: Deployment {spec.target.deployment} already has a container "
            f"{SIDECAR}, put there by {who} (its pod template has no annotation "
            f"{ANNOTATION_CAPTURE}={rlcycle}); rtrl does not overwrite it: rename or remove it, "
            "or remove spec.capture",
        )
    for other in containers(template):
        if other.get("name") == SIDECAR:
            continue
        ports = [int(p.get("containerPort") or 0) for p in other.get("ports") or []]
        if capture.port in ports:
            return (
                Reason.CAPTURE_PORT_CONFLICT,
                f"spec.capture.port: container {other.get('name')} of Deployment "
                f"{spec.target.deployment} already uses port {capture.port}; set capture.port "
                "to a free one",
            )
    engine = container(template, spec.target.container) or {}
    declared = [int(p.get("containerPort") or 0) for p in engine.get("ports") or []]
    if declared and capture.engine_port not in declared:
        return (
            Reason.CAPTURE_PORT_CONFLICT,
            f"spec.capture.enginePort: container {spec.target.container} of Deployment "
            f"{spec.target.deployment} declares port(s) {', '.join(map(str, declared))}, not "
            f"{capture.engine_port}: set capture.enginePort to the port the engine serves on",
        )
    if capture.adapters is not None:
        return adapters_conflict(spec, template, engine)
    return "", ""


@dataclass(frozen=True)
class Sidecar:
    """The sidecar as a pod template should hold it: the container, the volumes it mounts,
    and the hash of both with the per-checkpoint values left out."""

    container: dict[str, Any]
    volumes: list[dict[str, Any]]
    hash: str


def _env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def sidecar(
    spec: RLCycleSpec,
    engine: Mapping[str, Any],
    *,
    rlcycle: str,
    arm: str,
    checkpoint: str,
    model_uri: str,
    grace: int | None = None,
) -> Sidecar:
    """The sidecar of a pod whose engine container is ``engine``, serving ``checkpoint``
    (``model_uri``, the value the engine's ``checkpointEnv`` holds) on ``arm``; ``grace``:
    the pod's ``terminationGracePeriodSeconds`` when it sets one."""
    capture: CaptureSpec | None = spec.capture
    assert capture is not None
    env = [
        _env("RTRL_CAPTURE_LISTEN", f"0.0.0.0:{capture.port}"),
        _env("RTRL_CAPTURE_ENGINE", f"http://127.0.0.1:{capture.engine_port}"),
        _env("RTRL_CAPTURE_EVENTS", capture.events),
        _env("RTRL_CAPTURE_SPOOL", SPOOL_MOUNT),
        _env("RTRL_CAPTURE_USER_HEADER", capture.headers.user),
        _env("RTRL_CAPTURE_SESSION_HEADER", capture.headers.session),
        _env("RTRL_CAPTURE_ORG_HEADER", capture.headers.org),
    ]
    if capture.commit_interval is not None:
        millis = max(1, round(parse_duration(capture.commit_interval) * 1000))
        env.append(_env("RTRL_CAPTURE_COMMIT_MS", str(millis)))
    for flag, name in ENGINE_FLAGS:
        value = engine_flag(engine, flag)
        if value is not None:
            env.append(_env(name, value))
    if grace is not None:  # drain within the pod's grace period, before the SIGKILL
        env.append(_env("RTRL_CAPTURE_DRAIN_TIMEOUT_S", str(max(1, grace - DRAIN_MARGIN_SECONDS))))
    env += [
        _env("RTRL_RLCYCLE", rlcycle),
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "TMPDIR", "value": "/tmp"},
        *store_env(spec),
        _env(ARM_ENV, arm),
        _env(CHECKPOINT_ID_ENV, checkpoint),
        _env(MODEL_URI_ENV, model_uri),
    ]
    mounts: list[dict[str, Any]] = [
        {"name": SPOOL_VOLUME, "mountPath": SPOOL_MOUNT},
        {"name": TMP_VOLUME, "mountPath": "/tmp"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": SPOOL_VOLUME, "emptyDir": {}},
        {"name": TMP_VOLUME, "emptyDir": {}},
    ]
    credentials = credentials_volume(spec, name=CREDENTIALS_VOLUME, mode=SIDECAR_CREDENTIALS_MODE)
    if credentials is not None:
        volumes.append(credentials[0])
        mounts.append(credentials[1])
    if capture.adapters is not None:
        more_env, more_volumes, more_mounts = adapters_sidecar(capture.adapters)
        env += more_env
        volumes += more_volumes
        mounts += more_mounts
    probe = {"periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 3}
    body: dict[str, Any] = {
        "name": SIDECAR,
        "image": capture.image,
        "command": ["rtrl-capture"],
        "env": env,
        "ports": [{"name": SIDECAR, "containerPort": capture.port, "protocol": "TCP"}],
        "volumeMounts": mounts,
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": SIDECAR}, **probe},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": SIDECAR}, **probe},
        "securityContext": {
            **copy.deepcopy(CONTAINER_SECURITY),
            "runAsUser": SIDECAR_UID,
            "runAsGroup": SIDECAR_UID,
        },
    }
    if capture.resources is not None:
        body["resources"] = capture.resources.model_dump(
            mode="json", by_alias=True, exclude_none=True
        )
    static = copy.deepcopy(body)
    static["env"] = [e for e in static["env"] if e["name"] not in PER_CHECKPOINT]
    digest = hashlib.sha256(
        json.dumps([static, volumes], sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()[:16]
    return Sidecar(body, volumes, digest)


def env_values(body: Mapping[str, Any] | None, names: tuple[str, ...]) -> dict[str, str | None]:
    env = {e.get("name"): e.get("value") for e in (body or {}).get("env") or []}
    return {name: env.get(name) for name in names}


# --- a template, as a value (a new canary Deployment is built from the target's) ----------
def with_sidecar(template: dict[str, Any], want: Sidecar | None, rlcycle: str) -> dict[str, Any]:
    """``template`` (a copy) with this RLCycle's sidecar as ``want`` says, or without it
    (``want`` None: only a sidecar this RLCycle injected is taken out)."""
    out = copy.deepcopy(template)
    spec = out.setdefault("spec", {})
    meta = out.setdefault("metadata", {})
    ours = injected_by(out) == rlcycle
    if want is None and not ours:
        return out
    spec["containers"] = _containers_with(containers(out), want)
    volumes = _volumes_with(list(spec.get("volumes") or []), want)
    if volumes:
        spec["volumes"] = volumes
    else:
        spec.pop("volumes", None)
    notes = {k: v for k, v in template_annotations(out).items()
             if k not in (ANNOTATION_CAPTURE, ANNOTATION_CAPTURE_HASH)}  # fmt: skip
    if want is not None:
        notes.update({ANNOTATION_CAPTURE: rlcycle, ANNOTATION_CAPTURE_HASH: want.hash})
    if notes:
        meta["annotations"] = notes
    else:
        meta.pop("annotations", None)
    return out


def _containers_with(current: list[dict[str, Any]], want: Sidecar | None) -> list[dict[str, Any]]:
    out = [copy.deepcopy(c) for c in current if c.get("name") != SIDECAR]
    if want is not None:
        at = next((i for i, c in enumerate(current) if c.get("name") == SIDECAR), len(out))
        out.insert(min(at, len(out)), copy.deepcopy(want.container))
    return out


def _volumes_with(current: list[dict[str, Any]], want: Sidecar | None) -> list[dict[str, Any]]:
    out = [copy.deepcopy(v) for v in current if v.get("name") not in VOLUMES]
    return out + (copy.deepcopy(want.volumes) if want is not None else [])


# --- a stored Deployment, as a patch -----------------------------------------------------
@dataclass(frozen=True)
class CapturePatch:
    """A JSON patch to a Deployment's sidecar, and what it does in words (an Event reason:
    ``CaptureInjected``, ``CaptureUpdated``, ``CaptureRemoved``)."""

    ops: list[dict[str, Any]]
    reason: Reason


def capture_patch(
    deployment: Mapping[str, Any], want: Sidecar | None, rlcycle: str
) -> CapturePatch | None:
    """The patch that makes ``deployment``'s pod template hold ``want`` (None: no sidecar of
    this RLCycle), or None when it already does: no write, no rollout. A template whose
    ``rtrl-capture`` container is someone else's is never patched (see :func:`conflict`)."""
    template = (deployment.get("spec") or {}).get("template") or {}
    present = container(template, SIDECAR)
    ours = injected_by(template) == rlcycle
    if want is None:
        if not ours:
            return None
        return CapturePatch(_swap(template, None, rlcycle), Reason.CAPTURE_REMOVED)
    if present is not None and not ours:
        return None
    hashed = template_annotations(template).get(ANNOTATION_CAPTURE_HASH)
    if present is None or hashed != want.hash:
        reason = Reason.CAPTURE_INJECTED if present is None else Reason.CAPTURE_UPDATED
        return CapturePatch(_swap(template, want, rlcycle), reason)
    wanted = env_values(want.container, PER_CHECKPOINT)
    if env_values(present, PER_CHECKPOINT) == wanted:
        return None
    ops = set_env_patch(dict(deployment), SIDECAR, {k: str(v) for k, v in wanted.items()})
    return CapturePatch(ops, Reason.CAPTURE_UPDATED)


def _swap(template: Mapping[str, Any], want: Sidecar | None, rlcycle: str) -> list[dict[str, Any]]:
    """Compare-and-swap of the template's containers and volumes (and its annotations)."""
    target = with_sidecar(dict(template), want, rlcycle)
    pod = template.get("spec") or {}
    ops: list[dict[str, Any]] = [
        {"op": "test", "path": f"{_TEMPLATE}/spec/containers", "value": pod.get("containers")},
        {"op": "replace", "path": f"{_TEMPLATE}/spec/containers",
         "value": target["spec"]["containers"]},
    ]  # fmt: skip
    volumes = target["spec"].get("volumes")
    if "volumes" in pod:
        ops.append({"op": "test", "path": f"{_TEMPLATE}/spec/volumes", "value": pod["volumes"]})
        if volumes is None:
            ops.append({"op": "remove", "path": f"{_TEMPLATE}/spec/volumes"})
        elif volumes != pod["volumes"]:
            ops.append({"op": "replace", "path": f"{_TEMPLATE}/spec/volumes", "value": volumes})
    elif volumes is not None:
        ops.append({"op": "add", "path": f"{_TEMPLATE}/spec/volumes", "value": volumes})
    before = template_annotations(template)
    after = (target.get("metadata") or {}).get("annotations") or {}
    if not before and after:
        ops.append({"op": "add", "path": f"{_TEMPLATE}/metadata/annotations", "value": after})
    elif before and not after:
        ops.append({"op": "remove", "path": f"{_TEMPLATE}/metadata/annotations"})
    else:
        for key in (ANNOTATION_CAPTURE, ANNOTATION_CAPTURE_HASH):
            path = f"{_TEMPLATE}/metadata/annotations/{key.replace('~', '~0').replace('/', '~1')}"
            if key in after and after[key] != before.get(key):
                ops.append({"op": "add", "path": path, "value": after[key]})
            elif key not in after and key in before:
                ops.append({"op": "remove", "path": path})
    return ops


def capture_ports(
    ports: list[dict[str, Any]], spec: RLCycleSpec, engine: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """A Service's ``ports`` made to reach the sidecar instead of the engine: the port that
    targets the engine (``capture.enginePort``, or the engine container's name for it; the
    only port, when there is one) targets ``rtrl-capture``. Other ports stay."""
    capture = spec.capture
    assert capture is not None
    names = {
        str(p.get("name"))
        for p in engine.get("ports") or []
        if p.get("name") and int(p.get("containerPort") or 0) == capture.engine_port
    }
    engine_targets = {capture.engine_port, capture.port, SIDECAR, *names}
    out = []
    for given in ports:
        port = dict(given)
        target = port.get("targetPort", port.get("port"))
        if len(ports) == 1 or target in engine_targets:
            port["targetPort"] = SIDECAR
        out.append(port)
    return out
