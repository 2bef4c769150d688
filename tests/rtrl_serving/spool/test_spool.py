"""The spool: group commit, rotation, torn tails, recovery after kill -9, deterministic
names on a retried upload, a failing S3, a full spool."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pyarrow.parquet as pq
import pytest

from rtrl.core.events import GENERATION_SCHEMA, parse_hour_partition
from rtrl.core.store import ObjectStore, open_store
from rtrl_localkube.s3faults import FaultProxy, serve_fault_proxy
from rtrl_serving.spool import EventKind, Spool, SpoolClosed, SpoolFull, by_hour_of
from rtrl_serving.spool.records import frame, read_segment
from tests.conftest import REPO
from tests.rtrl_serving.conftest import new_bucket

KIND = EventKind("generations", GENERATION_SCHEMA, by_hour_of("created_at"))


def record(i: int, hour: int = 14) -> bytes:
    return json.dumps({
        "interaction_id": f"id-{i:06d}", "created_at": f"2026-12-03T{hour:02d}:{i % 60:02d}:00Z",
        "prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "completion_logprobs": [-0.5, -1.25],
        "completion_mask": [True, True], "status": 200, "temperature": 0.7,
    }).encode()  # fmt: skip


def shipped(root: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(root.rglob("*.parquet")):
        hour = parse_hour_partition(str(path))
        for row in pq.read_table(path).to_pylist():
            assert row["created_at"].replace(minute=0, second=0) == hour
            rows.append(row)
    return rows


def make(tmp: Path, store: ObjectStore | None = None, **kwargs: Any) -> Spool:
    store = store or open_store(f"file://{tmp}/events/")
    return Spool(tmp / "spool", store, KIND, writer_name="Pod_A", **kwargs)


def test_records_are_shipped_once_each_per_hour_under_the_writers_names(tmp_path: Path) -> None:
    spool = make(tmp_path, commit_ms=5, segment_age_s=0.2)
    spool.start()
    for i in range(500):
        spool.append(record(i, hour=14 + i % 2))
    assert spool.close(30)
    rows = shipped(tmp_path / "events")
    assert sorted(r["interaction_id"] for r in rows) == [f"id-{i:06d}" for i in range(500)]
    keys = sorted(
        str(p.relative_to(tmp_path / "events")) for p in (tmp_path / "events").rglob("*.parquet")
    )
    assert keys[0].startswith("generations/date=2026-12-03/hour=14/pod-a-")
    writer = spool.writer_id
    assert writer.startswith("pod-a-") and all(writer in k for k in keys)
    snap = spool.snapshot()
    assert (snap.appended, snap.durable, snap.shipped, snap.held_bytes) == (500, 500, 500, 0)


def test_fsyncs_are_shared_by_the_records_of_a_commit_window(tmp_path: Path) -> None:
    spool = make(tmp_path, commit_ms=200)
    spool.start()
    futures = [spool.append(record(i), wait=True) for i in range(300)]
    for future in futures:
        assert future is not None
        future.result(10)
    commits = spool.snapshot().commits
    assert 1 <= commits <= 5, commits  # not one per record
    spool.close(10)


def test_a_waiting_append_resolves_only_once_fsynced(tmp_path: Path) -> None:
    spool = make(tmp_path, commit_ms=300)
    spool.start()
    started = time.monotonic()
    future = spool.append(record(1), wait=True)
    assert future is not None
    future.result(5)
    assert time.monotonic() - started >= 0.25  # it waited for the window's fsync
    assert spool.snapshot().durable == 1
    spool.close(10)


def test_segments_rotate_by_size_and_by_age(tmp_path: Path) -> None:
    spool = make(tmp_path, segment_bytes=2000, segment_age_s=3600)
    spool.start(ship=False)
    for i in range(40):
        spool.append(record(i), wait=True).result(5)  # type: ignore[union-attr]
    closed = spool.segdir.closed()
    assert len(closed) >= 3
    spool.close(1)
    aged = make(tmp_path / "b", segment_age_s=0.2)
    aged.start(ship=False)
    aged.append(record(1))
    time.sleep(0.8)
    assert len(aged.segdir.closed()) == 1  # closed by age, without a second record
    aged.close(1)


def test_a_torn_last_record_is_dropped_and_counted_the_rest_shipped(tmp_path: Path) -> None:
    segments = tmp_path / "spool" / "segments"
    segments.mkdir(parents=True)
    whole = b"".join(frame(record(i)) for i in range(10))
    torn = frame(record(10))[:-7]  # killed mid-write
    (segments / "000000000004.open").write_bytes(whole + torn)
    bad_crc = bytearray(frame(record(20)))
    bad_crc[-3] ^= 0xFF  # flipped on the way to the disk
    (segments / "000000000002.open").write_bytes(frame(record(19)) + bytes(bad_crc))
    spool = make(tmp_path)
    assert spool.recovered == (2, len(torn) + len(bad_crc))
    spool.start()
    assert spool.close(30)
    ids = sorted(r["interaction_id"] for r in shipped(tmp_path / "events"))
    assert ids == [f"id-{i:06d}" for i in [*range(10), 19]]
    assert spool.snapshot().torn == 2
    # the numbering continues past what the killed process had used (its start opened 5)
    assert spool.segdir.next_number() == 6


def test_read_segment_stops_at_the_first_bad_record(tmp_path: Path) -> None:
    path = tmp_path / "seg"
    path.write_bytes(frame(b"a") + frame(b"bb")[:5])
    contents = read_segment(path)
    assert (contents.records, contents.torn_bytes) == ([b"a"], 5)


def test_a_record_that_does_not_parse_is_dropped_and_counted(tmp_path: Path) -> None:
    spool = make(tmp_path)
    spool.start()
    spool.append(record(1))
    spool.append(b'{"interaction_id": "x", "status": "not a number"}')
    spool.append(b"not json at all")
    spool.append(record(2))
    assert spool.close(30)
    assert sorted(r["interaction_id"] for r in shipped(tmp_path / "events")) == [
        "id-000001", "id-000002"]  # fmt: skip
    assert spool.snapshot().corrupt == 2


def test_a_segment_shipped_again_replaces_its_own_files(tmp_path: Path) -> None:
    spool = make(tmp_path, segment_age_s=3600)
    spool.start(ship=False)
    for i in range(50):
        spool.append(record(i, hour=14 + i % 3))
    spool.writer.close()
    [number] = spool.segdir.closed()
    saved = spool.segdir.path(number, ".seg").read_bytes()
    spool.shipper.ship_segment(number)
    first = {p: p.read_bytes() for p in (tmp_path / "events").rglob("*.parquet")}
    # a crash after the uploads, before the segment's deletion: shipped again on restart
    spool.segdir.path(number, ".seg").write_bytes(saved)
    spool.shipper.ship_segment(number)
    again = {p: p.read_bytes() for p in (tmp_path / "events").rglob("*.parquet")}
    assert set(again) == set(first) and len(first) == 3
    assert again == first
    assert len(shipped(tmp_path / "events")) == 50


def test_a_full_spool_refuses_and_counts_but_never_blocks(tmp_path: Path) -> None:
    spool = make(tmp_path, max_bytes=5000, segment_age_s=3600)
    spool.start(ship=False)  # the store is away
    taken = refused = 0
    started = time.monotonic()
    for i in range(200):
        try:
            spool.append(record(i))
            taken += 1
        except SpoolFull:
            refused += 1
    assert time.monotonic() - started < 1.0
    assert taken > 0 and refused > 0 and taken + refused == 200
    snap = spool.snapshot()
    assert (snap.appended, snap.dropped_full) == (taken, refused)
    assert snap.held_bytes <= 5000
    spool.writer.close()
    spool.shipper.start()
    spool.shipper.drain(time.monotonic() + 30)
    assert len(shipped(tmp_path / "events")) == taken
    with pytest.raises(SpoolClosed):
        spool.append(record(1))


def test_the_limit_holds_while_segments_rotate_under_concurrent_appends(tmp_path: Path) -> None:
    limit = 20_000
    spool = make(tmp_path, max_bytes=limit, segment_bytes=700, segment_age_s=3600)
    spool.start(ship=False)  # nothing leaves: the spool fills while segments keep rotating
    seen: list[int] = []

    def writer(base: int) -> None:
        for i in range(300):
            with contextlib.suppress(SpoolFull):
                spool.append(record(base + i))
            seen.append(spool.snapshot().held_bytes)

    threads = [threading.Thread(target=writer, args=(n * 1000,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    spool.writer.close()
    assert max(seen) <= limit
    assert spool.segdir.disk_bytes() <= limit
    assert spool.snapshot().dropped_full > 0


# --- against S3 ------------------------------------------------------------------------


@pytest.fixture
def faulty_s3(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[FaultProxy, str]]:
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_MAX_ATTEMPTS", "2"),
                        ("AWS_CONFIG_FILE", "/dev/null"),
                        ("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")):  # fmt: skip
        monkeypatch.setenv(name, value)
    with serve_fault_proxy(moto_endpoint) as (proxy, endpoint):
        yield proxy, endpoint


def s3_rows(endpoint: str, bucket: str) -> list[dict[str, Any]]:
    client = boto3.session.Session().client("s3", endpoint_url=endpoint)
    rows = []
    for obj in client.list_objects_v2(Bucket=bucket).get("Contents", []):
        body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        rows.extend(pq.read_table(io.BytesIO(body)).to_pylist())
    return rows


def test_failed_uploads_back_off_and_retry_without_duplicates(
    faulty_s3: tuple[FaultProxy, str], moto_endpoint: str, tmp_path: Path
) -> None:
    proxy, endpoint = faulty_s3
    bucket = new_bucket(moto_endpoint)
    puts = lambda method, path, headers: method == "PUT"  # noqa: E731
    proxy.fail(puts, times=6)  # three tries of the spool, two attempts of botocore each
    store = open_store(f"s3://{bucket}/events/", endpoint_url=endpoint)
    spool = make(tmp_path, store, segment_age_s=0.1)
    spool.start()
    for i in range(100):
        spool.append(record(i))
    time.sleep(0.3)
    assert spool.close(60)
    snap = spool.snapshot()
    assert snap.upload_failures >= 3
    rows = s3_rows(moto_endpoint, bucket)
    assert sorted(r["interaction_id"] for r in rows) == [f"id-{i:06d}" for i in range(100)]
    assert "testing" not in (spool.shipper.stats.last_error or "")


def test_a_store_down_through_shutdown_leaves_the_segments_for_the_next_start(
    faulty_s3: tuple[FaultProxy, str], moto_endpoint: str, tmp_path: Path
) -> None:
    proxy, endpoint = faulty_s3
    bucket = new_bucket(moto_endpoint)
    proxy.fail(lambda m, p, h: m == "PUT", times=-1)
    store = open_store(f"s3://{bucket}/events/", endpoint_url=endpoint)
    spool = make(tmp_path, store)
    spool.start()
    for i in range(20):
        spool.append(record(i))
    assert not spool.close(2)  # the deadline passed: nothing lost, it waits on disk
    assert len(spool.segdir.closed()) == 1
    proxy.faults.clear()
    again = make(tmp_path, store)
    again.start()
    assert again.close(30)
    assert len(s3_rows(moto_endpoint, bucket)) == 20


# --- kill -9 ---------------------------------------------------------------------------

CHILD = """
import json, sys
from pathlib import Path
from rtrl.core.store import open_store
from tests.rtrl_serving.spool.test_spool import KIND, record
from rtrl_serving.spool import Spool
spool = Spool(Path(sys.argv[1]), open_store(sys.argv[2]), KIND, writer_name="child",
              commit_ms=float(sys.argv[3]), segment_age_s=0.05)
spool.start(ship=False)  # everything stays for the restart
i = 0
while True:
    spool.append(record(i), wait=True).result()
    print(i, flush=True)  # acknowledged: fsynced
    i += 1
"""


def test_kill_9_loses_no_acknowledged_record(tmp_path: Path) -> None:
    events = f"file://{tmp_path}/events/"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "spool"), events, "2"],
        stdout=subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.stdout is not None
    acked = []
    with proc.stdout:
        for line in proc.stdout:
            acked.append(int(line))
            if len(acked) >= 200:
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        acked.extend(int(line) for line in proc.stdout.read().split())
    spool = Spool(tmp_path / "spool", open_store(events), KIND, writer_name="ignored")
    assert spool.writer_id.startswith("child-")  # the writer id survives the restart
    spool.start()
    assert spool.close(30)
    ids = {r["interaction_id"] for r in shipped(tmp_path / "events")}
    assert {f"id-{i:06d}" for i in acked} <= ids
    assert len(ids) <= len(acked) + 1  # at most the one in flight when it died


def test_file_names_are_fixed_before_the_first_upload(tmp_path: Path) -> None:
    """The name of an event file depends on the writer id and the segment number alone."""
    spool = make(tmp_path, segment_age_s=3600)
    spool.start(ship=False)
    spool.append(record(1, hour=9))
    spool.writer.close()
    [number] = spool.segdir.closed()
    spool.shipper.ship_segment(number)
    [path] = (tmp_path / "events").rglob("*.parquet")
    assert path.name == f"{spool.writer_id}-{number * 1000:012d}.parquet"
    assert datetime(2026, 12, 3, 9, tzinfo=UTC) == parse_hour_partition(str(path))


DISK_FULL = """
import resource, signal, sys, time
from pathlib import Path
from rtrl.core.store import open_store
from tests.rtrl_serving.spool.test_spool import KIND, record
from rtrl_serving.spool import Spool
spool = Spool(Path(sys.argv[1]), open_store(sys.argv[2]), KIND, writer_name="full")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))
spool.start(ship=False)
lost = 0
for i in range(40):
    future = spool.append(record(i), wait=True)
    try:
        future.result(5)
    except OSError:
        lost += 1
snap = spool.snapshot()
print(lost, snap.appended, snap.durable, snap.dropped_io)
"""


def test_a_disk_that_refuses_writes_is_counted_and_reported(tmp_path: Path) -> None:
    ran = subprocess.run(
        [sys.executable, "-c", DISK_FULL, str(tmp_path / "spool"), f"file://{tmp_path}/ev/"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    lost, appended, durable, dropped_io = ran.stdout.split()
    assert int(lost) == int(dropped_io) > 0  # every waiter of a lost record was told
    assert int(durable) + int(dropped_io) == int(appended) == 40  # the writer went on
    assert "cannot write the spool segment" in ran.stderr
