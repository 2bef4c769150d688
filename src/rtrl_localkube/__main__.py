"""``python -m rtrl_localkube [DIR]``: the test control plane and its kubelet, kept running
for a developer to poke with kubectl, helm or ``rtrl operator`` until Ctrl-C.

    $ .venv/bin/python -m rtrl_localkube /tmp/rtrl-cluster
    export KUBECONFIG=/tmp/rtrl-cluster/admin.kubeconfig
"""

from __future__ import annotations

import contextlib
import signal
import sys
import tempfile
import threading
from pathlib import Path

from rtrl_localkube.controlplane import ControlPlane
from rtrl_localkube.controlplane_setup import binaries_dir
from rtrl_localkube.kubelet import Kubelet


def main(argv: list[str]) -> int:
    binaries = binaries_dir()
    if binaries is None:
        print("the control plane is not built: run `make controlplane`", file=sys.stderr)
        return 1
    root = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="rtrl-cluster-"))
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with ControlPlane(root, binaries) as cp, Kubelet(cp, root / "kubelet"):
        print(f"kube-apiserver {cp.version} at {cp.url}, ready in {cp.startup_seconds:.1f}s")
        print(f"export KUBECONFIG={cp.admin_kubeconfig}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            done.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
