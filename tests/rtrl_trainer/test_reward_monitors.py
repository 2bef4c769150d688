"""The reward, advantage and monitor building blocks on their own: hand-computed values,
the missing-signal rule, streaming statistics equal to whole-array ones, and latency
quantiles within 1% of the exact ones."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from rtrl.core.api.rlcycle import RewardSpec
from rtrl_trainer.monitors import LatencyHistogram, Monitors
from rtrl_trainer.reward import RunningStats, Strata, advantages, rewards
from tests.rtrl_trainer.helpers import approx, rows


def test_reward_weights_each_signal() -> None:
    t = rows(
        5,
        edit_persisted=[0.5, 0.0, 0.0, 0.0, 0.0],
        dissatisfied_followup=[False, True, False, False, False],
        latency_ms=[0.0, 0.0, 30_000.0, 0.0, 0.0],
        tool_calls=[0, 0, 0, 4, 4],
        invalid_tool_calls=[0, 0, 0, 3, 0],
        asked_clarification=[False, False, False, False, True],
    )
    spec = RewardSpec(
        edit_persisted=2.0,
        dissatisfied_followup=-3.0,
        latency=-0.5,
        latency_scale_ms=20_000,
        invalid_tool_call=-0.75,
        asked_clarification=0.25,
    )
    # The invalid-call term is per interaction (any invalid call), not per call.
    assert rewards(t, spec).tolist() == approx([1.0, -3.0, -0.75, -0.75, 0.25])


def test_missing_signals_count_as_nothing_happened() -> None:
    nulls = {
        name: None
        for name in (
            "edit_persisted",
            "dissatisfied_followup",
            "latency_ms",
            "tool_calls",
            "invalid_tool_calls",
            "asked_clarification",
        )
    }
    spec = RewardSpec(asked_clarification=-1.0)
    assert rewards(rows(3, **nulls), spec).tolist() == [0.0, 0.0, 0.0]


def test_clip_is_symmetric() -> None:
    t = rows(2, edit_persisted=1.0, latency_ms=[0.0, 1e12])
    spec = RewardSpec(edit_persisted=100.0, latency=-1.0, clip=3.0)
    assert rewards(t, spec).tolist() == [3.0, -3.0]


def test_rewards_are_float32() -> None:
    assert rewards(rows(2), RewardSpec()).dtype == np.float32


def test_running_stats_match_numpy() -> None:
    rng = np.random.default_rng(0)
    values = rng.normal(3.0, 2.0, size=10_001).astype(np.float32)
    stats = RunningStats()
    for chunk in np.array_split(values, 7):
        stats.update(chunk)
    stats.update(np.zeros(0, dtype=np.float32))
    assert stats.count == values.size
    assert stats.mean == pytest.approx(float(values.astype(np.float64).mean()), rel=1e-12)
    assert stats.std == pytest.approx(float(values.astype(np.float64).std()), rel=1e-12)
    assert (stats.min, stats.max) == (float(values.min()), float(values.max()))
    assert RunningStats().to_dict() == {"mean": None, "std": None, "min": None, "max": None}


def test_strata_codes_are_stable_and_null_is_a_stratum() -> None:
    strata = Strata(by_org=True)
    first = strata.encode(pa.array(["b", "a", None, "b"]))
    second = strata.encode(pa.chunked_array([["a", "c"], [None]]))
    assert first.tolist()[:2] == [0, 1] and first[0] == first[3]
    assert second.tolist() == [1, 3, first[2]]
    strata.add(first, np.array([1.0, 2.0, 4.0, 3.0], dtype=np.float32))
    baselines = strata.baselines()
    assert baselines[first].tolist() == [2.0, 2.0, 4.0, 2.0]
    assert strata.describe() == [
        {"org": "b", "rows": 2, "baseline": 2.0},
        {"org": "a", "rows": 1, "baseline": 2.0},
        {"org": None, "rows": 1, "baseline": 4.0},
    ]
    batch = Strata(by_org=False)
    assert batch.encode(pa.array(["x", None])).tolist() == [0, 0]


def test_advantages() -> None:
    values = np.array([1.0, 3.0], dtype=np.float32)
    codes = np.array([0, 1], dtype=np.int32)
    out = advantages(values, codes, np.array([0.0, 1.0]), std=2.0)
    assert out.tolist() == [0.5, 1.0] and out.dtype == np.float32
    assert advantages(values, codes, np.array([0.0, 1.0]), std=0.0).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("q", [0.01, 0.5, 0.9, 0.95, 0.99])
def test_latency_quantiles_within_one_percent(q: float) -> None:
    rng = np.random.default_rng(1)
    values = rng.lognormal(7.5, 1.2, size=200_000)
    histogram = LatencyHistogram()
    for chunk in np.array_split(values, 9):
        histogram.add(chunk)
    exact = float(np.quantile(values, q, method="inverted_cdf"))
    assert histogram.quantile(q) == pytest.approx(exact, rel=0.01)


def test_latency_histogram_edges() -> None:
    histogram = LatencyHistogram()
    assert histogram.quantile(0.5) is None
    histogram.add(np.array([0.0, 0.0, 0.0, 1e12]))
    assert histogram.quantile(0.5) == 0.0
    assert histogram.quantile(1.0) == LatencyHistogram.HIGH_MS
    assert histogram.counts.nbytes < 32_000  # fixed, whatever the number of values


def test_monitors_without_rows_or_tool_calls_are_undefined() -> None:
    assert set(Monitors().result().values()) == {None}
    monitors = Monitors()
    monitors.update(rows(2), np.array([3, 5]))
    result = monitors.result()
    assert result["invalid_tool_call_rate"] is None  # no tool calls at all
    assert result["mean_completion_tokens"] == 4.0
