"""The sample-ratio-mismatch check: is the canary getting the share of units it was given?

It is sequential, like the intervals of :mod:`.confidence`: a beta-binomial mixture
likelihood ratio for the canary's share (the two-arm case of Lindon & Malek,
"Anytime-Valid Inference for Multinomial Count Data", NeurIPS 2022), exact for any number
of interactions, valid at every look. Pure numpy, scalars or arrays alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from rtrl_trainer.analyze.estimate import unwrap

# A promotion waits while the sample-ratio test's evidence against the configured split is
# strong (Bayes factor >= 10, p <= 0.1) though not yet conclusive (srmAlpha): the arms may
# not be comparable, and the test needs more assignments to tell. Under a correct split the
# Bayes factor is a martingale that drifts to 0, so this rarely waits long; when rows are
# being lost it keeps a fast-improving canary from being promoted before the loss is seen.
SRM_HOLD_P = 0.1


class SrmResult(NamedTuple):
    expected_canary_share: Any
    observed_canary_share: Any
    p_value: Any
    mismatch: Any


# The mixture's spread around the expected share, relative to the smaller arm's share: tuned
# to the shifts that matter, a few percent of the arm's units lost (3% of canary rows lost
# moves a 50% share by 1.5% of it, a 5% share by 2.9%); larger mismatches are caught anyway,
# the sensitivity falls off only logarithmically.
SRM_RELATIVE_SPREAD = 0.03

_lgamma = np.vectorize(math.lgamma, otypes=[np.float64])


def srm_log_bf(n_baseline: Any, n_canary: Any, expected_share: float) -> Any:
    """Log Bayes factor of the beta-binomial mixture against the binomial at
    ``expected_share``: a nonnegative martingale (in exp) under the null."""
    p0 = float(expected_share)
    nb = np.asarray(n_baseline, dtype=np.float64)
    nc = np.asarray(n_canary, dtype=np.float64)
    spread = SRM_RELATIVE_SPREAD * min(p0, 1 - p0)
    kappa = max(p0 * (1 - p0) / spread**2 - 1, 1.0)
    a, b = kappa * p0, kappa * (1 - p0)
    log_beta_prior = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    log_beta_post = _lgamma(a + nc) + _lgamma(b + nb) - _lgamma(a + b + nb + nc)
    return log_beta_post - log_beta_prior - nc * math.log(p0) - nb * math.log(1 - p0)


def srm_test(n_baseline: Any, n_canary: Any, expected_share: float, alpha: float) -> SrmResult:
    """Anytime-valid test that the canary's share of units is ``expected_share``.

    The p-value is ``1 / BF`` (capped at 1), BF the beta-binomial mixture against the
    binomial at ``expected_share``: a nonnegative martingale under the null, so the chance
    that it ever reaches ``1 / alpha`` is at most alpha (Ville), at any number of looks.
    """
    return srm_steps([n_baseline], [n_canary], [expected_share], alpha)


def srm_steps(
    n_baseline: Sequence[Any], n_canary: Sequence[Any], shares: Sequence[float], alpha: float
) -> SrmResult:
    """The sample-ratio test over every canary step so far: per step, the units assigned
    to each arm (counted at assignment, without waiting for feedback) against that step's
    share. Each step's Bayes factor is a test martingale that starts at 1 when the step
    starts; chained, their product is one over the whole canary (Ville's inequality
    applies to it), so evidence from earlier steps is kept. The observed share is the
    current (last) step's."""
    log_bf: Any = 0.0
    for nb, nc, share in zip(n_baseline, n_canary, shares, strict=True):
        log_bf = log_bf + srm_log_bf(nb, nc, share)
    nb_last = np.asarray(n_baseline[-1], dtype=np.float64)
    nc_last = np.asarray(n_canary[-1], dtype=np.float64)
    total = nb_last + nc_last
    with np.errstate(all="ignore"):
        p_value = np.minimum(1.0, np.exp(-np.asarray(log_bf)))
        observed = np.where(total > 0, nc_last / total, np.nan)
    mismatch = p_value <= alpha
    return SrmResult(
        float(shares[-1]),
        unwrap(observed),
        unwrap(p_value),
        mismatch if mismatch.ndim else bool(mismatch),
    )
