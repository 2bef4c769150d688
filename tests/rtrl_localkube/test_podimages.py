"""What an image is on the kubelet stand-in's machine, and the API from inside a pod: the
chart's operator Deployment gives no command (its image's entrypoint is ``rtrl operator``)
and reads the API as its ServiceAccount through in-cluster configuration, which the
stand-in gives as a kubeconfig naming the pod's own token and CA files."""

from __future__ import annotations

from pathlib import Path

import kubernetes

from rtrl_localkube.podimages import entrypoint, is_vllm_image
from rtrl_localkube.podvolumes import SERVICE_ACCOUNT_DIR, in_cluster_kubeconfig


def test_the_operator_image_runs_rtrl_operator_and_no_other_gets_an_entrypoint() -> None:
    for image in ("registry.example.com/rtrl-operator:0.1.0", "ghcr.io/rtrl/rtrl-operator",
                  "rtrl-operator:test", "r.io/rtrl-operator@sha256:0123"):  # fmt: skip
        assert entrypoint(image) == ["rtrl", "operator"], image
    for image in ("registry.example.com/rtrl-trainer:0.1.0", "rtrl-operator-fork:1",
                  "vllm/vllm-openai:v0.32.0", "python:3.11"):  # fmt: skip
        assert entrypoint(image) == [], image
    assert is_vllm_image("vllm/vllm-openai:v0.32.0") and not is_vllm_image("rtrl-operator")


def test_a_pod_with_its_token_mounted_gets_a_kubeconfig_for_it(tmp_path: Path) -> None:
    volume = tmp_path / "volumes" / "kube-api-access-x"
    volume.mkdir(parents=True)
    (volume / "token").write_text("the-pods-token")
    (volume / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    mounts = [("/etc/config", str(tmp_path / "volumes" / "config")),
              (SERVICE_ACCOUNT_DIR, str(volume))]  # fmt: skip
    config_file = in_cluster_kubeconfig("https://127.0.0.1:6443", mounts)
    assert config_file is not None and config_file.parent == volume.parent
    # what the operator's client and kopf read it as
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(str(config_file), client_configuration=configuration)
    assert configuration.host == "https://127.0.0.1:6443"
    assert configuration.ssl_ca_cert == str(volume / "ca.crt")
    assert configuration.get_api_key_with_prefix("BearerToken") == "Bearer the-pods-token"
    # no token mounted (automountServiceAccountToken: false), or no API server: nothing
    assert in_cluster_kubeconfig("https://127.0.0.1:6443", mounts[:1]) is None
    assert in_cluster_kubeconfig("", mounts) is None
