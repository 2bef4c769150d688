"""Building blocks for the shard tests: small canonical tables and hand-made bad files."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rtrl.core.shards import INTERACTION_SCHEMA, synthetic_interactions


def table(n: int = 50, *, seed: int = 0, checkpoint_id: str = "ckpt-1") -> pa.Table:
    """``n`` canonical synthetic interactions."""
    batches = list(synthetic_interactions(n, seed=seed, checkpoint_id=checkpoint_id, tokens=8))
    return pa.Table.from_batches(batches, schema=INTERACTION_SCHEMA)


def replace(t: pa.Table, name: str, values: pa.Array | pa.ChunkedArray) -> pa.Table:
    """``t`` with column ``name`` replaced (type included)."""
    index = t.schema.get_field_index(name)
    return t.set_column(index, name, values)


def set_cell(t: pa.Table, name: str, row: int, value: object) -> pa.Table:
    """``t`` with one cell of column ``name`` changed (through Python: tests only)."""
    column = t.column(name).to_pylist()
    column[row] = value
    return replace(t, name, pa.array(column, t.schema.field(name).type))


def write(t: pa.Table, path: Path, **options: object) -> Path:
    """Write ``t`` as one Parquet file as a foreign pipeline would (no rtrl writer)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(t, path, **options)
    return path
