"""Every scenario of issue 31 in the realistic population (bench/analysis_population.py:
8,000 users, lognormal activity, 20% new during the canary, drift, ICC 0.1-0.2), a few
canaries each with a fixed seed, judged by today's analysis (mixture intervals, CUPED on
each user's own history, no novelty or lost-row rule: ``TODAY``) and by the analysis as
it is now (``AFTER``) on the same simulated canaries, through the analyze step's own
functions (bench/analysis_methods.py).

Where today's analysis misses a goal (power, novelty, rows lost by a logging fault), its case
is a strict xfail: the test fails on today's analysis and the expected failure is checked on
every run. The A/A and harm scenarios are properties today's analysis already had and must
keep. The full figures with standard errors are the bench's (docs/analysis.md); these
replicate counts only separate the two analyses. To keep the run short the analyses are
half-hourly (``analysis.interval: 30m``) except in the looks-every-5-minutes scenario.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import numpy as np
import pytest
from bench import analysis_calibration as cal
from bench.analysis_methods import TODAY, Outcome

from rtrl_trainer.analyze.rule import POLICY_ROLLBACK, PROMOTE, ROLLBACK

SEED = 31


@cache
def outcomes(name: str, canaries: int, interval_h: float = 0.5) -> dict[str, Outcome]:
    """Today's analysis and the current one on the same ``canaries`` canaries of the bench's
    scenario ``name``."""
    (scenario,) = [s for s in cal.scenarios() if s.canary.name == name]
    canary = replace(scenario.canary, interval_h=interval_h)
    with np.errstate(all="ignore"):
        return cal.run_chunk(
            (replace(scenario, canary=canary, methods=(TODAY, cal.AFTER)), canaries, SEED)
        )


def analysis(which: str) -> object:
    if which == "today":
        return pytest.param(TODAY.label, marks=pytest.mark.xfail(strict=True, reason="issue 31"))
    return "after"


def pick(name: str, canaries: int, label: str, interval_h: float = 0.5) -> Outcome:
    found = outcomes(name, canaries, interval_h)
    if label == "after":
        (label,) = [k for k in found if k != TODAY.label]
    return found[label]


def share(mask: np.ndarray) -> float:
    return float(np.mean(mask))


def false_decisions(out: Outcome) -> float:
    evidence = (out.decision == ROLLBACK) & (out.cause != POLICY_ROLLBACK)
    return share((out.decision == PROMOTE) | evidence)


@pytest.mark.parametrize("label", [TODAY.label, "after"])
def test_aa_looked_at_every_5_minutes_decides_almost_nothing(label: str) -> None:
    """A/A at ICC 0.2 looked at every 5 minutes for 24 h: at most one canary in 8 promoted
    or rolled back on evidence (at a family-wise error of alpha 0.05, two or more happen
    in 6% of such runs; at 0.3, in 74%). The bench measures the rate itself."""
    out = pick("user A/A icc 0.2, looks every 5 min", 8, label, interval_h=5 / 60)
    assert false_decisions(out) <= 1 / 8


@pytest.mark.parametrize("label", [analysis("today"), "after"])
def test_the_blogs_effects_are_promoted_within_24_hours(label: str) -> None:
    """+2.28% persistence, -3.13% dissatisfied, -10.3% latency at unit user: promoted at
    least 5 times in 8 (today: about a third)."""
    out = pick("user A/B icc 0.1", 8, label)
    assert share(out.decision == PROMOTE) >= 5 / 8


@pytest.mark.parametrize("label", [analysis("today"), "after"])
@pytest.mark.parametrize("novelty", ["canary's first 2 h", "each user's first 2 h"])
def test_a_novelty_bump_is_not_promoted(label: str, novelty: str) -> None:
    """+6% for 2 hours (of the canary, or of each user on it), then nothing."""
    out = pick(f"novelty: {novelty} +6%", 8, label)
    assert share(out.decision == PROMOTE) == 0


@pytest.mark.parametrize("label", [analysis("today"), "after"])
@pytest.mark.parametrize("unit", ["user", "request"])
def test_rows_lost_by_a_logging_fault_are_not_promoted(label: str, unit: str) -> None:
    """An A/A whose canary loses 3% of its rows, the failed edits among them."""
    out = pick(f"A/A, 3% of canary rows lost (failed edits), {unit}", 8, label)
    assert share(out.decision == PROMOTE) == 0


@pytest.mark.parametrize("label", [TODAY.label, "after"])
@pytest.mark.parametrize(
    ("name", "on_evidence"),
    [("harm to the heaviest 1% of users (-15%)", False),
     ("latency +10.3% behind the blog's gains", True)],
)  # fmt: skip
def test_harmful_canaries_are_rolled_back(label: str, name: str, on_evidence: bool) -> None:
    """Never promoted, and rolled back: a harm confined to the heaviest 1% of users by the
    maxDuration's inconclusive policy at the latest (their share of the rows is too small
    to show within 24 h); a latency regression behind the blog's gains on its evidence."""
    out = pick(name, 4, label)
    assert share(out.decision == ROLLBACK) == 1
    if on_evidence:
        assert share(out.cause != POLICY_ROLLBACK) == 1
