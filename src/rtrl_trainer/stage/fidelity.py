"""The fidelity gate: are the logged log-probs the serving checkpoint's?

The trainer's importance weights divide by the engine's logged log-probs; they are right
only if those numbers are the serving checkpoint's, under the distribution each row says
it was sampled from. Nothing in a shard proves it: a partition written by pods still
serving another checkpoint, an engine whose temperature was not what the logging pipeline
recorded, or raw log-probs labelled processed, all look like valid rows. So before pass 1,
for each partition (the directory of its files: ``checkpoint=/date=/hour=``) of the
serving checkpoint, the gate takes a bounded sample of rows (``data.fidelity.sampleRows``),
recomputes their completion log-probs with the serving checkpoint (``--parent``; a LoRA
adapter is loaded on its base) in float32 under each row's sampling
(:mod:`rtrl_trainer.logprobs`), and compares:

- per token, ``delta = recomputed - logged``; ``exp(delta)`` is the first step's
  importance weight (a token outside the recomputed top-p/top-k is *unsupported*: weight 0);
- a partition whose mean ``|delta|`` exceeds ``maxMeanAbsDelta``, or whose share of
  unsupported tokens exceeds ``maxUnsupportedFraction``, is quarantined whole
  (:data:`~rtrl_trainer.quarantine.FIDELITY`: its rows count as bad rows);
- the figures (rows and tokens checked, mean and max ``|delta|``, importance-weight
  quantiles, the serving dtypes seen) go into ``stage.json`` per partition and overall.

The sample is the first rows of row groups spread evenly over the partition's files (read
page by page, not whole row groups), valid rows only, of rows whose log-probs can be matched
at all (:func:`rtrl.core.shards.sampling.unmatched`). Its cost is the model's load plus one
forward pass per sampled row, whatever the size of the partition; torch and transformers
are imported only when the gate runs.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from rtrl.core.api.rlcycle import FidelitySpec
from rtrl.core.shards import CANONICAL_COLUMNS, ShardFile, list_files
from rtrl.core.shards.checks import check_rows
from rtrl.core.shards.limits import oversized_strings
from rtrl.core.shards.reader import declared_types, open_parquet, plan_file
from rtrl.core.shards.sampling import unmatched
from rtrl.core.shards.schema import CastPlan
from rtrl.core.store import ObjectStore, StoreError, open_store

# Partitions listed one by one in stage.json (the overall figures cover all of them).
MAX_LISTED = 1000
QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)


@dataclass
class Measured:
    """The token deltas of some rows, and what they add up to."""

    rows: int = 0
    deltas: list[npt.NDArray[np.float64]] = field(default_factory=list)  # finite only
    unsupported: int = 0
    dtypes: Counter[str] = field(default_factory=Counter)

    @property
    def tokens(self) -> int:
        return sum(len(d) for d in self.deltas) + self.unsupported

    def merge(self, other: Measured) -> None:
        self.rows += other.rows
        self.deltas += other.deltas
        self.unsupported += other.unsupported
        self.dtypes.update(other.dtypes)

    def figures(self) -> dict[str, Any]:
        """rows, tokens, mean/max |delta|, mean delta, unsupported share, weight quantiles."""
        tokens = self.tokens
        finite = np.concatenate(self.deltas) if self.deltas else np.zeros(0)
        weights = np.concatenate([np.exp(finite), np.zeros(self.unsupported)])
        out: dict[str, Any] = {
            "rows": self.rows,
            "tokens": tokens,
            "mean_abs_delta": _round(float(np.abs(finite).mean())) if finite.size else None,
            "max_abs_delta": _round(float(np.abs(finite).max())) if finite.size else None,
            "mean_delta": _round(float(finite.mean())) if finite.size else None,
            "unsupported": self.unsupported,
            "unsupported_fraction": _round(self.unsupported / tokens) if tokens else None,
            "is_weight": {
                f"p{round(q * 100):02d}": _round(float(np.quantile(weights, q))) for q in QUANTILES
            }
            if weights.size
            else None,
            "serving_dtype": dict(sorted(self.dtypes.items())),
        }
        return out


def _round(value: float) -> float:
    return float(f"{value:.6g}")


def partitions_of(files: Iterable[ShardFile]) -> dict[str, list[ShardFile]]:
    """Files by partition: the directory of their key (``checkpoint=a/date=d/hour=h``)."""
    out: dict[str, list[ShardFile]] = defaultdict(list)
    for shard in files:
        out[shard.key.rpartition("/")[0]].append(shard)
    return dict(out)


def sample_rows(
    store: ObjectStore,
    files: Sequence[ShardFile],
    n: int,
    *,
    checkpoint: str,
    vocab_size: int | None,
) -> pa.Table | None:
    """Up to ``n`` valid, matchable rows of ``checkpoint`` from ``files`` (one partition):
    the first rows of row groups spread evenly over the files. None when there are none."""
    probes = min(len(files), n)
    per = math.ceil(n / probes)
    batches: list[pa.RecordBatch] = []
    taken = 0
    for probe in range(probes):
        shard = files[probe * len(files) // probes]
        batch = _first_rows(store, shard, probe, per * 2)
        if batch is None:
            continue
        flags = check_rows(batch, vocab_size)
        keep = np.ones(batch.num_rows, dtype=np.bool_)
        bad = flags.bad()
        if bad is not None:
            keep &= ~bad
        keep &= np.asarray(batch.column("checkpoint_id").to_pylist(), dtype=object) == checkpoint
        for rows in unmatched(batch, vocab_size).values():
            keep &= ~rows
        batch = batch.filter(pa.array(keep)).slice(0, min(per, n - taken))
        taken += batch.num_rows
        if batch.num_rows:
            batches.append(batch)
        if taken >= n:
            break
    return pa.Table.from_batches(batches) if batches else None


def _first_rows(store: ObjectStore, shard: ShardFile, probe: int, n: int) -> pa.RecordBatch | None:
    """The first ``n`` rows of row group ``probe`` (modulo their number) of ``shard``,
    canonical, read through a small buffer (a few pages, not the row group); None when
    the file cannot be used (the validating reader counts it in pass 1). Opened as every
    reader opens a shard: within the limits of its footer (rtrl.core.shards.limits)."""
    try:
        with open_parquet(store, shard, stream=True) as opened:
            if opened.num_row_groups == 0:
                return None
            plan = plan_file(opened, shard, CANONICAL_COLUMNS)
            if not isinstance(plan, CastPlan):
                return None
            group = probe % opened.num_row_groups
            raw = next(opened.batches(plan.read_names, n, row_group=group), None)
            if raw is None or oversized_strings(raw) is not None:
                return None
            return plan.apply(declared_types(raw, opened.schema))
    except StoreError:
        raise
    except Exception:  # a foreign file fails in many ways: pass 1 reports it
        return None


class GateError(Exception):
    """The gate cannot run: the serving checkpoint cannot be fetched or loaded."""


class Recomputer:
    """The serving checkpoint in float32 (on the GPU when the pod has one, else the CPU):
    each row's completion log-probs under its sampling; with ``base``, the checkpoint in
    ``directory`` is a LoRA adapter, merged into that base (:mod:`rtrl_trainer.models`).
    torch and transformers are imported here, only when the gate runs."""

    def __init__(self, directory: Path, *, base: Path | None = None) -> None:
        import inspect

        import torch

        from rtrl_trainer.models import load_causal_lm

        self.torch = torch
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_causal_lm(directory, base=base, dtype=torch.float32)
        if self.device.type != "cpu":
            self.model.to(self.device)
        # Logits of the completion's positions only (the vocabulary projection is most of a
        # small model's forward), where the model supports it (the trainer does the same).
        self.keep_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        config = self.model.config
        self.positions = int(
            getattr(config, "n_positions", 0) or getattr(config, "max_position_embeddings", 0) or 0
        )

    def measure(self, table: pa.Table) -> Measured:
        """The deltas of every masked completion token of ``table``'s rows."""
        from rtrl_trainer.logprobs import Sampling, sampled_logprobs

        torch = self.torch
        out = Measured()
        columns = {name: table.column(name).to_pylist() for name in table.column_names}
        for i in range(table.num_rows):
            prompt = columns["prompt_ids"][i]
            completion = columns["completion_ids"][i]
            logged = np.asarray(columns["completion_logprobs"][i], dtype=np.float64)
            mask = np.asarray(columns["completion_mask"][i], dtype=np.bool_)
            if not prompt:  # nothing predicts the first token (as the trainer does)
                prompt, completion = completion[:1], completion[1:]
                logged, mask = logged[1:], mask[1:]
            if self.positions and len(completion) >= self.positions:
                continue
            if self.positions:
                prompt = prompt[max(0, len(prompt) + len(completion) - self.positions) :]
            if not completion or not mask.any():
                continue
            s = Sampling.of_row(
                columns["temperature"][i],
                columns["top_p"][i],
                columns["top_k"][i],
                columns["logprobs_mode"][i],
            )
            n = len(completion)
            keep = {"logits_to_keep": n + 1} if self.keep_logits else {}
            with torch.no_grad():
                ids = torch.tensor([list(prompt) + list(completion)], device=self.device)
                forward = self.model(input_ids=ids, use_cache=False, **keep)
                logits = forward.logits[0, -n - 1 : -1]
                lp = sampled_logprobs(
                    logits,
                    torch.tensor(completion, device=self.device),
                    temperature=torch.full((n,), s.temperature, device=self.device),
                    top_p=torch.full((n,), s.top_p, device=self.device),
                    top_k=torch.full((n,), s.top_k, dtype=torch.long, device=self.device),
                )
            recomputed = lp.double().cpu().numpy()[mask]
            delta = recomputed - logged[mask]
            supported = np.isfinite(recomputed)
            out.rows += 1
            out.deltas.append(delta[supported])
            out.unsupported += int((~supported).sum())
            out.dtypes[columns["serving_dtype"][i] or "unrecorded"] += 1
        return out


@dataclass
class GateResult:
    """The gate's verdict: the partitions quarantined, and stage.json's ``fidelity``."""

    unfaithful: frozenset[str]
    document: dict[str, Any]


def disabled(reason: str, spec: FidelitySpec) -> GateResult:
    return GateResult(frozenset(), {"checked": False, "reason": reason, **_bounds(spec)})


def _bounds(spec: FidelitySpec) -> dict[str, Any]:
    return {
        "sample_rows": spec.sample_rows,
        "max_mean_abs_delta": spec.max_mean_abs_delta,
        "max_unsupported_fraction": spec.max_unsupported_fraction,
    }


def verdict(figures: dict[str, Any], spec: FidelitySpec) -> str | None:
    """Why a partition's figures fail the gate, or None when they pass (or say nothing)."""
    mean = figures["mean_abs_delta"]
    if mean is not None and mean > spec.max_mean_abs_delta:
        return f"mean |delta| {mean:.4g} > {spec.max_mean_abs_delta:g}"
    share = figures["unsupported_fraction"]
    if share is not None and share > spec.max_unsupported_fraction:
        return f"unsupported tokens {share:.3g} > {spec.max_unsupported_fraction:g}"
    return None


def run_gate(
    store: ObjectStore,
    *,
    spec: FidelitySpec,
    checkpoint: str,
    partition_key: str,
    parent: str | None,
    endpoint_url: str | None,
    vocab_size: int | None,
    work_dir: Path | None = None,
) -> GateResult:
    """Sample, recompute and judge every partition of ``checkpoint`` (see the module
    docstring); the model is loaded once, and only when some partition has rows to check."""
    if spec.sample_rows == 0:
        return disabled("data.fidelity.sampleRows is 0", spec)
    if parent is None:
        return disabled("no --parent: no serving checkpoint to recompute with", spec)
    clock = time.perf_counter()
    partitions = partitions_of(list_files(store, partitions={partition_key: {checkpoint}}))
    samples = {
        name: sample_rows(
            store, files, spec.sample_rows, checkpoint=checkpoint, vocab_size=vocab_size
        )
        for name, files in sorted(partitions.items())
    }
    recomputer: Recomputer | None = None
    listed: list[dict[str, Any]] = []
    overall = Measured()
    unfaithful: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="rtrl-fidelity-", dir=work_dir) as tmp:
        for name, table in samples.items():
            if table is None:
                measured = Measured()
            else:
                if recomputer is None:
                    recomputer = _load(parent, endpoint_url, Path(tmp))
                measured = recomputer.measure(table)
            overall.merge(measured)
            figures = measured.figures()
            why = verdict(figures, spec)
            if why is not None:
                unfaithful.add(name)
            if len(listed) < MAX_LISTED:
                listed.append({"partition": name, **figures, "quarantined": why})
    document = {
        "checked": True,
        **_bounds(spec),
        "checkpoint": checkpoint,
        "partitions": len(partitions),
        "partitions_checked": sum(1 for p in listed if p["tokens"]),
        "partitions_quarantined": len(unfaithful),
        "overall": overall.figures(),
        "by_partition": listed,
        "seconds": round(time.perf_counter() - clock, 3),
    }
    return GateResult(frozenset(unfaithful), document)


def _load(parent: str, endpoint_url: str | None, scratch: Path) -> Recomputer:
    """The serving checkpoint, downloaded (checksums verified) into ``scratch``, a LoRA
    adapter with the base its manifest names (checked by digest:
    :func:`~rtrl_trainer.checkpoint_io.fetch_model`); :class:`GateError` when it cannot be
    fetched or loaded."""
    from rtrl_trainer.checkpoint_io import InputError, fetch_model

    try:
        fetched, base = fetch_model(
            open_store(parent, endpoint_url=endpoint_url),
            scratch / "serving",
            label="--parent",
            endpoint_url=endpoint_url,
        )
        return Recomputer(fetched.directory, base=base.directory if base else None)
    except (InputError, OSError, ValueError) as exc:
        text = " ".join(str(exc).split())
        raise GateError(
            f"cannot load the serving checkpoint {parent}: {text} (data.fidelity.sampleRows: "
            "0 stages without the gate)"
        ) from None
