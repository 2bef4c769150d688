"""``rtrl-job analyze``: judge a canary from the interactions each arm served.

The operator runs this step at every analysis of a canary (every few minutes, at every
weight) and acts on ``analysis.json``: promote, rollback or continue. One streaming pass
over the shards of the two checkpoints (only their Hive partitions are listed), through the
validating reader, so bad files and rows are quarantined and counted exactly as the stage
step does, never silently used. Per arm it accumulates the sufficient statistics of every
metric (sums and sums of squares, a latency histogram), so memory does not grow with the
number of rows; the statistics and the decision rule are in :mod:`rtrl_trainer.sequential`.

Which rows count:

- created at or after ``--since`` (the canary's start) and served by one of the two arms
  (its ``checkpoint_id`` agreeing with its file's ``checkpoint=`` partition, else it is
  quarantined as ``checkpoint_mismatch``);
- *matured*, as the stage step defines it from ``data.maturity``: created at least
  ``maturity`` before ``--now`` and its feedback arrived (``feedback_at`` set, not after
  ``--now``). Metrics use only these.

The sample-ratio check counts assignments, not feedback: rows created in
``[--weight-since, now - maturity]`` per arm (``--weight-since``, when the canary weight
last changed, defaults to ``--since``; shares from before a weight change would otherwise
mix two expected ratios).

``analysis.json`` depends only on the inputs apart from ``timing``; it is committed at
``--out`` with the store's commit protocol (manifest last). Exit 0 when the analysis ran,
whatever the decision; 1 when it could not (store errors, more bad rows than
``data.maxBadFraction``: ``analysis.json`` is then committed with ``ok: false`` and
decision ``continue``); 2 for usage and config errors.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rtrl.api.common import parse_duration
from rtrl.api.rlcycle import DataSpec, RolloutSpec
from rtrl.shards import ValidatingReader
from rtrl.shards.layout import parse_partitions
from rtrl.store import StoreError, open_store, parse_store_uri
from rtrl.store.local import LocalStore
from rtrl_trainer.config import format_time, time_arg
from rtrl_trainer.monitors import LatencyHistogram
from rtrl_trainer.reward import Strata, filled
from rtrl_trainer.sequential import METHOD, Estimate, Moments, decide, srm_test
from rtrl_trainer.spec_file import ConfigError, load_sections, validate_section
from rtrl_trainer.stage import (
    CHECKPOINT_MISMATCH,
    Selection,
    quarantine,
    quarantine_message,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

RESULT_NAME = "analysis.json"
MAX_BAD_FILES = 100
_INT64_MAX = np.iinfo(np.int64).max


class AnalyzeError(Exception):
    """The analysis cannot be trusted (too much bad data); exit status 1."""


@dataclass(frozen=True)
class AnalyzeConfig:
    data: DataSpec
    rollout: RolloutSpec
    baseline: str
    canary: str
    out: str
    now: datetime
    since: datetime | None = None
    weight_since: datetime | None = None
    canary_weight: float | None = None
    max_duration_reached: bool = False
    endpoint_url: str | None = None

    @property
    def cutoff(self) -> datetime:
        return self.now - timedelta(seconds=parse_duration(self.data.maturity))

    @property
    def srm_since(self) -> datetime | None:
        if self.weight_since is None:
            return self.since
        if self.since is None:
            return self.weight_since
        return max(self.since, self.weight_since)


def build_config(
    *,
    config_file: Path | None,
    baseline: str,
    canary: str,
    out: str,
    now: datetime,
    shards: str | None = None,
    since: datetime | None = None,
    weight_since: datetime | None = None,
    canary_weight: float | None = None,
    max_duration_reached: bool = False,
    endpoint_url: str | None = None,
) -> AnalyzeConfig:
    """Validate the file and flags; :class:`ConfigError` naming the field otherwise."""
    data_doc: dict[str, Any] = {}
    rollout_doc: dict[str, Any] = {}
    base, where = "", "flags"
    if config_file is not None:
        found, base = load_sections(config_file, ("rollout", "data"))
        data_doc, rollout_doc = dict(found["data"]), found["rollout"]
        where = str(config_file)
    prefix = f"{base}." if base else ""
    flags: dict[str, str] = {}
    if shards is not None:
        data_doc.pop("shards", None)
        data_doc["shards"] = shards
        flags["shards"] = "--shards"
    if "shards" not in data_doc:
        raise ConfigError(
            f"{prefix}data.shards: required: pass --shards URI or set data.shards in the "
            "config file"
        )
    data = validate_section(DataSpec, data_doc, where=where, path=f"{prefix}data", flags=flags)
    rollout = validate_section(RolloutSpec, rollout_doc, where=where, path=f"{prefix}rollout")
    for flag, value in (("--baseline", baseline), ("--canary", canary)):
        if not value or value != value.strip():
            raise ConfigError(f"{flag}: {value!r} is not a checkpoint id")
    if baseline == canary:
        raise ConfigError("--canary must differ from --baseline")
    if canary_weight is not None and not 1 <= canary_weight <= 99:
        raise ConfigError(f"--canary-weight: expected a percentage in 1..99, got {canary_weight:g}")
    for flag, instant in (("--since", since), ("--weight-since", weight_since)):
        if instant is not None and instant > now:
            raise ConfigError(f"{flag} {format_time(instant)} is after --now {format_time(now)}")
    try:
        parse_store_uri(out)
    except ValueError as exc:
        raise ConfigError(f"--out: {exc}") from None
    return AnalyzeConfig(
        data=data,
        rollout=rollout,
        baseline=baseline,
        canary=canary,
        out=out,
        now=now,
        since=since,
        weight_since=weight_since,
        canary_weight=canary_weight,
        max_duration_reached=max_duration_reached,
        endpoint_url=endpoint_url,
    )


# --- per-arm statistics --------------------------------------------------------------------


@dataclass
class Arm:
    """Running sufficient statistics of one arm's matured interactions."""

    rows: int = 0
    assigned: int = 0  # rows counted by the sample-ratio check
    moments: dict[str, Moments] = field(default_factory=dict)
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def _add(self, name: str, x: Any, y: Any = None) -> None:
        if np.size(x) == 0:
            return
        self.moments.setdefault(name, Moments()).add(Moments.of(x, y))

    def update(self, batch: pa.RecordBatch) -> None:
        """Add the matured rows in ``batch``."""
        if batch.num_rows == 0:
            return
        self.rows += batch.num_rows
        edit = batch.column("edit_persisted")
        self._add("edit_persistence", pc.drop_null(edit).to_numpy(zero_copy_only=False))
        self._add(
            "dissatisfied_followup_rate", filled(batch.column("dissatisfied_followup"), False)
        )
        latency = pc.drop_null(batch.column("latency_ms")).to_numpy(zero_copy_only=False)
        latency = latency.astype(np.float64, copy=False)
        self._add("latency_ms", latency)
        self.latency.add(latency)
        self._add("edit_rate", filled(batch.column("edits_proposed"), 0) > 0)
        self._add("clarification_rate", filled(batch.column("asked_clarification"), False))
        self._add(
            "invalid_tool_call_rate",
            filled(batch.column("invalid_tool_calls"), 0),
            filled(batch.column("tool_calls"), 0),
        )
        self._add(
            "mean_completion_tokens",
            filled(pc.list_value_length(batch.column("completion_ids")), 0),
        )

    def estimates(self) -> dict[str, Estimate]:
        found = {name: m.estimate() for name, m in self.moments.items()}
        p95 = quantile_estimate(self.latency, 0.95)
        if p95 is not None:
            found["latency_p95_ms"] = p95
        return found


def quantile_estimate(hist: LatencyHistogram, q: float) -> Estimate | None:
    """The ``q`` quantile of a histogram and its asymptotic variance ``q(1-q) s^2 / n``,
    the sparsity ``s`` by the Siddiqui-Bofinger difference quotient with the Hall-Sheather
    bandwidth (Koenker, Quantile Regression, 2005, section 3.4); floored at the histogram's
    resolution."""
    n = hist.count
    if n < 2:
        return None
    value = hist.quantile(q)
    assert value is not None
    z = NormalDist().inv_cdf(q)
    z_level = NormalDist().inv_cdf(0.975)
    density = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    h = n ** (-1 / 3) * z_level ** (2 / 3) * (1.5 * density**2 / (2 * z * z + 1)) ** (1 / 3)
    h = min(h, q * 0.5, (1 - q) * 0.5)
    upper, lower = hist.quantile(q + h), hist.quantile(q - h)
    assert upper is not None and lower is not None
    sparsity = (upper - lower) / (2 * h)
    resolution = value * (hist.GROWTH - 1) / 2
    var = max(q * (1 - q) * sparsity**2 / n, resolution**2 / n)
    return Estimate(value, var, float(n))


# --- the pass over the shards ---------------------------------------------------------------


def _us(value: datetime) -> int:
    delta = value.astimezone(UTC) - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _mask(array: pa.Array) -> np.ndarray[Any, np.dtype[np.bool_]]:
    values: np.ndarray[Any, np.dtype[np.bool_]] = filled(array, False).astype(np.bool_)
    return values


def _times(array: pa.Array, fill: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    values: np.ndarray[Any, np.dtype[np.int64]] = filled(array.cast(pa.int64()), fill)
    return values


@dataclass
class Scan:
    arms: dict[str, Arm]
    selection: Selection
    excluded: Counter[str] = field(default_factory=Counter)
    bad_by_arm: Counter[str] = field(default_factory=Counter)


def scan(config: AnalyzeConfig) -> Scan:
    store = open_store(config.data.shards, endpoint_url=config.endpoint_url)
    if isinstance(store, LocalStore) and not store.root.is_dir():
        raise ConfigError(f"data.shards: {store.root} is not a directory")
    key = config.data.checkpoint_partition
    reader = ValidatingReader(store, partitions={key: {config.baseline, config.canary}})
    selection = Selection(report=reader.report, strata=Strata(by_org=False))
    result = Scan({config.baseline: Arm(), config.canary: Arm()}, selection)
    now = _us(config.now)
    cutoff = _us(config.cutoff)
    since = _us(config.since) if config.since is not None else None
    srm_since = _us(config.srm_since) if config.srm_since is not None else None
    path_checkpoints: dict[str, str | None] = {}
    for good in reader:
        batch = good
        file = reader.report.files[-1]
        if file.key not in path_checkpoints:
            path_checkpoints[file.key] = parse_partitions(file.key).get(key)
        expected = path_checkpoints[file.key]
        ckpt = batch.column("checkpoint_id")
        if expected is not None:
            mismatch = _mask(pc.not_equal(ckpt, expected))
            if mismatch.any():
                selection.mismatched[file.url] += int(np.count_nonzero(mismatch))
                batch = batch.filter(pa.array(~mismatch))
                ckpt = batch.column("checkpoint_id")
        created = _times(batch.column("created_at"), 0)
        feedback = _times(batch.column("feedback_at"), _INT64_MAX)
        window = np.ones(batch.num_rows, dtype=bool)
        if since is not None:
            window = created >= since
            result.excluded["before_since"] += int(np.count_nonzero(~window))
        old_enough = created <= cutoff
        matured = window & old_enough & (feedback <= now)
        result.excluded["too_recent"] += int(np.count_nonzero(window & ~old_enough))
        result.excluded["immature"] += int(np.count_nonzero(window & old_enough & ~matured))
        assigned = old_enough & (created >= srm_since if srm_since is not None else True)
        for checkpoint, arm in result.arms.items():
            mine = _mask(pc.equal(ckpt, checkpoint))
            arm.assigned += int(np.count_nonzero(mine & assigned))
            keep = mine & matured
            if keep.any():
                arm.update(batch.filter(pa.array(keep)))
    for file in reader.report.files:
        served_by = parse_partitions(file.key).get(key)
        lost = file.rows_bad + selection.mismatched.get(file.url, 0)
        if lost and served_by is not None:
            result.bad_by_arm[served_by] += lost
    return result


# --- the step --------------------------------------------------------------------------------


def analyze(config: AnalyzeConfig) -> dict[str, Any]:
    """Run the analysis; return the ``analysis.json`` document it committed.

    Raises :class:`AnalyzeError` (after committing ``ok: false``) when too much data is bad,
    :class:`StoreError` when the store fails.
    """
    clock = time.perf_counter()
    out = open_store(config.out, endpoint_url=config.endpoint_url)
    found = scan(config)
    q = quarantine(found.selection)
    limit = config.data.max_bad_fraction
    base_arm, canary_arm = found.arms[config.baseline], found.arms[config.canary]
    analysis_spec = config.rollout.analysis
    doc: dict[str, Any] = {
        "ok": True,
        "decision": "continue",
        "message": "",
        "reasons": [],
        "baseline": config.baseline,
        "canary": config.canary,
        "baseline_samples": base_arm.rows,
        "canary_samples": canary_arm.rows,
        "metrics": [],
        "metrics_missing": [],
        "srm": None,
        "alpha": analysis_spec.alpha,
        "method": dict(METHOD),
        "inconclusive_policy": str(analysis_spec.inconclusive),
        "non_inferiority_margin": analysis_spec.non_inferiority_margin,
        "max_duration_reached": config.max_duration_reached,
        "canary_weight": config.canary_weight,
        "now": format_time(config.now),
        "since": format_time(config.since),
        "weight_since": format_time(config.srm_since),
        "cutoff": format_time(config.cutoff),
        "maturity": config.data.maturity,
        "shards": config.data.shards,
        "rows_read": q.rows_read,
        "rows_bad": q.rows_bad,
        "bad_fraction": q.bad_fraction,
        "max_bad_fraction": limit,
        "quarantined": q.by_reason,
        "quarantined_by_arm": {
            "baseline": found.bad_by_arm.get(config.baseline, 0),
            "canary": found.bad_by_arm.get(config.canary, 0),
        },
        "files_total": q.files_total,
        "files_bad": q.files_bad,
        "quarantined_files": q.bad_files[:MAX_BAD_FILES],
        "excluded": dict(sorted((k, v) for k, v in found.excluded.items() if v)),
    }
    if q.bad_fraction > limit:
        doc["ok"] = False
        doc["message"] = quarantine_message(q, limit)
        doc["reasons"] = [f"cannot analyse: {doc['message']}"]
    else:
        srm = None
        if config.canary_weight is not None:
            srm = srm_test(
                base_arm.assigned,
                canary_arm.assigned,
                config.canary_weight / 100,
                analysis_spec.srm_alpha,
            )
        result = decide(
            base_arm.estimates(),
            canary_arm.estimates(),
            analysis_spec,
            config.rollout.guardrails,
            srm=srm,
            max_duration_reached=config.max_duration_reached,
        )
        result.srm.update(
            baseline_interactions=base_arm.assigned, canary_interactions=canary_arm.assigned
        )
        doc.update(
            decision=result.decision,
            message=result.reasons[0],
            reasons=result.reasons,
            metrics=result.metrics,
            metrics_missing=result.missing,
            srm=result.srm,
        )
    doc["timing"] = {"seconds": round(time.perf_counter() - clock, 3)}
    with tempfile.TemporaryDirectory(prefix="rtrl-analyze-") as tmp:
        path = Path(tmp) / RESULT_NAME
        path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        metadata = {
            "step": "analyze",
            "ok": doc["ok"],
            "decision": doc["decision"],
            "baseline": config.baseline,
            "canary": config.canary,
        }
        out.commit("", {RESULT_NAME: path}, metadata)
    if not doc["ok"]:
        raise AnalyzeError(doc["message"])
    return doc


# --- command line ----------------------------------------------------------------------------


def _weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 1 <= value <= 99:
        raise argparse.ArgumentTypeError(f"expected a percentage in 1..99, not {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Judge a canary: per-arm statistics of the matured interactions each checkpoint "
        "served since the canary started, always-valid intervals, guardrails and a "
        "sample-ratio check; commit analysis.json (decision promote, rollback or continue, "
        "with reasons) to --out. Exit 0 when it ran (whatever the decision), 1 when it "
        "could not (store errors, too much bad data), 2 for usage and config errors."
    )
    parser.add_argument("--shards", metavar="URI", help="shard source (sets data.shards)")
    parser.add_argument("--baseline", metavar="ID", required=True, help="stable checkpoint")
    parser.add_argument("--canary", metavar="ID", required=True, help="canary checkpoint")
    parser.add_argument("--out", metavar="URI", required=True, help="where analysis.json goes")
    parser.add_argument(
        "--canary-weight",
        type=_weight,
        metavar="W",
        help="the canary's configured traffic share in percent (1..99): enables the "
        "sample-ratio check",
    )
    parser.add_argument(
        "--since",
        type=time_arg,
        metavar="ISO8601",
        help="canary start: only interactions created at or after it",
    )
    parser.add_argument(
        "--weight-since",
        type=time_arg,
        metavar="ISO8601",
        help="when the canary weight last changed (default --since): the sample-ratio check "
        "counts interactions created at or after it",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        type=Path,
        help="YAML/JSON: an RLCycle, its spec, or a mapping with rollout and/or data",
    )
    parser.add_argument(
        "--now", type=time_arg, metavar="ISO8601", help="the analysis time (default: the clock)"
    )
    parser.add_argument(
        "--max-duration-reached",
        action="store_true",
        help="the canary ran for analysis.maxDuration: apply the inconclusive policy",
    )
    parser.add_argument(
        "--endpoint-url",
        metavar="URL",
        help="S3-compatible endpoint (default: $AWS_ENDPOINT_URL, else AWS)",
    )


def run(args: argparse.Namespace) -> int:
    """``rtrl-job analyze``: build the config, run the analysis, print the decision."""
    now = args.now if args.now is not None else datetime.now(UTC).replace(microsecond=0)
    try:
        config = build_config(
            config_file=args.config,
            baseline=args.baseline,
            canary=args.canary,
            out=args.out,
            now=now,
            shards=args.shards,
            since=args.since,
            weight_since=args.weight_since,
            canary_weight=args.canary_weight,
            max_duration_reached=args.max_duration_reached,
            endpoint_url=args.endpoint_url,
        )
        doc = analyze(config)
    except ConfigError as exc:
        print(f"rtrl-job analyze: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (AnalyzeError, StoreError) as exc:
        print(f"analyze: cannot analyse: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(f"analyze: cannot analyse: local I/O failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"analyze: {doc['decision']}: {doc['message']} -> {config.out}")
    return EXIT_OK


__all__ = ["CHECKPOINT_MISMATCH", "AnalyzeConfig", "analyze", "build_config", "run"]
