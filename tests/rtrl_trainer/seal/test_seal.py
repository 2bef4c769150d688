"""``rtrl-job seal`` on real event files in a real store: the join's rules, each counted;
the marker last; idempotent reruns; late feedback after the marker."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rtrl.core.events import SealMarker, new_interaction_id, seal_marker_key
from rtrl.core.shards import iter_batches
from rtrl.core.shards.schema import OPTIONAL_COLUMNS, REQUIRED_COLUMNS
from rtrl.core.store import ObjectStore
from rtrl.core.store.local import LocalStore
from rtrl.core.store.s3 import S3Store
from rtrl_trainer.cli import main
from tests.rtrl_trainer.seal.events import feedback, generation, write_events

H = datetime(2026, 12, 3, 10, tzinfo=UTC)
NOW = H + timedelta(hours=3)
M = timedelta(minutes=1)


def run_seal(capsys: pytest.CaptureFixture[str], events: str, shards: str, *extra: str,
             now: datetime = NOW) -> tuple[int, dict[str, Any]]:  # fmt: skip
    capsys.readouterr()
    code = main(["seal", "--log-format", "json", "--events", events, "--shards", shards,
                 "--now", now.isoformat(), *extra])  # fmt: skip
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    results = [line for line in lines if line.get("event") == "result"]
    return code, results[-1] if results else {}


def sealed_rows(store: ObjectStore) -> dict[str, dict[str, Any]]:
    columns = [*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS]
    rows = [r for b in iter_batches(store, columns=columns) for r in b.to_pylist()]
    return {row["interaction_id"]: row for row in rows}


def scenario(events: ObjectStore) -> dict[str, str]:
    """One hour of events exercising every rule; returns the interaction ids by name."""
    a = generation(H + 5 * M)
    b = generation(H + 10 * M, user_id="u-2", arm="canary", checkpoint_id="ckpt-2")
    b_again = {**b, "latency_ms": 999.0}  # shipped twice: the first copy is kept
    c = generation(H + 11 * M, checkpoint_verified=False)
    d = generation(H + 12 * M, status=500, completion_ids=None, completion_logprobs=None,
                   completion_mask=None)  # fmt: skip
    e = generation(H + 13 * M, completion_ids=[], completion_logprobs=[], completion_mask=[])
    write_events(events, "generations", H, [a, b, c], seq=0)
    write_events(events, "generations", H, [b_again, d, e], writer="writer-b", seq=0)
    ia, ib, ic = a["interaction_id"], b["interaction_id"], c["interaction_id"]
    served = a["created_at"]
    events_a = [
        feedback(ia, "edit_persisted", 0.2, served + 10 * M),
        feedback(ia, "edit_persisted", 0.8, served + 50 * M),  # the last before maturity
        feedback(ia, "edit_persisted", 0.1, served + 70 * M),  # late: after 1h
        feedback(ia, "dissatisfied_followup", 1, served + 5 * M),
        feedback(ia, "tool_calls", 3, served + 2 * M),  # more than the proxy's 1: kept
        feedback(ia, "invalid_tool_calls", 0, served + 2 * M),  # fewer than the proxy's 2
        feedback(ia, "latency_ms", 900, served + 1 * M),  # replaces the proxy's 250
        feedback(ia, "asked_clarification", 1, served - 1 * M),  # before it was served
        feedback(
            ia,
            "edits_proposed",
            2,
            served + 3 * M,
            event_id="conflicted",
            received_at=served + 4 * M,
        ),
        feedback(ib, "thumbs", 1, H + 20 * M),  # not a signal
        feedback(new_interaction_id(H + 20 * M), "edit_persisted", 1, H + 30 * M),  # orphan
        feedback(ic, "edit_persisted", 1, H + 30 * M),  # its generation is not written
    ]
    write_events(events, "feedback", H, events_a, writer="fb-1", seq=0)
    later = [
        events_a[0],  # a retried write: the same event again
        feedback(
            ia,
            "edits_proposed",
            5,
            served + 3 * M,
            event_id="conflicted",
            received_at=served + 9 * M,
        ),
    ]
    write_events(events, "feedback", H, later, writer="fb-2", seq=3)
    events.put_bytes("generations/date=2026-12-03/hour=10/_SUCCESS", b"")
    a["invalid_tool_calls"] = 2
    return {"a": ia, "b": ib}


EXPECTED_COUNTS = {
    "generations": 6, "sealed": 2, "duplicates": 1, "invalid": 0, "outside_hour": 0,
    "unverified": 1, "engine_errors": 1, "no_completion": 1, "feedback_events": 14,
    "feedback_used": 7, "feedback_duplicates": 2, "feedback_conflicts": 1,
    "feedback_invalid": 0, "orphans": 1, "late": 1, "before_served": 1, "unknown_signal": 1,
}  # fmt: skip


@pytest.fixture
def stores(tmp_path: Path) -> tuple[LocalStore, LocalStore]:
    return LocalStore(tmp_path / "events"), LocalStore(tmp_path / "shards")


def test_an_hour_is_joined_by_the_rules_and_each_is_counted(
    stores: tuple[LocalStore, LocalStore], capsys: pytest.CaptureFixture[str]
) -> None:
    events, shards = stores
    ids = scenario(events)
    # the proxy measured two invalid tool calls for a
    code, result = run_seal(capsys, events.uri, shards.uri)
    assert code == 0, result
    assert result["counts"] == EXPECTED_COUNTS
    assert result["hours_sealed"] == [H.isoformat()]
    rows = sealed_rows(shards)
    assert set(rows) == {ids["a"], ids["b"]}
    a, b = rows[ids["a"]], rows[ids["b"]]
    assert a["edit_persisted"] == 0.8
    assert a["dissatisfied_followup"] is True
    assert (a["tool_calls"], a["latency_ms"]) == (3, 900.0)
    assert a["asked_clarification"] is None  # observed before it was served: not used
    assert a["edits_proposed"] == 2  # the conflicting id: the first received
    # ready to train on when it was sealed: after its last signal's maturity (1 h)
    assert a["feedback_at"] == NOW > a["created_at"] + timedelta(hours=1)
    assert (a["temperature"], a["top_p"], a["logprobs_mode"]) == (
        pytest.approx(0.7), pytest.approx(0.95), "processed_logprobs",
    )  # fmt: skip
    assert (a["arm"], a["session_id"], a["completion_ids"]) == ("stable", "s-1", [4, 5, 6])
    # b: no feedback; the proxy's own measurements, the first copy's
    assert (b["latency_ms"], b["tool_calls"], b["edit_persisted"]) == (250.0, 1, None)
    assert (b["arm"], b["checkpoint_id"], b["user_id"]) == ("canary", "ckpt-2", "u-2")
    marker = SealMarker.from_json(shards.get_bytes(seal_marker_key(H)))
    assert [f["key"] for f in marker.files] == [
        "checkpoint=ckpt-1/date=2026-12-03/hour=10/sealed-2026120310-00000.parquet",
        "checkpoint=ckpt-2/date=2026-12-03/hour=10/sealed-2026120310-00000.parquet",
    ]
    assert [f["rows"] for f in marker.files] == [1, 1]
    assert len(marker.generations) == 2 and len(marker.feedback) == 2
    assert marker.counts == EXPECTED_COUNTS


def test_the_invalid_tool_calls_of_the_proxy_are_never_lowered(
    stores: tuple[LocalStore, LocalStore], capsys: pytest.CaptureFixture[str]
) -> None:
    events, shards = stores
    g = generation(H + 5 * M, invalid_tool_calls=2, tool_calls=2)
    write_events(events, "generations", H, [g])
    write_events(events, "feedback", H, [
        feedback(g["interaction_id"], "invalid_tool_calls", 0, H + 6 * M),
        feedback(g["interaction_id"], "tool_calls", 0, H + 6 * M),
    ])  # fmt: skip
    assert run_seal(capsys, events.uri, shards.uri)[0] == 0
    row = sealed_rows(shards)[g["interaction_id"]]
    assert (row["invalid_tool_calls"], row["tool_calls"]) == (2, 2)


def test_values_observed_at_the_same_moment_go_by_receipt_then_by_reading_order(
    stores: tuple[LocalStore, LocalStore], capsys: pytest.CaptureFixture[str]
) -> None:
    events, shards = stores
    g, h = generation(H + 5 * M), generation(H + 6 * M)
    gid, hid = g["interaction_id"], h["interaction_id"]
    write_events(events, "generations", H, [g, h])
    at = H + 20 * M
    write_events(events, "feedback", H, [
        feedback(gid, "edit_persisted", 0.9, at, event_id="g-2", received_at=at + 2 * M),
        feedback(gid, "edit_persisted", 0.1, at, event_id="g-1", received_at=at + 1 * M),
        feedback(hid, "edit_persisted", 0.3, at, event_id="h-1", received_at=at + M),
        feedback(hid, "edit_persisted", 0.4, at, event_id="h-2", received_at=at + M),
    ], writer="fb-1")  # fmt: skip
    write_events(events, "feedback", H, [
        feedback(hid, "edit_persisted", 0.5, at, event_id="h-3", received_at=at + M),
    ], writer="fb-2")  # fmt: skip
    code, result = run_seal(capsys, events.uri, shards.uri)
    assert code == 0, result
    rows = sealed_rows(shards)
    assert rows[gid]["edit_persisted"] == 0.9  # received last
    assert rows[hid]["edit_persisted"] == 0.5  # received together: the one read last
    assert result["counts"]["feedback_used"] == 2


def test_an_hour_waits_until_every_maturity_and_the_delay_have_passed(
    stores: tuple[LocalStore, LocalStore], capsys: pytest.CaptureFixture[str]
) -> None:
    events, shards = stores
    scenario(events)
    just_before = H + timedelta(hours=2, minutes=9)
    code, result = run_seal(capsys, events.uri, shards.uri, now=just_before)
    assert code == 0
    assert (result["hours_sealed"], result["hours_waiting"]) == ([], [H.isoformat()])
    assert list(shards.list()) == []
    # a longer maturity for one signal holds the hour back, and moves what is late
    code, result = run_seal(capsys, events.uri, shards.uri, "--maturity",
                            "edit_persisted=2h", now=H + timedelta(hours=3))  # fmt: skip
    assert result["hours_waiting"] == [H.isoformat()]
    code, result = run_seal(capsys, events.uri, shards.uri, "--maturity",
                            "edit_persisted=2h", now=H + timedelta(hours=4))  # fmt: skip
    assert result["counts"]["late"] == 0
    rows = sealed_rows(shards)
    assert 0.1 in {r["edit_persisted"] for r in rows.values()}  # observed at 70m: in time
    assert all(r["feedback_at"] == H + timedelta(hours=4) for r in rows.values())


def test_a_rerun_writes_nothing_and_counts_feedback_after_the_marker(
    stores: tuple[LocalStore, LocalStore], capsys: pytest.CaptureFixture[str]
) -> None:
    events, shards = stores
    ids = scenario(events)
    assert run_seal(capsys, events.uri, shards.uri)[0] == 0
    before = {i.key: shards.get_bytes(i.key) for i in shards.list()}
    write_events(events, "feedback", H, [
        feedback(ids["b"], "edit_persisted", 1, H + 30 * M),
        feedback(ids["b"], "dissatisfied_followup", 1, H + 31 * M),
    ], writer="fb-9", seq=0)  # fmt: skip
    code, result = run_seal(capsys, events.uri, shards.uri, now=NOW + timedelta(hours=1))
    assert code == 0
    assert result["hours_sealed"] == [] and result["hours_already_sealed"] == 1
    assert (result["late_feedback_files"], result["late_feedback_events"]) == (1, 2)
    assert (
        "2 feedback event(s) in 1 file(s) arrived after their hour was sealed"
        in (result["message"])
    )
    assert {i.key: shards.get_bytes(i.key) for i in shards.list()} == before


def test_a_crashed_seal_is_redone_with_the_same_files_and_its_leftovers_go(
    stores: tuple[LocalStore, LocalStore], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    events, shards = stores
    scenario(events)
    clean = LocalStore(tmp_path / "clean")
    assert run_seal(capsys, events.uri, clean.uri)[0] == 0
    expected = {i.key: clean.get_bytes(i.key) for i in clean.list()}
    # a crashed run: one of its files written, another from a run with more input, no marker
    first = "checkpoint=ckpt-1/date=2026-12-03/hour=10/sealed-2026120310-00000.parquet"
    shards.put_bytes(first, expected[first])
    stale = "checkpoint=ckpt-2/date=2026-12-03/hour=10/sealed-2026120310-00001.parquet"
    shards.put_bytes(stale, expected[first])
    mine = "checkpoint=ckpt-2/date=2026-12-03/hour=10/part-of-my-own-pipeline-00000.parquet"
    shards.put_bytes(mine, expected[first])
    assert run_seal(capsys, events.uri, shards.uri)[0] == 0
    found = {i.key: shards.get_bytes(i.key) for i in shards.list()}
    assert found.pop(mine) == expected[first]  # not the seal's: left alone
    marker = seal_marker_key(H)
    assert (
        SealMarker.from_json(found.pop(marker)).files
        == SealMarker.from_json(expected.pop(marker)).files
    )
    assert found == expected


def test_a_bad_maturity_is_a_usage_error(
    stores: tuple[LocalStore, LocalStore], capsys: pytest.CaptureFixture[str]
) -> None:
    events, shards = stores
    for flag, says in (
        ("thumbs=1h", "--maturity thumbs=1h: unknown signal 'thumbs'"),
        ("edit_persisted=soon", "--maturity edit_persisted=soon:"),
        ("edit_persisted", "expected signal=duration"),
    ):
        code = main(["seal", "--events", events.uri, "--shards", shards.uri,
                     "--maturity", flag])  # fmt: skip
        assert code == 2
        assert says in capsys.readouterr().err


def test_the_shard_root_may_come_from_the_rlcycle(
    stores: tuple[LocalStore, LocalStore], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    events, shards = stores
    scenario(events)
    spec = tmp_path / "rlcycle.yaml"
    spec.write_text(f"kind: RLCycle\nspec:\n  data:\n    shards: {shards.uri}\n")
    code = main(["seal", "--events", events.uri, "--config", str(spec), "--now", NOW.isoformat()])
    assert code == 0
    assert shards.exists(seal_marker_key(H))
    spec.write_text("kind: RLCycle\nspec:\n  data: {}\n")
    assert main(["seal", "--events", events.uri, "--config", str(spec)]) == 2
    assert "spec.data.shards: required (or pass --shards)" in capsys.readouterr().err
    assert main(["seal", "--events", events.uri]) == 2
    assert "--shards: required" in capsys.readouterr().err


def test_an_unusable_event_file_fails_the_run_and_seals_nothing(
    stores: tuple[LocalStore, LocalStore], capsys: pytest.CaptureFixture[str]
) -> None:
    events, shards = stores
    scenario(events)
    bad = "generations/date=2026-12-03/hour=10/writer-c-000000000000.parquet"
    events.put_bytes(bad, b"not parquet at all")
    flags = ["seal", "--events", events.uri, "--shards", shards.uri, "--now", NOW.isoformat()]
    assert main(flags) == 1
    assert f"event file {bad}: not Parquet" in capsys.readouterr().err
    # a Parquet file without the generation columns
    table = pa.table({"interaction_id": [new_interaction_id(H)]})
    sink = io.BytesIO()
    pq.write_table(table, sink)
    events.put_bytes(bad, sink.getvalue())
    assert main(flags) == 1
    assert "hour date=2026-12-03/hour=10: the event files cannot be joined" in (
        capsys.readouterr().err
    )
    assert list(shards.list()) == []


def test_sealed_over_s3(s3_bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    events, shards = S3Store(s3_bucket, "events"), S3Store(s3_bucket, "shards")
    ids = scenario(events)
    code, result = run_seal(capsys, events.uri, shards.uri)
    assert code == 0
    assert result["counts"] == EXPECTED_COUNTS
    assert set(sealed_rows(shards)) == {ids["a"], ids["b"]}
    keys = [i.key for i in shards.list()]
    assert keys[0] == seal_marker_key(H) and len(keys) == 3
    with shards.open_input(keys[1]) as handle:
        assert pq.read_metadata(handle).num_rows == 1
