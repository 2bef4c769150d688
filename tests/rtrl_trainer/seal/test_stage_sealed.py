"""``rtrl-job stage --sealed`` reads exactly what the seal markers list: not a crashed
seal's files, not another writer's, and fails when a listed file is gone."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from rtrl.core.events import SealedView
from rtrl.core.shards import INTERACTION_SCHEMA, write_shards
from rtrl.core.store.local import LocalStore
from rtrl_trainer.cli import main
from tests.rtrl_trainer.seal.events import generation, write_events
from tests.rtrl_trainer.seal.test_seal import NOW, H, M, sealed_rows

H2 = H + timedelta(hours=1)


def stage(shards: LocalStore, out: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    code = main(["stage", "--shards", shards.uri, "--checkpoint", "ckpt-1",
                 "--out", out.as_uri() + "/", "--now", (NOW + timedelta(hours=2)).isoformat(),
                 "--min-interactions", "1", "--min-tokens", "1", "--heldout-fraction", "0",
                 *flags])  # fmt: skip
    doc = json.loads((out / "stage.json").read_text()) if (out / "stage.json").exists() else {}
    return code, doc


@pytest.fixture
def shard_root(tmp_path: Path) -> LocalStore:
    """Hour H sealed (5 rows); hour H2 with a crashed seal's file (3 rows, no marker); and
    2 rows another pipeline wrote beside the sealed ones."""
    events, shards = LocalStore(tmp_path / "events"), LocalStore(tmp_path / "shards")
    write_events(events, "generations", H, [generation(H + i * M) for i in range(5)])
    code = main(["seal", "--events", events.uri, "--shards", shards.uri,
                 "--now", NOW.isoformat()])  # fmt: skip
    assert code == 0
    crashed = [generation(H2 + i * M) for i in range(3)]
    write_events(events, "generations", H2, crashed)
    clean = LocalStore(tmp_path / "clean")
    code = main(["seal", "--events", events.uri, "--shards", clean.uri,
                 "--now", (NOW + timedelta(hours=1)).isoformat()])  # fmt: skip
    assert code == 0
    for info in clean.list("checkpoint=ckpt-1/"):
        if "hour=11" in info.key:
            shards.put_bytes(info.key, clean.get_bytes(info.key))  # the files, not the marker
    rows = list(sealed_rows(clean).values())[:2]
    for row in rows:
        row["interaction_id"] = row["interaction_id"][:-4] + "ffff"
    table = pa.Table.from_pylist(rows).select(INTERACTION_SCHEMA.names)
    write_shards(table, shards, file_prefix="part-mine")
    return shards


def test_stage_sealed_reads_only_the_marked_files(shard_root: LocalStore, tmp_path: Path) -> None:
    code, doc = stage(shard_root, tmp_path / "all")
    assert code == 0
    assert (doc["files_total"], doc["rows_read"]) == (3, 10)
    code, doc = stage(shard_root, tmp_path / "sealed", "--sealed")
    assert code == 0
    assert (doc["files_total"], doc["rows_read"]) == (1, 5)
    view = SealedView(shard_root)
    assert list(view.sealed_files()) == [
        "checkpoint=ckpt-1/date=2026-12-03/hour=10/sealed-2026120310-00000.parquet"
    ]


def test_a_sealed_file_gone_fails_the_stage(
    shard_root: LocalStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard_root.delete("checkpoint=ckpt-1/date=2026-12-03/hour=10/sealed-2026120310-00000.parquet")
    code, _ = stage(shard_root, tmp_path / "out", "--sealed")
    assert code == 1
    err = capsys.readouterr().err
    assert "sealed-2026120310-00000.parquet is listed by the seal marker" in err
    assert "_sealed/date=2026-12-03/hour=10.json but is not in the store" in err


def test_rows_sealed_after_a_cycle_began_are_the_next_cycle_s(tmp_path: Path) -> None:
    """Hour H is sealable at H+2h10m but sealed late, after cycle 1 began; cycle 2 stages
    its rows. (With feedback_at at the rows' maturity, H+1h-ish, they were before cycle 2's
    --since and after cycle 1 had read: staged by neither.)"""
    events, shards = LocalStore(tmp_path / "events"), LocalStore(tmp_path / "shards")
    write_events(events, "generations", H, [generation(H + i * M) for i in range(5)])
    cycle1, sealed_at = H + timedelta(hours=2, minutes=15), H + timedelta(hours=2, minutes=30)
    cycle2 = NOW
    (tmp_path / "shards").mkdir()
    code, first = stage(shards, tmp_path / "c1", "--sealed", "--now", cycle1.isoformat())
    assert code == 0 and first["rows_read"] == 0  # nothing sealed yet
    assert main(["seal", "--events", events.uri, "--shards", shards.uri,
                 "--now", sealed_at.isoformat()]) == 0  # fmt: skip
    code, second = stage(shards, tmp_path / "c2", "--sealed", "--since", cycle1.isoformat(),
                         "--now", cycle2.isoformat())  # fmt: skip
    assert code == 0
    assert second["interactions_used"] == 5
