"""Exactly-once data across cycles: the operator's real decisions (``plan`` on the in-memory
cluster of ``rtrl_localkube``), the real stage step on real Parquet shards, and users who keep
interacting with whatever serves while the cycles run, with feedback that arrives late.

Four cycles: promoted, rolled back, promoted, promoted. Along the lineage that serves
(base -> 1 -> 3 -> 4), each interaction is trained on at most once, every interaction of a
cycle's parent that became ready in the cycle's interval is staged (trained or held out), and
the interactions a rolled-back candidate trained on are staged again by the next cycle from
the same parent. Before the operator passed ``--since`` (the watermark), cycle 4 re-admitted
rows of checkpoint 1 that cycle 3 had trained on.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tests.rtrl_trainer.helpers import rows, training_set

from rtrl.core.api import names
from rtrl.core.shards import write_shards
from rtrl.core.store import open_store
from rtrl.planning import plan
from rtrl.planning.manifests.canary import env_value
from rtrl.planning.timeutil import parse_time
from rtrl_localkube.cluster import LocalCluster
from rtrl_localkube.cycle_world import (
    ANALYSIS_PROMOTE,
    ANALYSIS_ROLLBACK,
    EVAL_PASS,
    NAME,
    TRAIN_OK,
    arg,
    base_checkpoint,
    base_uri,
    commit_result,
    deployment,
    rlcycle,
)
from rtrl_trainer.cli import main as rtrl_job
from rtrl_trainer.stagedset import HELDOUT_NAME

T0 = datetime(2026, 3, 2, 0, 0, tzinfo=UTC)
TICK = timedelta(minutes=30)
PER_TICK = 24  # interactions per tick, split between the arms by the canary's share
# Feedback delays: most within minutes, some hours late (ready only in a later cycle).
DELAYS = [timedelta(minutes=10)] * 6 + [timedelta(hours=3), timedelta(hours=7)]
TARGET = "composer-vllm"
CONTAINER = "vllm"
DECISIONS = {1: ANALYSIS_PROMOTE, 2: ANALYSIS_ROLLBACK, 3: ANALYSIS_PROMOTE, 4: ANALYSIS_PROMOTE}
MODEL_CONFIG = {"model_type": "llama", "vocab_size": 64}


class World:
    """The namespace, the users, and the Jobs run as the kubelet would run them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.now = T0
        self.cluster = LocalCluster(T0)
        self.shards = root / "shards"
        self.shards.mkdir()
        self.ticks = 0
        self.produced: dict[str, dict[str, Any]] = {}  # interaction id -> checkpoint, ready at
        put_model(base_uri(root))
        self.cluster.create(in_namespace(deployment(root)))
        self.cluster.create(in_namespace(base_checkpoint(root)))
        data = {
            "shards": self.shards.as_uri() + "/",
            "maturity": "1h",
            "window": "7d",
            "minInteractions": 1,
            "minTokens": 1,
            "maxOffPolicyFraction": 0.1,
            "maxBadFraction": 0.5,
        }
        self.cluster.create(in_namespace(rlcycle(root, data=data, schedule={"interval": "4h"})))
        self.cluster.settle()

    # --- the users ---------------------------------------------------------------------
    def arms(self) -> list[tuple[str, int]]:
        target = self.cluster.get("Deployment", TARGET)
        canary = self.cluster.get("Deployment", f"{TARGET}-canary")
        stable = str(env_value(target, CONTAINER, "RTRL_CHECKPOINT_ID"))
        if canary is None:
            return [(stable, PER_TICK)]
        n_canary = int(canary["spec"].get("replicas", 1))
        n_stable = int(target["spec"].get("replicas", 1)) if target else 1
        share = max(1, round(PER_TICK * n_canary / (n_stable + n_canary)))
        return [
            (stable, PER_TICK - share),
            (str(env_value(canary, CONTAINER, "RTRL_CHECKPOINT_ID")), share),
        ]

    def serve_tick(self) -> None:
        """One tick of users on what is deployed now; then the clock moves on."""
        tables = []
        for checkpoint, n in self.arms():
            ids = [f"t{self.ticks:03d}-{checkpoint}-{i:02d}" for i in range(n)]
            created = [self.now + TICK * i / n for i in range(n)]
            feedback = [c + DELAYS[i % len(DELAYS)] for i, c in enumerate(created)]
            for id_, c, f in zip(ids, created, feedback, strict=True):
                ready = max(c + timedelta(hours=1), f)
                self.produced[id_] = {"checkpoint": checkpoint, "created": c, "ready": ready}
            tables.append(
                rows(
                    n,
                    interaction_id=ids,
                    checkpoint_id=checkpoint,
                    created_at=created,
                    feedback_at=feedback,
                    user_id=[f"u{i}" for i in range(n)],
                    edit_persisted=[float(i % 2) for i in range(n)],
                )
            )
        with tempfile.TemporaryDirectory() as tmp:
            for key in write_shards(pa.concat_tables(tables), tmp):
                target = self.shards / key.replace("/part-", f"/part-{self.ticks:03d}-")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(Path(tmp) / key, target)
        self.ticks += 1
        self.now += TICK
        self.cluster.now = self.now

    # --- the operator and the kubelet -----------------------------------------------------
    def reconcile(self) -> None:
        for _ in range(50):
            decided = plan(self.cluster.observe(NAME), self.now)
            self.cluster.apply(decided.actions)
            self.cluster.patch_status("RLCycle", NAME, decided.status)
            self.cluster.settle()
            ran = self.run_jobs()
            if not decided.actions and not ran and decided.requeue_after != 0:
                return

    def run_jobs(self) -> bool:
        jobs = self.cluster.pending_jobs()
        for job in jobs:
            step = job["metadata"]["labels"][names.LABEL_STEP].split("-")[0]
            if step == "stage":
                self.stage(job)
            else:
                scratch = self.root / "results"
                if step == "train":
                    put_model(arg(job, "out"))
                    doc = TRAIN_OK
                elif step == "eval":
                    doc = EVAL_PASS
                else:
                    doc = DECISIONS[self.cycle_of(job)]
                commit_result(step, doc, scratch)(job)
            self.cluster.finish_job(job["metadata"]["name"], succeeded=True)
        return bool(jobs)

    def stage(self, job: dict[str, Any]) -> None:
        """The stage Job's own arguments, run by the real ``rtrl-job stage``: only the
        mounts (its config file, its scratch) are local paths here."""
        config_map = self.cluster.get(
            "ConfigMap", job["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"]
        )
        assert config_map is not None
        config = self.root / f"{job['metadata']['name']}.json"
        config.write_text(next(iter(config_map["data"].values())))
        work = self.root / "scratch" / job["metadata"]["name"]
        work.mkdir(parents=True)
        local = {"--config": f"--config={config}", "--work-dir": f"--work-dir={work}"}
        args = [
            local.get(a.split("=", 1)[0], a)
            for a in job["spec"]["template"]["spec"]["containers"][0]["args"]
        ]
        # The checkpoints here are a config.json only, the log-probs synthetic: no
        # fidelity gate (it would load the serving weights).
        assert rtrl_job([*args, "--fidelity-sample-rows=0"]) == 0, args

    def cycle_of(self, job: dict[str, Any]) -> int:
        ck = self.cluster.get("Checkpoint", job["metadata"]["labels"][names.LABEL_CHECKPOINT])
        assert ck is not None
        return int(ck["spec"]["cycle"])

    def checkpoints(self) -> list[dict[str, Any]]:
        owned = [c for c in self.cluster.list_objects("Checkpoint") if c["spec"].get("rlCycle")]
        return sorted(owned, key=lambda c: int(c["spec"]["cycle"]))


def in_namespace(doc: dict[str, Any]) -> dict[str, Any]:
    doc["metadata"]["namespace"] = "default"
    return doc


def put_model(uri: str) -> None:
    """The checkpoint's config.json, which the stage reads the vocabulary from."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(MODEL_CONFIG))
        open_store(uri).put_file("config.json", path)


def staged(ck: dict[str, Any]) -> tuple[set[str], set[str], dict[str, Any]]:
    """(trained ids, held-out ids, stage.json) of a Checkpoint's stage."""
    out = Path(ck["status"]["data"]["manifest"].removeprefix("file://"))
    doc = json.loads((out / "stage.json").read_text())
    trained = set(training_set(out).column("interaction_id").to_pylist())
    heldout_file = out / HELDOUT_NAME
    heldout = (
        set(pq.read_table(heldout_file).column("interaction_id").to_pylist())
        if heldout_file.exists()
        else set()
    )
    return trained, heldout, doc


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("exactly-once"))
    for _ in range(4):  # a history before the first cycle
        w.serve_tick()
    for _ in range(200):
        w.reconcile()
        finished = [
            c
            for c in w.checkpoints()
            if c["status"].get("phase") in ("Promoted", "Superseded", "RolledBack")
        ]
        if len(finished) == 4:
            break
        w.serve_tick()
    else:
        phases = [(c["metadata"]["name"], c["status"].get("phase")) for c in w.checkpoints()]
        pytest.fail(f"4 cycles did not finish: {phases}")
    yield w


def test_the_four_cycles_went_as_scripted(world: World) -> None:
    phases = [
        (c["spec"]["cycle"], c["spec"]["parent"], c["status"]["phase"]) for c in world.checkpoints()
    ]
    assert phases == [
        (1, "composer-0", "Superseded"),
        (2, "composer-1", "RolledBack"),
        (3, "composer-1", "Superseded"),
        (4, "composer-3", "Promoted"),
    ]


def test_the_watermark_is_the_serving_lineage_s_and_is_passed_to_stage(world: World) -> None:
    by_cycle = {int(c["spec"]["cycle"]): c for c in world.checkpoints()}
    started = {
        k: c["metadata"]["annotations"][names.ANNOTATION_STARTED] for k, c in by_cycle.items()
    }
    since = {
        k: c["metadata"]["annotations"].get(names.ANNOTATION_DATA_SINCE)
        for k, c in by_cycle.items()
    }
    # base: none; 2 and 3 both from composer-1 (2 was rolled back: its data is returned)
    assert since == {1: None, 2: started[1], 3: started[1], 4: started[3]}
    for k, ck in by_cycle.items():
        _, _, doc = staged(ck)
        assert doc["since"] == since[k] and doc["next_since"] == started[k]
        data = ck["status"]["data"]
        assert data.get("since") == since[k] and data["until"] == started[k]
    status = world.cluster.get("RLCycle", NAME)["status"]  # type: ignore[index]
    assert status["serving"] == "composer-4"
    assert status["dataWatermark"] == started[4]


def test_each_interaction_is_trained_on_at_most_once_along_the_lineage(world: World) -> None:
    lineage = [c for c in world.checkpoints() if c["status"]["phase"] != "RolledBack"]
    seen: dict[str, str] = {}
    for ck in lineage:
        trained, heldout, _ = staged(ck)
        assert not trained & heldout
        for id_ in trained | heldout:
            assert id_ not in seen, (
                f"{id_} staged by {seen[id_]} and again by {ck['metadata']['name']}"
            )
            seen[id_] = ck["metadata"]["name"]
    rolled_back = [
        c["metadata"]["name"] for c in world.checkpoints() if c["status"]["phase"] == "RolledBack"
    ]
    # the rolled-back candidate's own interactions (its canary's) are never trained on
    assert rolled_back == ["composer-2"]
    assert not any(world.produced[i]["checkpoint"] == "composer-2" for i in seen)
    assert any(p["checkpoint"] == "composer-2" for p in world.produced.values())


def test_every_ready_interaction_of_the_parent_is_staged_once(world: World) -> None:
    """On-policy rows: all of them, in the cycle in which they became ready (however late
    their feedback); a rolled-back candidate's set is staged again by the next cycle."""
    by_cycle = {int(c["spec"]["cycle"]): c for c in world.checkpoints()}
    for k, ck in by_cycle.items():
        trained, heldout, doc = staged(ck)
        since = parse_time(doc["since"]) or datetime.min.replace(tzinfo=UTC)
        until = parse_time(doc["next_since"])
        assert until is not None
        expected = {
            i
            for i, p in world.produced.items()
            if p["checkpoint"] == ck["spec"]["parent"] and since < p["ready"] <= until
        }
        assert expected, f"cycle {k} had no on-policy interactions to stage"
        assert expected <= trained | heldout, (
            f"cycle {k} missed {sorted(expected - trained - heldout)[:5]}"
        )
        if k > 1:  # some were created in an earlier interval; their feedback came late
            assert any(world.produced[i]["created"] <= since for i in expected)
    rolled_back, retried = staged(by_cycle[2]), staged(by_cycle[3])
    returned = (rolled_back[0] | rolled_back[1]) & {
        i for i, p in world.produced.items() if p["checkpoint"] == "composer-1"
    }
    assert returned and returned <= retried[0] | retried[1]
