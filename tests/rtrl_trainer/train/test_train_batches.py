"""From the staged set to micro-batches (rtrl_trainer.train.examples and .batches): rows to
ranks, the checks that name a bad row, truncation, the schedule every rank agrees on, and
the loss grid that lines each completion token up with the logits that predict it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rtrl.core.results import ResultError, StageResult
from rtrl_trainer.train.batches import (
    collate,
    epoch_micro_batches,
    make_schedule,
    step_micro_batches,
    step_tokens,
)
from rtrl_trainer.train.examples import (
    DataError,
    Example,
    Skipped,
    assign_files,
    check_skipped,
    max_bad_fraction,
    read_rank,
)
from rtrl_trainer.train.forward import token_logprobs
from tests.rtrl_trainer.trainset import (
    LIST_TRAINSET_SCHEMA,
    TRAINSET_SCHEMA,
    Row,
    completion_logprobs,
    tiny_gpt2,
)


def _write(path: Path, rows: list[Row]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([r.record() for r in rows], schema=TRAINSET_SCHEMA), path)
    return path


def _rows(n: int, start: int = 0) -> list[Row]:
    return [Row(prompt=[start + i, 1], completion=[2, 3, 4], advantage=1.0) for i in range(n)]


def _read(
    paths: list[tuple[str, Path]], rank: int = 0, world: int = 1, **kw: object
) -> list[Example]:
    one_per_rank = kw.pop("one_per_rank", False)
    data = read_rank(
        paths,
        rank=rank,
        world_size=world,
        one_per_rank=bool(one_per_rank),
        vocab_size=int(kw.pop("vocab_size", 260)),  # type: ignore[call-overload]
        max_sequence_length=int(kw.pop("max_len", 64)),  # type: ignore[call-overload]
    )
    return data.examples


def test_one_file_per_rank_when_the_counts_match() -> None:
    names = [f"train/rank-0000{i}-of-00002.parquet" for i in (1, 0)] + ["stage.json"]
    assert assign_files(names, 2) == (
        True,
        ["train/rank-00000-of-00002.parquet", "train/rank-00001-of-00002.parquet"],
    )
    assert assign_files(names, 3)[0] is False
    assert assign_files(names, 1)[0] is False
    with pytest.raises(DataError, match="no train/rank"):
        assign_files(["stage.json"], 1)


def test_striding_gives_every_row_to_exactly_one_rank(tmp_path: Path) -> None:
    # Three files of 5, 2 and 4 rows read by two ranks: global rows 0..10 alternate.
    paths = [
        (
            f"train/rank-0000{i}-of-00003.parquet",
            _write(tmp_path / f"{i}.parquet", _rows(n, 10 * i)),
        )
        for i, n in enumerate((5, 2, 4))
    ]
    seen = []
    for rank in (0, 1):
        seen.append([int(e.input_ids[0]) for e in _read(paths, rank=rank, world=2)])
    everything = [10 * i + j for i, n in enumerate((5, 2, 4)) for j in range(n)]
    assert seen[0] == everything[0::2]
    assert seen[1] == everything[1::2]


def test_one_file_per_rank_reads_only_its_file(tmp_path: Path) -> None:
    paths = [
        (
            f"train/rank-0000{i}-of-00002.parquet",
            _write(tmp_path / f"{i}.parquet", _rows(3, 10 * i)),
        )
        for i in (0, 1)
    ]
    rows = _read(paths, rank=1, world=2, one_per_rank=True)
    assert [int(e.input_ids[0]) for e in rows] == [10, 11, 12]
    assert rows[0].source == "train/rank-00001-of-00002.parquet row 0"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            Row(prompt=[1], completion=[2, 3], advantage=1, logprobs=[0.0]),
            "completion_logprobs and completion_ids differ in length",
        ),
        (
            Row(prompt=[1], completion=[2], advantage=1, logprobs=[float("nan")]),
            "completion_logprobs has a non-finite value",
        ),
        (Row(prompt=[1], completion=[2], advantage=float("inf")), "advantage is not finite"),
        (
            Row(prompt=[1], completion=[2], advantage=1, sample_weight=-1),
            "sample_weight is negative",
        ),
    ],
)
def test_a_bad_row_is_named_by_file_and_row(tmp_path: Path, row: Row, message: str) -> None:
    row.interaction_id = "bad-one"
    path = _write(tmp_path / "f.parquet", [*_rows(2), row])
    with pytest.raises(DataError) as caught:
        _read([("train/rank-00000-of-00001.parquet", path)])
    text = str(caught.value)
    assert text.startswith("train/rank-00000-of-00001.parquet row 2 (interaction bad-one): ")
    assert message in text


def test_a_row_with_a_token_id_outside_the_vocabulary_is_skipped_and_counted(
    tmp_path: Path,
) -> None:
    """A set staged without the parent's vocabulary (an older stage) may hold such a row:
    it is left out and counted, on whichever rank it falls, instead of failing the run."""
    rows = [
        *_rows(4),
        Row(prompt=[1], completion=[2, 260], advantage=1, interaction_id="big"),
        Row(prompt=[-1, 300], completion=[2], advantage=1, interaction_id="neg"),
    ]
    paths = [("train/rank-00000-of-00001.parquet", _write(tmp_path / "f.parquet", rows))]
    parts = [
        read_rank(paths, rank=r, world_size=2, one_per_rank=False, vocab_size=260,
                  max_sequence_length=64)
        for r in (0, 1)
    ]  # fmt: skip
    # Global rows alternate: rank 0 has rows 0, 2, 4 ("big"), rank 1 rows 1, 3, 5 ("neg").
    assert [len(p.examples) for p in parts] == [2, 2]
    skipped = Skipped.merged([p.skipped for p in parts])
    assert (skipped.rows_read, skipped.by_reason) == (6, {"token_out_of_range": 2})
    name = "train/rank-00000-of-00001.parquet"
    assert skipped.examples == [
        f"{name} row 4 (interaction big): completion_ids has token id 260, outside the "
        "model's vocabulary of 260",
        f"{name} row 5 (interaction neg): prompt_ids has token id -1, outside the "
        "model's vocabulary of 260",
    ]
    check_skipped(skipped, 0.5)
    with pytest.raises(DataError) as caught:
        check_skipped(skipped, 0.01)
    assert str(caught.value) == (
        "2 of 6 rows cannot be trained on (0.333 of the set, limit 0.01: stage.json "
        f"max_bad_fraction): token_out_of_range=2; first: {skipped.examples[0]}"
    )
    # One row never stops a run, however small the set or the limit.
    check_skipped(Skipped(rows_read=1, by_reason={"token_out_of_range": 1}), 0.0)
    counts = {"interactions_used": 6, "tokens_used": 60}
    assert max_bad_fraction(StageResult.read({**counts, "max_bad_fraction": 0.25})) == 0.25
    assert max_bad_fraction(StageResult.read(counts)) == 0.01  # a stage.json that does not say
    with pytest.raises(ResultError, match=r"^stage.json: max_bad_fraction: Input should be"):
        StageResult.read({**counts, "max_bad_fraction": "x"})


def test_tool_output_log_probs_may_be_anything(tmp_path: Path) -> None:
    row = Row(prompt=[1], completion=[2, 3], advantage=1, logprobs=[-1.0, float("nan")])
    row.mask = [True, False]
    path = _write(tmp_path / "f.parquet", [row])
    (example,) = _read([("train/rank-00000-of-00001.parquet", path)])
    assert example.tokens == 1


def test_a_set_with_list_columns_reads_the_same(tmp_path: Path) -> None:
    # Sets staged before the per-token columns were packed stay readable.
    rows = [
        *_rows(3),
        Row(prompt=[], completion=[5, 6, 7], advantage=-0.5, logprobs=[-0.1, -0.2, -0.3]),
        Row(prompt=[9], completion=[8, 7], advantage=0.25, mask=[False, True]),
    ]
    packed = _write(tmp_path / "packed.parquet", rows)
    lists = tmp_path / "lists.parquet"
    table = pa.Table.from_pylist([r.list_record() for r in rows], schema=LIST_TRAINSET_SCHEMA)
    pq.write_table(table, lists)
    name = "train/rank-00000-of-00001.parquet"
    got = [_read([(name, path)]) for path in (packed, lists)]
    assert len(got[0]) == len(got[1]) == 5
    for a, b in zip(*got, strict=True):
        assert a.input_ids.tolist() == b.input_ids.tolist()
        assert a.completion_start == b.completion_start
        assert a.logprobs.tolist() == b.logprobs.tolist()
        assert a.mask.tolist() == b.mask.tolist()
        assert (a.advantage, a.sample_weight, a.source) == (b.advantage, b.sample_weight, b.source)


def test_a_packed_column_of_the_wrong_width_is_named(tmp_path: Path) -> None:
    table = pa.Table.from_pylist([r.record() for r in _rows(3)], schema=TRAINSET_SCHEMA)
    index = table.schema.get_field_index("completion_ids")
    broken = pa.array([b"\x01\x00\x00\x00" * 3, b"\x01\x00\x00", b""], pa.binary())
    table = table.set_column(index, table.schema.field(index), broken)
    pq.write_table(table, tmp_path / "f.parquet")
    expected = r"f\.parquet row 1: completion_ids is not packed <i4 \(3 bytes"
    with pytest.raises(DataError, match=expected):
        _read([("f.parquet", tmp_path / "f.parquet")])


def test_missing_column_is_named(tmp_path: Path) -> None:
    table = pa.Table.from_pylist([r.record() for r in _rows(1)], schema=TRAINSET_SCHEMA)
    pq.write_table(table.drop_columns(["advantage"]), tmp_path / "f.parquet")
    with pytest.raises(DataError, match=r"f\.parquet: missing column\(s\) advantage"):
        _read([("f.parquet", tmp_path / "f.parquet")])


def test_advantages_come_from_the_rank_files_advantage_file(tmp_path: Path) -> None:
    """As the stage step writes a set: the rank file without its advantages, and next to it
    the advantage file, joined by position."""
    rows = [Row(prompt=[i, 1], completion=[2, 3], advantage=0.0) for i in range(3)]
    table = pa.Table.from_pylist([r.record() for r in rows], schema=TRAINSET_SCHEMA)
    name = "train/rank-00000-of-00001.parquet"
    path = tmp_path / name
    path.parent.mkdir(parents=True)
    pq.write_table(table.drop_columns(["advantage"]), path)
    side = tmp_path / "train/rank-00000-of-00001.advantage.parquet"
    pq.write_table(pa.table({"advantage": pa.array([0.5, -1.0, 2.0], pa.float32())}), side)
    assert [e.advantage for e in _read([(name, path)])] == [0.5, -1.0, 2.0]
    pq.write_table(pa.table({"advantage": pa.array([0.5, -1.0], pa.float32())}), side)
    expected = (
        r"rank-00000-of-00001\.advantage\.parquet: cannot be used \(.* 2 advantages for the 3"
    )
    with pytest.raises(DataError, match=expected):
        _read([(name, path)])


def test_rewards_ride_along_from_the_rank_file_when_it_has_them(tmp_path: Path) -> None:
    """Each row's combined reward (the rank file's ``reward`` column, the value the stage
    computed the advantage from) goes with it, for the step's ``mean_reward``; a file
    without the column, or a null reward, leaves the row without one (never invented)."""
    rewards = [0.5, -1.0, 2.0]
    rows = [
        Row(prompt=[i, 1], completion=[2, 3], advantage=0.0, reward=r)
        for i, r in enumerate(rewards)
    ]
    table = pa.Table.from_pylist([r.record() for r in rows], schema=TRAINSET_SCHEMA)
    name = "train/rank-00000-of-00001.parquet"
    path = tmp_path / name
    path.parent.mkdir(parents=True)
    # As the stage writes a set: the advantages in the advantage file.
    pq.write_table(table.drop_columns(["advantage"]), path)
    side = tmp_path / "train/rank-00000-of-00001.advantage.parquet"
    pq.write_table(pa.table({"advantage": pa.array([0.5, -1.0, 2.0], pa.float32())}), side)
    assert [e.reward for e in _read([(name, path)])] == rewards
    # A rank file with its own advantage column (a set written by hand) reads it too.
    pq.write_table(table, path)
    assert [e.reward for e in _read([(name, path)])] == rewards
    pq.write_table(table.drop_columns(["reward"]), path)
    assert [e.reward for e in _read([(name, path)])] == [None, None, None]
    index = table.schema.get_field_index("reward")
    nulls = pa.array([0.5, None, float("nan")], pa.float32())
    pq.write_table(table.set_column(index, table.schema.field(index), nulls), path)
    assert [e.reward for e in _read([(name, path)])] == [0.5, None, None]


def test_truncation_keeps_the_completion_and_the_end_of_the_prompt(tmp_path: Path) -> None:
    rows = [
        Row(prompt=list(range(10, 20)), completion=[1, 2, 3], advantage=1),
        Row(prompt=[7, 8], completion=list(range(30, 40)), advantage=1),
        Row(prompt=[], completion=[5, 6, 7], advantage=1),
        Row(prompt=[4], completion=[5, 6], advantage=1, mask=[False, False]),
    ]
    path = _write(tmp_path / "f.parquet", rows)
    data = read_rank(
        [("f", path)],
        rank=0,
        world_size=1,
        one_per_rank=True,
        vocab_size=260,
        max_sequence_length=6,
    )
    long_prompt, long_completion, no_prompt = data.examples
    assert long_prompt.input_ids.tolist() == [17, 18, 19, 1, 2, 3]
    assert long_prompt.completion_start == 3
    # A completion longer than the limit keeps one prompt token and its own beginning.
    assert long_completion.input_ids.tolist() == [8, 30, 31, 32, 33, 34]
    assert long_completion.logprobs.shape == (5,)
    # Nothing predicts the first token of a completion without prompt: it becomes context.
    assert no_prompt.input_ids.tolist() == [5, 6, 7]
    assert no_prompt.completion_start == 1 and no_prompt.tokens == 2
    # The all-tool-output row carries no loss and is skipped.
    assert len(data.examples) == 3
    assert data.rows_truncated == 2


def test_schedule_spreads_tokens_over_steps_and_pads_ranks() -> None:
    schedule = make_schedule(
        [10, 7], 170, batch_tokens=50, micro_batch_size=2, epochs=2, max_steps=None, seed=0
    )
    assert schedule.steps_per_epoch == 4  # ceil(170 / 50)
    assert schedule.gradient_accumulation_steps == 2  # ceil(ceil(10 / 4) / 2)
    assert schedule.total_steps == 8
    capped = make_schedule(
        [3, 3], 10_000, batch_tokens=1, micro_batch_size=1, epochs=1, max_steps=None, seed=0
    )
    assert capped.steps_per_epoch == 3  # never more steps than the largest rank has rows
    limited = make_schedule(
        [10], 100, batch_tokens=10, micro_batch_size=1, epochs=3, max_steps=5, seed=0
    )
    assert limited.total_steps == 5
    with pytest.raises(DataError, match="no completion tokens"):
        make_schedule(
            [0, 0], 0, batch_tokens=1, micro_batch_size=1, epochs=1, max_steps=None, seed=0
        )


def test_every_rank_runs_the_same_number_of_micro_batches_and_sees_each_row_once() -> None:
    schedule = make_schedule(
        [11, 6], 100, batch_tokens=30, micro_batch_size=2, epochs=2, max_steps=None, seed=7
    )
    for rank, n in ((0, 11), (1, 6)):
        for epoch in (0, 1):
            batches = epoch_micro_batches(n, schedule, epoch=epoch, rank=rank)
            assert len(batches) == schedule.micro_batches_per_epoch
            assert sorted(i for b in batches for i in b) == list(range(n))
            assert all(len(b) <= 2 for b in batches)
        first, second = (epoch_micro_batches(n, schedule, epoch=e, rank=rank) for e in (0, 1))
        assert first != second  # reshuffled each epoch
        # Deterministic: a resumed run recomputes exactly the same micro-batches; step
        # numbers run on across epochs.
        gas = schedule.gradient_accumulation_steps
        step = schedule.steps_per_epoch + 2  # the second step of the second epoch
        assert step_micro_batches(n, schedule, step=step, rank=rank) == second[gas : 2 * gas]
        assert step_micro_batches(n, schedule, step=1, rank=rank) == first[:gas]


def test_step_tokens_count_each_rows_loss_tokens() -> None:
    examples = [
        Example(
            input_ids=np.arange(5),
            completion_start=2,
            logprobs=np.zeros(3, np.float32),
            mask=np.array([True, i % 2 == 0, True]),
            advantage=1.0,
            sample_weight=1.0,
            source="x",
        )
        for i in range(6)
    ]
    schedule = make_schedule(
        [6], 15, batch_tokens=5, micro_batch_size=1, epochs=1, max_steps=None, seed=0
    )
    counts = step_tokens(examples, schedule, rank=0)
    assert len(counts) == schedule.total_steps
    assert sum(counts) == 15


def test_the_loss_grid_lines_up_with_the_serving_log_probs() -> None:
    # collate + token_logprobs must score exactly the completion tokens, each from the
    # logits of the position before it, whatever the prompt lengths in the micro-batch.
    model = tiny_gpt2(seed=3)
    rows = [
        Row(prompt=[40, 41, 42, 43, 44], completion=[5, 6, 7], advantage=1.0),
        Row(prompt=[50], completion=[8, 9], advantage=-1.0, mask=[False, True]),
        Row(prompt=[60, 61, 62], completion=[10, 11, 12, 13], advantage=0.5),
    ]
    examples = [
        Example(
            input_ids=np.array(r.prompt + r.completion),
            completion_start=len(r.prompt),
            logprobs=np.array(completion_logprobs(model, r.prompt, r.completion), np.float32),
            mask=np.array(r.mask or [True] * len(r.completion)),
            advantage=r.advantage,
            sample_weight=1.0,
            source=str(i),
        )
        for i, r in enumerate(rows)
    ]
    mb = collate(examples, [0, 1, 2], device=torch.device("cpu"))
    assert mb.first == 0  # the shortest prompt (1 token) starts the grid
    assert mb.tokens == 3 + 1 + 4
    assert mb.input_tokens == 8 + 3 + 7
    for keep_logits in (True, False):
        with torch.no_grad():
            grid = token_logprobs(model, mb, keep_logits)
        per_row = mb.gather(grid)
        for values, example in zip(per_row, examples, strict=True):
            np.testing.assert_allclose(values, example.logprobs, atol=1e-5)
        # The serving log-probs sit on the grid where the model's own land.
        torch.testing.assert_close(
            torch.where(mb.mask, grid, 0.0),
            torch.where(mb.mask, mb.logp_serve, 0.0),
            atol=1e-5,
            rtol=0,
        )
    # scatter is gather's inverse.
    torch.testing.assert_close(mb.scatter(per_row), torch.where(
        torch.tensor([[c.start <= j < c.stop for j in range(grid.shape[1])] for c in mb.columns]),
        grid, 0.0))  # fmt: skip


def test_filler_micro_batch_has_no_tokens() -> None:
    mb = collate([], [], device=torch.device("cpu"))
    assert mb.tokens == 0 and mb.rows == [] and mb.input_tokens == 0
