"""Duplicate interaction ids across a whole shard set, in bounded memory.

Logging pipelines retry, so the same interaction can land in two files (or twice in one);
training on it twice double-counts its reward. Detecting that across millions of rows with
a Python set of strings would cost ~100 bytes per id. Instead each id is hashed to 64 bits
with numpy (no Python object per row) and the hashes are kept as a few sorted numpy runs
merged like a binary counter (an LSM tree in miniature): 8 bytes per distinct id,
O(log n) sorted runs to probe, amortised O(n log n) in total.

A 64-bit hash means two distinct ids collide with probability about n^2 / 2^65: ~3e-8 for
a million ids, ~3e-4 for a hundred million. A collision makes one good row be reported as
a duplicate (never the reverse), which the report makes visible.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pyarrow as pa

U64Array = npt.NDArray[np.uint64]
BoolArray = npt.NDArray[np.bool_]

_SEED = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: U64Array) -> U64Array:
    """splitmix64's finaliser: a bijection on 64 bits with full avalanche."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    mixed: U64Array = x ^ (x >> np.uint64(31))
    return mixed


def hash_strings(array: pa.Array) -> U64Array:
    """A 64-bit hash of each value of a ``string`` / ``large_string`` array (nulls hash as
    the empty string; callers exclude them).

    Strings are consumed 8 bytes at a time for all rows at once: an overlapping uint64 view
    of the data buffer turns "the k-th word of every string" into one gather, so the Python
    loop runs over word positions (5 for a UUID), never over rows.
    """
    n = len(array)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    if pa.types.is_large_string(array.type):
        offset_type: type[np.integer] = np.int64
    elif pa.types.is_string(array.type):
        offset_type = np.int32
    else:
        raise TypeError(f"hash_strings needs a string array, not {array.type}")
    buffers = array.buffers()
    offsets = np.frombuffer(buffers[1], dtype=offset_type)[array.offset : array.offset + n + 1]
    offsets = offsets.astype(np.int64)
    begin, end = int(offsets[0]), int(offsets[-1])
    data = np.zeros(end - begin + 8, dtype=np.uint8)
    if buffers[2] is not None and end > begin:
        data[: end - begin] = np.frombuffer(buffers[2], dtype=np.uint8)[begin:end]
    # words[i] = the 8 bytes starting at byte i (little-endian), unaligned and overlapping.
    words: U64Array = np.ndarray(
        shape=(end - begin + 1,), dtype="<u8", buffer=data, offset=0, strides=(1,)
    )
    starts = offsets[:-1] - begin
    lengths = offsets[1:] - offsets[:-1]
    hashes = _mix(lengths.astype(np.uint64) ^ _SEED)
    max_length = int(lengths.max())
    all_ones = np.uint64(0xFFFFFFFFFFFFFFFF)
    for word_start in range(0, max_length, 8):
        remaining = lengths - word_start
        gathered = words[np.minimum(starts + word_start, end - begin)]
        # Bytes past a string's end belong to the next string: mask them out.
        keep = np.clip(remaining, 0, 8).astype(np.uint64) * np.uint64(8)
        partial = (np.uint64(1) << (keep & np.uint64(63))) - np.uint64(1)
        mask = np.where(keep >= np.uint64(64), all_ones, partial)
        hashes = _mix(hashes ^ (gathered & mask))
    return hashes


class SeenIds:
    """The set of id hashes seen so far, as sorted runs of decreasing size."""

    def __init__(self) -> None:
        self._runs: list[U64Array] = []

    def __len__(self) -> int:
        return sum(len(run) for run in self._runs)

    @property
    def nbytes(self) -> int:
        return sum(run.nbytes for run in self._runs)

    def _contains(self, values: U64Array) -> BoolArray:
        found = np.zeros(len(values), dtype=np.bool_)
        for run in self._runs:
            index = np.minimum(np.searchsorted(run, values), len(run) - 1)
            found |= run[index] == values
        return found

    def add_batch(self, hashes: U64Array, candidates: BoolArray | None = None) -> BoolArray:
        """Record the ids of one batch and return which rows are duplicates: of an id seen
        in an earlier batch, or of an earlier row of this batch (the first occurrence is
        kept). Rows outside ``candidates`` (e.g. null ids) are neither checked nor added."""
        duplicate = np.zeros(len(hashes), dtype=np.bool_)
        rows = np.arange(len(hashes)) if candidates is None else np.flatnonzero(candidates)
        if rows.size == 0:
            return duplicate
        order = rows[np.argsort(hashes[rows], kind="stable")]
        ordered = hashes[order]
        repeat = np.zeros(len(order), dtype=np.bool_)
        repeat[1:] = ordered[1:] == ordered[:-1]
        seen = self._contains(ordered)
        duplicate[order[repeat | seen]] = True
        fresh = ordered[~(repeat | seen)]
        if fresh.size:
            self._push(fresh)
        return duplicate

    def _push(self, run: U64Array) -> None:
        self._runs.append(run)
        # Merge while the newer run is at least half the older: keeps O(log n) runs and
        # every hash is merged O(log n) times. Stable sort of two sorted runs is a merge.
        while len(self._runs) > 1 and 2 * len(self._runs[-1]) >= len(self._runs[-2]):
            merged = np.concatenate(self._runs[-2:])
            # Drop the inputs before sorting in place: the transient peak stays at twice
            # the merged size, not three times.
            del self._runs[-2:]
            merged.sort(kind="stable")
            self._runs.append(merged)
