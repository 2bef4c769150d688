"""The demo's last step: the base model against the checkpoint now serving, 50/50 for
``HEAD_TO_HEAD``, judged by ``rtrl-job analyze`` (the canary's always-valid test)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from rtrl.core.results import AnalysisResult, ResultError
from rtrl.core.store import read_committed_json
from rtrl.planning.manifests import capture as cap
from rtrl.planning.manifests.canary import CHECKPOINT_ID_ENV, env_value
from rtrl.planning.timeutil import iso
from rtrl_localkube.cluster import LocalCluster

from .pipeline import ServedArm
from .scenario import CONTAINER, DEPLOYMENT, HEAD_TO_HEAD, NAME, SEAL_LAG
from .summary import analysis_metrics


class Demo(Protocol):
    """What of the demo (``rtrl_demo.demo.Demo``) the head-to-head uses."""

    cluster: LocalCluster
    store: str
    work: Path

    def arm_of(self, checkpoint: str, uri: str, arm: str) -> ServedArm: ...
    def serve_tick(self, arms: tuple[ServedArm, ServedArm | None, float] | None = None) -> None: ...
    def seal(self, now: datetime | None = None) -> None: ...
    def job(self, argv: list[str], label: str, kind: str) -> None: ...


def head_to_head(self: Demo) -> dict[str, Any] | None:
    """The newcomer's question: is the model now serving better than the one we started
    from? Both serve half the users for ``HEAD_TO_HEAD``, then the canary analysis
    (``rtrl-job analyze``, the same always-valid test) compares them once every
    interaction has matured. None when nothing was promoted."""
    target = self.cluster.get("Deployment", DEPLOYMENT)
    final = str(env_value(target, CONTAINER, CHECKPOINT_ID_ENV))
    if final == "demo-0":
        return None
    # the base on the stable arm, the final checkpoint (serving now) on the canary's
    base = self.arm_of("demo-0", f"{self.store}models/demo-0/", cap.STABLE)
    arm = self.arm_of(final, str(env_value(target, CONTAINER, "MODEL_URI")), cap.CANARY)
    start = self.cluster.now
    while self.cluster.now < start + HEAD_TO_HEAD:
        self.serve_tick((base, arm, 0.5))
    spec = self.cluster.get("RLCycle", NAME)
    config = self.work / "rlcycle.json"
    config.write_text(json.dumps(spec))
    out = f"{self.store}head-to-head/{final}-vs-demo-0/"
    try:
        _head_to_head_job(self, out, final, start, config)
    except RuntimeError as exc:  # the demo's own extra: report it, keep the cycles
        return {"baseline": "demo-0", "canary": final, "error": str(exc)[:2000]}
    try:
        doc = AnalysisResult.read(read_committed_json(f"{out}{AnalysisResult.FILE}"))
    except ResultError as exc:
        return {"baseline": "demo-0", "canary": final, "error": str(exc)}
    return {
        "baseline": "demo-0",
        "canary": final,
        "since": iso(start),
        "baseline_samples": doc.baseline_samples,
        "canary_samples": doc.canary_samples,
        "metrics": analysis_metrics(doc),
    }


def _head_to_head_job(self: Demo, out: str, final: str, start: datetime, config: Path) -> None:
    # every hour of the head-to-head sealed: all its feedback final
    maturity = SEAL_LAG + timedelta(hours=1)
    self.seal(self.cluster.now + maturity)
    self.job(
        [
            "rtrl-job", "analyze", f"--shards={self.store}interactions/",
            "--baseline=demo-0", f"--canary={final}", f"--out={out}",
            "--canary-weight=50", f"--since={iso(start)}", f"--weight-since={iso(start)}",
            f"--config={config}", f"--now={iso(self.cluster.now + maturity)}",
        ],
        f"head-to-head {final} vs demo-0",
        "analyze",
    )  # fmt: skip
