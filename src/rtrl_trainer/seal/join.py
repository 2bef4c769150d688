"""The join of one hour, in DuckDB: which generation rows are written, and each one's
final signals.

Only narrow columns enter the engine (ids, times, the proxy's own measurements, where each
row sits in its file); the token lists stay in the files and are read once, in file order,
by :mod:`~rtrl_trainer.seal.rows`. The engine works in memory under a memory limit and
spills its tables, sorts and hash tables to the step's scratch directory beyond it, so
memory stays flat however many interactions an hour holds.

The rules, each a table (ids as UUIDs: 16 bytes, any case; one that is not a UUID is
``invalid``):

- ``gen``: every generation row, with ``pos`` (file index << 32 | row in file), the total
  order of the input (event files in key order, rows in file order).
- ``kept``: one row per interaction id, the first by ``pos`` (the others are
  ``duplicates``), and why it will not be written, if so: served outside the hour,
  ``checkpoint_verified`` not true (``unverified``), or an engine status other than 2xx
  (``engine_errors``).
- ``fb_dups`` / ``fb_dropped``: the feedback events whose id occurs more than once (few:
  retries), and of each such id all but the first the service received (they are
  ``feedback_duplicates``; an id with two different contents counts once in
  ``feedback_conflicts``). Only the repeated ids are ordered, not every event, and they
  are found by the ids' hashes first.
- ``fb_class``: every other event judged against its interaction: ``orphans`` (no
  generation of that id in the hour: forged, or its generation lost), ``before_served``,
  ``late`` (observed after the interaction's ``created_at`` plus the signal's maturity),
  ``unknown_signal``, else ``valid``.
- ``signals``: per interaction and signal, the valid value observed last (ties: received
  last, then read last).

The decisions: the kept rows in input order with every signal (``signals`` pivoted, one
column each) merged with the proxy's own measurement by its
:class:`~rtrl.core.events.signals.Merge` rule.
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
    """The join of one hour's event files (local Parquet paths, in key order) in DuckDB,
    spilling to ``spill``; :meth:`counts` and :meth:`decisions` once built."""

    def __init__(self, *, memory_limit: str, threads: int, spill: Path) -> None:
        spill.mkdir(parents=True, exist_ok=True)
        self._counts: dict[str, int] = {}
        self._checkpoints: list[str | None] = []
        self.con = duckdb.connect(
            ":memory:",
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

    def _files(self, table: str, paths: Sequence[Path]) -> str:
        """A table of ``paths`` with their index; the read_parquet source of them."""
        self.con.execute(f"CREATE TABLE {table}(idx INTEGER, path VARCHAR)")
        if paths:
            self.con.executemany(
                f"INSERT INTO {table} VALUES (?, ?)", [(i, str(p)) for i, p in enumerate(paths)]
            )
        return f"read_parquet({_list(paths)}, filename=true, file_row_number=true)"

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
        pos = f"CAST(f.idx AS BIGINT) * {POS_SHIFT} + file_row_number"
        source = self._files("gen_files", generations)
        if generations:
            sql(
                f"""CREATE TABLE gen AS
                SELECT {pos} AS pos,
                       TRY_CAST(g.interaction_id AS UUID) AS iid,
                       epoch_us(g.created_at) AS created_us,
                       g.checkpoint_id, g.checkpoint_verified, g.status{captured}
                FROM {source} g JOIN gen_files f ON g.filename = f.path"""
            )
        else:
            columns = "".join(
                f", {name} {_SQL_TYPES[INTERACTION_SCHEMA.field(name).type]}" for name in CAPTURED
            )
            sql(f"""CREATE TABLE gen(pos BIGINT, iid UUID,
                created_us BIGINT, checkpoint_id VARCHAR, checkpoint_verified BOOLEAN,
                status INTEGER{columns})""")  # fmt: skip
        start = _us(hour)
        # only the columns read after it (file and row are in pos): less to hold, and to
        # spill beyond the memory limit, in the table that lives to the end
        captured = "".join(f", {name}" for name in CAPTURED)
        sql(
            f"""CREATE TABLE kept AS
            SELECT pos, iid, created_us{captured}, CASE
                WHEN created_us < $start OR created_us >= $end THEN 'outside_hour'
                WHEN NOT coalesce(checkpoint_verified, false) THEN 'unverified'
                WHEN status IS NULL OR status NOT BETWEEN 200 AND 299 THEN 'engine_errors'
                END AS dropped
            FROM gen WHERE iid IS NOT NULL AND created_us IS NOT NULL
            QUALIFY row_number() OVER (PARTITION BY iid ORDER BY pos) = 1""",
            {"start": start, "end": start + 3_600_000_000},
        )
        self._count_generations()
        source = self._files("fb_files", feedback)
        if feedback:
            sql(
                f"""CREATE TABLE fb AS
                SELECT e.event_id, hash(e.event_id) AS event_hash,
                       TRY_CAST(e.interaction_id AS UUID) AS iid, e.signal,
                       e.value, epoch_us(e.observed_at) AS observed_us,
                       epoch_us(e.received_at) AS received_us, {pos} AS pos
                FROM {source} e JOIN fb_files f ON e.filename = f.path"""
            )
        else:
            sql("""CREATE TABLE fb(event_id VARCHAR, event_hash UBIGINT, iid UUID,
                signal VARCHAR, value DOUBLE, observed_us BIGINT, received_us BIGINT,
                pos BIGINT)""")  # fmt: skip
        # the candidates by the ids' 64-bit hashes (grouping integers is several times
        # cheaper than grouping strings); a collision only adds a candidate, which the
        # steps below, by the id itself, then treat as the single event it is
        sql(
            """CREATE TABLE fb_dups AS SELECT * FROM fb
            WHERE event_id IS NOT NULL AND event_hash IN (
                SELECT event_hash FROM fb WHERE event_id IS NOT NULL
                GROUP BY event_hash HAVING count(*) > 1)"""
        )
        sql(
            """CREATE TABLE fb_dropped AS SELECT pos FROM fb_dups
            QUALIFY row_number() OVER (
                PARTITION BY event_id ORDER BY received_us NULLS LAST, pos) > 1"""
        )
        sql(
            """CREATE TABLE fb_class AS
            SELECT f.iid, f.signal, f.value, f.observed_us, f.received_us, f.pos,
              CASE WHEN f.event_id IS NULL OR f.iid IS NULL OR f.signal IS NULL
                        OR f.value IS NULL OR f.observed_us IS NULL THEN 'feedback_invalid'
                   WHEN m.signal IS NULL THEN 'unknown_signal'
                   WHEN k.iid IS NULL THEN 'orphans'
                   WHEN f.observed_us < k.created_us THEN 'before_served'
                   WHEN f.observed_us > k.created_us + m.maturity THEN 'late'
                   ELSE 'valid' END AS verdict
            FROM fb f ANTI JOIN fb_dropped d USING (pos)
            LEFT JOIN kept k USING (iid) LEFT JOIN maturity m USING (signal)"""
        )
        self._count_feedback()
        # one group per interaction and signal (one filtered aggregate per signal over
        # groups of interactions cost four times as much); :meth:`decisions` pivots them
        sql(
            """CREATE TABLE signals AS SELECT iid, signal, arg_max(value,
                {'o': observed_us, 'r': coalesce(received_us, -1), 'p': pos}) AS value
            FROM fb_class WHERE verdict = 'valid' GROUP BY iid, signal"""
        )
        self._count_verdicts()

    def _one(self, query: str) -> tuple[int, ...]:
        rows = self.con.execute(query).fetchall()  # fetched whole: the result is complete
        return tuple(int(v or 0) for v in rows[0])

    def _pairs(self, query: str) -> dict[str, int]:
        return {str(k): int(v) for k, v in self.con.execute(query).fetchall()}

    # Each table is counted, and dropped, as soon as the next is built from it: the join's
    # memory then holds two of them at a time, not all, and spills less.

    def _count_generations(self) -> None:
        counts = self._counts
        generations, invalid = self._one(
            "SELECT count(*), count(*) FILTER (WHERE iid IS NULL OR created_us IS NULL) FROM gen"
        )
        counts["generations"] = generations
        counts["invalid"] = invalid
        kept = self._pairs("SELECT coalesce(dropped, 'kept'), count(*) FROM kept GROUP BY 1")
        counts["duplicates"] = generations - invalid - sum(kept.values())
        for name in ("outside_hour", "unverified", "engine_errors"):
            counts[name] = kept.get(name, 0)
        rows = self.con.execute("SELECT DISTINCT checkpoint_id FROM gen").fetchall()
        self._checkpoints = [row[0] for row in rows]
        self.con.execute("DROP TABLE gen")

    def _count_feedback(self) -> None:
        counts = self._counts
        (counts["feedback_events"],) = self._one("SELECT count(*) FROM fb")
        (counts["feedback_duplicates"],) = self._one("SELECT count(*) FROM fb_dropped")
        (counts["feedback_conflicts"],) = self._one(
            "SELECT count(*) FROM (SELECT event_id FROM fb_dups GROUP BY event_id "
            "HAVING count(DISTINCT hash(iid, signal, value, observed_us)) > 1)"
        )
        self.con.execute("DROP TABLE fb")

    def _count_verdicts(self) -> None:
        counts = self._counts
        verdicts = self._pairs("SELECT verdict, count(*) FROM fb_class GROUP BY 1")
        for name in ("feedback_invalid", "orphans", "before_served", "late", "unknown_signal"):
            counts[name] = verdicts.get(name, 0)
        (counts["feedback_used"],) = self._one("SELECT count(value) FROM signals")
        self.con.execute("DROP TABLE fb_class")

    def counts(self) -> dict[str, int]:
        """What the join counted (every name always present)."""
        return dict(self._counts)

    def checkpoints(self) -> list[str | None]:
        """The checkpoint ids of the hour's generation rows (the shard partitions the
        hour's files can be in)."""
        return list(self._checkpoints)

    def decisions(self, batch_size: int) -> pa.RecordBatchReader:
        """The rows to write, in input order: ``file``, ``row`` and every signal column,
        merged, in canonical types."""
        merged = ", ".join(_signal_expr(name) for name in SIGNALS)
        pivot = ", ".join(
            f"any_value(value) FILTER (WHERE signal = {_quote(name)}) AS {name}" for name in SIGNALS
        )
        query = f"""
            SELECT CAST(k.pos // {POS_SHIFT} AS INTEGER) AS file, k.pos % {POS_SHIFT} AS row,
                   {merged}
            FROM kept k LEFT JOIN (SELECT iid, {pivot} FROM signals GROUP BY iid) p
                USING (iid)
            WHERE k.dropped IS NULL ORDER BY k.pos"""
        reader: pa.RecordBatchReader = self.con.sql(query).to_arrow_reader(batch_size)
        return reader
