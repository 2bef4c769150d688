"""Reading back what a capture proxy shipped: the generation events under an events root in
moto's S3, as rows of GENERATION_SCHEMA."""

from __future__ import annotations

import io
import time
from typing import Any

import boto3
import pyarrow.parquet as pq

from rtrl.core.events import GENERATION_SCHEMA, parse_hour_partition


def _client(endpoint: str) -> Any:
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, aws_access_key_id="testing",
        aws_secret_access_key="testing", region_name="us-east-1",
    )  # fmt: skip


def event_keys(endpoint: str, events: str) -> list[str]:
    bucket, _, prefix = events.removeprefix("s3://").partition("/")
    client = _client(endpoint)
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix + "generations/"
    ):
        keys.extend(obj["Key"] for obj in page.get("Contents", []))
    return sorted(keys)


def read_events(endpoint: str, events: str) -> list[dict[str, Any]]:
    """Every event row shipped under ``events`` (``s3://bucket/prefix/``); each file's schema
    must be GENERATION_SCHEMA and lie in the hour partition of its rows."""
    bucket, _, _ = events.removeprefix("s3://").partition("/")
    client = _client(endpoint)
    rows: list[dict[str, Any]] = []
    for key in event_keys(endpoint, events):
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        table = pq.read_table(io.BytesIO(body))
        assert table.schema.equals(GENERATION_SCHEMA), key
        hour = parse_hour_partition(key)
        for row in table.to_pylist():
            assert hour is not None
            assert row["created_at"].replace(minute=0, second=0, microsecond=0) == hour, key
            rows.append({**row, "_key": key})
    return rows


def wait_for_events(
    endpoint: str, events: str, ids: set[str], timeout: float = 60.0
) -> dict[str, list[dict[str, Any]]]:
    """The shipped rows of ``ids`` (by interaction id), once every one of them is there."""
    deadline = time.monotonic() + timeout
    while True:
        found: dict[str, list[dict[str, Any]]] = {}
        for row in read_events(endpoint, events):
            if row["interaction_id"] in ids:
                found.setdefault(row["interaction_id"], []).append(row)
        if set(found) >= ids or time.monotonic() > deadline:
            missing = ids - set(found)
            assert not missing, f"events never shipped: {sorted(missing)}"
            return found
        time.sleep(0.3)
