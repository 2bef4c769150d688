"""The canonical schema of interaction shards, and the rules for accepting other pipelines'.

Shards are written by logging pipelines this project does not own, with whatever Arrow
types their writers happened to choose: nanosecond or millisecond timestamps, naive or
zoned, int64 token ids, ``large_list``, dictionary-encoded strings. Everything downstream
(staging, rewards, the trainer, the canary analysis) must see one set of types, so every
file is checked once, from its footer schema, and either gets a :class:`CastPlan` to the
canonical types or a list of :class:`SchemaProblem` saying why it cannot be used.

Compatibility is decided by explicit rules, not by whether pyarrow can cast: pyarrow
happily parses the string ``"17"`` into an integer, but string token ids mean the
producing pipeline is broken and the file must be rejected, not silently reinterpreted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

TIMESTAMP = pa.timestamp("us", tz="UTC")

# Arrow-level nullability is left permissive on purpose: foreign writers declare every field
# nullable, and the null policy is enforced row by row by the validator (NON_NULL_COLUMNS),
# which quarantines offending rows instead of failing whole files.
INTERACTION_SCHEMA = pa.schema(
    [
        pa.field("interaction_id", pa.string()),
        pa.field("checkpoint_id", pa.string()),
        pa.field("user_id", pa.string()),
        pa.field("org", pa.string()),
        pa.field("created_at", TIMESTAMP),
        pa.field("feedback_at", TIMESTAMP),
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("completion_ids", pa.list_(pa.int32())),
        pa.field("completion_logprobs", pa.list_(pa.float32())),
        pa.field("completion_mask", pa.list_(pa.bool_())),
        pa.field("edit_persisted", pa.float64()),
        pa.field("dissatisfied_followup", pa.bool_()),
        pa.field("latency_ms", pa.float64()),
        pa.field("tool_calls", pa.int32()),
        pa.field("invalid_tool_calls", pa.int32()),
        pa.field("asked_clarification", pa.bool_()),
        pa.field("edits_proposed", pa.int32()),
    ]
)

REQUIRED_COLUMNS: tuple[str, ...] = tuple(INTERACTION_SCHEMA.names)

# How the engine sampled each completion and what its log-probs mean. The trainer computes
# its log-probs under the same distribution (temperature; top-p/top-k truncation where the
# engine logged processed log-probs), so these travel from the capture proxy through the
# seal into the shards. They are optional: a shard without them was sampled at temperature
# 1 from the full distribution, and its log-probs are the engine's raw ones.
SAMPLING_COLUMNS: tuple[pa.Field, ...] = (
    pa.field("temperature", pa.float32()),  # as sampled; null: 1.0
    pa.field("top_p", pa.float32()),  # null: 1.0 (no truncation)
    pa.field("top_k", pa.int32()),  # null, 0 or -1: no truncation
    # vLLM's --logprobs-mode: raw_logprobs (before temperature and truncation, vLLM's
    # default) or processed_logprobs (of the distribution actually sampled from); null: raw
    pa.field("logprobs_mode", pa.string()),
    pa.field("serving_dtype", pa.string()),  # the engine's weights dtype: float32, bfloat16
)

# Canonical columns a shard may lack (read as null when absent): the sampling parameters,
# and who was served in which arm (written by the seal step from the capture proxy's events).
OPTIONAL_SCHEMA = pa.schema(
    [
        *SAMPLING_COLUMNS,
        pa.field("arm", pa.string()),  # stable | canary: the arm that served it
        pa.field("session_id", pa.string()),
    ]
)
OPTIONAL_COLUMNS: tuple[str, ...] = tuple(OPTIONAL_SCHEMA.names)
# Every canonical column: the required ones, then the optional ones. A read without a
# projection yields these, an optional column a file lacks as nulls.
CANONICAL_SCHEMA = pa.schema([*INTERACTION_SCHEMA, *OPTIONAL_SCHEMA])
CANONICAL_COLUMNS: tuple[str, ...] = tuple(CANONICAL_SCHEMA.names)

# Columns a row is useless without: identity, on-policy tag, time, and the token streams the
# trainer consumes. Signals may be null (edit_persisted is null until it matures; other
# signals may be missing from a client that does not report them).
NON_NULL_COLUMNS: frozenset[str] = frozenset(
    {
        "interaction_id",
        "checkpoint_id",
        "created_at",
        "prompt_ids",
        "completion_ids",
        "completion_logprobs",
        "completion_mask",
    }
)

# Per-token lists that describe the same completion and must have equal lengths per row.
COMPLETION_LIST_COLUMNS: tuple[str, ...] = (
    "completion_ids",
    "completion_logprobs",
    "completion_mask",
)

# The token id lists: the ids the model embeds, which must lie in its vocabulary.
TOKEN_ID_COLUMNS: tuple[str, ...] = ("prompt_ids", "completion_ids")

# Canonical columns whose value a Hive partition of the same meaning can supply.
PATH_COLUMNS: dict[str, str] = {"checkpoint_id": "checkpoint", "org": "org"}

# Scalar float signals may arrive as integers (e.g. latency in whole milliseconds, a
# temperature of 1, a top_p of 1); token log-probs may not, since an integer log-prob column
# means the wrong column was written.
_INT_ACCEPTED_AS_FLOAT: frozenset[str] = frozenset(
    {"edit_persisted", "latency_ms", "temperature", "top_p"}
)


@dataclass(frozen=True)
class SchemaProblem:
    """Why one column of a file cannot be used; ``reason`` is a validator reason code."""

    column: str
    reason: str  # "missing_column" | "wrong_type"
    message: str


@dataclass(frozen=True)
class ColumnCast:
    """How one column is brought to its canonical type. ``options`` is None when the column
    already has it and passes through untouched; ``constant`` is set when the column is not
    in the file but its value is in the file's Hive path (read from there instead);
    ``absent`` when it is an optional canonical column the file does not have (read as
    nulls: what a null means is the column's documented default)."""

    name: str
    source: pa.DataType
    target: pa.DataType
    options: pc.CastOptions | None
    constant: str | None = None
    absent: bool = False

    @property
    def from_file(self) -> bool:
        """Whether the column is read from the file (not from its path, nor absent)."""
        return self.constant is None and not self.absent


@dataclass(frozen=True)
class CastPlan:
    """The per-file recipe turning record batches read with :attr:`read_names` into
    canonical ones with the columns asked for, in that order.

    Columns outside the canonical schema (extras a consumer asked for) pass through as they
    are. ``needs_cast`` is False for files already written in canonical types, so the common
    case costs nothing per batch.
    """

    columns: tuple[ColumnCast, ...]
    schema: pa.Schema

    @property
    def names(self) -> list[str]:
        """The output columns."""
        return [c.name for c in self.columns]

    @property
    def read_names(self) -> list[str]:
        """The columns to read from the file (those not supplied by the path)."""
        return [c.name for c in self.columns if c.from_file]

    @property
    def needs_cast(self) -> bool:
        return any(c.options is not None or not c.from_file for c in self.columns)

    def apply(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Cast ``batch`` (read with exactly :attr:`read_names`, in that order) to
        :attr:`schema`.

        Raises ``pyarrow.ArrowInvalid`` when a value does not fit its canonical type (an int64
        token id beyond int32); callers treat that as a bad batch, not a bad process.
        """
        if not self.needs_cast:
            return batch
        arrays = []
        read = iter(batch.columns)
        for spec in self.columns:
            if spec.constant is not None:
                arrays.append(pa.repeat(pa.scalar(spec.constant, spec.target), batch.num_rows))
                continue
            if spec.absent:
                arrays.append(pa.nulls(batch.num_rows, spec.target))
                continue
            array = next(read)
            arrays.append(array if spec.options is None else pc.cast(array, options=spec.options))
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


def _is_string_like(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return _is_string_like(t.value_type)
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t))


def _is_list_like(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))


def _scalar_compatible(name: str, source: pa.DataType, target: pa.DataType) -> bool:
    if pa.types.is_string(target):
        return _is_string_like(source)
    if pa.types.is_timestamp(target):
        return bool(pa.types.is_timestamp(source))
    if pa.types.is_floating(target):
        if pa.types.is_floating(source):
            return True
        return name in _INT_ACCEPTED_AS_FLOAT and bool(pa.types.is_integer(source))
    if pa.types.is_integer(target):
        return bool(pa.types.is_integer(source))
    if pa.types.is_boolean(target):
        return bool(pa.types.is_boolean(source))
    return bool(source.equals(target))


def is_compatible(name: str, source: pa.DataType, target: pa.DataType) -> bool:
    """Whether column ``name`` of type ``source`` may be cast to canonical ``target``.

    An all-null column (Arrow's ``null`` type, what writers produce for a column with no
    value yet, e.g. ``edit_persisted`` before maturity) is compatible with everything; the
    validator then judges its nulls like any others.
    """
    if pa.types.is_null(source):
        return True
    if _is_list_like(target):
        return _is_list_like(source) and _scalar_compatible(
            name, source.value_type, target.value_type
        )
    return _scalar_compatible(name, source, target)


def _cast_options(source: pa.DataType, target: pa.DataType) -> pc.CastOptions | None:
    if source.equals(target):
        return None
    # Sub-microsecond precision is noise for interaction times; refusing nanosecond files
    # over it would reject most pandas-written shards.
    truncate = pa.types.is_timestamp(target)
    return pc.CastOptions(target, allow_time_truncate=truncate)


def plan_casts(
    schema: pa.Schema,
    columns: Sequence[str] = REQUIRED_COLUMNS,
    *,
    partitions: Mapping[str, str] | None = None,
) -> CastPlan | list[SchemaProblem]:
    """Decide, from a file's Arrow schema alone, how to read ``columns`` canonically.

    Every named column must exist, except the optional canonical ones
    (:data:`OPTIONAL_COLUMNS`), read as nulls when a file lacks them (a shard written before
    they existed); canonical ones must have a compatible type and are cast, others (extras
    a consumer asked for) pass through as they are. ``partitions`` are the
    Hive values of the file's path: writers that partition by checkpoint commonly drop
    ``checkpoint_id`` from the files (pyarrow.dataset and Spark do), so a missing
    ``checkpoint_id`` is taken from ``checkpoint=<id>`` in the path.

    Returns a :class:`CastPlan` with the columns in the order given, or every problem found
    (not just the first), so a report names all that is wrong with a file at once.
    """
    names: list[str] = list(dict.fromkeys(columns))
    problems: list[SchemaProblem] = []
    plan: list[ColumnCast] = []
    fields: list[pa.Field] = []
    for name in names:
        indices = schema.get_all_field_indices(name)
        path_value = (partitions or {}).get(PATH_COLUMNS.get(name, ""))
        if not indices and path_value is not None:
            target = INTERACTION_SCHEMA.field(name).type
            plan.append(ColumnCast(name, target, target, None, constant=path_value))
            fields.append(INTERACTION_SCHEMA.field(name))
            continue
        if not indices and name in OPTIONAL_COLUMNS:
            optional = OPTIONAL_SCHEMA.field(name)
            plan.append(ColumnCast(name, pa.null(), optional.type, None, absent=True))
            fields.append(optional)
            continue
        if not indices:
            where = "required column" if name in REQUIRED_COLUMNS else "requested column"
            problems.append(SchemaProblem(name, "missing_column", f"{where} {name!r} is missing"))
            continue
        if len(indices) > 1:
            problems.append(
                SchemaProblem(name, "wrong_type", f"column {name!r} appears {len(indices)} times")
            )
            continue
        field = schema.field(indices[0])
        if name not in CANONICAL_COLUMNS:
            plan.append(ColumnCast(name, field.type, field.type, None))
            fields.append(field)
            continue
        canonical = CANONICAL_SCHEMA.field(name)
        if not is_compatible(name, field.type, canonical.type):
            problems.append(
                SchemaProblem(
                    name,
                    "wrong_type",
                    f"column {name!r} has type {field.type}, which cannot be cast to "
                    f"the canonical {canonical.type}",
                )
            )
            continue
        options = _cast_options(field.type, canonical.type)
        plan.append(ColumnCast(name, field.type, canonical.type, options))
        fields.append(canonical)
    if problems:
        return problems
    return CastPlan(columns=tuple(plan), schema=pa.schema(fields))
