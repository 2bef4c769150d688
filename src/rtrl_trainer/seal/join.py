"""The join of one hour, in DuckDB: which generation rows are written, and each one's
final signals.

Only narrow columns enter the engine (ids, times, the proxy's own measurements, where each
row sits in its file); the token lists stay in the files and are read once, in file order,
by :mod:`~rtrl_trainer.seal.rows`. The engine works in a database file in the step's
scratch directory under a memory limit, spilling sorts, windows and hash tables there
beyond it, so memory stays flat however many interactions an hour holds.

The rules, each a table:

- ``gen``: every generation row, with ``pos`` (file index << 32 | row in file), the total
  order of the input (event files in key order, rows in file order).
- ``kept``: one row per interaction id, the first by ``pos`` (the others are
  ``duplicates``), and why it will not be written, if so: no id or time (``invalid``),
  served outside the hour, ``checkpoint_verified`` not true (``unverified``), or an engine
  status other than 2xx (``engine_errors``).
- ``fb_first``: one feedback event per event id, the first the service received (the
  others are ``feedback_duplicates``; an id with two different contents counts once in
  ``feedback_conflicts``).
- ``fb_class``: each such event judged against its interaction: ``orphans`` (no
  generation of that id in the hour: forged, or its generation lost), ``before_served``,
  ``late`` (observed after the interaction's ``created_at`` plus the signal's maturity),
  ``unknown_signal``, else ``valid``.
- ``last``: per interaction and signal, the valid value observed last (ties: received
  last, then read last).

The decisions: the kept rows in input order with every signal merged with the proxy's
own measurement by its :class:`~rtrl.core.events.signals.Merge` rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import pyarrow as pa

from rtrl.core.events import SIGNALS
from rtrl.core.events.signals import Merge
from rtrl.core.shards.schema import INTERACTION_SCHEMA

POS_SHIFT = 1 << 32

# DuckDB's spelling of each signal column's canonical type.
_SQL_TYPES = {pa.float64(): "DOUBLE", pa.int32(): "INTEGER", pa.bool_(): "BOOLEAN"}
# The proxy's own measurement of a signal is the generation column of the same name.
CAPTURED = tuple(name for name, s in SIGNALS.items() if s.merge is not Merge.FEEDBACK_ONLY)


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _list(paths: Sequence[Path]) -> str:
    return "[" + ", ".join(_quote(str(p)) for p in paths) + "]"


def _us(moment: datetime) -> int:
    """Microseconds since the epoch, the unit of the events' timestamps."""
    delta = moment.astimezone(UTC) - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _signal_expr(name: str) -> str:
    """The merged value of one signal column for a kept row ``k`` and pivot ``p``."""
    target = INTERACTION_SCHEMA.field(name).type
    raw = f"p.{name}"
    value = f"({raw} <> 0)" if target == pa.bool_() else f"CAST({raw} AS {_SQL_TYPES[target]})"
    merge = SIGNALS[name].merge
    if merge is Merge.REPLACES_CAPTURE:
        value = f"coalesce({value}, k.{name})"
    elif merge is Merge.MAX_WITH_CAPTURE:
        value = f"greatest({value}, k.{name})"  # NULLs ignored: either alone counts
    return f"{value} AS {name}"


class HourJoin:
    """The join of one hour's event files (local Parquet paths, in key order) in the
    DuckDB database ``database``; :meth:`counts` and :meth:`decisions` once built."""

    def __init__(
        self,
        database: Path,
        *,
        memory_limit: str,
        threads: int,
        spill: Path,
    ) -> None:
        spill.mkdir(parents=True, exist_ok=True)
        self.con = duckdb.connect(
            str(database),
            config={
                "memory_limit": memory_limit,
                "threads": threads,
                "temp_directory": str(spill),
                "preserve_insertion_order": False,
                # nothing is fetched at run time (a Job pod may have no way out); times
                # are compared as microseconds since the epoch, which needs no time zone
                "autoinstall_known_extensions": False,
                "autoload_known_extensions": False,
            },
        )

    def close(self) -> None:
        self.con.close()

    def build(
        self,
        hour: datetime,
        generations: Sequence[Path],
        feedback: Sequence[Path],
        maturity: dict[str, timedelta],
    ) -> None:
        sql = self.con.execute
        sql("CREATE TABLE maturity(signal VARCHAR, maturity BIGINT)")
        self.con.executemany(
            "INSERT INTO maturity VALUES (?, ?)",
            [(name, int(m.total_seconds() * 1_000_000)) for name, m in maturity.items()],
        )
        captured = "".join(f", g.{name}" for name in CAPTURED)
        if generations:
            source = f"read_parquet({_list(generations)}, filename=true, file_row_number=true)"
            files = ", ".join(f"({i}, {_quote(str(p))})" for i, p in enumerate(generations))
            sql(f"CREATE TABLE gen_files(idx INTEGER, path VARCHAR); "
                f"INSERT INTO gen_files VALUES {files}")  # fmt: skip
            sql(
                f"""CREATE TABLE gen AS
                SELECT f.idx AS file, g.file_row_number AS row,
                       CAST(f.idx AS BIGINT) * {POS_SHIFT} + g.file_row_number AS pos,
                       lower(g.interaction_id) AS interaction_id,
                       epoch_us(g.created_at) AS created_us,
                       g.checkpoint_id, g.checkpoint_verified, g.status{captured}
                FROM {source} g JOIN gen_files f ON g.filename = f.path"""
            )
        else:
            columns = "".join(
                f", {name} {_SQL_TYPES[INTERACTION_SCHEMA.field(name).type]}" for name in CAPTURED
            )
            sql(f"""CREATE TABLE gen(file INTEGER, row BIGINT, pos BIGINT,
                interaction_id VARCHAR, created_us BIGINT, checkpoint_id VARCHAR,
                checkpoint_verified BOOLEAN, status INTEGER{columns})""")  # fmt: skip
        start = _us(hour)
        end = start + 3_600_000_000
        sql(
            """CREATE TABLE kept AS
            SELECT *, CASE
                WHEN created_us < $start OR created_us >= $end THEN 'outside_hour'
                WHEN NOT coalesce(checkpoint_verified, false) THEN 'unverified'
                WHEN status IS NULL OR status NOT BETWEEN 200 AND 299 THEN 'engine_errors'
                END AS dropped
            FROM gen WHERE interaction_id IS NOT NULL AND created_us IS NOT NULL
            QUALIFY row_number() OVER (PARTITION BY interaction_id ORDER BY pos) = 1""",
            {"start": start, "end": end},
        )
        if feedback:
            files = ", ".join(f"({i}, {_quote(str(p))})" for i, p in enumerate(feedback))
            sql(f"CREATE TABLE fb_files(idx INTEGER, path VARCHAR); "
                f"INSERT INTO fb_files VALUES {files}")  # fmt: skip
            sql(
                f"""CREATE TABLE fb AS
                SELECT e.event_id, lower(e.interaction_id) AS interaction_id, e.signal,
                       e.value, epoch_us(e.observed_at) AS observed_us,
                       epoch_us(e.received_at) AS received_us,
                       CAST(f.idx AS BIGINT) * {POS_SHIFT} + e.file_row_number AS pos
                FROM read_parquet({_list(feedback)}, filename=true, file_row_number=true) e
                JOIN fb_files f ON e.filename = f.path"""
            )
        else:
            sql("""CREATE TABLE fb(event_id VARCHAR, interaction_id VARCHAR, signal VARCHAR,
                value DOUBLE, observed_us BIGINT, received_us BIGINT,
                pos BIGINT)""")  # fmt: skip
        sql(
            """CREATE TABLE fb_first AS SELECT * FROM fb
            WHERE event_id IS NOT NULL AND interaction_id IS NOT NULL AND signal IS NOT NULL
              AND value IS NOT NULL AND observed_us IS NOT NULL
            QUALIFY row_number() OVER (
                PARTITION BY event_id ORDER BY received_us NULLS LAST, pos) = 1"""
        )
        sql(
            """CREATE TABLE fb_class AS
            SELECT f.interaction_id, f.signal, f.value, f.observed_us, f.received_us, f.pos,
              CASE WHEN m.signal IS NULL THEN 'unknown_signal'
                   WHEN k.interaction_id IS NULL THEN 'orphans'
                   WHEN f.observed_us < k.created_us THEN 'before_served'
                   WHEN f.observed_us > k.created_us + m.maturity THEN 'late'
                   ELSE 'valid' END AS verdict
            FROM fb_first f LEFT JOIN kept k USING (interaction_id)
            LEFT JOIN maturity m USING (signal)"""
        )
        sql(
            """CREATE TABLE last AS
            SELECT interaction_id, signal, value FROM fb_class WHERE verdict = 'valid'
            QUALIFY row_number() OVER (PARTITION BY interaction_id, signal
                ORDER BY observed_us DESC, received_us DESC NULLS LAST, pos DESC) = 1"""
        )

    def _one(self, query: str) -> tuple[int, ...]:
        rows = self.con.execute(query).fetchall()  # fetched whole: the result is complete
        return tuple(int(v) for v in rows[0])

    def _pairs(self, query: str) -> dict[str, int]:
        return {str(k): int(v) for k, v in self.con.execute(query).fetchall()}

    def counts(self) -> dict[str, int]:
        """What the join counted (every name always present)."""
        counts: dict[str, int] = {}
        generations, invalid = self._one(
            "SELECT count(*), count(*) FILTER (WHERE interaction_id IS NULL "
            "OR created_us IS NULL) FROM gen"
        )
        counts["generations"] = generations
        counts["invalid"] = invalid
        kept = self._pairs("SELECT coalesce(dropped, 'kept'), count(*) FROM kept GROUP BY 1")
        counts["duplicates"] = generations - invalid - sum(kept.values())
        for name in ("outside_hour", "unverified", "engine_errors"):
            counts[name] = kept.get(name, 0)
        events, ided = self._one(
            "SELECT count(*), count(*) FILTER (WHERE event_id IS NOT NULL AND interaction_id "
            "IS NOT NULL AND signal IS NOT NULL AND value IS NOT NULL AND observed_us IS NOT "
            "NULL) FROM fb"
        )
        (first,) = self._one("SELECT count(*) FROM fb_first")
        (conflicts,) = self._one(
            "SELECT count(*) FROM (SELECT event_id FROM fb WHERE event_id IS NOT NULL "
            "GROUP BY event_id HAVING count(DISTINCT hash(interaction_id, signal, value, "
            "observed_us)) > 1)"
        )
        counts["feedback_events"] = events
        counts["feedback_invalid"] = events - ided
        counts["feedback_duplicates"] = ided - first
        counts["feedback_conflicts"] = conflicts
        verdicts = self._pairs("SELECT verdict, count(*) FROM fb_class GROUP BY 1")
        for name in ("orphans", "before_served", "late", "unknown_signal"):
            counts[name] = verdicts.get(name, 0)
        (counts["feedback_used"],) = self._one("SELECT count(*) FROM last")
        return counts

    def checkpoints(self) -> list[str | None]:
        """The checkpoint ids of the hour's generation rows (the shard partitions the
        hour's files can be in)."""
        rows = self.con.execute("SELECT DISTINCT checkpoint_id FROM gen").fetchall()
        return [row[0] for row in rows]

    def decisions(self, batch_size: int) -> pa.RecordBatchReader:
        """The rows to write, in input order: ``file``, ``row`` and every signal column,
        merged, in canonical types."""
        pivot = ", ".join(
            f"max(value) FILTER (WHERE signal = {_quote(name)}) AS {name}" for name in SIGNALS
        )
        merged = ", ".join(_signal_expr(name) for name in SIGNALS)
        query = f"""
            WITH p AS (SELECT interaction_id, {pivot} FROM last GROUP BY interaction_id)
            SELECT k.file, k.row, {merged}
            FROM kept k LEFT JOIN p USING (interaction_id)
            WHERE k.dropped IS NULL ORDER BY k.pos"""
        reader: pa.RecordBatchReader = self.con.sql(query).to_arrow_reader(batch_size)
        return reader
