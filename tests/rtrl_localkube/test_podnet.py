"""The kubelet stand-in's pod network (``src/rtrl_localkube/podnet.py``): a pod's hosts file
follows the EndpointSlices it is fed, a real process in the pod's mount namespace resolves
its peers by name (and nothing else), and a Job's pods share one rendezvous port."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rtrl_localkube.podnet import PodNetwork, pod_names


def _pod(name: str, index: int, *, job_uid: str = "job-uid-1") -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"{name}-{index}-abcde",
            "namespace": "ns",
            "uid": f"pod-uid-{name}-{index}",
            "labels": {"batch.kubernetes.io/controller-uid": job_uid},
        },
        "spec": {"hostname": f"{name}-{index}", "subdomain": "svc"},
    }


def _slice(name: str, hostnames: list[str], service: str = "svc") -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "labels": {"kubernetes.io/service-name": service},
        },
        "endpoints": [{"hostname": h, "addresses": ["10.244.0.9"]} for h in hostnames],
    }


@pytest.fixture
def network() -> PodNetwork:
    net = PodNetwork(server=None)  # type: ignore[arg-type]  # the watch is never started
    net.resolves = True
    return net


def test_the_hosts_file_follows_the_services_endpoint_slices(
    network: PodNetwork, tmp_path: Path
) -> None:
    pod = _pod("train-0", 1)
    argv = network.wrap(pod, ["python"], tmp_path)
    hosts = tmp_path / "etc-hosts"
    assert argv[-2:] == [os.fspath(hosts), "python"] and "--mount" in argv
    inode = hosts.stat().st_ino
    own = "train-0-1.svc.ns.svc.cluster.local\ttrain-0-1"
    assert own in hosts.read_text() and "train-0-0" not in hosts.read_text().replace(own, "")

    network._feed("EndpointSlice", "ADDED", _slice("svc-a", ["train-0-0", "train-0-1"]))
    network._feed("EndpointSlice", "ADDED", _slice("other-a", ["x-0"], service="other"))
    text = hosts.read_text()
    assert "127.0.0.1\t" + " ".join(pod_names("train-0-0", "svc", "ns")) in text
    assert "train-0-0.svc\n" in text and "x-0" not in text
    assert hosts.stat().st_ino == inode  # rewritten in place: it is bind-mounted

    network._feed("EndpointSlice", "DELETED", _slice("svc-a", []))
    assert "train-0-0" not in hosts.read_text()
    network.release(pod)
    network._feed("EndpointSlice", "ADDED", _slice("svc-a", ["train-0-0"]))
    assert "train-0-0" not in hosts.read_text()  # a finished pod's file is left alone


def test_a_job_gets_one_rendezvous_port_of_its_own(network: PodNetwork) -> None:
    env = {"MASTER_PORT": "29500", "OTHER": "1"}
    first = [network.env(_pod("a", i), env)["MASTER_PORT"] for i in (0, 1)]
    second = network.env(_pod("b", 0, job_uid="job-uid-2"), env)["MASTER_PORT"]
    assert first[0] == first[1] != second and "29500" not in (first[0], second)
    assert network.env(_pod("a", 0), {"OTHER": "1"}) == {"OTHER": "1"}


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")
def test_a_process_in_the_pod_resolves_its_peers_by_name_only(
    network: PodNetwork, tmp_path: Path
) -> None:
    network._feed("EndpointSlice", "ADDED", _slice("svc-a", ["train-0-0"]))
    script = (
        "import socket, sys\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        print(name, socket.gethostbyname(name))\n"
        "    except OSError:\n"
        "        print(name, None)\n"
    )
    names = ["train-0-0.svc", "train-0-0.svc.ns.svc.cluster.local", "train-0-1", "train-0-7.svc"]
    argv = network.wrap(_pod("train-0", 1), [sys.executable, "-c", script, *names], tmp_path)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split("\n")[:4] == [
        "train-0-0.svc 127.0.0.1",
        "train-0-0.svc.ns.svc.cluster.local 127.0.0.1",
        "train-0-1 127.0.0.1",  # its own hostname, as a kubelet writes it
        "train-0-7.svc None",  # no endpoint has that hostname
    ]
    assert "train-0-0.svc" not in Path("/etc/hosts").read_text()  # the host's is untouched


def _serving(name: str, ports: dict[str, list[int]]) -> dict[str, Any]:
    """A serving pod (no Job) whose containers declare ``ports``."""
    containers = [
        {"name": c, "ports": [{"name": f"{c}-{p}", "containerPort": p} for p in ps]}
        for c, ps in ports.items()
    ]
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
            "spec": {"containers": containers}}  # fmt: skip


def test_two_pods_declaring_one_port_get_two_host_ports(network: PodNetwork) -> None:
    stable = _serving("stable", {"engine": [8000], "sidecar": [8081]})
    canary = _serving("canary", {"engine": [8000], "sidecar": [8081]})
    first = network.host_ports(stable)
    second = network.host_ports(canary)
    assert set(first) == set(second) == {8000, 8081}
    assert not set(first.values()) & set(second.values())
    assert network.host_ports(stable) == first  # kept for the pod's life
    assert network.host_port(canary, "sidecar-8081") == second[8081]  # by the port's name
    with pytest.raises(KeyError, match="no port named 'nope'"):
        network.host_port(canary, "nope")
    network.release(stable)
    again = network.host_ports(_serving("stable-2", {"engine": [8000]}))
    assert again[8000] not in second.values()


def test_a_moved_port_is_rewritten_where_the_pod_names_it(network: PodNetwork) -> None:
    network.host_ports(_serving("first", {"engine": [8000], "sidecar": [8081]}))
    pod = _serving("second", {"engine": [8000], "sidecar": [8081]})
    moved = network.host_ports(pod)
    engine, sidecar = str(moved[8000]), str(moved[8081])
    assert "8000" not in (engine, sidecar) and "8081" not in (engine, sidecar)
    argv = ["python3", "-m", "server", "--port=8000", "--metrics-port", "8081", "--workers", "8000",
            "--host=0.0.0.0", "--url=http://127.0.0.1:8000/v1"]  # fmt: skip
    assert network.args(pod, argv) == [
        "python3", "-m", "server", f"--port={engine}", "--metrics-port", sidecar,
        "--workers", "8000",  # not a port flag
        "--host=0.0.0.0", f"--url=http://127.0.0.1:{engine}/v1",
    ]  # fmt: skip
    env = {
        "RTRL_CAPTURE_LISTEN": "0.0.0.0:8081",
        "RTRL_CAPTURE_ENGINE": "http://127.0.0.1:8000",
        "ENGINE_PORT": "8000",
        "REPLICAS": "8000",  # not a port variable
        "REMOTE": "http://other-host:8000",  # not this machine's
        "WIDE": "[::]:8081",
    }
    assert network.env(pod, env) == {
        "RTRL_CAPTURE_LISTEN": f"0.0.0.0:{sidecar}",
        "RTRL_CAPTURE_ENGINE": f"http://127.0.0.1:{engine}",
        "ENGINE_PORT": engine,
        "REPLICAS": "8000",
        "REMOTE": "http://other-host:8000",
        "WIDE": f"[::]:{sidecar}",
    }


def test_a_pod_alone_on_its_ports_keeps_them_and_its_args(network: PodNetwork) -> None:
    import socket

    with socket.socket() as probe:  # a port nobody holds now
        probe.bind(("0.0.0.0", 0))
        port = probe.getsockname()[1]
    pod = _serving("alone", {"engine": [port]})
    assert network.host_ports(pod) == {port: port}
    argv = ["serve", f"--port={port}"]
    assert network.args(pod, argv) == argv
    assert network.env(pod, {"URL": f"http://127.0.0.1:{port}"}) == {
        "URL": f"http://127.0.0.1:{port}"
    }


def test_a_pods_containers_run_with_their_host_ports_and_are_probed_there(
    network: PodNetwork,
) -> None:
    network.host_ports(_serving("first", {"engine": [8000]}))
    pod = _serving("second", {"engine": [8000]})
    engine = pod["spec"]["containers"][0]
    engine["readinessProbe"] = {"httpGet": {"path": "/health", "port": "engine-8000"}}
    engine["livenessProbe"] = {"tcpSocket": {"port": 8000}}
    host = network.host_port(pod, 8000)
    mapped = network.container(pod, engine)
    assert mapped["ports"] == [{"name": "engine-8000", "containerPort": host}]
    assert mapped["readinessProbe"]["httpGet"]["port"] == "engine-8000"  # by name: the port
    assert mapped["livenessProbe"]["tcpSocket"]["port"] == host
    assert engine["ports"][0]["containerPort"] == 8000  # the pod's own spec is untouched
