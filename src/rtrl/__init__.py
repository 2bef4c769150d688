"""rtrl: a Kubernetes operator for real-time reinforcement learning of a served coding model.

Layering (see DESIGN.md): handlers -> kube -> planning -> api, each importing only to its
right. ``rtrl.core.store`` and ``rtrl.core.shards`` are I/O libraries shared with the Job side
(``rtrl_trainer``); ``rtrl.cli`` is the command line.
"""

__version__ = "0.1.0"
