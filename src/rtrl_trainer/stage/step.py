"""The stage step, top to bottom: select (pass 1), decide, advantages (pass 2), commit.

The rules and the reasons are in :mod:`rtrl_trainer.stage`; this module is the order in
which the parts run and the ``stage.json`` they add up to.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from rtrl.core.events import SealedView
from rtrl.core.results import StageResult
from rtrl.core.shards.vocabulary import VocabularyError, read_vocab_size
from rtrl.core.store import ObjectStore, open_store
from rtrl.core.store.local import LocalStore
from rtrl_trainer.checkpoint_io import InputError, model_store
from rtrl_trainer.quarantine import Quarantine, quarantine, quarantine_message
from rtrl_trainer.reward import RunningStats
from rtrl_trainer.spec_file import ConfigError, format_time
from rtrl_trainer.stage.admit import Admission, admit_previous, write_ranks
from rtrl_trainer.stage.commit import Staging
from rtrl_trainer.stage.config import StageConfig
from rtrl_trainer.stage.fidelity import GateError, GateResult, run_gate
from rtrl_trainer.stage.ranks import Ranks, deal
from rtrl_trainer.stage.select import (
    Selection,
    scratch_schema,
    select,
    shard_partitions,
    token_id_type,
)
from rtrl_trainer.stage.workers import Worker
from rtrl_trainer.stagedset import HELDOUT_NAME, RESULT_NAME, train_schema

SCRATCH_COMPRESSION = "zstd"


class StageError(Exception):
    """The step cannot produce a training set (too much bad data, a parent without a
    vocabulary); exit status 1."""


def parent_vocabulary(config: StageConfig) -> int | None:
    """The vocabulary token ids must lie in: the parent's config.json ``vocab_size``
    (read through the store, as the train step reads it), None without ``--parent``. A
    parent that is a LoRA adapter has the vocabulary of the base its manifest names, whose
    files must be the ones it was trained on (checked by digest, as train and the fidelity
    gate check them)."""
    if config.parent is None:
        return None
    store = open_store(config.parent, endpoint_url=config.endpoint_url)
    try:
        model, lineage = model_store(store, label="--parent", endpoint_url=config.endpoint_url)
    except InputError as exc:
        raise StageError(str(exc)) from None
    try:
        return read_vocab_size(model)
    except VocabularyError as exc:
        under = f" (base {model.uri})" if lineage is not None else ""
        raise StageError(f"parent {config.parent}{under}: {exc}") from None


def _summary_document(config: StageConfig) -> dict[str, Any]:
    return {
        "ok": True,
        "sufficient": False,
        "message": "",
        "checkpoint": config.checkpoint,
        "previous_checkpoint": config.previous_checkpoint,
        "excluded_checkpoints": list(config.exclude_checkpoints),
        "shards": config.data.shards,
        "out": config.out,
        "now": format_time(config.now),
        "since": format_time(config.since),
        "cutoff": format_time(config.cutoff),
        "window_start": format_time(config.window_start),
        "next_since": format_time(config.now),
        "maturity": config.data.maturity,
        "parent": config.parent,
        "vocab_size": None,
    }


def stage(config: StageConfig, *, work_dir: Path | None = None) -> dict[str, Any]:
    """Run the stage step; return the ``stage.json`` document it committed.

    Raises :class:`StageError` (after committing a ``stage.json`` with ``ok: false``) when
    too much of the data is bad, and :class:`StoreError` when the store fails.
    """
    clock = time.perf_counter()
    shards = open_store(config.data.shards, endpoint_url=config.endpoint_url)
    if isinstance(shards, LocalStore) and not shards.root.is_dir():
        raise ConfigError(f"data.shards: {shards.root} is not a directory")
    if config.sealed:
        # every listing of the shards below sees only the files the seal markers list
        shards = SealedView(shards, since=config.window_start)
    out = open_store(config.out, endpoint_url=config.endpoint_url)
    doc = _summary_document(config)
    doc["vocab_size"] = vocab_size = parent_vocabulary(config)
    with (
        tempfile.TemporaryDirectory(prefix="rtrl-stage-", dir=work_dir) as tmp,
        Staging(out, Path(tmp)) as staging,
    ):
        tmp_dir = Path(tmp)
        heldout = staging.path(HELDOUT_NAME) if config.heldout_fraction > 0 else None
        token_ids = token_id_type(shards, shard_partitions(config))
        gate = _fidelity(config, shards, vocab_size, tmp_dir)
        doc["fidelity"] = gate.document
        ranks = Ranks(config.ranks, staging, tmp_dir, train_schema(token_ids))
        with ranks:
            selection, scratch = _pass_one(
                config, shards, ranks, heldout, token_ids, tmp_dir, vocab_size, gate.unfaithful
            )
            select_seconds = time.perf_counter() - clock
            q = quarantine(selection)
            doc.update(_quarantine_fields(q, selection, config, token_ids))
            admission = admit_previous(selection, config.data.max_off_policy_fraction)
            stats = RunningStats()
            stats.merge(selection.on_stats)
            stats.merge(admission.stats)
            doc.update(_set_fields(selection, admission, stats, config))
            keys = _decide_and_write(
                doc,
                q,
                config,
                selection=selection,
                admission=admission,
                stats=stats,
                ranks=ranks,
                scratch=scratch,
                heldout=heldout,
            )
        if scratch is not None:
            scratch.unlink()  # before the upload: the disk held both only while needed
        doc["quarantined_files"] = q.bad_files
        seconds = time.perf_counter() - clock
        doc["timing"] = {
            "seconds": round(seconds, 3),
            "select_seconds": round(select_seconds, 3),
            "write_seconds": round(seconds - select_seconds, 3),
            "rows_per_second": round(q.rows_read / seconds) if seconds > 0 else None,
        }
        result = StageResult.written(doc)  # the contract the operator reads it by
        staging.path(RESULT_NAME).write_text(result.to_json())
        doc = result.document()
        metadata = {
            "step": "stage",
            "ok": doc["ok"],
            "sufficient": doc["sufficient"],
            "checkpoint": config.checkpoint,
            "interactions": doc["interactions_used"],
            "tokens": doc["tokens_used"],
        }
        staging.commit([*keys, RESULT_NAME], metadata, ranks.entries())
    if not doc["ok"]:
        raise StageError(doc["message"])
    return doc


def _fidelity(
    config: StageConfig, shards: ObjectStore, vocab_size: int | None, tmp_dir: Path
) -> GateResult:
    """The fidelity gate over the serving checkpoint's partitions (before pass 1, which
    quarantines the partitions it failed)."""
    try:
        return run_gate(
            shards,
            spec=config.data.fidelity,
            checkpoint=config.checkpoint,
            partition_key=config.data.checkpoint_partition,
            parent=config.parent,
            endpoint_url=config.endpoint_url,
            vocab_size=vocab_size,
            work_dir=tmp_dir,
        )
    except GateError as exc:
        raise StageError(f"fidelity gate: {exc}") from None


def _pass_one(  # noqa: PLR0917 (the step's parts, named at the one call)
    config: StageConfig,
    shards: ObjectStore,
    ranks: Ranks,
    heldout: Path | None,
    token_ids: str,
    tmp_dir: Path,
    vocab_size: int | None,
    unfaithful: frozenset[str] = frozenset(),
) -> tuple[Selection, Path | None]:
    """Pass 1 into the rank files, or, when previous-checkpoint rows are admissible, into a
    scratch file (returned) for pass 2."""
    if not config.admits_previous:
        # Every selected row enters the set: straight to the rank files.
        selection = select(
            config,
            shards,
            lambda b: deal(ranks, b),
            heldout,
            token_ids,
            vocab_size=vocab_size,
            unfaithful=unfaithful,
        )
        ranks.close()
        return selection, None
    # Which previous-checkpoint rows enter the set is known only once all are read: the
    # selected rows wait in a scratch file (Arrow IPC, zstd buffers: not re-encoded on the
    # way in or out), dealt to the ranks in pass 2.
    scratch = tmp_dir / "selected.arrow"
    options = pa.ipc.IpcWriteOptions(compression=SCRATCH_COMPRESSION)
    with (
        pa.OSFile(os.fspath(scratch), "wb") as sink,
        pa.ipc.new_stream(sink, scratch_schema(token_ids), options=options) as writer,
        Worker("stage-scratch") as background,
    ):
        selection = select(
            config,
            shards,
            lambda b: background.submit(writer.write_batch, b),
            heldout,
            token_ids,
            vocab_size=vocab_size,
            unfaithful=unfaithful,
        )
    return selection, scratch


def _quarantine_fields(
    q: Quarantine, selection: Selection, config: StageConfig, token_ids: str
) -> dict[str, Any]:
    return {
        "rows_read": q.rows_read,
        "rows_bad": q.rows_bad,
        "bad_fraction": q.bad_fraction,
        "max_bad_fraction": config.data.max_bad_fraction,
        "files_total": q.files_total,
        "files_bad": q.files_bad,
        "quarantined": q.by_reason,
        "files_by_reason": q.files_by_reason,
        "immature": selection.immature,
        "too_recent": selection.too_recent,
        # Valid rows whose logged log-probs are not their sampling distribution's (not bad
        # data: not counted against maxBadFraction), by reason.
        "refused": dict(sorted(selection.refused.items())),
        "token_ids": np.dtype(token_ids).name,
    }


def _set_fields(
    selection: Selection, admission: Admission, stats: RunningStats, config: StageConfig
) -> dict[str, Any]:
    """What the set holds (before the verdict: an insufficient set reports them too)."""
    excluded = Counter(selection.excluded)
    if admission.eligible > admission.admitted:
        excluded["off_policy_cap"] += admission.eligible - admission.admitted
    used = selection.on_rows + admission.admitted
    return {
        "excluded": dict(sorted(excluded.items())),
        "eligible": {"on_policy": selection.on_rows, "previous": admission.eligible},
        "interactions_used": used,
        "tokens_used": selection.on_tokens + admission.tokens,
        "on_policy_interactions": selection.on_rows,
        "heldout_fraction": config.heldout_fraction,
        "heldout_interactions": selection.heldout,
        "heldout_file": None,
        "off_policy_interactions": admission.admitted,
        "on_policy_fraction": selection.on_rows / used if used else None,
        "min_interactions": config.data.min_interactions,
        "min_tokens": config.data.min_tokens,
        "reward_spec": config.reward.to_k8s(),
        "reward": stats.to_dict(),
        "advantage": RunningStats().to_dict(),
        "baselines": selection.strata.describe(),
        "missing_signals": dict(selection.monitors.missing),
        "monitors": selection.monitors.result(),
        "ranks": [],
        "files": [],
    }


def _refused_words(selection: Selection) -> str:
    """``; 40 refused (log-probs not of the sampled distribution: raw_logprobs_tempered=40)``"""
    if not selection.refused:
        return ""
    reasons = ", ".join(f"{r}={n}" for r, n in sorted(selection.refused.items()))
    total = sum(selection.refused.values())
    return f"; {total} refused (log-probs not of the sampled distribution: {reasons})"


def _decide_and_write(
    doc: dict[str, Any],
    q: Quarantine,
    config: StageConfig,
    *,
    selection: Selection,
    admission: Admission,
    stats: RunningStats,
    ranks: Ranks,
    scratch: Path | None,
    heldout: Path | None,
) -> list[str]:
    """The verdict (too much bad data, insufficient, or a set) into ``doc``; for a set,
    pass 2 and the advantage files. The keys of the files to commit besides stage.json."""
    used, tokens = doc["interactions_used"], doc["tokens_used"]
    limit = config.data.max_bad_fraction
    if q.bad_fraction > limit:
        doc["ok"] = False
        doc["message"] = quarantine_message(q, limit)
        return []
    if used < config.data.min_interactions or tokens < config.data.min_tokens:
        doc["message"] = (
            f"insufficient data: {used} interactions (minimum "
            f"{config.data.min_interactions}), {tokens} completion tokens (minimum "
            f"{config.data.min_tokens}); {selection.immature} immature and "
            f"{selection.too_recent} too recent wait for a later cycle"
        ) + _refused_words(selection)
        return []
    if scratch is not None:
        write_ranks(ranks, scratch=scratch, admission=admission)
        ranks.close()
    summary, adv_stats = ranks.write_advantages(selection.strata.baselines(), stats.std)
    keys = ranks.keys()
    doc["sufficient"] = True
    doc["ranks"] = summary
    doc["files"] = list(keys)
    doc["message"] = (
        f"{used} interactions, {tokens} completion tokens, "
        f"{doc['on_policy_fraction']:.1%} on-policy, in {config.ranks} rank file(s)"
    ) + _refused_words(selection)
    doc["advantage"] = adv_stats.to_dict()
    if heldout is not None:
        keys.append(HELDOUT_NAME)
        doc["heldout_file"] = HELDOUT_NAME
    return keys
