"""The admin's tenancy policy in the operator's decisions (rtrl.planning.tenancy): what an
RLCycle's author asks beyond its own objects is checked before anything is created; a spec
outside the policy is ``Invalid`` with the field and the rule named, and no Job is made.

The attacks of issue 32, as ``plan()`` saw them: the author picked the training image (and
with it got the credentials Secret mounted into code of their choosing), the Jobs'
ServiceAccount, tolerations, node selectors and resources without limit, and named any
Secret of the namespace. Each test below failed before the policy existed: the plan created
the Job (or the Checkpoint that leads to it) as asked."""

from __future__ import annotations

from typing import Any

import pytest

from rtrl.core.api.policy import UNRESTRICTED, TenancyPolicy, parse_quantity
from rtrl.planning import SecretState
from tests.rtrl.planning.test_plan import T0, World

ADMIN = TenancyPolicy(
    images=["registry.example.com/rtrl-trainer:*"],
    endpoints=["https://minio.storage:9000"],
    job_service_account="rtrl-steps",
    service_accounts=["rtrl-irsa"],
    tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}],
    node_selectors={"node.kubernetes.io/instance-type": ["p5.48xlarge"]},
    max_resources={"cpu": "64", "memory": "2000Gi", "nvidia.com/gpu": "8"},
    max_nodes=2,
)


def world(policy: TenancyPolicy = ADMIN, **spec: Any) -> World:
    w = World(**spec)
    w.policy = policy
    w.secret = SecretState(True, labels={"rtrl.io/rlcycle-secret": "true"})
    w.now = T0
    return w


def training(**changes: Any) -> dict[str, Any]:
    w = World()
    return {**w.rlcycle["spec"]["training"], **changes}


def storage(**changes: Any) -> dict[str, Any]:
    w = World()
    found = {**w.rlcycle["spec"]["storage"], **changes}
    return {k: v for k, v in found.items() if v is not None}


def started(w: World) -> bool:
    """Whether the round made anything toward a Job (a Checkpoint, a Job)."""
    return any(c.startswith(("Job/", "Checkpoint/")) for c in w.created)


def test_the_example_within_the_policy_runs_as_the_admin_says() -> None:
    """The positive control: the example RLCycle within ADMIN starts its cycle; its Jobs run
    the allowed image, as the admin's ServiceAccount (the spec names none)."""
    w = world()
    w.reconcile(3)
    assert w.rlcycle["status"]["phase"] == "Staging", w.rlcycle["status"].get("message")
    (job,) = [m for k, m in w.manifests.items() if "stage" in k]
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "rtrl-steps"
    assert pod["containers"][0]["image"] == "registry.example.com/rtrl-trainer:0.1.0"
    assert pod["automountServiceAccountToken"] is False


CONTROL_PLANE = {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}
ATTACKS = {
    "image": (
        {"training": training(image="attacker.example/steal-secrets:1")},
        "ImageNotAllowed",
        "spec.training.image: image attacker.example/steal-secrets:1 is not one the "
        "operator's policy allows (policy.images: registry.example.com/rtrl-trainer:*)",
    ),
    "image-prefix": (
        # a prefix match must not be fooled by a longer registry name
        {"training": training(image="registry.example.com/rtrl-trainer-evil:1")},
        "ImageNotAllowed",
        "spec.training.image",
    ),
    "service-account": (
        {"storage": storage(credentialsSecret=None, serviceAccountName="cluster-admin-sa")},
        "ServiceAccountNotAllowed",
        "spec.storage.serviceAccountName: ServiceAccount cluster-admin-sa",
    ),
    "toleration": (
        {"training": training(tolerations=[CONTROL_PLANE])},
        "TolerationNotAllowed",
        "spec.training.tolerations[0]",
    ),
    "node-selector": (
        {"training": training(nodeSelector={"kubernetes.io/hostname": "control-plane-0"})},
        "NodeSelectorNotAllowed",
        "spec.training.nodeSelector.kubernetes.io/hostname",
    ),
    "memory": (
        {"training": training(resources={"requests": {"memory": "64Ti"}})},
        "ResourcesNotAllowed",
        "spec.training.resources.requests.memory: 64Ti is more than the 2000Gi",
    ),
    "unlisted-resource": (
        {"training": training(resources={"limits": {"hugepages-1Gi": "100Gi"}})},
        "ResourcesNotAllowed",
        "spec.training.resources.limits.hugepages-1Gi: hugepages-1Gi is not a resource",
    ),
    "gpus": (
        {"training": training(gpusPerNode=16)},
        "ResourcesNotAllowed",
        "spec.training.gpusPerNode (nvidia.com/gpu): 16 is more than the 8",
    ),
    "gpu-resource": (
        {"training": training(gpuResource="example.com/fpga")},
        "ResourcesNotAllowed",
        "spec.training.gpusPerNode (example.com/fpga)",
    ),
    "nodes": (
        {"training": training(nodes=64)},
        "ResourcesNotAllowed",
        "spec.training.nodes: 64 pods, more than the 2",
    ),
    "endpoint": (
        {"storage": storage(endpoint="http://listener.attacker.example:8080")},
        "EndpointNotAllowed",
        "spec.storage.endpoint: http://listener.attacker.example:8080 is not an object-store",
    ),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_spec_beyond_the_policy_is_invalid_and_creates_nothing(attack: str) -> None:
    spec, reason, message = ATTACKS[attack]
    w = world(**spec)
    w.reconcile(3)
    status = w.rlcycle["status"]
    assert status["phase"] == "Invalid", status.get("message")
    condition = w.condition("InvalidSpec")
    assert (condition["status"], condition["reason"]) == ("True", reason), condition
    assert message in condition["message"], condition["message"]
    assert not started(w), w.created
    # the same spec with everything allowed goes ahead: it is the policy that stops it
    open_world = world(UNRESTRICTED, **spec)
    open_world.reconcile(3)
    assert open_world.rlcycle["status"]["phase"] != "Invalid", open_world.condition("InvalidSpec")


def test_a_credentials_secret_the_namespace_did_not_mark_is_not_mounted() -> None:
    """Any Secret with the two keys was mounted into the steps' pods (and used against the
    spec's buckets): the Secret must carry the policy's label, set by whoever may read it."""
    w = world()
    w.secret = SecretState(True, labels={"team": "payments"})
    w.reconcile(3)
    condition = w.condition("InvalidSpec")
    assert condition["reason"] == "SecretNotAllowed"
    assert (
        "Secret s3-creds does not carry the label rtrl.io/rlcycle-secret=true"
        in (condition["message"])
    )
    assert not started(w)


def test_the_capture_sidecar_image_is_held_to_the_policy_too() -> None:
    capture = {"events": "s3://rtrl-artifacts/events/", "image": "attacker.example/sidecar:1"}
    w = world(capture=capture)
    w.reconcile(3)
    condition = w.condition("InvalidSpec")
    assert condition["reason"] == "ImageNotAllowed"
    assert condition["message"].startswith("spec.capture.image: image attacker.example/")
    assert not [p for p in w.patches if p.kind == "Deployment"]
    assert not started(w)


def test_a_spec_account_the_policy_allows_is_the_one_the_jobs_run_as() -> None:
    w = world(storage=storage(credentialsSecret=None, serviceAccountName="rtrl-irsa"))
    w.secret = None
    w.reconcile(3)
    (job,) = [m for k, m in w.manifests.items() if "stage" in k]
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == "rtrl-irsa"


def test_with_no_policy_nothing_beyond_its_own_objects_is_allowed() -> None:
    """The operator without RTRL_POLICY: the door is closed, and the condition says who
    opens it."""
    w = world(TenancyPolicy())
    w.reconcile(2)
    condition = w.condition("InvalidSpec")
    assert condition["reason"] == "ImageNotAllowed"
    assert "(policy.images: none); ask the cluster admin" in condition["message"]
    assert not started(w)


def test_fixing_the_spec_resumes() -> None:
    w = world(training=training(image="attacker.example/x:1"))
    w.reconcile(2)
    assert w.rlcycle["status"]["phase"] == "Invalid"
    w.rlcycle["spec"]["training"]["image"] = "registry.example.com/rtrl-trainer:0.2.0"
    w.rlcycle["metadata"]["generation"] = 2
    w.reconcile(3)
    assert w.condition("InvalidSpec")["status"] == "False"
    assert started(w)


@pytest.mark.parametrize(
    ("text", "value"),
    [("8", 8), ("500m", 0.5), ("64Gi", 64 * 2**30), ("1.5k", 1500), ("2e3", 2000), ("1Ei", 2**60)],
)
def test_quantities_are_read_as_kubernetes_reads_them(text: str, value: float) -> None:
    assert parse_quantity(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["", "1x", "Gi", "1 Gi", "--1"])
def test_a_quantity_that_is_none_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match=r"maxResources\.cpu: .* is not a Kubernetes quantity"):
        parse_quantity(text, "maxResources.cpu")
