"""One whole cycle with the real steps: the operator (kopf, ``rtrl.handlers``) creates the
stage, train and eval Jobs, and the job runner executes their containers' ``rtrl-job``
commands on this machine (CPU DeepSpeed, a tiny GPT-2, a ``file://`` store), mounts and env
as the pod templates say. The cycle must end Evaluated or Rejected with every summary in
the Checkpoint's status, read back from the steps' own result documents."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kopf.testing
import pytest
from tests.integration.conftest import KubeAPI
from tests.integration.cycle_world import NAME, RTRL, base_checkpoint, deployment, rlcycle
from tests.integration.job_runner import JobRunner
from tests.trainer.trainset import VOCAB, save_parent, tiny_gpt2

from rtrl import handlers
from rtrl.api.checkpoint import Checkpoint
from rtrl.shards import synthetic_interactions, write_shards
from rtrl.store import open_store

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def operator(
    kube_api: KubeAPI, deployment_controller: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    monkeypatch.setenv("RTRL_RESYNC_SECONDS", "1")
    args = ["run", "--standalone", "--namespace", kube_api.namespace]
    with kopf.testing.KopfRunner(args, timeout=60, registry=handlers.registry) as runner:
        yield runner
    assert runner.exception is None, runner.output


def test_a_cycle_with_the_real_steps_on_cpu(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    # Interactions the base model served over the last three hours, matured by now.
    write_shards(
        synthetic_interactions(
            240, seed=3, checkpoint_id="composer-0", tokens=12, prompt_tokens=(4, 12),
            vocab_size=VOCAB, start=datetime.now(UTC) - timedelta(hours=4),
            duration=timedelta(hours=2),
        ),
        root / "interactions",
    )  # fmt: skip
    save_parent(
        open_store(root.as_uri() + "/"), "models/base", tiny_gpt2(seed=1), tmp_path,
        tokenizer_size=250,
    )  # fmt: skip
    kube_api.create(deployment(root))
    kube_api.create(base_checkpoint(root))
    spec = rlcycle(root)["spec"]
    spec["data"].update(
        shards=(root / "interactions").as_uri() + "/",
        minInteractions=50,
        minTokens=100,
        window="24h",
        maxBadFraction=0.05,
    )
    spec["training"].update(
        precision="fp32", zeroStage=0, learningRate=1e-3, batchTokens=512,
        microBatchSize=8, maxSequenceLength=64, activationCheckpointing=False,
    )  # fmt: skip
    spec["eval"] = {"suites": ["replay"], "gates": [{"metric": "replay.kl", "maxRegression": 5}]}
    kube_api.create(rlcycle(root, **spec))

    def phase() -> str | None:
        return ((kube_api.get(RTRL, "Checkpoint", "composer-1") or {}).get("status") or {}).get(
            "phase"
        )

    def logs() -> str:
        return "\n".join(f"--- {job}\n{job_runner.logs(job)}" for job in job_runner.jobs_seen)

    def judged() -> bool:
        status = (kube_api.get(RTRL, "Checkpoint", "composer-1") or {}).get("status") or {}
        return bool((status.get("rollout") or [{}])[0].get("analyses"))

    # Eval passes or rejects; after a pass, the canary runs and the real analysis step
    # judges it (nobody is served by the canary here, so its verdict is to wait).
    kube_api.wait_for(
        lambda: phase() in ("Rejected", "Failed", "RolledBack") or judged(),
        timeout=240,
        message=logs,
    )
    ck = kube_api.get(RTRL, "Checkpoint", "composer-1")
    assert ck is not None and phase() in ("Canary", "Rejected"), (ck.get("status"), logs())
    Checkpoint.model_validate(ck)
    status = ck["status"]
    assert status["data"]["interactions"] >= 50 and status["data"]["onPolicyFraction"] == 1.0
    assert status["training"]["steps"] >= 1 and status["training"]["tokens"] > 0
    assert status["eval"]["gates"][0]["metric"] == "replay.kl"
    assert job_runner.jobs_seen[:3] == [
        "composer-1-stage-0", "composer-1-train-0", "composer-1-eval-0"
    ]  # fmt: skip
    if phase() == "Canary":
        record = status["rollout"][0]
        assert record["decision"] == "continue" and record["canarySamples"] == 0
        assert "composer-1-analyze-0-0" in job_runner.jobs_seen
    # the trained checkpoint is committed where the Checkpoint says
    model = open_store(ck["spec"]["uri"])
    assert model.committed("") is not None and model.exists("model.safetensors")
    rlc_phase = (kube_api.get(RTRL, "RLCycle", NAME) or {}).get("status", {}).get("phase")
    assert rlc_phase in ("Canary", "Idle")
