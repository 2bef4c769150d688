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

The per-row values are what the gates resample; the parent's log-likelihoods are cached
with its other results, but the KL needs both models' distributions, so the parent model
is loaded whenever this suite runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import torch

from rtrl_trainer.evaluate.gates import Metric
from rtrl_trainer.evaluate.model import EvalModel
from rtrl_trainer.progress import Progress

KEPT = 0.5


@dataclass(frozen=True)
class HeldoutRow:
    prompt: list[int]
    completion: list[int]
    mask: list[bool]
    edit_persisted: float | None


def rows_from_table(table: pa.Table, *, limit: int | None = None) -> list[HeldoutRow]:
    """Held-out rows with at least one generated completion token."""
    rows: list[HeldoutRow] = []
    persisted = (
        table.column("edit_persisted").to_pylist()
        if "edit_persisted" in table.column_names
        else [None] * table.num_rows
    )
    for prompt, completion, logged_mask, kept in zip(
        table.column("prompt_ids").to_pylist(),
        table.column("completion_ids").to_pylist(),
        table.column("completion_mask").to_pylist(),
        persisted,
        strict=True,
    ):
        if not completion:
            continue
        mask = (
            logged_mask
            if logged_mask is not None and len(logged_mask) == len(completion)
            else [True] * len(completion)
        )
        if not any(mask):
            continue
        rows.append(HeldoutRow(list(prompt or []), list(completion), list(mask), kept))
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
    """Mean per-token log-likelihood of each row's generated completion tokens."""
    values = []
    for row in _counted(rows, progress):
        logp = model.logits(row.prompt, row.completion)
        token = logp.gather(1, torch.tensor(row.completion)[-len(logp) :, None])[:, 0]
        mask = torch.tensor(row.mask[-len(logp) :])
        values.append(float(token[mask].mean()))
    return values


def kl_values(
    candidate: EvalModel,
    parent: EvalModel,
    rows: list[HeldoutRow],
    progress: Progress | None = None,
) -> list[float]:
    """Mean per-token KL(candidate || parent) of each row."""
    values = []
    for row in _counted(rows, progress):
        cand = candidate.logits(row.prompt, row.completion)
        par = parent.logits(row.prompt, row.completion)
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
