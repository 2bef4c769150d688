"""Which foreign column types the shard reader accepts, how they become canonical, and how
uncastable ones are rejected (from the schema alone, naming column and both types)."""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from rtrl.core.shards import (
    INTERACTION_SCHEMA,
    REQUIRED_COLUMNS,
    CastPlan,
    SchemaProblem,
    plan_casts,
)
from tests.rtrl.core.shards.helpers import replace, table

Variant = Callable[[pa.Table], pa.Table]


def _cast(name: str, target: pa.DataType) -> Variant:
    return lambda t: replace(t, name, t.column(name).cast(target, safe=False))


def _dictionary(name: str) -> Variant:
    return lambda t: replace(t, name, pc.dictionary_encode(t.column(name)))


def _fixed_size(name: str, value_type: pa.DataType) -> Variant:
    def variant(t: pa.Table) -> pa.Table:
        # Every row gets a list of the same length (2) so it fits a fixed_size_list.
        firsts = pc.list_slice(t.column(name), 0, 2).combine_chunks()
        values = firsts.flatten().cast(value_type)
        return replace(t, name, pa.FixedSizeListArray.from_arrays(values, 2))

    return variant


VARIANTS: dict[str, Variant] = {
    "timestamp[s]": _cast("created_at", pa.timestamp("s", tz="UTC")),
    "timestamp[ms] naive": _cast("created_at", pa.timestamp("ms")),
    "timestamp[ns] naive": _cast("feedback_at", pa.timestamp("ns")),
    "timestamp[ns] other zone": _cast("created_at", pa.timestamp("ns", tz="America/New_York")),
    "int64 token ids": _cast("completion_ids", pa.list_(pa.int64())),
    "int16 token ids": _cast("prompt_ids", pa.list_(pa.int16())),
    "uint32 token ids": _cast("prompt_ids", pa.list_(pa.uint32())),
    "large_list ids": _cast("completion_ids", pa.large_list(pa.int32())),
    "large_list int64 ids": _cast("prompt_ids", pa.large_list(pa.int64())),
    "large_list bool mask": _cast("completion_mask", pa.large_list(pa.bool_())),
    "fixed_size_list ids": _fixed_size("prompt_ids", pa.int64()),
    "large_string id": _cast("interaction_id", pa.large_string()),
    "dictionary org": _dictionary("org"),
    "dictionary checkpoint": _dictionary("checkpoint_id"),
    "dictionary large_string user": lambda t: replace(
        t, "user_id", pc.dictionary_encode(t.column("user_id").cast(pa.large_string()))
    ),
    "string_view user": _cast("user_id", pa.string_view()),
    "float64 logprobs": _cast("completion_logprobs", pa.list_(pa.float64())),
    "float16 logprobs": _cast("completion_logprobs", pa.list_(pa.float16())),
    "float32 edit_persisted": _cast("edit_persisted", pa.float32()),
    "int64 latency": lambda t: replace(
        t, "latency_ms", pc.round(t.column("latency_ms")).cast(pa.int64())
    ),
    "int64 signals": _cast("tool_calls", pa.int64()),
    "uint8 signals": _cast("edits_proposed", pa.uint8()),
    "all-null edit_persisted": lambda t: replace(
        t, "edit_persisted", pa.nulls(t.num_rows, pa.null())
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_compatible_types_cast_to_canonical(variant: str) -> None:
    canonical = table(20)
    foreign = VARIANTS[variant](canonical)
    plan = plan_casts(foreign.schema)
    assert isinstance(plan, CastPlan), plan
    assert plan.needs_cast
    for batch in foreign.to_batches():
        out = plan.apply(batch.select(plan.read_names))
        assert out.schema.equals(INTERACTION_SCHEMA)
        # Casting back from the foreign type gives the canonical values (up to the foreign
        # type's own precision), and instants do not move with the time zone.
        expected = pa.Table.from_batches([batch]).cast(INTERACTION_SCHEMA, safe=False)
        assert pa.Table.from_batches([out]).equals(expected)


def test_naive_timestamps_are_utc() -> None:
    canonical = table(5)
    naive = replace(
        canonical, "created_at", canonical.column("created_at").cast(pa.timestamp("us"))
    )
    plan = plan_casts(naive.schema)
    assert isinstance(plan, CastPlan)
    out = plan.apply(naive.to_batches()[0])
    assert out.column("created_at").equals(canonical.column("created_at").chunk(0))


def test_canonical_file_needs_no_cast() -> None:
    canonical = table(5)
    plan = plan_casts(canonical.schema)
    assert isinstance(plan, CastPlan)
    assert not plan.needs_cast
    batch = canonical.to_batches()[0]
    assert plan.apply(batch) is batch


def _problems(t: pa.Table) -> list[SchemaProblem]:
    result = plan_casts(t.schema)
    assert isinstance(result, list), "expected the schema to be rejected"
    return result


@pytest.mark.parametrize(
    ("name", "foreign", "shown"),
    [
        ("completion_ids", pa.list_(pa.string()), "list<item: string>"),
        ("prompt_ids", pa.list_(pa.float32()), "list<item: float>"),
        ("completion_logprobs", pa.list_(pa.int32()), "list<item: int32>"),
        ("completion_mask", pa.list_(pa.int8()), "list<item: int8>"),
        ("created_at", pa.string(), "string"),
        ("created_at", pa.date32(), "date32[day]"),
        ("latency_ms", pa.string(), "string"),
        ("tool_calls", pa.float64(), "double"),
        ("dissatisfied_followup", pa.int8(), "int8"),
        ("interaction_id", pa.int64(), "int64"),
    ],
)
def test_uncastable_types_are_rejected_with_both_types(
    name: str, foreign: pa.DataType, shown: str
) -> None:
    canonical = table(3)
    t = replace(canonical, name, pa.nulls(3, foreign))
    (problem,) = _problems(t)
    assert problem.column == name
    assert problem.reason == "wrong_type"
    assert repr(name) in problem.message
    assert shown in problem.message
    assert str(INTERACTION_SCHEMA.field(name).type) in problem.message


def test_struct_where_a_list_is_expected_is_rejected() -> None:
    canonical = table(3)
    struct = pa.array([{"ids": [1, 2]}] * 3)
    (problem,) = _problems(replace(canonical, "prompt_ids", struct))
    assert problem.reason == "wrong_type"
    assert "struct<ids: list<item: int64>>" in problem.message


def test_every_problem_is_reported_at_once() -> None:
    canonical = table(3)
    t = canonical.drop_columns(["org", "latency_ms"])
    t = replace(t, "completion_ids", pa.nulls(3, pa.list_(pa.string())))
    problems = _problems(t)
    assert {(p.column, p.reason) for p in problems} == {
        ("org", "missing_column"),
        ("latency_ms", "missing_column"),
        ("completion_ids", "wrong_type"),
    }
    assert "required column 'org' is missing" in [p.message for p in problems]


def test_duplicate_column_is_rejected() -> None:
    canonical = table(3)
    t = canonical.append_column("org", canonical.column("org"))
    (problem,) = _problems(t)
    assert (problem.column, problem.reason) == ("org", "wrong_type")


def test_extra_columns_pass_through_and_missing_extras_are_reported() -> None:
    canonical = table(3).append_column("session", pa.array(["a", "b", "c"], pa.large_string()))
    plan = plan_casts(canonical.schema, [*REQUIRED_COLUMNS, "session"])
    assert isinstance(plan, CastPlan)
    assert plan.schema.field("session").type == pa.large_string()
    missing = plan_casts(canonical.schema, ["interaction_id", "nope"])
    assert isinstance(missing, list)
    assert missing[0].message == "requested column 'nope' is missing"


def test_value_out_of_canonical_range_fails_the_cast() -> None:
    canonical = table(3)
    ids = pa.array([[1, 2**40]] * 3, pa.list_(pa.int64()))
    t = replace(canonical, "prompt_ids", ids)
    plan = plan_casts(t.schema)
    assert isinstance(plan, CastPlan)
    with pytest.raises(pa.ArrowInvalid, match="not in range"):
        plan.apply(t.to_batches()[0])


def test_checkpoint_id_from_the_hive_path_when_the_file_lacks_it() -> None:
    canonical = table(4).drop_columns(["checkpoint_id"])
    assert isinstance(plan_casts(canonical.schema), list)
    plan = plan_casts(canonical.schema, partitions={"checkpoint": "ckpt-9", "date": "x"})
    assert isinstance(plan, CastPlan)
    out = plan.apply(canonical.select(plan.read_names).to_batches()[0])
    assert out.schema.equals(INTERACTION_SCHEMA)
    assert out.column("checkpoint_id").to_pylist() == ["ckpt-9"] * 4
