"""Which program an image is on this machine (``src/rtrl_localkube/pods.py``): every image is
this checkout's environment, except vLLM's official image, which is the vLLM venv (``make
vllm``); and the entrypoint of rtrl's images whose pods give no ``command`` (the chart's
operator Deployment relies on its image's ``rtrl operator``, images/operator/Dockerfile)."""

from __future__ import annotations

import fnmatch

# vLLM's official image (docs/serving.md), with or without the registry's name in front
VLLM_IMAGES = ("vllm/vllm-openai:*", "vllm/vllm-openai@*", "*/vllm/vllm-openai:*",
               "*/vllm/vllm-openai@*", "vllm/vllm-openai")  # fmt: skip


# The entrypoints of rtrl's images whose pods give no command (the chart's operator).
ENTRYPOINTS = (
    (("*/rtrl-operator:*", "*/rtrl-operator@*", "*/rtrl-operator", "rtrl-operator:*",
      "rtrl-operator"), ("rtrl", "operator")),
)  # fmt: skip


def entrypoint(image: str) -> list[str]:
    """The entrypoint of ``image`` where it is one of rtrl's (:data:`ENTRYPOINTS`), else []."""
    for patterns, command in ENTRYPOINTS:
        if any(fnmatch.fnmatchcase(image, pattern) for pattern in patterns):
            return list(command)
    return []


def is_vllm_image(image: str) -> bool:
    return any(fnmatch.fnmatchcase(image, pattern) for pattern in VLLM_IMAGES)
