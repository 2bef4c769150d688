"""The kubelet stand-in under the real controllers: what the other real-server suites build
on. Each test checks one thing a kubelet does, through what the real Job and Deployment
controllers make of it."""

from __future__ import annotations

import base64
import urllib.error
from typing import Any

import pytest

from rtrl_localkube.api import KubeAPI
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.outcomes import Fail, Succeed

pytestmark = pytest.mark.timeout(120)


def job(name: str, script: str, **spec: Any) -> dict[str, Any]:
    container = {
        "name": "main",
        "image": "python:3.11",
        "command": ["python", "-c", script],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    container.update(spec.pop("container", {}))
    pod_spec = {"restartPolicy": "Never", "containers": [container], **spec.pop("pod", {})}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {"backoffLimit": 0, "template": {"spec": pod_spec}, **spec},
    }


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind and cond["status"] == "True":
            return dict(cond)
    return None


def test_a_job_runs_with_its_volumes_env_and_token(kube: KubeAPI, node: Kubelet) -> None:
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "conf"},
                 "data": {"step.json": '{"step": "stage"}'}})  # fmt: skip
    kube.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"},
                 "data": {"KEY": base64.b64encode(b"s3cr3t").decode()}})  # fmt: skip
    script = (
        "import os, sys, pathlib; "
        "print(os.environ['KEY'], pathlib.Path(sys.argv[1]).read_text(), os.environ['POD']); "
        "t = pathlib.Path('/var/run/secrets/kubernetes.io/serviceaccount/token'); "
        "print('token', len(pathlib.Path(os.environ['TOKEN_DIR'], 'token').read_text()) > 100)"
    )
    body = job(
        "run",
        script,
        container={
            "args": ["/etc/conf/step.json"],
            "env": [
                {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "KEY"}}},
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "TOKEN_DIR", "value": "/var/run/secrets/kubernetes.io/serviceaccount"},
            ],
            "volumeMounts": [{"name": "conf", "mountPath": "/etc/conf"}],
        },
        pod={"volumes": [{"name": "conf", "configMap": {"name": "conf"}}]},
    )
    kube.create(body)
    done = kube.wait_for(
        lambda: (
            condition(kube.get("batch/v1", "Job", "run"), "Complete")
            or condition(kube.get("batch/v1", "Job", "run"), "Failed")
        ),
        timeout=60,
        message=lambda: node.logs("run", kube.namespace),
    )
    assert done["type"] == "Complete", node.logs("run", kube.namespace)
    pods = kube.list("v1", "Pod", labels={"batch.kubernetes.io/job-name": "run"})
    assert len(pods) == 1 and pods[0]["status"]["phase"] == "Succeeded"
    # the real ServiceAccount admission mounted a projected token volume; the kubelet filled it
    mounts = pods[0]["spec"]["containers"][0]["volumeMounts"]
    assert any(m["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount" for m in mounts)
    logs = node.logs("run", kube.namespace)
    assert f's3cr3t {{"step": "stage"}} {pods[0]["metadata"]["name"]}' in logs
    assert "token True" in logs


def test_a_failing_pod_fails_the_job_with_its_termination_message(
    kube: KubeAPI, node: Kubelet
) -> None:
    kube.create(job("boom", "import sys; print('the parent checkpoint is corrupt'); sys.exit(3)"))
    failed = kube.wait_for(
        lambda: condition(kube.get("batch/v1", "Job", "boom"), "Failed"), timeout=60
    )
    assert failed["reason"] == "BackoffLimitExceeded"
    (pod,) = kube.list("v1", "Pod", labels={"batch.kubernetes.io/job-name": "boom"})
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3
    assert "the parent checkpoint is corrupt" in terminated["message"]


# Each pod resolves its peers' names (waiting up to 30 s: a name exists once the Service's
# EndpointSlice lists its pod) and a name no pod has, then stays until its peer is likely
# done resolving it (a finished pod leaves the EndpointSlice, as on a cluster).
RESOLVE = """
import os, socket, time
def resolve(name, wait):
    end = time.time() + wait
    while True:
        try:
            return socket.gethostbyname(name)
        except OSError:
            if time.time() > end:
                return None
            time.sleep(0.2)
me, ns = os.environ['JOB_COMPLETION_INDEX'], os.environ['NS']
peers = [resolve(f'idx-{i}.idx-svc', 30) for i in (0, 1)]
fqdn = resolve(f'idx-{1 - int(me)}.idx-svc.{ns}.svc.cluster.local', 0)
print('index', me, os.environ['MASTER'], os.environ['MASTER_PORT'], peers, fqdn,
      resolve('idx-7.idx-svc', 0), flush=True)
time.sleep(5)
"""


def test_an_indexed_job_gets_completion_indexes_and_hostnames(kube: KubeAPI, node: Kubelet) -> None:
    selector = {"batch.kubernetes.io/job-name": "idx"}
    kube.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "idx-svc"},
                 "spec": {"clusterIP": "None", "selector": selector}})  # fmt: skip
    env = [
        {"name": "MASTER", "value": "idx-0.idx-svc"},
        {"name": "MASTER_PORT", "value": "29500"},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    body = job("idx", RESOLVE, completionMode="Indexed", completions=2, parallelism=2,
               container={"env": env}, pod={"subdomain": "idx-svc"})  # fmt: skip
    kube.create(body)
    kube.wait_for(
        lambda: condition(kube.get("batch/v1", "Job", "idx"), "Complete"),
        timeout=90,
        message=lambda: node.logs("idx", kube.namespace),
    )
    logs = node.logs("idx", kube.namespace)
    assert kube.get("batch/v1", "Job", "idx")["status"]["completedIndexes"] == "0,1"
    lines = sorted(line.split() for line in logs.splitlines() if line.startswith("index "))
    assert [words[1] for words in lines] == ["0", "1"], logs
    ports = {words[3] for words in lines}
    if node.network.resolves:
        # Names are resolved, not rewritten: the env keeps the name, and both peers resolve
        # (to loopback: every pod shares this machine's network); a name no pod has does not.
        for words in lines:
            assert words[2] == "idx-0.idx-svc", logs
            assert " ".join(words[4:]) == "['127.0.0.1', '127.0.0.1'] 127.0.0.1 None", logs
    else:  # no mount namespaces (not root): the names are rewritten in args and env
        assert all(words[2] == "127.0.0.1" for words in lines), logs
    # One rendezvous port for the Job, of its own (two trainings must not share 29500).
    assert len(ports) == 1 and ports != {"29500"}, logs


def test_a_killed_pod_fails_its_job_with_exit_137(kube: KubeAPI, node: Kubelet) -> None:
    kube.create(job("victim", "import time; print('up', flush=True); time.sleep(600)"))
    kube.wait_for(lambda: "up" in node.logs("victim", kube.namespace), timeout=60)
    (pod,) = kube.list("v1", "Pod", labels={"batch.kubernetes.io/job-name": "victim"})
    node.kill(pod["metadata"]["name"])
    failed = kube.wait_for(
        lambda: condition(kube.get("batch/v1", "Job", "victim"), "Failed"), timeout=60
    )
    assert failed["reason"] == "BackoffLimitExceeded"
    (pod,) = kube.list("v1", "Pod", labels={"batch.kubernetes.io/job-name": "victim"})
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137


def test_scripted_failure_and_deletion_stop_pods(kube: KubeAPI, node: Kubelet) -> None:
    node.script("scripted", Fail(reason="Error", message="OOMKilled-ish", exit_code=137))
    kube.create(job("scripted", "print('never runs')"))
    kube.wait_for(lambda: condition(kube.get("batch/v1", "Job", "scripted"), "Failed"), timeout=60)
    kube.create(job("sleeper", "import time; time.sleep(600)"))
    kube.wait_for(
        lambda: any(
            (p.get("status") or {}).get("phase") == "Running"
            for p in kube.list("v1", "Pod", labels={"batch.kubernetes.io/job-name": "sleeper"})
        ),
        timeout=60,
    )
    kube.delete("batch/v1", "Job", "sleeper", propagation_policy="Foreground")
    # the garbage collector deletes the pod; the kubelet stops it and confirms the deletion
    kube.wait_for(lambda: kube.get("batch/v1", "Job", "sleeper") is None, timeout=60)
    assert kube.list("v1", "Pod", labels={"batch.kubernetes.io/job-name": "sleeper"}) == []


def test_a_script_that_raises_fails_its_container_not_the_kubelet(
    kube: KubeAPI, node: Kubelet
) -> None:
    """A scripted step whose ``before`` raises (its test's store already gone, as when a pod of
    an ended test runs late) is a container that failed, as a real kubelet reports a process
    that crashed: the Job fails with the error, and the kubelet goes on; before, the
    container's thread died, the pod never ended and the session's teardown failed."""

    def broken(_: dict[str, Any]) -> None:
        raise ConnectionRefusedError("the test's store is gone")

    node.script("broken", Succeed(before=broken))
    errors_before = len(node.errors)
    kube.create(job("broken", "print('never runs')"))
    failed = kube.wait_for(lambda: condition(kube.get("batch/v1", "Job", "broken"), "Failed"),
                           timeout=60)  # fmt: skip
    assert failed["reason"] == "BackoffLimitExceeded"
    (pod,) = kube.list("v1", "Pod", labels={"batch.kubernetes.io/job-name": "broken"})
    ended = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert ended["exitCode"] == 1 and ended["reason"] == "Error"
    assert "ConnectionRefusedError: the test's store is gone" in ended["message"]
    assert len(node.errors) == errors_before


def test_a_deployment_becomes_available(kube: KubeAPI, node: Kubelet) -> None:
    labels = {"app": "srv"}
    container = {"name": "srv", "image": "srv:1", "command": ["sleep", "600"]}
    kube.create(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "srv"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [container]},
                },
            },
        }
    )
    kube.wait_for(
        lambda: (
            ((kube.get("apps/v1", "Deployment", "srv") or {}).get("status") or {}).get(
                "availableReplicas"
            )
            == 2
        ),
        timeout=60,
    )


def test_a_pod_asking_for_gpus_stays_pending(kube: KubeAPI, node: Kubelet) -> None:
    body = job("gpu", "print(1)", container={"resources": {"limits": {"nvidia.com/gpu": 8}}})
    kube.create(body)

    def unschedulable() -> dict[str, Any] | None:
        for pod in kube.list("v1", "Pod", labels={"batch.kubernetes.io/job-name": "gpu"}):
            for cond in (pod.get("status") or {}).get("conditions") or []:
                if cond["type"] == "PodScheduled" and cond["status"] == "False":
                    return dict(cond)
        return None

    cond = kube.wait_for(unschedulable, timeout=60)
    assert cond["reason"] == "Unschedulable" and "nvidia.com/gpu" in cond["message"]


def test_every_container_of_a_pod_is_reported_running_and_the_pod_ready(
    kube: KubeAPI, node: Kubelet
) -> None:
    """Containers start on threads of their own and each reports the pod's status: the last
    report sent must be the newest state (a stale one, sent last, left a serving pod with a
    sidecar 'ContainerCreating' for good, never Ready)."""
    containers = [{"name": f"c{i}", "image": "srv:1", "command": ["sleep", "600"]}
                  for i in range(6)]  # fmt: skip
    for n in range(4):
        kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"multi-{n}"},
                     "spec": {"containers": containers}})  # fmt: skip

    def ready() -> bool:
        for n in range(4):
            status = (kube.get("v1", "Pod", f"multi-{n}") or {}).get("status") or {}
            states = [s.get("state") or {} for s in status.get("containerStatuses") or []]
            if len(states) != 6 or not all("running" in s for s in states):
                return False
            if not condition({"status": status}, "Ready"):
                return False
        return True

    kube.wait_for(ready, timeout=60, message=lambda: str(
        [(kube.get("v1", "Pod", f"multi-{n}") or {}).get("status") for n in range(4)]
    ))  # fmt: skip


def test_a_status_report_the_server_fails_is_sent_again(
    kube: KubeAPI, node: Kubelet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy API server times out or answers 503 to a status report: the kubelet sends it
    again. Dropped, the last report of a pod whose containers all started was lost with the
    thread that sent it, and the pod stayed 'ContainerCreating' for good (a CI run at load)."""
    real = node.cp.request
    faults = iter([TimeoutError("timed out"), "503", TimeoutError("timed out"), "429"])

    def flaky(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        if method == "PATCH" and path.endswith("/pods/flaky/status"):
            fault = next(faults, None)
            if isinstance(fault, Exception):
                raise fault
            if fault is not None:
                raise urllib.error.HTTPError(path, int(fault), "busy", {}, None)  # type: ignore[arg-type]
        return real(method, path, *args, **kwargs)

    monkeypatch.setattr(node.cp, "request", flaky)
    kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "flaky"},
                 "spec": {"containers": [{"name": "c", "image": "srv:1",
                                          "command": ["sleep", "600"]}]}})  # fmt: skip
    kube.wait_for(
        lambda: condition(kube.get("v1", "Pod", "flaky"), "Ready"),
        timeout=60,
        message=lambda: str((kube.get("v1", "Pod", "flaky") or {}).get("status")),
    )
    assert next(faults, None) is None, "every fault was met"
    assert not node.errors
