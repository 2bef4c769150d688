"""A pod's volumes as the kubelet stand-in writes them (rtrl_localkube.podvolumes)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from rtrl_localkube.podvolumes import PodSources

DATA = {"ca.crt": "-----BEGIN CERTIFICATE-----\n" + "A" * 4000, "namespace": "default"}
POD = {
    "metadata": {"name": "multi", "namespace": "default"},
    "spec": {
        "volumes": [
            {"name": "kube-api-access", "projected": {"defaultMode": 0o444, "sources": [
                {"serviceAccountToken": {"path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt"}},
            ]}},
        ],
    },
}  # fmt: skip
CONTAINER = {"name": "c", "volumeMounts": [{"name": "kube-api-access", "mountPath": "/var/run"}]}


def test_the_containers_of_one_pod_write_its_volumes_at_once_and_read_them_whole(
    tmp_path: Path,
) -> None:
    """Each container of a pod starts on its own thread and writes the pod's volumes. Written
    in place (unlink, write, chmod), one container's chmod met the file another had just
    unlinked (FileNotFoundError: the container's thread died, its pod never Ready, in CI),
    and a reader could see a file half-written."""
    sources = PodSources(
        read=lambda kind, namespace, name: {"data": DATA},
        work_dir=tmp_path,
        extra_env={},
        token=lambda pod, audience, seconds: "t" * 900,
    )
    errors: list[BaseException] = []
    torn: list[int] = []
    done = threading.Event()
    root = tmp_path / "pod"

    def container() -> None:
        try:
            for _ in range(150):
                sources.volumes(POD, CONTAINER, root)
        except BaseException as exc:
            errors.append(exc)

    def reader() -> None:
        path = root / "volumes" / "kube-api-access" / "ca.crt"
        while not done.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            if text != DATA["ca.crt"]:
                torn.append(len(text))

    threads = [threading.Thread(target=container) for _ in range(6)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads take turns often: the race shows in a second
    try:
        watcher = threading.Thread(target=reader)
        watcher.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        done.set()
        watcher.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == [] and torn == []
    files = sorted(p.name for p in (root / "volumes" / "kube-api-access").iterdir())
    assert files == ["ca.crt", "namespace", "token"]  # no temporary file left behind
    mode = (root / "volumes" / "kube-api-access" / "token").stat().st_mode & 0o777
    assert mode == 0o444
