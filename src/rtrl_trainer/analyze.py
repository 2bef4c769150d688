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
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rtrl.core.api.common import parse_duration
from rtrl.core.api.rlcycle import AssignmentUnit, DataSpec, RolloutSpec
from rtrl.core.shards import REQUIRED_COLUMNS, ValidatingReader
from rtrl.core.shards.layout import parse_partitions
from rtrl.core.store import StoreError, open_store, parse_store_uri
from rtrl.core.store.local import LocalStore
from rtrl_trainer.ab_accumulate import Arms, strings
from rtrl_trainer.config import format_time, time_arg
from rtrl_trainer.reward import Strata, filled
from rtrl_trainer.sequential import METHOD, decide, srm_steps
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
    steps: tuple[tuple[datetime, float], ...] = ()
    pre_exposure_from: tuple[str, ...] = ()

    @property
    def step_plan(self) -> list[tuple[datetime, float | None]]:
        """The canary's steps (start, canary share in percent, None where unknown): the
        strata of the estimates and of the sample-ratio test. From ``--step`` when given;
        else the canary window from ``--since`` with ``--canary-weight`` from
        ``--weight-since`` (an earlier part of unknown share before it)."""
        if self.steps:
            return [(at, share) for at, share in self.steps]
        start = self.since or datetime(1970, 1, 1, tzinfo=UTC)
        current = self.srm_since or start
        if current > start:
            return [(start, None), (current, self.canary_weight)]
        return [(start, self.canary_weight)]

    @property
    def step_starts(self) -> list[datetime]:
        return [at for at, _ in self.step_plan]

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
    steps: list[tuple[datetime, float]] | None = None,
    pre_exposure_from: list[str] | None = None,
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
    ordered = list(steps or [])
    for i, (at, share) in enumerate(ordered):
        if i and at <= ordered[i - 1][0]:
            raise ConfigError(
                f"--step {format_time(at)}={share:g}: steps must be in time order, each after "
                "the one before"
            )
        if at > now:
            raise ConfigError(f"--step {format_time(at)}: after --now {format_time(now)}")
    if ordered and since is not None and ordered[0][0] < since:
        raise ConfigError(f"--step {format_time(ordered[0][0])}: before --since")
    if ordered and since is None:
        since = ordered[0][0]
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
        steps=tuple(ordered),
        pre_exposure_from=tuple(
            c for c in dict.fromkeys(pre_exposure_from or []) if c not in (baseline, canary)
        ),
    )


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
    arms: Arms
    selection: Selection
    excluded: Counter[str] = field(default_factory=Counter)
    bad_by_arm: Counter[str] = field(default_factory=Counter)


UNIT_COLUMN = {AssignmentUnit.USER: "user_id", AssignmentUnit.SESSION: "session_id"}


def scan(config: AnalyzeConfig) -> Scan:
    store = open_store(config.data.shards, endpoint_url=config.endpoint_url)
    if isinstance(store, LocalStore) and not store.root.is_dir():
        raise ConfigError(f"data.shards: {store.root} is not a directory")
    key = config.data.checkpoint_partition
    unit = config.rollout.unit
    extra = ["session_id"] if unit == AssignmentUnit.SESSION else []
    partitions: dict[str, set[str]] = {
        key: {config.baseline, config.canary, *config.pre_exposure_from}
    }
    if config.since is not None:
        # Nothing created before the pre-exposure window is used: skip its date partitions
        # (created_at's UTC date, or a later one such as an ingestion date; files without
        # a date in their path are read).
        first = config.since - timedelta(
            seconds=parse_duration(config.rollout.analysis.pre_exposure)
        )
        days = (config.now.astimezone(UTC).date() - first.astimezone(UTC).date()).days
        partitions["date"] = {
            (first.astimezone(UTC).date() + timedelta(days=d)).isoformat() for d in range(days + 1)
        }
    reader = ValidatingReader(
        store,
        partitions=partitions,
        columns=[*REQUIRED_COLUMNS, *extra] if extra else None,
    )
    selection = Selection(report=reader.report, strata=Strata(by_org=False))
    steps = config.step_starts
    result = Scan(Arms(len(steps), unit), selection)
    arms = result.arms
    now = _us(config.now)
    cutoff = _us(config.cutoff)
    since = _us(config.since) if config.since is not None else None
    starts = np.array([_us(at) for at in steps], dtype=np.int64)
    pre_since = (
        since - int(parse_duration(config.rollout.analysis.pre_exposure) * 1_000_000)
        if since is not None
        else None
    )
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
        if batch.num_rows == 0:
            continue
        created = _times(batch.column("created_at"), 0)
        feedback = _times(batch.column("feedback_at"), _INT64_MAX)
        arm = np.where(
            _mask(pc.equal(ckpt, config.canary)),
            1,
            np.where(_mask(pc.equal(ckpt, config.baseline)), 0, -1),
        )
        # the serving lineage before the canary: stable rows, covariates only
        earlier = arm == 0
        if config.pre_exposure_from:
            earlier |= _mask(pc.is_in(ckpt, pa.array(config.pre_exposure_from)))
        users = strings(batch.column("user_id"), None)
        old_enough = created <= cutoff
        window = np.ones(batch.num_rows, dtype=bool)
        if since is not None:
            window = created >= since
            before = ~window
            pre = before & earlier & old_enough & (feedback <= now)
            if pre_since is not None:
                pre &= created >= pre_since
            if pre.any():
                arms.add_pre(batch.filter(pa.array(pre)), users[pre])
            result.excluded["before_since"] += int(np.count_nonzero(before & ~pre & (arm >= 0)))
        matured = window & old_enough & (feedback <= now)
        result.excluded["too_recent"] += int(np.count_nonzero(window & ~old_enough))
        result.excluded["immature"] += int(np.count_nonzero(window & old_enough & ~matured))
        if unit == AssignmentUnit.REQUEST:
            keys = users
        else:
            keys = strings(batch.column(UNIT_COLUMN[unit]), batch.column("interaction_id"))
        stratum = np.maximum(np.searchsorted(starts, created, side="right") - 1, 0)
        counted = window & (created <= now)
        if counted.any():
            arms.count_assigned(np.where(counted, arm, -1), stratum, keys, created)
        arms.add(
            batch, np.where(window, arm, -1), stratum,
            keys=keys, users=users, matured=matured, judged=window & old_enough,
        )  # fmt: skip
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
    arms = found.arms
    analysis_spec = config.rollout.analysis
    plan_ = config.step_plan
    doc: dict[str, Any] = {
        "ok": True,
        "decision": "continue",
        "message": "",
        "reasons": [],
        "baseline": config.baseline,
        "canary": config.canary,
        "baseline_samples": arms.rows[0],
        "canary_samples": arms.rows[1],
        "metrics": [],
        "metrics_missing": [],
        "srm": None,
        "alpha": analysis_spec.alpha,
        "method": dict(METHOD),
        "inconclusive_policy": str(analysis_spec.inconclusive),
        "non_inferiority_margin": analysis_spec.non_inferiority_margin,
        "max_duration_reached": config.max_duration_reached,
        "canary_weight": config.canary_weight,
        "unit": str(config.rollout.unit),
        "steps": [{"start": format_time(at), "canary_share": share} for at, share in plan_],
        "variance_reduction": {
            "enabled": analysis_spec.variance_reduction,
            "pre_exposure": analysis_spec.pre_exposure,
            "pre_exposure_from": [config.baseline, *config.pre_exposure_from],
            "pre_exposure_rows": arms.pre_rows,
        },
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
        base_units, canary_units, both = arms.srm_counts()
        checked = [i for i, (_, share) in enumerate(plan_) if share is not None]
        srm = None
        if checked:
            srm = srm_steps(
                [base_units[i] for i in checked],
                [canary_units[i] for i in checked],
                [float(plan_[i][1] or 0) / 100 for i in checked],
                analysis_spec.srm_alpha,
            )
        diffs, covered = arms.differences(analysis_spec.variance_reduction)
        result = decide(
            diffs,
            analysis_spec,
            config.rollout.guardrails,
            srm=srm,
            max_duration_reached=config.max_duration_reached,
        )
        last = checked[-1] if checked else len(plan_) - 1
        result.srm.update(
            unit=str(config.rollout.unit),
            baseline_units=base_units[last],
            canary_units=canary_units[last],
            units_in_both_arms=both[last],
            steps=[
                {
                    "start": format_time(plan_[i][0]),
                    "canary_share": plan_[i][1],
                    "baseline_units": base_units[i],
                    "canary_units": canary_units[i],
                    "units_in_both_arms": both[i],
                }
                for i in range(len(plan_))
            ],
        )
        doc["variance_reduction"]["units_with_covariate"] = covered
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


def _step(text: str) -> tuple[datetime, float]:
    at, sep, share = text.rpartition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected ISO8601=SHARE, not {text!r}")
    return time_arg(at), _weight(share)


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
        "--step",
        dest="steps",  # "step" names the rtrl-job subcommand
        type=_step,
        action="append",
        metavar="ISO8601=SHARE",
        help="a canary step: when it started and the canary's share (percent) during it; "
        "repeat for every step so far, in order. The estimates are stratified by step and "
        "the sample-ratio test spans every step (default: one step from --since at "
        "--canary-weight)",
    )
    parser.add_argument(
        "--pre-exposure-from",
        action="append",
        metavar="ID",
        help="a checkpoint that served as stable before the baseline (its ancestors): its "
        "interactions in analysis.preExposure before --since give covariates too; repeat",
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
            steps=args.steps,
            pre_exposure_from=args.pre_exposure_from,
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
