"""rtrl: a Kubernetes operator for real-time reinforcement learning of a served coding model.

Layering: handlers -> kube -> planning -> core.api, each importing only to its right;
``rtrl.core`` is what the Job side (``rtrl_trainer``) shares with the operator. The map of
every room and who may import whom is docs/architecture.md (checked by
tests/test_architecture.py).
"""

from importlib import metadata

try:  # one version, the distribution's (pyproject.toml), for every CLI and the operator's log
    __version__ = metadata.version("rtrl")
except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
    __version__ = "0+unknown"
