"""The 64-bit id hashing and the sorted-run set behind duplicate detection, against a plain
Python set as the reference."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from rtrl.core.shards.dedup import SeenIds, hash_strings


def test_hash_depends_on_content_not_position_or_offsets() -> None:
    values = ["", "a", "abcdefgh", "abcdefghi", "abcdefgh\0", "x" * 100, "x" * 101, "é✓"]
    array = pa.array(values * 2)
    hashes = hash_strings(array)
    assert len(set(hashes[: len(values)].tolist())) == len(values)
    assert (hashes[: len(values)] == hashes[len(values) :]).all()
    assert (hash_strings(array.slice(3, 9)) == hashes[3:12]).all()
    assert (hash_strings(array.cast(pa.large_string())) == hashes).all()
    assert hash_strings(pa.array([], pa.string())).shape == (0,)
    with pytest.raises(TypeError, match="string array"):
        hash_strings(pa.array([1]))


def test_prefix_sharing_strings_do_not_collide() -> None:
    # Same 8-byte words in different places, and padding-like bytes at the end.
    values = [f"{i:08d}{j:08d}" for i in range(100) for j in range(100)]
    values += ["a", "a\0", "a\0\0", "\0a"]
    hashes = hash_strings(pa.array(values))
    assert len(np.unique(hashes)) == len(values)


def test_seen_ids_matches_a_python_set() -> None:
    rng = np.random.default_rng(7)
    pool = np.array([f"id-{i}" for i in range(5_000)])
    seen, reference = SeenIds(), set()
    for _ in range(40):
        ids = pool[rng.integers(0, len(pool), size=int(rng.integers(1, 400)))]
        valid = rng.random(len(ids)) < 0.9
        duplicate = seen.add_batch(hash_strings(pa.array(ids)), valid)
        expected = []
        for value, ok in zip(ids.tolist(), valid.tolist(), strict=True):
            expected.append(ok and value in reference)
            if ok:
                reference.add(value)
        assert duplicate.tolist() == expected
    assert len(seen) == len(reference)
    assert seen.nbytes == 8 * len(reference)
    assert len(seen._runs) <= 2 * int(np.log2(len(reference))) + 1
