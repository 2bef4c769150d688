"""rtrl: a Kubernetes operator for real-time reinforcement learning of a served coding model.

Layering: handlers -> kube -> planning -> core.api, each importing only to its right;
``rtrl.core`` is what the Job side (``rtrl_trainer``) shares with the operator. The map of
every room and who may import whom is docs/architecture.md (checked by
tests/test_architecture.py).
"""

__version__ = "0.1.0"
