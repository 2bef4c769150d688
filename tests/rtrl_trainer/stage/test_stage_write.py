"""How the stage step writes its files: advantage files written after the rank files
(across many row groups and ranks), rank files hashed while written, files staged in place
in a ``file://`` store and left nowhere when nothing is committed, and the fast row
filter."""

from __future__ import annotations

import hashlib
import stat
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rtrl.core.shards import synthetic_interactions, write_shards
from rtrl.core.store.local import LocalStore
from rtrl_trainer.stage.workers import GrowingFileDigest
from rtrl_trainer.stagedset import (
    PACKED_COLUMNS,
    PackedError,
    pack,
    packed_lengths,
    to_lists,
    unpack,
)
from tests.rtrl_trainer.helpers import rank_table, run_stage, write_config

CHECKPOINT = "ckpt-w"
# Synthetic rows are created from 2026-01-05 08:00 over 3 hours, feedback ~20 minutes later.
LATER = "2026-01-06T00:00:00Z"


def _shards(root: Path, n: int) -> Path:
    write_shards(
        synthetic_interactions(n, seed=3, checkpoint_id=CHECKPOINT, tokens=8), LocalStore(root)
    )
    return root


def _leftovers(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob(".tmp-*"))


@pytest.mark.parametrize("baseline", ["batch", "org"])
def test_advantages_are_filled_in_across_row_groups_and_ranks(
    tmp_path: Path, baseline: str
) -> None:
    shards = _shards(tmp_path / "shards", 60_000)
    config = write_config(tmp_path / "c.yaml", f"reward: {{baseline: {baseline}}}\n")
    out = tmp_path / "out"
    code, doc = run_stage(
        shards,
        out,
        *("--ranks", "2", "--heldout-fraction", "0.05", "--config", str(config)),
        checkpoint=CHECKPOINT,
        now=LATER,
    )
    assert code == 0 and doc["sufficient"]
    names = [r["file"] for r in doc["ranks"]]
    parts = [rank_table(out, name) for name in names]
    assert all(pq.ParquetFile(out / name).num_row_groups > 1 for name in names)
    table = pa.concat_tables(parts)
    assert table.num_rows == doc["interactions_used"] > 40_000
    reward = table.column("reward").to_numpy().astype(np.float64)
    if baseline == "batch":
        base = np.full_like(reward, reward.mean())
    else:
        orgs = np.asarray(table.column("org").to_pylist(), dtype=object)
        base = np.empty_like(reward)
        for org in set(orgs):
            base[orgs == org] = reward[orgs == org].mean()
    expected = ((reward - base) / reward.std()).astype(np.float32)
    np.testing.assert_allclose(table.column("advantage").to_numpy(), expected, atol=1e-5)
    assert doc["advantage"]["std"] == pytest.approx(
        float(table.column("advantage").to_numpy().astype(np.float64).std()), rel=1e-6
    )
    assert _leftovers(out) == []
    manifest = LocalStore(out).committed("")
    assert manifest is not None
    assert set(manifest.files) == {"stage.json", "heldout/part-00000.parquet", *doc["files"]}
    # The rank files were hashed while written: the manifest vouches for the bytes on disk.
    for name, entry in manifest.files.items():
        data = (out / name).read_bytes()
        assert dict(entry) == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o644, name
    heldout = pq.read_table(out / "heldout/part-00000.parquet")
    assert heldout.num_rows == doc["heldout_interactions"] > 0
    # Packed or not, the rows carry the shards' tokens, log-probs and masks unchanged.
    logged = {
        row["interaction_id"]: row
        for row in pa.concat_tables(
            pq.read_table(p) for p in sorted(shards.rglob("*.parquet"))
        ).to_pylist()
    }
    columns = ["interaction_id", *PACKED_COLUMNS]
    for table in (heldout, *parts):
        staged = to_lists(table.slice(0, 300).select(columns))
        assert staged.schema.field("completion_mask").type == pa.list_(pa.bool_())
        for row in staged.to_pylist():
            source = logged[row.pop("interaction_id")]
            assert row == {name: source[name] for name in PACKED_COLUMNS}


def test_a_growing_file_is_hashed_as_it_is_written(tmp_path: Path) -> None:
    path = tmp_path / "f"
    rng = np.random.default_rng(1)
    chunks = [rng.bytes(int(n)) for n in rng.integers(0, 9 << 20, size=6)]
    with path.open("wb", buffering=0) as file:
        digest = GrowingFileDigest(path, sync=True)
        for chunk in chunks:
            file.write(chunk)
            digest.poke()  # its thread hashes while the next chunk is written
            time.sleep(0.01)
        file.write(b"footer")
    data = b"".join(chunks) + b"footer"
    assert digest.finish() == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    # A file cut short under the digest's feet is an error, not a wrong hash.
    path.write_bytes(b"x" * 100)
    digest = GrowingFileDigest(path, sync=False)
    digest.poke()
    time.sleep(0.05)
    path.write_bytes(b"y" * 10)  # truncated: shorter than what was hashed
    with pytest.raises(OSError, match="shrank while written"):
        digest.finish()


def test_nothing_is_left_behind_when_the_set_is_not_committed(tmp_path: Path) -> None:
    shards = _shards(tmp_path / "shards", 2_000)
    out = tmp_path / "out"
    code, doc = run_stage(
        shards, out, "--min-interactions", "1000000", checkpoint=CHECKPOINT, now=LATER
    )
    assert code == 0 and not doc["sufficient"]
    assert sorted(p.name for p in out.iterdir()) == ["_MANIFEST.json", "stage.json"]


def test_packing_round_trips_through_slices() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(0, 9, size=int(rng.integers(0, 20)))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        total = int(offsets[-1])
        columns = {
            "<i4": pa.array(rng.integers(-(2**31), 2**31, size=total + 11, dtype=np.int32)),
            "<f4": pa.array(rng.standard_normal(total + 11).astype(np.float32)),
            "u1": pa.array(rng.random(total + 11) < 0.5),
        }
        skip = int(rng.integers(0, 11))  # the values sliced too, at any bit offset
        for dtype, values in columns.items():
            lists = pa.ListArray.from_arrays(pa.array(offsets), values.slice(skip))
            first = int(rng.integers(0, len(lists) + 1))
            for part in (lists, lists.slice(first), lists.slice(0, first)):
                packed = pack(part, dtype)
                assert unpack(packed, dtype).to_pylist() == part.to_pylist()
                assert packed_lengths(packed, dtype).tolist() == [len(x) for x in part.to_pylist()]
                if len(packed) > 1:
                    assert unpack(packed.slice(1), dtype).equals(part.slice(1))
    with pytest.raises(ValueError, match="null"):
        pack(pa.array([[1], None], pa.list_(pa.int32())), "<i4")
    with pytest.raises(ValueError, match="null"):
        pack(pa.array([[1, None]], pa.list_(pa.int32())), "<i4")
    future = pa.field("prompt_ids", pa.binary(), metadata={b"rtrl.packed": b"<i8"})
    with pytest.raises(PackedError, match="prompt_ids: unknown packed element type '<i8'"):
        to_lists(pa.table([pa.array([b""])], schema=pa.schema([future])))
