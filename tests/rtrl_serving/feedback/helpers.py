"""Feedback events as clients send them, and the feedback files read back from a store."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rtrl.core.events import FEEDBACK_DIR, FEEDBACK_SCHEMA, new_interaction_id
from rtrl.core.store import ObjectStore

TOKEN = "fb-token-DO-NOT-LEAK-0123456789"
_counter = itertools.count()


def event(
    interaction_id: str | None = None,
    *,
    signal: str = "edit_persisted",
    value: Any = 0.5,
    observed_at: datetime | str | None = None,
    event_id: str | None = None,
    served: datetime | None = None,
) -> dict[str, Any]:
    """One valid event (served a minute ago unless ``served``), fields overridable."""
    served = served or datetime.now(UTC) - timedelta(minutes=1)
    interaction_id = interaction_id or new_interaction_id(served)
    observed = observed_at or served + timedelta(seconds=30)
    return {
        "event_id": event_id or f"ev-{next(_counter)}-{interaction_id[-8:]}",
        "interaction_id": interaction_id,
        "signal": signal,
        "value": value,
        "observed_at": observed if isinstance(observed, str) else observed.isoformat(),
    }


def stored_feedback(store: ObjectStore) -> pa.Table:
    """Every feedback event file under the store's feedback/, with its key as a column."""
    tables = []
    for info in store.list(f"{FEEDBACK_DIR}/"):
        with store.open_input(info.key) as handle:
            table = pq.read_table(handle)
        assert table.schema.equals(FEEDBACK_SCHEMA), info.key
        tables.append(table.append_column("key", pa.array([info.key] * table.num_rows)))
    if not tables:
        return FEEDBACK_SCHEMA.empty_table().append_column("key", pa.array([], pa.string()))
    return pa.concat_tables(tables)
