"""A namespace in which an RLCycle can run for real on the real control plane: a base model and
the interactions it served in a ``file://`` store, the inference Deployment, the base
Checkpoint and the RLCycle of examples/rlcycle.yaml made small enough for one CPU (the
namespace of src/rtrl_localkube/cycle_world.py, with real data and a real model).

Users are the one stand-in: :func:`serve_arms` writes the interactions each arm of a canary
would have logged, with the canary's edit persistence shifted, as new shard files next to
the old ones (the way a logging pipeline appends them).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rtrl.core.shards import synthetic_interactions, write_shards
from rtrl.core.shards.schema import TIMESTAMP
from rtrl.core.store import ObjectStore, open_store
from rtrl.planning.timeutil import parse_time
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.cycle_world import RTRL, base_checkpoint, deployment, rlcycle
from tests.rtrl_trainer.trainset import VOCAB, save_parent, tiny_gpt2


def add_interactions(shards: Path | ObjectStore, batches: Any) -> None:
    """Write ``batches`` as shard files of a prefix of their own into the shard root
    ``shards``, next to what is there: the way a logging pipeline appends them."""
    write_shards(batches, shards, file_prefix=f"part-{uuid.uuid4().hex[:12]}")


def served(n: int = 240) -> Any:
    """``n`` interactions the base model served 4 to 2 hours ago, their feedback in."""
    return synthetic_interactions(
        n, seed=3, checkpoint_id="composer-0", tokens=12, prompt_tokens=(4, 12),
        vocab_size=VOCAB, start=datetime.now(UTC) - timedelta(hours=4),
        duration=timedelta(hours=2),
    )  # fmt: skip


def save_base_model(store: ObjectStore, prefix: str, tmp: Path, *, commit: bool = True) -> None:
    """The tiny model every cycle here trains from, under ``prefix`` of ``store``."""
    save_parent(store, prefix, tiny_gpt2(seed=1), tmp, tokenizer_size=250, commit=commit)


def small(spec: dict[str, Any], shards: str) -> dict[str, Any]:
    """An RLCycle spec made small enough for one CPU: a few hundred interactions from
    ``shards``, matured at once, a tiny model, the replay suite only, two canary steps of
    seconds. ``spec`` is changed in place and returned."""
    spec["data"].update(
        shards=shards, maturity="1s", window="24h", minInteractions=50,
        minTokens=100, maxBadFraction=0.05,
        # synthetic log-probs, not the model's: the fidelity gate would quarantine them
        fidelity={"sampleRows": 0},
    )  # fmt: skip
    spec["training"].update(
        precision="fp32", zeroStage=0, learningRate=1e-3, batchTokens=2048, microBatchSize=32,
        maxSequenceLength=64, activationCheckpointing=False,
    )  # fmt: skip
    spec["eval"] = {"suites": ["replay"], "gates": [{"metric": "replay.kl", "maxRegression": 5}]}
    spec["rollout"]["steps"] = [{"weight": 25, "minDuration": "2s"},
                                {"weight": 50, "minDuration": "2s"}]  # fmt: skip
    # a canary of seconds has no user 2 h past their first request in it: the novelty rule
    # (docs/analysis.md) would hold every promotion, so it is off here (null, which the
    # server keeps rather than defaulting it back to 2h)
    spec["rollout"]["analysis"].update(interval="2s", noveltyWindow=None)
    return spec


def set_up(kube: KubeAPI, root: Path, tmp: Path, **spec_changes: Any) -> dict[str, Any]:
    """The base model, 240 matured interactions it served, the Deployment, the base
    Checkpoint and the RLCycle (created last); returns the RLCycle as created."""
    interactions = root / "interactions"
    add_interactions(interactions, served())
    save_base_model(open_store(root.as_uri() + "/"), "models/base", tmp)
    kube.create(deployment(root))
    kube.create(base_checkpoint(root))
    spec = small(rlcycle(root)["spec"], interactions.as_uri() + "/")
    spec.update(spec_changes)
    return kube.create(rlcycle(root, **spec))


def serve_arms(
    shards: Path | ObjectStore,
    baseline: str,
    canary: str,
    *,
    since: datetime,
    n: int = 3000,
    canary_edit_persistence: float,
) -> None:
    """``n`` interactions of each arm created in the second after ``since``, their feedback
    arrived at once; the canary's edits persist with probability ``canary_edit_persistence``
    (the baseline's: about 0.5)."""
    for seed, checkpoint in enumerate((baseline, canary)):
        batch = pa.Table.from_batches(
            list(
                synthetic_interactions(
                    n, seed=100 + seed, checkpoint_id=checkpoint, tokens=12,
                    prompt_tokens=(4, 12), vocab_size=VOCAB, start=since,
                    duration=timedelta(seconds=1),
                )
            )
        )  # fmt: skip
        created = batch.column("created_at")
        feedback = pc.add(created, pa.scalar(100_000, pa.duration("us"))).cast(TIMESTAMP)
        batch = batch.set_column(batch.schema.get_field_index("feedback_at"), "feedback_at",
                                 feedback)  # fmt: skip
        if checkpoint == canary:
            rng = np.random.default_rng(7)
            persisted = (rng.random(n) < canary_edit_persistence).astype(np.float64)
            batch = batch.set_column(
                batch.schema.get_field_index("edit_persisted"),
                "edit_persisted",
                pa.array(persisted, pa.float64()),
            )
        else:
            rng = np.random.default_rng(8)
            persisted = (rng.random(n) < 0.5).astype(np.float64)
            batch = batch.set_column(
                batch.schema.get_field_index("edit_persisted"),
                "edit_persisted",
                pa.array(persisted, pa.float64()),
            )
        add_interactions(shards, batch.to_batches())


def checkpoint(kube: KubeAPI, name: str) -> dict[str, Any]:
    return kube.get(RTRL, "Checkpoint", name) or {}


def phase(kube: KubeAPI, name: str) -> str | None:
    return (checkpoint(kube, name).get("status") or {}).get("phase")


def canary_counted_from(kube: KubeAPI, name: str) -> Any:
    """When the canary's current step began to count: the analysis judges only interactions
    from the time the canary is ready at the step's weight (``readyAt``), not from when the
    step started, so the arms' users are written after it."""
    records = (checkpoint(kube, name).get("status") or {}).get("rollout") or []
    return parse_time(records[-1].get("readyAt")) if records else None
