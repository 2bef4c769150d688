"""``spec.capture`` in the planning core: the ``rtrl-capture`` sidecar injected into the
target and its canary, kept there without needless patches, pointed at each checkpoint the
engine serves, taken out with the spec, never over someone else's container; and the seal
CronJob created, replaced and deleted with the spec. Driven through the same in-memory
world as tests/rtrl/planning/test_plan.py."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import jsonpatch
import pytest

from rtrl.core.api.names import ANNOTATION_CAPTURE, ANNOTATION_CAPTURE_HASH, ANNOTATION_SPEC_HASH
from rtrl.planning import Create, Delete, Observed, Patch, plan
from rtrl.planning.manifests.capture import SIDECAR, capture_ports, engine_flag
from rtrl.planning.manifests.jobs import CREDENTIALS_MOUNT
from tests.rtrl.planning.test_plan import (
    EVAL_PASS,
    STAGE_OK,
    T0,
    TRAIN_OK,
    World,
    analysis,
    run_cycle,
    to_canary,
)

CAPTURE = {
    "events": "s3://rtrl-events/composer/",
    "image": "registry.example.com/rtrl-serving:0.1.0",
    "maturity": {"editPersisted": "2h", "dissatisfiedFollowup": "30m"},
    "resources": {"requests": {"cpu": "0.5", "memory": "256Mi"}},
}


class CaptureWorld(World):
    """The World with the seal CronJob the kube layer would observe."""

    def __init__(self, **spec_changes: Any) -> None:
        spec_changes.setdefault("capture", copy.deepcopy(CAPTURE))
        super().__init__(**spec_changes)
        self.cron_jobs: dict[str, dict[str, Any]] = {}

    def observed(self) -> Observed:
        obs = super().observed()
        return Observed(
            **{**obs.__dict__, "seal": copy.deepcopy(self.cron_jobs.get("composer-seal"))},
        )

    def apply(self, actions: list[Any]) -> None:
        rest = []
        for action in actions:
            kind = getattr(action, "kind", None)
            if kind != "CronJob":
                rest.append(action)
            elif isinstance(action, Create):
                self.cron_jobs.setdefault(action.name, copy.deepcopy(action.manifest))
                self.created.append(f"CronJob/{action.name}")
            elif isinstance(action, Patch):
                stored = self.cron_jobs[action.name]
                try:
                    self.cron_jobs[action.name] = jsonpatch.apply_patch(stored, action.patch)
                except jsonpatch.JsonPatchTestFailed:
                    continue
                self.patches.append(action)
            elif isinstance(action, Delete):
                self.cron_jobs.pop(action.name, None)
        super().apply(rest)

    def template(self, name: str = "composer-vllm") -> dict[str, Any]:
        return self.deployments[name]["spec"]["template"]

    def sidecar(self, name: str = "composer-vllm") -> dict[str, Any] | None:
        return next(
            (c for c in self.template(name)["spec"]["containers"] if c["name"] == SIDECAR), None
        )

    def sidecar_env(self, name: str = "composer-vllm") -> dict[str, Any]:
        sidecar = self.sidecar(name)
        assert sidecar is not None
        return {e["name"]: e.get("value", e.get("valueFrom")) for e in sidecar["env"]}

    def target_patches(self, name: str = "composer-vllm") -> list[Patch]:
        return [p for p in self.patches if p.kind == "Deployment" and p.name == name]


def test_the_sidecar_is_injected_into_the_target_with_the_contracts_env() -> None:
    world = CaptureWorld()
    original = copy.deepcopy(world.template())
    world.reconcile()
    names = [c["name"] for c in world.template()["spec"]["containers"]]
    assert names == ["vllm", SIDECAR]
    env = world.sidecar_env()
    serving_uri = world.checkpoint("composer-0")["spec"]["uri"]
    assert env == {
        "RTRL_CAPTURE_LISTEN": "0.0.0.0:8081",
        "RTRL_CAPTURE_ENGINE": "http://127.0.0.1:8000",
        "RTRL_CAPTURE_EVENTS": "s3://rtrl-events/composer/",
        "RTRL_CAPTURE_SPOOL": "/var/spool/rtrl-capture",
        "RTRL_CAPTURE_USER_HEADER": "X-Rtrl-User",
        "RTRL_CAPTURE_SESSION_HEADER": "X-Rtrl-Session",
        "RTRL_CAPTURE_ORG_HEADER": "X-Rtrl-Org",
        # read from the example engine's --logprobs-mode and --dtype
        "RTRL_CAPTURE_LOGPROBS_MODE": "processed_logprobs",
        "RTRL_CAPTURE_SERVING_DTYPE": "float32",
        "RTRL_RLCYCLE": "composer",
        "POD_NAME": {"fieldRef": {"fieldPath": "metadata.name"}},
        "TMPDIR": "/tmp",
        "RTRL_STORAGE_CREDENTIALS_DIR": CREDENTIALS_MOUNT,  # the Secret, as files
        "AWS_DEFAULT_REGION": "us-east-1",
        "RTRL_ARM": "stable",
        "RTRL_CHECKPOINT_ID": "composer-0",
        "RTRL_MODEL_URI": serving_uri,
    }
    sidecar = world.sidecar()
    assert sidecar is not None
    assert sidecar["image"] == CAPTURE["image"] and sidecar["command"] == ["rtrl-capture"]
    assert sidecar["ports"] == [{"name": SIDECAR, "containerPort": 8081, "protocol": "TCP"}]
    assert sidecar["resources"] == {"requests": {"cpu": "0.5", "memory": "256Mi"}}
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": SIDECAR}
    assert not any("secretKeyRef" in str(e) for e in sidecar["env"])  # never secrets as env
    volumes = {v["name"]: v for v in world.template()["spec"]["volumes"]}
    assert volumes["rtrl-capture-spool"] == {"name": "rtrl-capture-spool", "emptyDir": {}}
    assert volumes["rtrl-capture-credentials"]["secret"]["secretName"] == "s3-creds"
    notes = world.template()["metadata"]["annotations"]
    assert notes[ANNOTATION_CAPTURE] == "composer" and len(notes[ANNOTATION_CAPTURE_HASH]) == 16
    # the engine's container is as it was
    assert world.template()["spec"]["containers"][0] == original["spec"]["containers"][0]
    assert "CaptureInjected" in world.reasons()


def test_an_unchanged_spec_patches_nothing_even_after_the_server_defaulted_the_sidecar() -> None:
    world = CaptureWorld()
    world.reconcile()
    generation = world.deployments["composer-vllm"]["metadata"]["generation"]
    sidecar = world.sidecar()
    assert sidecar is not None
    # what the API server stores: defaults filled in, quantities canonical
    sidecar.update(terminationMessagePath="/dev/termination-log", imagePullPolicy="IfNotPresent")
    sidecar["resources"]["requests"]["cpu"] = "500m"
    sidecar["readinessProbe"]["successThreshold"] = 1
    pod_name = next(e for e in sidecar["env"] if e["name"] == "POD_NAME")
    pod_name["valueFrom"]["fieldRef"]["apiVersion"] = "v1"
    patches = len(world.target_patches())
    for _ in range(3):
        world.now += timedelta(minutes=1)
        world.reconcile()
    assert len(world.target_patches()) == patches
    assert world.deployments["composer-vllm"]["metadata"]["generation"] == generation
    assert world.reasons().count("CaptureInjected") == 1


def test_the_engines_sampling_flags_and_the_pods_grace_period_reach_the_sidecar() -> None:
    world = CaptureWorld()
    engine = world.template()["spec"]["containers"][0]
    engine["args"] += ["--dtype=float32", "--logprobs-mode", "$(LOGPROBS)",
                       "--generation-config", "vllm",
                       "--override-generation-config", '{"temperature": 0.7}']  # fmt: skip
    engine["env"].append({"name": "LOGPROBS", "value": "processed_logprobs"})
    world.template()["spec"]["terminationGracePeriodSeconds"] = 120
    world.reconcile()
    env = world.sidecar_env()
    assert env["RTRL_CAPTURE_SERVING_DTYPE"] == "float32"
    assert env["RTRL_CAPTURE_LOGPROBS_MODE"] == "processed_logprobs"
    assert env["RTRL_CAPTURE_GENERATION_CONFIG"] == "vllm"
    assert env["RTRL_CAPTURE_OVERRIDE_GENERATION_CONFIG"] == '{"temperature": 0.7}'
    assert env["RTRL_CAPTURE_DRAIN_TIMEOUT_S"] == "115"
    # the engine's flags change: the sidecar follows
    engine = world.template()["spec"]["containers"][0]
    engine["args"] = [a for a in engine["args"] if not a.startswith("--dtype")]
    world.reconcile()
    assert "RTRL_CAPTURE_SERVING_DTYPE" not in world.sidecar_env()
    assert world.reasons().count("CaptureUpdated") == 1


@pytest.mark.parametrize(
    ("argv", "value"),
    [
        (["--dtype", "bfloat16"], "bfloat16"),
        (["--dtype=float32"], "float32"),
        (["--model", "x"], None),
        (["--dtype"], None),  # a flag without its value
        (["--dtype", "$(UNSET)"], None),  # a reference the container's env does not hold
    ],
)
def test_engine_flag(argv: list[str], value: str | None) -> None:
    assert engine_flag({"args": argv}, "--dtype") == value


def test_promotion_points_engine_and_sidecar_at_the_candidate_in_one_patch() -> None:
    world = CaptureWorld()
    run_cycle(world)
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "Promoted"
    env = world.sidecar_env()
    assert env["RTRL_CHECKPOINT_ID"] == "composer-1" and env["RTRL_MODEL_URI"] == ck["spec"]["uri"]
    assert env["RTRL_ARM"] == "stable"
    promotion = next(
        p for p in world.target_patches()
        if any(op.get("value") == ck["spec"]["uri"] for op in p.patch)  # type: ignore[union-attr]
    )  # fmt: skip
    replaced = {op["path"] for op in promotion.patch if op["op"] == "replace"}  # type: ignore[index,union-attr]
    assert "/spec/template/spec/containers/0/env/0/value" in replaced  # the engine's MODEL_URI
    assert any(p.startswith("/spec/template/spec/containers/1/env/") for p in replaced)
    patches = len(world.target_patches())
    world.reconcile()
    assert len(world.target_patches()) == patches  # nothing left to do


def test_the_canary_sidecar_serves_the_candidate_on_the_canary_arm() -> None:
    world = CaptureWorld()
    to_canary(world)
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "Canary"
    canary = world.sidecar_env("composer-vllm-canary")
    assert canary["RTRL_ARM"] == "canary"
    assert canary["RTRL_CHECKPOINT_ID"] == "composer-1"
    assert canary["RTRL_MODEL_URI"] == ck["spec"]["uri"]
    stable = world.sidecar_env()
    assert (stable["RTRL_ARM"], stable["RTRL_CHECKPOINT_ID"]) == ("stable", "composer-0")
    notes = world.template("composer-vllm-canary")["metadata"]["annotations"]
    assert notes[ANNOTATION_CAPTURE] == "composer"
    patches = len(world.target_patches("composer-vllm-canary"))
    world.reconcile()
    assert len(world.target_patches("composer-vllm-canary")) == patches


def test_a_spec_change_mid_canary_reaches_the_stable_now_and_the_next_canary() -> None:
    world = CaptureWorld()
    to_canary(world)
    canary = copy.deepcopy(world.deployments["composer-vllm-canary"]["spec"])
    world.rlcycle["spec"]["capture"]["image"] = "registry.example.com/rtrl-serving:0.2.0"
    world.reconcile()
    sidecar = world.sidecar()
    assert sidecar is not None and sidecar["image"].endswith(":0.2.0")
    # the running canary keeps the template it was made from: no restart mid-analysis
    assert world.deployments["composer-vllm-canary"]["spec"] == canary
    assert world.reasons().count("CaptureUpdated") == 1
    world.now += timedelta(hours=1)
    world.reconcile()
    world.finish("analyze-0", result=analysis("rollback"))
    world.reconcile()
    world.now = T0 + timedelta(hours=5)
    world.reconcile()  # the next cycle
    world.finish("stage", result=STAGE_OK)
    world.reconcile()
    world.finish("train", result=TRAIN_OK)
    world.reconcile()
    world.finish("eval", result=EVAL_PASS)
    world.reconcile()
    sidecar = world.sidecar("composer-vllm-canary")
    assert sidecar is not None and sidecar["image"].endswith(":0.2.0")
    env = world.sidecar_env("composer-vllm-canary")
    assert (env["RTRL_ARM"], env["RTRL_CHECKPOINT_ID"]) == ("canary", "composer-2")


def test_a_rollback_points_the_sidecar_back_at_the_parent() -> None:
    world = CaptureWorld()
    run_cycle(world)
    world.now = T0 + timedelta(hours=2)
    world.rlcycle["metadata"]["annotations"] = {"rtrl.io/rollback": "back-1"}
    world.reconcile()
    world.settle()
    world.reconcile()
    env = world.sidecar_env()
    assert env["RTRL_CHECKPOINT_ID"] == "composer-0"
    assert env["RTRL_MODEL_URI"] == world.checkpoint("composer-0")["spec"]["uri"]


def test_a_canary_rolled_back_leaves_the_stable_sidecar_on_the_parent() -> None:
    world = CaptureWorld()
    run_cycle(world, canary="rollback")
    assert world.checkpoint("composer-1")["status"]["phase"] == "RolledBack"
    assert "composer-vllm-canary" not in world.deployments
    assert world.sidecar_env()["RTRL_CHECKPOINT_ID"] == "composer-0"


def test_removing_capture_takes_out_exactly_what_was_put_in() -> None:
    world = CaptureWorld()
    original = copy.deepcopy(world.template())
    world.reconcile()
    assert world.sidecar() is not None
    del world.rlcycle["spec"]["capture"]
    world.reconcile()
    assert world.template() == original
    assert "CaptureRemoved" in world.reasons()
    patches = len(world.target_patches())
    world.reconcile()
    assert len(world.target_patches()) == patches


def test_removal_keeps_the_users_own_volumes_and_annotations() -> None:
    world = CaptureWorld()
    pod = world.template()
    pod["spec"]["volumes"] = [{"name": "cache", "emptyDir": {}}]
    pod["metadata"]["annotations"] = {"team": "ml"}
    original = copy.deepcopy(pod)
    world.reconcile()
    assert world.template()["spec"]["volumes"][0]["name"] == "cache"
    del world.rlcycle["spec"]["capture"]
    world.reconcile()
    assert world.template() == original


def test_someone_elses_rtrl_capture_container_is_a_condition_never_an_overwrite() -> None:
    world = CaptureWorld()
    theirs = {"name": SIDECAR, "image": "example.com/their-proxy:1"}
    world.template()["spec"]["containers"].append(theirs)
    world.reconcile()
    status = world.rlcycle["status"]
    assert status["phase"] == "Invalid"
    invalid = world.condition("InvalidSpec")
    assert invalid["status"] == "True" and invalid["reason"] == "CaptureContainerConflict"
    assert invalid["message"].startswith("spec.capture: Deployment composer-vllm already has")
    assert world.template()["spec"]["containers"][1] == theirs
    assert world.target_patches() == [] and world.created == []  # no cycle, no CronJob
    # without spec.capture it is none of rtrl's business
    del world.rlcycle["spec"]["capture"]
    world.reconcile()
    assert world.condition("InvalidSpec")["status"] == "False"
    assert world.template()["spec"]["containers"][1] == theirs


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"enginePort": 8080}, "spec.capture.enginePort"),  # the engine declares 8000 only
        ({"port": 8000, "enginePort": 8001}, "spec.capture.port"),  # the engine's own port
    ],
)
def test_a_port_clash_with_the_engine_is_a_condition(change: dict[str, Any], field: str) -> None:
    world = CaptureWorld(capture={**CAPTURE, **change})
    world.reconcile()
    invalid = world.condition("InvalidSpec")
    assert invalid["reason"] == "CapturePortConflict" and invalid["message"].startswith(field)
    assert world.target_patches() == []


ADAPTERS = {"configMap": "composer-adapters"}


def _lora_ready(world: CaptureWorld) -> None:
    """The engine as spec.capture.adapters needs it: LoRA on, the adapters' volume."""
    pod = world.template()
    pod["spec"]["volumes"] = [{"name": "rtrl-adapters", "emptyDir": {}}]
    engine = pod["spec"]["containers"][0]
    engine["args"] = [*engine.get("args", []), "--enable-lora", "--max-lora-rank", "16"]
    engine["volumeMounts"] = [{"name": "rtrl-adapters", "mountPath": "/var/lib/rtrl-adapters"}]


def test_with_adapters_the_sidecar_follows_the_table_and_shares_the_engines_volume() -> None:
    world = CaptureWorld(capture={**CAPTURE, "adapters": ADAPTERS})
    _lora_ready(world)
    original = copy.deepcopy(world.template())
    world.reconcile()
    assert world.condition("InvalidSpec")["status"] == "False"
    env = world.sidecar_env()
    assert env["RTRL_CAPTURE_ADAPTERS"] == "/etc/rtrl-capture/adapters"  # every key
    assert env["RTRL_CAPTURE_ADAPTER_DIR"] == "/var/lib/rtrl-adapters"
    assert env["RTRL_CAPTURE_ADAPTERS_CONFIGMAP"] == "composer-adapters"  # through the API too
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    sidecar = world.sidecar()
    assert sidecar is not None
    mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
    assert mounts["rtrl-capture-adapters"]["readOnly"] is True
    assert mounts["rtrl-adapters"]["mountPath"] == "/var/lib/rtrl-adapters"
    volumes = {v["name"]: v for v in world.template()["spec"]["volumes"]}
    assert volumes["rtrl-capture-adapters"]["configMap"] == {"name": "composer-adapters"}
    assert volumes["rtrl-adapters"] == {"name": "rtrl-adapters", "emptyDir": {}}  # the pod's
    assert world.template()["spec"]["containers"][0] == original["spec"]["containers"][0]
    # taking adapters out takes out the table's volume, never the pod's own
    world.rlcycle["spec"]["capture"].pop("adapters")
    world.reconcile()
    volumes = {v["name"] for v in world.template()["spec"]["volumes"]}
    assert "rtrl-capture-adapters" not in volumes and "rtrl-adapters" in volumes
    assert "RTRL_CAPTURE_ADAPTERS" not in world.sidecar_env()
    del world.rlcycle["spec"]["capture"]
    world.reconcile()
    assert world.template() == original


@pytest.mark.parametrize(
    ("undo", "words"),
    [
        ("volume", "must mount a pod volume named rtrl-adapters"),
        ("lora", "must run vLLM with --enable-lora"),
    ],
)
def test_adapters_an_engine_cannot_serve_are_a_condition(undo: str, words: str) -> None:
    world = CaptureWorld(capture={**CAPTURE, "adapters": ADAPTERS})
    _lora_ready(world)
    engine = world.template()["spec"]["containers"][0]
    if undo == "volume":
        engine.pop("volumeMounts")
    else:
        engine["args"] = [a for a in engine["args"] if a != "--enable-lora"]
    world.reconcile()
    invalid = world.condition("InvalidSpec")
    assert invalid["reason"] == "CaptureAdaptersUnservable", invalid
    assert invalid["message"].startswith("spec.capture.adapters: ") and words in invalid["message"]
    assert world.target_patches() == []


def test_a_patch_planned_from_an_older_template_does_not_apply() -> None:
    world = CaptureWorld()
    decided = plan(world.observed(), world.now)
    world.template()["spec"]["containers"].append({"name": "log-shipper", "image": "x"})
    world.apply(decided.actions)  # the test of the containers list fails (the server: 422)
    assert [c["name"] for c in world.template()["spec"]["containers"]] == ["vllm", "log-shipper"]
    world.reconcile()  # planned again from what is there
    names = [c["name"] for c in world.template()["spec"]["containers"]]
    assert names == ["vllm", "log-shipper", SIDECAR]


def test_the_stage_reads_exactly_what_was_sealed() -> None:
    world = CaptureWorld()
    world.reconcile()
    args = world.manifests["composer-1-stage-0"]["spec"]["template"]["spec"]["containers"][0]
    assert "--sealed" in args["args"]
    plain = World()
    plain.reconcile()
    args = plain.manifests["composer-1-stage-0"]["spec"]["template"]["spec"]["containers"][0]
    assert "--sealed" not in args["args"]


def test_the_analysis_reconciles_the_rows_with_what_each_arm_served() -> None:
    world = CaptureWorld()
    to_canary(world)
    world.now += timedelta(minutes=30)
    world.reconcile()
    job = world.manifests["composer-1-analyze-0-0"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--events={CAPTURE['events']}" in args
    plain = World()
    to_canary(plain)
    plain.now += timedelta(minutes=30)
    plain.reconcile()
    args = plain.manifests["composer-1-analyze-0-0"]["spec"]["template"]["spec"]["containers"]
    assert not [a for a in args[0]["args"] if a.startswith("--events")]


def test_the_seal_cronjob_runs_rtrl_job_seal_with_the_spec_and_credentials() -> None:
    world = CaptureWorld()
    world.reconcile()
    cron = world.cron_jobs["composer-seal"]
    assert cron["metadata"]["ownerReferences"][0]["kind"] == "RLCycle"
    assert cron["metadata"]["labels"]["rtrl.io/rlcycle"] == "composer"
    spec = cron["spec"]
    assert spec["schedule"] == "*/10 * * * *" and spec["timeZone"] == "Etc/UTC"
    assert spec["concurrencyPolicy"] == "Forbid"
    job = spec["jobTemplate"]
    assert job["metadata"]["labels"] == {
        "app.kubernetes.io/managed-by": "rtrl", "rtrl.io/seal": "composer"
    }  # fmt: skip
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == world.rlcycle["spec"]["training"]["image"]
    assert container["command"] == ["rtrl-job"]
    assert container["args"] == [
        "seal",
        "--events=s3://rtrl-events/composer/",
        "--shards=s3://interactions/composer/",
        "--delay=10m",
        "--maturity=dissatisfied_followup=30m",
        "--maturity=edit_persisted=2h",
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["storage-credentials"]["secret"]["secretName"] == "s3-creds"
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert job["spec"]["activeDeadlineSeconds"] == 12 * 3600  # spec.jobs.activeDeadline
    assert "SealScheduled" in world.reasons()


def test_the_seal_cronjob_follows_the_spec_and_goes_with_capture() -> None:
    world = CaptureWorld()
    world.reconcile()
    world.reconcile()
    assert world.created.count("CronJob/composer-seal") == 1
    assert not [p for p in world.patches if p.kind == "CronJob"]
    stored = world.cron_jobs["composer-seal"]
    stored["spec"]["suspend"] = False  # a server default: no reason to write
    world.reconcile()
    assert not [p for p in world.patches if p.kind == "CronJob"]
    world.rlcycle["spec"]["capture"]["seal"] = {"schedule": "5 * * * *", "delay": "20m"}
    world.reconcile()
    cron = world.cron_jobs["composer-seal"]
    assert cron["spec"]["schedule"] == "5 * * * *"
    assert (
        "--delay=20m"
        in cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert (
        cron["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
        != stored["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    )
    assert "SealUpdated" in world.reasons()
    del world.rlcycle["spec"]["capture"]
    world.reconcile()
    assert world.cron_jobs == {} and "SealRemoved" in world.reasons()


def test_the_gateway_canary_service_targets_the_sidecar() -> None:
    world = CaptureWorld(
        rollout={
            "router": "gatewayapi", "httpRoute": "composer", "service": "composer",
            "steps": [{"weight": 10, "minDuration": "10m"}], "analysis": {"maxDuration": "1h"},
        }
    )  # fmt: skip
    world.deployments["composer"] = {
        "metadata": {"name": "composer", "generation": 1},
        "spec": {"rules": [{"backendRefs": [{"name": "composer", "port": 8000}]}]},
    }
    ports = [{"name": "http", "port": 8000, "targetPort": "http"},
             {"name": "metrics", "port": 9100, "targetPort": 9100}]  # fmt: skip
    world.stable_service = {"metadata": {"name": "composer"}, "spec": {"ports": ports}}
    to_canary(world)
    assert world.manifests["composer-canary"]["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": SIDECAR},
        {"name": "metrics", "port": 9100, "targetPort": 9100},
    ]


@pytest.mark.parametrize(
    ("ports", "targets"),
    [
        ([{"port": 80}], [SIDECAR]),  # the only port
        ([{"port": 80, "targetPort": 8000}, {"port": 90, "targetPort": 9}], [SIDECAR, 9]),
        ([{"port": 80, "targetPort": SIDECAR}, {"port": 90, "targetPort": 9}], [SIDECAR, 9]),
        ([{"port": 8000}, {"port": 90, "targetPort": 9}], [SIDECAR, 9]),  # targetPort = port
    ],
)
def test_capture_ports(ports: list[dict[str, Any]], targets: list[Any]) -> None:
    world = CaptureWorld()
    world.reconcile()
    from rtrl.planning.plan import validate_spec

    spec, _ = validate_spec(world.rlcycle["spec"])
    assert spec is not None
    engine = world.template()["spec"]["containers"][0]
    assert [p["targetPort"] for p in capture_ports(ports, spec, engine)] == targets


def test_a_whole_cycle_with_capture_runs_as_one_without() -> None:
    world, plain = CaptureWorld(), World()
    for w in (world, plain):
        run_cycle(w)
    assert world.rlcycle["status"]["phase"] == plain.rlcycle["status"]["phase"] == "Idle"
    assert world.checkpoint("composer-1")["status"]["phase"] == "Promoted"
    extra = {"CaptureInjected", "SealScheduled"}
    assert [r for r in world.reasons() if r not in extra] == plain.reasons()
