"""The ``replay`` eval suite: the candidate on the parent's held-out matured interactions.

The Stage step holds out a deterministic share of the parent's interactions
(``heldout/*.parquet``) and never trains on them. On those completions, with the logged
prompt as context and only the tokens the model generated (``completion_mask``):

- ``replay.loglik``: mean per-token log-likelihood of a completion (higher is better);
- ``replay.kept_loglik``: the same over completions whose edits persisted
  (``edit_persisted >= 0.5``): training should move the policy towards them;
- ``replay.kept_margin``: mean log-likelihood of kept minus that of discarded completions
  (``edit_persisted < 0.5``; null rows are in neither group): the preference the reward
  asked for, higher is better;
- ``replay.kl``: mean per-token KL(candidate || parent) over the full vocabulary: a trust
  region check, lower is better (0 for the parent itself).

Log-likelihoods follow the trainer's rule: each row's tokens are scored under the
distribution it was sampled from (the held-out file's sampling columns: its temperature,
and its top-p/top-k where the engine logged processed log-probs; :mod:`rtrl_trainer.logprobs`),
and rows whose logged log-probs cannot be matched (greedy, raw log-probs at another
temperature or truncated: :func:`rtrl.core.shards.sampling.unmatched`) are not replayed,
only counted (the stage refuses them before they are held out; an older held-out set may
have them). A token outside a model's top-p/top-k under the row's settings scores
:data:`LOGLIK_FLOOR` (that model could not have produced it; ``-inf`` would leave the row's
mean, and the gates' resampling, without meaning). The KL is between the two models'
distributions at the row's temperature over the whole vocabulary (truncated ones would
make it infinite wherever the two nuclei differ).

The per-row values are what the gates resample; the parent's log-likelihoods are cached
with its other results, but the KL needs both models' distributions, so the parent model
is loaded whenever this suite runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from rtrl.core.shards.sampling import unmatched
from rtrl.core.shards.schema import OPTIONAL_SCHEMA
from rtrl_trainer.evaluate.gates import Metric
from rtrl_trainer.evaluate.model import EvalModel
from rtrl_trainer.logprobs import DEFAULT, Sampling, sampled_logprobs
from rtrl_trainer.progress import Progress

KEPT = 0.5
# A token a model gives no probability under the row's top-p/top-k counts as this
# log-likelihood (e^-30: as unlikely as makes no difference, and finite for the gates).
LOGLIK_FLOOR = -30.0
SAMPLING_COLUMNS = ("temperature", "top_p", "top_k", "logprobs_mode")


@dataclass(frozen=True)
class HeldoutRow:
    prompt: list[int]
    completion: list[int]
    mask: list[bool]
    edit_persisted: float | None
    sampling: Sampling = DEFAULT


@dataclass
class Refused:
    """Held-out rows not replayed because their log-probs cannot be matched, by reason."""

    by_reason: dict[str, int] = field(default_factory=dict)


def _samplings(table: pa.Table) -> tuple[list[Sampling], list[str | None]]:
    """Each row's sampling, and why it cannot be matched (None: it can)."""
    n = table.num_rows
    arrays = [
        table.column(c).combine_chunks().cast(OPTIONAL_SCHEMA.field(c).type)
        if c in table.column_names
        else pa.nulls(n, OPTIONAL_SCHEMA.field(c).type)
        for c in SAMPLING_COLUMNS
    ]
    batch = pa.RecordBatch.from_arrays(arrays, names=list(SAMPLING_COLUMNS))
    why: list[str | None] = [None] * n
    for reason, mask in unmatched(batch).items():
        for row in np.flatnonzero(mask).tolist():
            why[row] = why[row] or reason
    values = [a.to_pylist() for a in arrays]
    return [Sampling.of_row(*v) for v in zip(*values, strict=True)], why


def rows_from_table(
    table: pa.Table, *, limit: int | None = None, refused: Refused | None = None
) -> list[HeldoutRow]:
    """Held-out rows with at least one generated completion token whose log-probs can be
    matched; the others' reasons counted in ``refused``."""
    rows: list[HeldoutRow] = []
    persisted = (
        table.column("edit_persisted").to_pylist()
        if "edit_persisted" in table.column_names
        else [None] * table.num_rows
    )
    samplings, why = _samplings(table)
    for prompt, completion, logged_mask, kept, sampling, reason in zip(
        table.column("prompt_ids").to_pylist(),
        table.column("completion_ids").to_pylist(),
        table.column("completion_mask").to_pylist(),
        persisted,
        samplings,
        why,
        strict=True,
    ):
        if not completion:
            continue
        if reason is not None:
            if refused is not None:
                refused.by_reason[reason] = refused.by_reason.get(reason, 0) + 1
            continue
        mask = (
            logged_mask
            if logged_mask is not None and len(logged_mask) == len(completion)
            else [True] * len(completion)
        )
        if not any(mask):
            continue
        rows.append(HeldoutRow(list(prompt or []), list(completion), list(mask), kept, sampling))
        if limit is not None and len(rows) >= limit:
            break
    return rows


def _groups(rows: list[HeldoutRow]) -> tuple[int, ...]:
    return tuple(-1 if r.edit_persisted is None else int(r.edit_persisted >= KEPT) for r in rows)


def _counted(rows: list[HeldoutRow], progress: Progress | None) -> Iterable[HeldoutRow]:
    return rows if progress is None else progress.track(rows)


def loglik_values(
    model: EvalModel, rows: list[HeldoutRow], progress: Progress | None = None
) -> list[float]:
    """Mean per-token log-likelihood of each row's generated completion tokens, under the
    row's sampling distribution (a token outside its top-p/top-k: :data:`LOGLIK_FLOOR`)."""
    values = []
    for row in _counted(rows, progress):
        logp = model.logits(row.prompt, row.completion)
        targets = torch.tensor(row.completion)[-len(logp) :]
        s = row.sampling
        if s.is_default:
            token = logp.gather(1, targets[:, None])[:, 0]
        else:
            # log_softmax is the logits less a constant: the same distribution at any T.
            n = len(logp)
            token = sampled_logprobs(
                logp,
                targets,
                temperature=torch.full((n,), s.temperature),
                top_p=torch.full((n,), s.top_p),
                top_k=torch.full((n,), s.top_k, dtype=torch.long),
            ).clamp_min(LOGLIK_FLOOR)
        mask = torch.tensor(row.mask[-len(logp) :])
        values.append(float(token[mask].mean()))
    return values


def kl_values(
    candidate: EvalModel,
    parent: EvalModel,
    rows: list[HeldoutRow],
    progress: Progress | None = None,
) -> list[float]:
    """Mean per-token KL(candidate || parent) of each row, between the two models'
    distributions at the row's temperature."""
    values = []
    for row in _counted(rows, progress):
        cand = candidate.logits(row.prompt, row.completion)
        par = parent.logits(row.prompt, row.completion)
        if row.sampling.temperature != 1.0:
            cand = torch.log_softmax(cand / row.sampling.temperature, dim=-1)
            par = torch.log_softmax(par / row.sampling.temperature, dim=-1)
        kl = (cand.exp() * (cand - par)).sum(-1)
        mask = torch.tensor(row.mask[-len(kl) :])
        values.append(float(kl[mask].mean().clamp_min(0.0)))
    return values


def metrics(loglik: list[float], rows: list[HeldoutRow], kl: list[float]) -> list[Metric]:
    """The suite's metrics for one model from its per-row values."""
    groups = _groups(rows)
    kept = [v for v, g in zip(loglik, groups, strict=True) if g == 1]
    return [
        Metric("replay.loglik", tuple(loglik), 1, description="mean per-token log-likelihood"),
        Metric(
            "replay.kept_loglik",
            tuple(kept),
            1,
            description="mean per-token log-likelihood of completions whose edits persisted",
        ),
        Metric(
            "replay.kept_margin",
            tuple(loglik),
            1,
            groups=groups,
            description="log-likelihood of kept minus discarded completions",
        ),
        Metric("replay.kl", tuple(kl), -1, description="per-token KL(candidate || parent)"),
    ]
