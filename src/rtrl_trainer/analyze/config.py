"""The analyze step's settings: the RLCycle's ``data`` and ``rollout`` sections and the
flags of one analysis (the arms, the canary's steps, the clock), validated once so the
scan and the decision see only consistent values (:class:`ConfigError` names the field
or flag otherwise)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rtrl.core.api.common import parse_duration
from rtrl.core.api.rlcycle import DataSpec, RolloutSpec, SequentialTest
from rtrl.core.store import parse_store_uri
from rtrl_trainer.analyze.looks import BIN_US, Looks
from rtrl_trainer.spec_file import ConfigError, format_time, load_sections, validate_section

RESULT_NAME = "analysis.json"


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
    events: str | None = None  # the capture proxy's events root: served requests per arm
    # one organisation's rows alone: the canary of its adapter, which its users alone see
    org: str | None = None
    # organisations left out: those served by adapters of their own, whom the base's
    # canary does not serve alike in both arms (its pods' sidecars route them elsewhere)
    exclude_orgs: tuple[str, ...] = ()

    @property
    def looks(self) -> Looks:
        """The looks of the plan replayed (:mod:`.looks`): the group-sequential test's every
        ``analysis.interval`` from ``--since`` up to ``--now``; the mixture's one, now."""
        analysis = self.rollout.analysis
        return Looks.plan(
            since=self.since,
            now=self.now,
            interval=timedelta(seconds=parse_duration(analysis.interval)),
            max_duration=timedelta(seconds=parse_duration(analysis.max_duration)),
            maturity=timedelta(seconds=parse_duration(self.data.maturity)),
            planned=analysis.sequential_test == SequentialTest.GROUP_SEQUENTIAL,
        )

    @property
    def settle_bins(self) -> int:
        """5-minute bins from a user's first row in the canary to their settled rows."""
        window = self.rollout.analysis.novelty_window
        if window is None:
            return 0
        return -(-int(parse_duration(window) * 1_000_000) // BIN_US)

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
    events: str | None = None,
    org: str | None = None,
    exclude_orgs: list[str] | None = None,
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
    if events is not None:
        try:
            parse_store_uri(events)
        except ValueError as exc:
            raise ConfigError(f"--events: {exc}") from None
    if org is not None and (not org or org != org.strip()):
        raise ConfigError(f"--org: {org!r} is not an organisation")
    for other in exclude_orgs or []:
        if not other or other != other.strip():
            raise ConfigError(f"--exclude-org: {other!r} is not an organisation")
        if other == org:
            raise ConfigError(f"--exclude-org: {other!r} is the --org analysed")
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
        events=events,
        org=org,
        exclude_orgs=tuple(dict.fromkeys(exclude_orgs or [])),
    )
