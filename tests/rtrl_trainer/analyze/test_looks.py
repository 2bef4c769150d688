"""The looks of the plan (rtrl_trainer.analyze.looks) and the sums kept per look
(accumulate.Ledger, unit_looks, row_looks): at every look, the totals and Gram matrix grown
look by look equal the plain reference computed from the rows counted by then."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from rtrl_trainer.analyze.estimate import cell_sums
from rtrl_trainer.analyze.ledger import Ledger, row_looks, unit_looks
from rtrl_trainer.analyze.looks import Looks, from_us, to_us

SINCE = datetime(2026, 1, 5, 8, 0, tzinfo=UTC)


def plan(now: datetime, *, planned: bool = True) -> Looks:
    return Looks.plan(
        since=SINCE, now=now, interval=timedelta(minutes=15), max_duration=timedelta(hours=24),
        maturity=timedelta(hours=1), planned=planned,
    )  # fmt: skip


def test_the_plan_and_a_look_between_two_of_it() -> None:
    looks = plan(SINCE + timedelta(hours=2, minutes=7))
    assert looks.count == 8 and looks.planned
    assert from_us(looks.last) == SINCE + timedelta(hours=2)  # as of the last look of the plan
    assert looks.fractions[-1] == pytest.approx(2 / 24)
    again = plan(SINCE + timedelta(hours=2, minutes=14, seconds=59))
    np.testing.assert_array_equal(again.times, looks.times)  # the same look, the same data
    early = plan(SINCE + timedelta(minutes=10))
    assert early.count == 1 and not early.planned  # no look of the plan yet: now, no verdict
    mixture = plan(SINCE + timedelta(hours=2, minutes=7), planned=False)
    assert mixture.count == 1 and from_us(mixture.last) == SINCE + timedelta(hours=2, minutes=7)


def test_the_first_look_each_row_counts_at() -> None:
    looks = plan(SINCE + timedelta(hours=3))  # looks at 08:15 ... 11:00
    t = [SINCE + timedelta(minutes=m) for m in (0, 14, 15, 16, 100)]
    created = np.array([to_us(x) for x in t])
    # feedback 10 minutes later, except the fourth: 2 hours later; the last: never
    feedback = created + 600_000_000
    feedback[3] = created[3] + 7_200_000_000
    feedback[4] = np.iinfo(np.int64).max
    counted = looks.counted(created, feedback)
    # created by look - 1 h: 08:00 counts at 09:00 (index 3), 08:14 and 08:15 at 09:15 (4);
    # 08:16 would at 09:30 but its feedback came at 10:16: 10:30 (9); the last never (12)
    assert counted.tolist() == [3, 4, 4, 9, 12]
    assert looks.judged(created).tolist() == [3, 4, 4, 5, 10]
    assert looks.assigned(created).tolist() == [0, 0, 0, 1, 6]
    assert looks.bins(created).tolist() == [0, 2, 3, 3, 20]


def rows(seed: int, n: int = 3000, strata: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    users = 150
    key = rng.integers(0, users, n)
    return {
        "key": key,
        "arm": (rng.random(users) < 0.4).astype(np.int64)[key],
        "stratum": rng.integers(0, strata, n),
        "look": rng.integers(0, 12, n),
        "x": rng.random(n) < rng.beta(2, 3, users)[key],
        "n": np.where(rng.random(n) < 0.2, 2.0, 1.0),
        "tag": rng.integers(0, 50, n),
        "cov": rng.random(users),
    }


@pytest.mark.parametrize("per_row", [False, True])
def test_sums_at_every_look_equal_the_reference(per_row: bool) -> None:
    r, strata, looks = rows(1), 2, 12
    x, n = r["x"].astype(np.float64), r["n"]
    cells = r["arm"] * strata + r["stratum"]
    users = int(r["key"].max()) + 1
    ledger = Ledger(2 * strata, 6 if per_row else 2, looks, tags=50)
    # added in three batches, out of look order, as files come
    for part in np.array_split(np.random.default_rng(2).permutation(x.size), 3):
        columns = [x[part], n[part]]
        if per_row:
            columns += [x[part] ** 2, n[part] ** 2, x[part] * n[part], np.ones(part.size)]
        ledger.add(r["key"][part], r["look"][part], cells[part], columns, r["tag"][part])
    new = np.arange(users) % 3 == 0
    build = row_looks if per_row else unit_looks
    per = build(ledger, users, looks, r["cov"], strata, groups=(new, ~new))
    for j in range(looks):
        mine = r["look"] <= j
        totals, gram, units = cell_sums(
            None if per_row else r["key"][mine], r["arm"][mine], r["stratum"][mine], x[mine],
            n[mine], covariate=r["cov"][r["key"][mine]], strata=strata,
        )  # fmt: skip
        np.testing.assert_allclose(per.totals[j], totals, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(per.gram[j], gram, rtol=1e-12, atol=1e-9)
        assert per.units[j] == units
    # the parts at the last look: the Gram of each group of keys, summing to the whole
    np.testing.assert_allclose(per.parts[0] + per.parts[1], per.gram[-1], rtol=1e-12, atol=1e-9)
    mine = new[r["key"]]
    _, gram_new, _ = cell_sums(
        None if per_row else r["key"][mine], r["arm"][mine], r["stratum"][mine], x[mine],
        n[mine], covariate=r["cov"][r["key"][mine]], strata=strata,
    )  # fmt: skip
    np.testing.assert_allclose(per.parts[0], gram_new, rtol=1e-12, atol=1e-9)


def test_a_selection_of_entries() -> None:
    """Settled rows: the ledger's entries of a selection (here by tag) give the sums of
    those rows alone."""
    r, strata, looks = rows(4), 2, 12
    x, n = r["x"].astype(np.float64), r["n"]
    cells = r["arm"] * strata + r["stratum"]
    users = int(r["key"].max()) + 1
    ledger = Ledger(2 * strata, 2, looks, tags=50)
    ledger.add(r["key"], r["look"], cells, [x, n], r["tag"])
    select = ledger.tag[: ledger.size] >= 20
    per = unit_looks(ledger, users, looks, r["cov"], strata, select=select)
    mine = r["tag"] >= 20
    totals, gram, _ = cell_sums(
        r["key"][mine], r["arm"][mine], r["stratum"][mine], x[mine], n[mine],
        covariate=r["cov"][r["key"][mine]], strata=strata,
    )  # fmt: skip
    np.testing.assert_allclose(per.totals[-1], totals, rtol=1e-12)
    np.testing.assert_allclose(per.gram[-1], gram, rtol=1e-12)


def test_rows_per_unit_counts_a_unit_once_per_cell() -> None:
    """``counts``: the ledger holds rows; a unit's n is 1 in each cell it has rows in."""
    key = np.array([0, 0, 0, 1, 2, 2])
    cells = np.array([0, 0, 1, 2, 2, 3])
    look = np.array([0, 1, 1, 0, 1, 1])
    ledger = Ledger(4, 1, 2)
    ledger.add(key, look, cells, [1.0])
    per = unit_looks(ledger, 3, 2, np.array([1.0, 2.0, 3.0]), 2, counts=True)
    # look 0: key 0 one row in cell 0; key 1 one row in cell 2
    assert per.totals[0].reshape(4, 3).tolist() == [[1, 1, 1], [0, 0, 0], [1, 1, 2], [0, 0, 0]]
    # look 1: key 0 two rows in cell 0, one in cell 1; key 2 one row in each of 2 and 3
    assert per.totals[1].reshape(4, 3).tolist() == [[2, 1, 1], [1, 1, 1], [2, 2, 5], [1, 1, 3]]
    assert per.units.tolist() == [2, 3]
