"""Interaction shards: the Parquet files the serving fleet's logging pipelines write, and
the only doorway through which the rest of rtrl reads them.

- :mod:`~rtrl.core.shards.schema`: the canonical schema and which foreign types are accepted.
- :mod:`~rtrl.core.shards.reader`: streaming canonical reads (trusting the data).
- :mod:`~rtrl.core.shards.validate`: the validating reader pipeline steps use, and its report.
- :mod:`~rtrl.core.shards.statistics`: what the files' footers declare about their values
  (the token id range), read before any row.
- :mod:`~rtrl.core.shards.writer` / :mod:`~rtrl.core.shards.synthetic`: writing shards, and
  realistic synthetic ones for tests, benchmarks and the demo.
"""

from rtrl.core.shards.reader import (
    DEFAULT_BATCH_SIZE,
    ShardError,
    ShardFile,
    iter_batches,
    list_files,
)
from rtrl.core.shards.report import REASONS, FileReport, ValidationReport
from rtrl.core.shards.schema import (
    CANONICAL_COLUMNS,
    INTERACTION_SCHEMA,
    NON_NULL_COLUMNS,
    REQUIRED_COLUMNS,
    CastPlan,
    SchemaProblem,
    plan_casts,
)
from rtrl.core.shards.synthetic import synthetic_interactions
from rtrl.core.shards.validate import ValidatingReader, validate
from rtrl.core.shards.writer import write_shards

__all__ = [
    "CANONICAL_COLUMNS",
    "DEFAULT_BATCH_SIZE",
    "INTERACTION_SCHEMA",
    "NON_NULL_COLUMNS",
    "REASONS",
    "REQUIRED_COLUMNS",
    "CastPlan",
    "FileReport",
    "SchemaProblem",
    "ShardError",
    "ShardFile",
    "ValidatingReader",
    "ValidationReport",
    "iter_batches",
    "list_files",
    "plan_casts",
    "synthetic_interactions",
    "validate",
    "write_shards",
]
