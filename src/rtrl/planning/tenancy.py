"""What a spec asks of the operator beyond the RLCycle's own objects, against the admin's
policy (:mod:`rtrl.core.api.policy`): checked before anything is created for a cycle, so a
spec outside it makes the RLCycle ``Invalid`` with the field and the rule it breaks, and
no Job, CronJob or sidecar ever runs what the policy does not allow.

The author of an RLCycle may only have rights to RLCycles; the operator's are much wider.
Without these checks an RLCycle chose the image of every step Job (and so read the
credentials Secret mounted into it), the ServiceAccount the Job ran as, its tolerations,
node selectors and resources, and made the operator read results, with the operator's own
S3 key, from any endpoint the spec named.
"""

from __future__ import annotations

from rtrl.core.api.policy import TenancyPolicy
from rtrl.core.api.reasons import Reason
from rtrl.core.api.rlcycle import RLCycleSpec
from rtrl.core.redaction import redact

from .observed import SecretState

ADMIN = "ask the cluster admin (the operator's chart values, policy)"


def policy_problem(
    spec: RLCycleSpec, policy: TenancyPolicy, secret: SecretState | None
) -> tuple[str, str]:
    """``(reason, message)`` of the first thing in ``spec`` the policy does not allow,
    ``("", "")`` when it allows all of it. ``secret`` is the credentials Secret as
    observed (its labels), None when the spec names none."""
    for field, image in _images(spec):
        if not policy.allows_image(image):
            allowed = ", ".join(policy.images) or "none"
            return (
                Reason.IMAGE_NOT_ALLOWED,
                f"{field}: image {image} is not one the operator's policy allows "
                f"(policy.images: {allowed}); {ADMIN}",
            )
    account = spec.storage.service_account_name
    if account and not policy.allows_service_account(account):
        return (
            Reason.SERVICE_ACCOUNT_NOT_ALLOWED,
            f"spec.storage.serviceAccountName: ServiceAccount {account} is not one the "
            f"operator's policy lets an RLCycle's Jobs run as (policy.serviceAccounts: "
            f"{', '.join(policy.service_accounts) or 'none'}); {ADMIN}",
        )
    training = spec.training
    for i, toleration in enumerate(training.tolerations or []):
        if not policy.allows_toleration(toleration):
            shown = toleration.to_k8s()
            return (
                Reason.TOLERATION_NOT_ALLOWED,
                f"spec.training.tolerations[{i}]: {shown} is not a toleration the operator's "
                f"policy allows (policy.tolerations); {ADMIN}",
            )
    for key, value in sorted((training.node_selector or {}).items()):
        if not policy.allows_node_label(key, value):
            return (
                Reason.NODE_SELECTOR_NOT_ALLOWED,
                f"spec.training.nodeSelector.{key}: {key}={value} is not a node label the "
                f"operator's policy lets an RLCycle select (policy.nodeSelectors); {ADMIN}",
            )
    problem = _resources(spec, policy)
    if problem:
        return Reason.RESOURCES_NOT_ALLOWED, f"{problem}; {ADMIN}"
    endpoint = spec.storage.endpoint
    if endpoint and not policy.allows_endpoint(endpoint):
        return (
            Reason.ENDPOINT_NOT_ALLOWED,
            f"spec.storage.endpoint: {redact(endpoint)} is not an object-store endpoint the "
            f"operator's policy allows (policy.endpoints: {', '.join(policy.endpoints) or 'none'}"
            f"); the operator reads step results there; {ADMIN}",
        )
    label = policy.secret_label_pair()
    name = spec.storage.credentials_secret
    found = secret is not None and secret.found
    if name and label and secret is not None and found and secret.labels.get(label[0]) != label[1]:
        return (
            Reason.SECRET_NOT_ALLOWED,
            f"spec.storage.credentialsSecret: Secret {name} does not carry the label "
            f"{label[0]}={label[1]} that marks a Secret for RLCycles (set by whoever may "
            "read it: the operator mounts it into the steps' pods)",
        )
    return "", ""


def _images(spec: RLCycleSpec) -> list[tuple[str, str]]:
    images = [("spec.training.image", spec.training.image)]
    if spec.capture is not None:
        images.append(("spec.capture.image", spec.capture.image))
    return images


def _resources(spec: RLCycleSpec, policy: TenancyPolicy) -> str:
    training = spec.training
    if training.nodes > policy.max_nodes:
        return (
            f"spec.training.nodes: {training.nodes} pods, more than the {policy.max_nodes} the "
            "operator's policy allows a training Job"
        )
    problem = policy.resource_problem("spec.training.resources", training.resources)
    if problem:
        return problem
    if training.gpus_per_node:
        problem = policy.quantity_problem(training.gpu_resource, training.gpus_per_node)
        if problem:
            return f"spec.training.gpusPerNode ({training.gpu_resource}): {problem}"
    if spec.capture is not None:
        return policy.resource_problem("spec.capture.resources", spec.capture.resources)
    return ""


def job_service_account(spec: RLCycleSpec, policy: TenancyPolicy) -> str | None:
    """The ServiceAccount the RLCycle's Jobs run as: the spec's (once the policy allowed
    it), else the admin's, else the namespace's default (None)."""
    return spec.storage.service_account_name or policy.job_service_account
