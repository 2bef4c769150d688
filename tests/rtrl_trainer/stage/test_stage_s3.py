"""End to end over real HTTP S3 (moto): shards written to a bucket, ``rtrl-job stage`` run
as a Job pod runs it (a subprocess, credentials and endpoint from the environment), and the
committed training set read back through the object store."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import uuid
from pathlib import Path

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rtrl.core.shards import INTERACTION_SCHEMA, synthetic_interactions, write_shards
from rtrl.core.store import open_store
from rtrl_trainer.stagedset import to_lists, with_advantages
from tests.conftest import REPO, console_script

SECRET = "s3cr3t-DO-NOT-LEAK-stage"


@pytest.fixture
def bucket(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket; dummy credentials and the endpoint in the environment, as in a pod."""
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_ROLE_ARN", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIASTAGETEST0000000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    name = f"stage-{uuid.uuid4().hex[:12]}"
    client = boto3.session.Session().client("s3", endpoint_url=moto_endpoint)
    client.create_bucket(Bucket=name)
    client.close()
    return name


def _rtrl_job(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script("rtrl-job"), *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ),
        timeout=120,
    )


def test_stage_in_s3_end_to_end(bucket: str, tmp_path: Path) -> None:
    shards = f"s3://{bucket}/interactions/composer/"
    out = f"s3://{bucket}/runs/composer/cycle-7/stage/"
    serving = synthetic_interactions(3000, seed=7, checkpoint_id="composer-7", tokens=8)
    write_shards(serving, open_store(shards), row_group_size=512)
    previous = synthetic_interactions(1000, seed=6, checkpoint_id="composer-6", tokens=8)
    write_shards(previous, open_store(shards), row_group_size=512)
    # A foreign team's broken upload next to the good files.
    open_store(shards).put_bytes(
        "checkpoint=composer-7/date=2026-01-05/hour=23/part-00000.parquet", b"oops"
    )
    config = tmp_path / "rlcycle-data.yaml"
    config.write_text("data:\n  maxOffPolicyFraction: 0.1\n  minInteractions: 100\n")
    done = _rtrl_job(
        "stage",
        "--shards",
        shards,
        "--checkpoint",
        "composer-7",
        "--previous-checkpoint",
        "composer-6",
        "--out",
        out,
        "--now",
        "2026-01-06T00:00:00Z",
        "--ranks",
        "2",
        "--max-bad-fraction",
        "0.05",
        "--config",
        str(config),
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("stage: sufficient: ")
    # progress: the files to read, then (throttled) files and rows read, rate and ETA
    assert re.fullmatch(r"rtrl-job stage: reading shards: started, (\d+) files", lines[0])
    files = int(lines[0].split()[-2])
    assert re.fullmatch(
        rf"rtrl-job stage: reading shards: \d+/{files} files \(\d+%\), rows [\d,]+, "
        r"[\d.,]+ files/s, ETA \S+",
        lines[1],
    ), lines[1]
    assert lines[-2].startswith(f"rtrl-job stage: reading shards: done, {files}/{files} files")

    store = open_store(out)
    manifest = store.committed("")
    assert manifest is not None
    assert set(manifest.files) == {
        "stage.json",
        "train/rank-00000-of-00002.parquet",
        "train/rank-00000-of-00002.advantage.parquet",
        "train/rank-00001-of-00002.parquet",
        "train/rank-00001-of-00002.advantage.parquet",
        "heldout/part-00000.parquet",  # the default held-out split for the eval step
    }
    # The rank files were hashed while written: the manifest vouches for what was uploaded.
    for name, entry in manifest.files.items():
        data = store.get_bytes(name)
        assert dict(entry) == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    doc = json.loads(store.get_bytes("stage.json"))
    assert (doc["ok"], doc["sufficient"], doc["files_bad"]) == (True, True, 1)
    assert doc["quarantined"] == {}  # the broken upload had no readable rows to count
    parts = []
    for rank in doc["ranks"]:
        with store.open_input(rank["file"]) as handle, store.open_input(rank["advantages"]) as side:
            parts.append(with_advantages(pq.read_table(handle), pq.read_table(side), rank["file"]))
    staged = pa.concat_tables(parts)
    assert staged.num_rows == doc["interactions_used"]
    assert [r["rows"] for r in doc["ranks"]] == [p.num_rows for p in parts]
    assert len(staged.column("interaction_id").unique()) == staged.num_rows
    on_policy = staged.column("on_policy").to_pylist()
    assert sum(on_policy) == doc["on_policy_interactions"]
    assert doc["on_policy_fraction"] >= 0.9
    assert set(staged.column("checkpoint_id").to_pylist()) == {"composer-7", "composer-6"}
    # Per-token columns are packed; unpacked they are the shards' lists.
    assert pa.types.is_binary(staged.schema.field("completion_ids").type)
    lists = to_lists(staged)
    assert (
        lists.schema.field("completion_ids").type == INTERACTION_SCHEMA.field("completion_ids").type
    )
    assert sum(len(ids) for ids in lists.column("completion_ids").to_pylist()) == doc["tokens_used"]
    assert staged.column("advantage").type == pa.float32()


def test_store_failures_exit_1_without_leaking_credentials(bucket: str) -> None:
    done = _rtrl_job(
        "stage",
        "--shards",
        "s3://no-such-bucket-rtrl/interactions/",
        "--checkpoint",
        "composer-7",
        "--out",
        f"s3://{bucket}/out/",
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stage: ")
    assert "NoSuchBucket" in lines[0]
    assert SECRET not in done.stderr + done.stdout
