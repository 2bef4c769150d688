"""Tests of the integration-test harness itself: the emulated API, the Job runner, kopf on it."""

from __future__ import annotations

import base64
import sys
import threading
from pathlib import Path
from typing import Any

import kopf.testing
import kubernetes
import pytest
from tests.integration.conftest import KubeAPI

from rtrl_localkube.job_runner import JobRunner
from rtrl_localkube.outcomes import Fail, Hang, Succeed

pytestmark = pytest.mark.timeout(60)

RTRL = "rtrl.io/v1alpha1"


def rlcycle(name: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": RTRL,
        "kind": "RLCycle",
        "metadata": {"name": name, "labels": labels},
        "spec": {"target": {"deployment": "d"}},
    }


def job(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "unused", "command": command}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": spec.pop("backoffLimit", 0),
            **spec,
            "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
        },
    }


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind and cond["status"] == "True":
            return cond
    return None


# --- the emulated API ---------------------------------------------------------------------------


def test_metadata_is_stamped_and_generation_tracks_spec_only(kube_api: KubeAPI) -> None:
    created = kube_api.create(rlcycle("a"))
    meta = created["metadata"]
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert meta["generation"] == 1 and meta["namespace"] == "default"
    rv0 = int(meta["resourceVersion"])

    labelled = kube_api.patch(RTRL, "RLCycle", "a", {"metadata": {"labels": {"x": "1"}}})
    assert labelled["metadata"]["generation"] == 1
    assert int(labelled["metadata"]["resourceVersion"]) > rv0

    respec = kube_api.patch(RTRL, "RLCycle", "a", {"spec": {"target": {"deployment": "e"}}})
    assert respec["metadata"]["generation"] == 2
    rv2 = int(respec["metadata"]["resourceVersion"])
    assert rv2 > int(labelled["metadata"]["resourceVersion"])

    status = kube_api.patch(
        RTRL, "RLCycle", "a", {"status": {"phase": "Idle"}}, subresource="status"
    )
    assert status["status"] == {"phase": "Idle"} and status["metadata"]["generation"] == 2
    assert int(status["metadata"]["resourceVersion"]) > rv2

    # With a status subresource, the main endpoint ignores status and /status ignores the rest.
    ignored = kube_api.patch(RTRL, "RLCycle", "a", {"status": {"phase": "Hacked"}})
    assert ignored["status"] == {"phase": "Idle"}
    assert ignored["metadata"]["resourceVersion"] == status["metadata"]["resourceVersion"]
    ignored = kube_api.patch(
        RTRL, "RLCycle", "a", {"spec": {"x": 1}, "status": {"phase": "Ok"}}, subresource="status"
    )
    assert "x" not in ignored["spec"] and ignored["metadata"]["generation"] == 2

    # The server's fields cannot be overwritten, and a stale JSON-patch test is a 422.
    same = kube_api.patch(RTRL, "RLCycle", "a", {"metadata": {"uid": "mine"}})
    assert same["metadata"]["uid"] == meta["uid"]
    stale = [{"op": "test", "path": "/metadata/resourceVersion", "value": str(rv0)}]
    with pytest.raises(kubernetes.dynamic.exceptions.UnprocessibleEntityError):
        kube_api.patch(RTRL, "RLCycle", "a", [*stale, {"op": "add", "path": "/spec/y", "value": 1}])
    with pytest.raises(kubernetes.dynamic.exceptions.ConflictError):
        kube_api.create(rlcycle("a"))


def test_finalizers_hold_deletion_until_removed(kube_api: KubeAPI) -> None:
    obj = rlcycle("f")
    obj["metadata"]["finalizers"] = ["rtrl.io/test"]
    kube_api.create(obj)

    kube_api.delete(RTRL, "RLCycle", "f", propagation_policy="Foreground")
    held = kube_api.get(RTRL, "RLCycle", "f")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    kube_api.delete(RTRL, "RLCycle", "f")  # a second DELETE changes nothing
    assert kube_api.get(RTRL, "RLCycle", "f") == held

    kube_api.patch(RTRL, "RLCycle", "f", {"metadata": {"finalizers": None}})
    assert kube_api.get(RTRL, "RLCycle", "f") is None
    assert kube_api.delete(RTRL, "RLCycle", "f") is None

    kube_api.create(rlcycle("g"))
    kube_api.delete(RTRL, "RLCycle", "g")
    assert kube_api.get(RTRL, "RLCycle", "g") is None


def test_owner_references_are_garbage_collected(kube_api: KubeAPI) -> None:
    owner = kube_api.create(
        {
            "apiVersion": RTRL,
            "kind": "Checkpoint",
            "metadata": {"name": "c"},
            "spec": {"uri": "s3://bucket/c"},
        }
    )
    ref = {"apiVersion": RTRL, "kind": "Checkpoint", "name": "c", "uid": owner["metadata"]["uid"]}
    for name in ("j1", "j2"):
        child = job(name, ["true"])
        child["metadata"]["ownerReferences"] = [ref]
        kube_api.create(child)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {}}
    created_job = kube_api.get("batch/v1", "Job", "j1")
    assert created_job is not None
    pod["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": "j1",
            "uid": created_job["metadata"]["uid"],
        }
    ]
    kube_api.create(pod)
    kube_api.create(job("unrelated", ["true"]))

    kube_api.delete(RTRL, "Checkpoint", "c")
    names = [j["metadata"]["name"] for j in kube_api.list("batch/v1", "Job")]
    assert names == ["unrelated"]
    assert kube_api.get("v1", "Pod", "p") is None  # transitively


def test_label_and_field_selectors(kube_api: KubeAPI) -> None:
    kube_api.create(rlcycle("a", app="x", tier="1"))
    kube_api.create(rlcycle("b", app="y"))
    kube_api.create(rlcycle("c"))

    def names(labels: dict[str, str] | str) -> list[str]:
        return sorted(o["metadata"]["name"] for o in kube_api.list(RTRL, "RLCycle", labels))

    assert names({"app": "x"}) == ["a"]
    assert names("app") == ["a", "b"]
    assert names("!app") == ["c"]
    assert names("app!=x") == ["b", "c"]
    assert names("app in (x, y),tier") == ["a"]
    assert names("app notin (x)") == ["b", "c"]
    assert names("app==y") == ["b"]
    with pytest.raises(kubernetes.client.exceptions.ApiException) as err:
        names("app in x")
    assert err.value.status == 400
    items = kubernetes.client.CustomObjectsApi(kube_api.api_client).list_namespaced_custom_object(
        "rtrl.io", "v1alpha1", "default", "rlcycles", field_selector="metadata.name=b"
    )["items"]
    assert [o["metadata"]["name"] for o in items] == ["b"]


def test_official_client_crud_with_status_subresource(kube_api: KubeAPI) -> None:
    api = kubernetes.client.CustomObjectsApi(kube_api.api_client)
    args = ("rtrl.io", "v1alpha1", "default", "rlcycles")
    api.create_namespaced_custom_object(*args, rlcycle("crud"))
    api.patch_namespaced_custom_object_status(*args, "crud", {"status": {"phase": "Training"}})
    got = api.get_namespaced_custom_object(*args, "crud")
    assert got["status"] == {"phase": "Training"} and got["kind"] == "RLCycle"
    got["spec"]["target"]["deployment"] = "replaced"
    replaced = api.replace_namespaced_custom_object(*args, "crud", got)
    assert replaced["metadata"]["generation"] == 2
    assert [o["metadata"]["name"] for o in api.list_namespaced_custom_object(*args)["items"]] == [
        "crud"
    ]
    api.delete_namespaced_custom_object(*args, "crud")
    with pytest.raises(kubernetes.client.exceptions.ApiException) as err:
        api.get_namespaced_custom_object(*args, "crud")
    assert err.value.status == 404

    # Typed APIs too: a Secret's stringData is folded into base64 data, as a real server does.
    core = kubernetes.client.CoreV1Api(kube_api.api_client)
    secret = kubernetes.client.V1Secret(metadata={"name": "s"}, string_data={"k": "v"})
    core.create_namespaced_secret("default", secret)
    assert core.read_namespaced_secret("s", "default").data == {
        "k": base64.b64encode(b"v").decode()
    }
    assert [ns.metadata.name for ns in core.list_namespace().items] == ["default"]
    batch = kubernetes.client.BatchV1Api(kube_api.api_client)
    batch.create_namespaced_job("default", job("typed", ["true"]))
    assert [j.metadata.name for j in batch.list_namespaced_job("default").items] == ["typed"]


def test_watch_streams_events_and_ends_on_timeout(kube_api: KubeAPI) -> None:
    api = kubernetes.client.CustomObjectsApi(kube_api.api_client)
    args = ("rtrl.io", "v1alpha1", "default", "rlcycles")
    kube_api.create(rlcycle("w1", app="x"))
    seen: list[tuple[str, str]] = []

    def watch() -> None:
        stream = kubernetes.watch.Watch().stream(
            api.list_namespaced_custom_object, *args, label_selector="app=x", timeout_seconds=1
        )
        seen.extend((e["type"], e["object"]["metadata"]["name"]) for e in stream)

    thread = threading.Thread(target=watch)
    thread.start()
    kube_api.wait_for(lambda: seen)
    kube_api.create(rlcycle("w2"))  # filtered out by the selector
    kube_api.create(rlcycle("w3", app="x"))
    thread.join(5)
    assert not thread.is_alive()
    assert seen == [("ADDED", "w1"), ("ADDED", "w3")]


# --- the Job runner -----------------------------------------------------------------------------


def test_run_executes_the_container_with_secret_env(
    kube_api: KubeAPI, job_runner: JobRunner
) -> None:
    kube_api.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "creds"},
            "stringData": {"token": "s3cr3t"},
        }
    )
    kube_api.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "cfg"},
            "data": {"step.json": '{"step": "stage"}'},
        }
    )
    script = (
        "import os,sys; print(os.environ['TOKEN'], open(sys.argv[1]).read(), os.environ['POD'])"
    )
    manifest = job(
        "run",
        [sys.executable, "-c", script],
        container={
            "args": ["$(CONFIG_DIR)/step.json"],
            "env": [
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "CONFIG_DIR", "value": "/etc/rtrl"},
            ],
            "volumeMounts": [{"name": "cfg", "mountPath": "/etc/rtrl"}],
        },
    )
    manifest["spec"]["template"]["spec"]["volumes"] = [
        {"name": "cfg", "configMap": {"name": "cfg"}}
    ]
    kube_api.create(manifest)

    done = kube_api.wait_for(
        lambda: condition(kube_api.get("batch/v1", "Job", "run"), "Complete"),
        message=lambda: job_runner.logs("run"),
    )
    assert done["reason"] == "CompletionsReached"
    status = kube_api.get("batch/v1", "Job", "run")["status"]  # type: ignore[index]
    assert status["succeeded"] == 1 and "active" not in status and status["completionTime"]
    assert condition({"status": status}, "SuccessCriteriaMet")
    (pod,) = kube_api.list("v1", "Pod", {"job-name": "run"})
    assert pod["status"]["phase"] == "Succeeded"
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"
    owner = kube_api.get("batch/v1", "Job", "run")
    assert owner is not None
    assert pod["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    assert f's3cr3t {{"step": "stage"}} {pod["metadata"]["name"]}' in job_runner.logs("run")
    assert job_runner.jobs_seen == ["run"]


def test_indexed_job_runs_each_index(kube_api: KubeAPI, job_runner: JobRunner) -> None:
    script = "import os; print('index', os.environ['JOB_COMPLETION_INDEX'], os.environ['ADDR'])"
    manifest = job(
        "idx",
        [sys.executable, "-c", script],
        completionMode="Indexed",
        completions=2,
        parallelism=2,
        container={"env": [{"name": "ADDR", "value": "idx-0.idx-svc:29500"}]},
    )
    manifest["spec"]["template"]["spec"]["subdomain"] = "idx-svc"
    kube_api.create(manifest)
    kube_api.wait_for(
        lambda: condition(kube_api.get("batch/v1", "Job", "idx"), "Complete"),
        message=lambda: job_runner.logs("idx"),
    )
    status = kube_api.get("batch/v1", "Job", "idx")["status"]  # type: ignore[index]
    assert status["succeeded"] == 2 and status["completedIndexes"] == "0-1"
    pods = kube_api.list("v1", "Pod", "batch.kubernetes.io/job-name=idx")
    assert sorted(
        p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] for p in pods
    ) == ["0", "1"]
    assert all(p["metadata"]["name"].startswith(("idx-0-", "idx-1-")) for p in pods)
    logs = job_runner.logs("idx")
    assert "index 0 127.0.0.1:29500" in logs and "index 1 127.0.0.1:29500" in logs


def test_fail_retries_up_to_the_backoff_limit(kube_api: KubeAPI, job_runner: JobRunner) -> None:
    job_runner.script("train-*", Fail(reason="OOMKilled", message="out of memory", exit_code=137))
    kube_api.create(job("train-1", ["true"], backoffLimit=2))
    failed = kube_api.wait_for(
        lambda: condition(kube_api.get("batch/v1", "Job", "train-1"), "Failed")
    )
    assert failed["reason"] == "BackoffLimitExceeded"
    assert failed["message"] == "Job has reached the specified backoff limit"
    status = kube_api.get("batch/v1", "Job", "train-1")["status"]  # type: ignore[index]
    assert status["failed"] == 3 and condition({"status": status}, "FailureTarget")
    pods = kube_api.list("v1", "Pod", {"job-name": "train-1"})
    assert len(pods) == 3
    for pod in pods:
        terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        assert (terminated["exitCode"], terminated["reason"]) == (137, "OOMKilled")
        assert terminated["message"] == "out of memory"


def test_run_failure_reports_the_log_tail(kube_api: KubeAPI, job_runner: JobRunner) -> None:
    script = "import sys; print('\\n'.join(f'line {i}' for i in range(30))); sys.exit(3)"
    kube_api.create(
        job(
            "bad",
            [sys.executable, "-c", script],
            container={"terminationMessagePolicy": "FallbackToLogsOnError"},
        )
    )
    kube_api.wait_for(lambda: condition(kube_api.get("batch/v1", "Job", "bad"), "Failed"))
    (pod,) = kube_api.list("v1", "Pod", {"job-name": "bad"})
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3 and terminated["reason"] == "Error"
    assert terminated["message"].splitlines() == [f"line {i}" for i in range(10, 30)]


def test_hang_until_deleted_kills_the_process(kube_api: KubeAPI, job_runner: JobRunner) -> None:
    job_runner.script("sleepy", Hang())
    kube_api.create(job("sleepy", ["true"]))
    kube_api.create(job("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"]))

    def both_running() -> list[dict[str, Any]] | None:
        # Wait for both: the two pods exist before the second one starts running.
        pods = kube_api.list("v1", "Pod")
        running = [p for p in pods if p.get("status", {}).get("phase") == "Running"]
        return running if len(running) == 2 else None

    running = kube_api.wait_for(both_running)
    assert len(running) == 2 and len(kube_api.list("v1", "Pod")) == 2
    assert kube_api.get("batch/v1", "Job", "sleeper")["status"]["active"] == 1  # type: ignore[index]
    kube_api.delete("batch/v1", "Job", "sleepy")
    kube_api.delete("batch/v1", "Job", "sleeper")
    job_runner.wait_idle(timeout=10)
    assert kube_api.list("v1", "Pod") == []  # garbage-collected with their Jobs
    assert job_runner.jobs_seen == ["sleepy", "sleeper"]


def test_succeed_calls_before(kube_api: KubeAPI, job_runner: JobRunner, tmp_path: Path) -> None:
    calls: list[str] = []

    def write_result(job_dict: dict[str, Any]) -> None:
        calls.append(job_dict["metadata"]["name"])
        (tmp_path / "result.json").write_text('{"ok": true}')

    job_runner.script("eval-*", Succeed(before=write_result))
    kube_api.create(job("eval-7", ["does-not-exist"]))
    kube_api.wait_for(lambda: condition(kube_api.get("batch/v1", "Job", "eval-7"), "Complete"))
    job_runner.wait_idle()
    assert calls == ["eval-7"] and (tmp_path / "result.json").exists()


# --- kopf end to end ----------------------------------------------------------------------------


def test_kopf_operator_end_to_end(kube_api: KubeAPI) -> None:
    operator = Path(__file__).with_name("_noop_operator.py")
    args = ["run", "--standalone", "--namespace", kube_api.namespace, str(operator)]
    # A registry of its own: kopf makes the registry it runs with the process-wide default, so
    # without one this file's handlers would join whatever registry ran before (rtrl's).
    with kopf.testing.KopfRunner(args, timeout=30, registry=kopf.OperatorRegistry()) as runner:
        kube_api.create(rlcycle("op"))
        seen = kube_api.wait_for(
            lambda: (kube_api.get(RTRL, "RLCycle", "op") or {}).get("status", {}).get("phase")
        )
        assert seen == "Seen"
        obj = kube_api.get(RTRL, "RLCycle", "op")
        assert obj is not None and "rtrl.io/harness-test" in obj["metadata"]["finalizers"]
        kube_api.delete(RTRL, "RLCycle", "op")
        kube_api.wait_for(lambda: kube_api.get(RTRL, "RLCycle", "op") is None)
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output
    assert "Handler 'created' succeeded" in runner.output
    assert "Handler 'deleted' succeeded" in runner.output
