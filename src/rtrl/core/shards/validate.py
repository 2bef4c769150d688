"""The validating reader: the only way pipeline steps read shards.

Shards come from pipelines this project does not control, so every file and row is judged
before anything learns from it: files that cannot be read or made canonical are rejected
whole; rows that break the contract (nulls where a row is useless, disagreeing completion
lists, impossible log-probs or signals, token ids outside the vocabulary, repeated
interaction ids) are quarantined. Only good
rows come out, and a running :class:`ValidationReport` says what was held back and why, so
nothing is silently dropped and nothing bad is silently passed on.

Every row is checked against the full contract whatever columns the consumer projects, so
"good" means the same thing to the stage step, the evaluator and the canary analysis.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from rtrl.core.shards.checks import DUPLICATE_INTERACTION_ID, check_rows
from rtrl.core.shards.dedup import SeenIds, hash_strings
from rtrl.core.shards.footer import OVER_LIMIT
from rtrl.core.shards.layout import PartitionFilter, resolve_store
from rtrl.core.shards.limits import TOO_LONG, oversized_strings
from rtrl.core.shards.reader import (
    DEFAULT_BATCH_SIZE,
    OpenShard,
    ShardError,
    ShardFile,
    UnreadableBatchError,
    declared_types,
    decoded,
    describe_error,
    list_files,
    open_parquet,
    output_columns,
    plan_file,
)
from rtrl.core.shards.report import (
    MAX_EXAMPLES,
    UNREADABLE,
    WRONG_TYPE,
    FileReport,
    ValidationReport,
)
from rtrl.core.shards.schema import CANONICAL_COLUMNS, CastPlan, SchemaProblem
from rtrl.core.store.base import ObjectStore


class ValidatingReader:
    """Iterate for the good rows of a shard set as canonical record batches; :attr:`report`
    is updated as iteration proceeds and is complete once the iterator is exhausted.

    Files are read in key order; of repeated interaction ids the first good occurrence is
    kept. ``columns`` projects the output (default: the required canonical columns; ask for
    :data:`~rtrl.core.shards.schema.CANONICAL_COLUMNS` to get the optional ones too): all
    canonical columns are read and checked whatever the projection (an optional one a file
    lacks is read as nulls, which pass). ``require`` names optional columns that a file must
    hold all the same (a consumer that cannot run without them, such as an analysis by
    session): a file without one is rejected as ``missing_column``.
    ``vocab_size`` is the vocabulary of the model the rows are for
    (:mod:`~rtrl.core.shards.vocabulary`): ids at or beyond it are quarantined, as negative
    ids always are.
    """

    def __init__(
        self,
        source: ObjectStore | str | os.PathLike[str],
        *,
        columns: Sequence[str] | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        prefix: str = "",
        partitions: PartitionFilter | None = None,
        vocab_size: int | None = None,
        require: Sequence[str] = (),
    ) -> None:
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.store = resolve_store(source)
        self.columns = output_columns(columns)
        self.batch_size = batch_size
        self.prefix = prefix
        self.partitions = partitions
        uri = self.store.url(prefix.strip("/") + "/") if prefix.strip("/") else self.store.uri
        self.vocab_size = vocab_size
        self.require = tuple(require)
        self.report = ValidationReport(uri=uri, vocab_size=vocab_size)
        self._read_columns = list(dict.fromkeys([*CANONICAL_COLUMNS, *self.columns]))
        self._project = self.columns != self._read_columns
        self._seen = SeenIds()

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        for _, batch in self.batches_by_file():
            yield batch

    def batches_by_file(self) -> Iterator[tuple[FileReport, pa.RecordBatch]]:
        """The good batches, each with the report of the file it came from: for a consumer
        that runs behind the reader (on another thread), for which the report's last file
        is not necessarily the batch's."""
        for shard in list_files(self.store, prefix=self.prefix, partitions=self.partitions):
            for batch in self._read_file(shard):
                yield self.report.files[-1], batch

    def _read_file(self, shard: ShardFile) -> Iterator[pa.RecordBatch]:
        file = FileReport(key=shard.key, url=shard.url)
        self.report.files.append(file)
        try:
            with open_parquet(self.store, shard) as opened:
                # What the footer plausibly holds, not what it claims (limits.check_footer).
                file.rows_total = opened.rows
                plan = plan_file(opened, shard, self._read_columns)
                absent = [
                    SchemaProblem(name, "missing_column", f"column {name!r} is missing")
                    for name in self.require
                    if not opened.schema.get_all_field_indices(name)
                ]
                if absent:
                    plan = [*absent, *(plan if not isinstance(plan, CastPlan) else [])]
                if not isinstance(plan, CastPlan):
                    file.status = "rejected"
                    for problem in plan:
                        lost = 0 if problem.reason in file.reasons else file.rows_total
                        file.add_problem(problem.reason, problem.message, rows=lost)
                    return
                first_row = 0
                for index in range(opened.num_row_groups):
                    yield from self._read_row_group(file, opened, index, first_row, plan)
                    first_row += opened.row_group_rows(index)
        except ShardError as exc:
            if exc.reason == OVER_LIMIT:
                # Beyond the limits, from its footer: rejected whole, none of it decoded.
                file.status = "rejected"
                file.rows_total = exc.rows
                file.add_problem(OVER_LIMIT, exc.detail, rows=exc.rows)
                return
            file.status = "unreadable"
            if exc.__cause__ is None:  # the footer contradicts itself (limits.check_footer)
                file.rows_total = exc.rows
                file.add_problem(UNREADABLE, exc.detail, rows=exc.rows)
            else:
                file.add_problem(UNREADABLE, describe_error(exc.__cause__))
            return
        if file.status == "ok" and file.rows_good < file.rows_total:
            file.status = "bad"

    def _read_row_group(
        self,
        file: FileReport,
        opened: OpenShard,
        index: int,
        first_row: int,
        plan: CastPlan,
    ) -> Iterator[pa.RecordBatch]:
        """The good rows of one row group; ``first_row`` is its first row in the file."""
        end = first_row + opened.row_group_rows(index)
        batches = opened.batches(plan.read_names, self.batch_size, row_group=index)
        try:
            for read in decoded(batches):
                raw, rows = read, read.num_rows
                numbers = np.arange(first_row, first_row + rows)
                first_row += rows
                oversized = oversized_strings(raw)
                if oversized is not None:
                    # Still dictionary-encoded: the rows that would decode beyond the
                    # limits go before a value of theirs is copied out.
                    mask, first, detail = oversized
                    examples = numbers[mask][:MAX_EXAMPLES].tolist()
                    file.add_rows(TOO_LONG, int(mask.sum()), examples,
                                  f"row {numbers[first]}: {detail}")  # fmt: skip
                    raw = raw.filter(pa.array(~mask))
                    numbers = numbers[~mask]
                try:
                    batch = plan.apply(declared_types(raw, opened.schema))
                except pa.ArrowInvalid as exc:
                    # A value that does not fit its canonical type (an int64 token id beyond
                    # int32): the cast is all-or-nothing per batch, so it is quarantined.
                    span = f"rows {numbers[0]}-{numbers[-1]}" if len(numbers) else "rows"
                    file.add_problem(
                        WRONG_TYPE, f"{span}: {describe_error(exc)}", rows=raw.num_rows
                    )
                    continue
                good = self._good_rows(file, batch, numbers)
                if good.num_rows:
                    file.rows_good += good.num_rows
                    yield good.select(self.columns) if self._project else good
        except UnreadableBatchError as exc:
            # A corrupt page: rows already passed on stay good, the rest of this row
            # group is lost and counted; the next row group may well be intact.
            file.status = "unreadable"
            file.add_problem(
                UNREADABLE,
                f"row group {index}, rows {first_row}-{end - 1}: {exc}",
                rows=end - first_row,
            )
            return
        if first_row < end:
            # A corrupt page header can make the decoder end a row group early without an
            # error (pyarrow yields nothing more of it): the footer says how many rows there
            # were (limits.check_footer found that plausible), so the missing ones are
            # counted, never silently lost.
            file.status = "unreadable"
            file.add_problem(
                UNREADABLE,
                f"row group {index}, rows {first_row}-{end - 1}: its pages ended before the "
                f"{end - first_row} rows the file's footer counts",
                rows=end - first_row,
            )

    def _good_rows(
        self, file: FileReport, batch: pa.RecordBatch, numbers: npt.NDArray[np.int64]
    ) -> pa.RecordBatch:
        """The rows of ``batch`` that pass every check; ``numbers`` are their row numbers
        in the file (for the report's examples)."""
        flags = check_rows(batch, self.vocab_size)
        ids = batch.column("interaction_id")
        # Only rows good on every other count claim their id: a quarantined row is never
        # trained on, so a later good copy of it is not a duplicate of anything used.
        candidates = flags.bad()
        candidates = None if candidates is None else ~candidates
        if ids.null_count:
            valid = np.asarray(ids.is_valid())
            candidates = valid if candidates is None else candidates & valid
        flags.flag(DUPLICATE_INTERACTION_ID, self._seen.add_batch(hash_strings(ids), candidates))
        bad = flags.bad()
        if bad is None:
            return batch
        for reason, mask in flags.reasons.items():
            rows = np.flatnonzero(mask)
            found = flags.details.get(reason)
            detail = None if found is None else f"row {numbers[found[0]]}: {found[1]}"
            file.add_rows(reason, int(rows.size), numbers[rows[:MAX_EXAMPLES]].tolist(), detail)
        return batch.filter(pa.array(~bad))


def validate(
    source: ObjectStore | str | os.PathLike[str],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    prefix: str = "",
    partitions: PartitionFilter | None = None,
    vocab_size: int | None = None,
) -> ValidationReport:
    """Read a whole shard set through the validating reader and return its report."""
    reader = ValidatingReader(
        source,
        columns=["interaction_id"],
        batch_size=batch_size,
        prefix=prefix,
        partitions=partitions,
        vocab_size=vocab_size,
    )
    for _ in reader:
        pass
    return reader.report
