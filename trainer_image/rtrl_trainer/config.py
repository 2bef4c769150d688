"""The stage step's configuration: a typed object built from the RLCycle's own API types.

The operator hands a Job pod the ``data`` and ``reward`` parts of the RLCycle spec (as a
config file) plus per-cycle flags (checkpoint, time, output). The fields, their defaults and
their validation are those of :class:`~rtrl.api.rlcycle.DataSpec` and
:class:`~rtrl.api.rlcycle.RewardSpec`, reused rather than redefined, so a config the API
server accepted is exactly a config this step accepts, and a bad one is rejected with the
same field path ``rtrl validate`` would print.

The config file may be a whole RLCycle manifest, an RLCycle ``spec``, or a mapping with
``data`` and/or ``reward`` (YAML or JSON). Flags override the file; ``--shards`` fills
``data.shards``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rtrl.api.common import parse_duration
from rtrl.api.errors import error_message, format_loc
from rtrl.api.rlcycle import DataSpec, RewardSpec, RLCycleSpec
from rtrl.store import parse_store_uri


class ConfigError(ValueError):
    """The configuration is unusable; the message names the file or flag and the field."""


# DataSpec fields (camelCase, as in YAML) that a flag may override -> the flag's name.
DATA_FLAGS: dict[str, str] = {
    "shards": "--shards",
    "maturity": "--maturity",
    "maxBadFraction": "--max-bad-fraction",
    "minInteractions": "--min-interactions",
    "minTokens": "--min-tokens",
}
# Top-level keys of an RLCycle spec this step does not use but must tolerate, so that the
# operator can pass the spec through as it is.
_SPEC_KEYS = frozenset(
    field.alias or name for name, field in RLCycleSpec.model_fields.items()
) | frozenset(RLCycleSpec.model_fields)


@dataclass(frozen=True)
class StageConfig:
    """Everything one run of ``rtrl-job stage`` needs, validated.

    Times are timezone-aware UTC. ``since`` is the readiness watermark (see
    :mod:`rtrl_trainer.stage`): rows that became ready at or before it were staged by an
    earlier cycle.
    """

    data: DataSpec
    reward: RewardSpec
    checkpoint: str
    out: str
    now: datetime
    since: datetime | None = None
    previous_checkpoint: str | None = None
    exclude_checkpoints: tuple[str, ...] = ()
    ranks: int = 1
    endpoint_url: str | None = None

    @property
    def maturity(self) -> timedelta:
        return timedelta(seconds=parse_duration(self.data.maturity))

    @property
    def cutoff(self) -> datetime:
        """Interactions created after this are too recent for their feedback to be final."""
        return self.now - self.maturity

    @property
    def window_start(self) -> datetime | None:
        """Interactions created before this are too old to learn from (``data.window``)."""
        if self.data.window is None:
            return None
        return self.now - timedelta(seconds=parse_duration(self.data.window))

    @property
    def admits_previous(self) -> bool:
        """Whether rows of the previous checkpoint may enter the training set at all."""
        return (
            self.previous_checkpoint is not None
            and self.previous_checkpoint not in self.exclude_checkpoints
            and self.data.max_off_policy_fraction > 0
        )


def parse_time(text: str) -> datetime:
    """An ISO 8601 instant (``2026-01-05T12:00:00Z``); a naive one is taken as UTC."""
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not an ISO 8601 time (e.g. 2026-01-05T12:00:00Z)") from None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def format_time(value: datetime | None) -> str | None:
    """``value`` as ISO 8601 UTC with a ``Z`` (the form stage.json uses), or None."""
    if value is None:
        return None
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _validation_problems(
    exc: ValidationError, *, where: str, path: str, flags: Mapping[str, str]
) -> str:
    """One line per problem: ``FILE: spec.data.maturity: ...`` or ``--maturity: ...``."""
    lines = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        flag = flags.get(str(loc[0])) if loc else None
        field = format_loc((path, *loc))
        if flag is not None:
            lines.append(f"{flag} ({field}): {error_message(error)}")
        else:
            lines.append(f"{where}: {field}: {error_message(error)}")
    return "; ".join(lines)


def _json(value: Any) -> str:
    # YAML may hold dates or other non-JSON scalars; as strings they fail validation with a
    # message naming the field, instead of an exception here.
    return json.dumps(value, default=str)


def load_config_file(path: Path) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The ``data`` and ``reward`` mappings of a config file and the path they sit under
    (``spec`` for a manifest, empty otherwise), for messages naming fields."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read: {exc.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"{path}: not valid YAML or JSON: {detail}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(
            f"{path}: expected a mapping (an RLCycle, its spec, or data/reward), "
            f"got {type(doc).__name__}"
        )
    base = ""
    if "spec" in doc or "kind" in doc or "apiVersion" in doc:
        if doc.get("kind", "RLCycle") != "RLCycle":
            raise ConfigError(f"{path}: kind: expected RLCycle, got {doc.get('kind')!r}")
        doc, base = doc.get("spec"), "spec"
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: spec: expected a mapping")
    unknown = sorted(str(key) for key in doc if key not in _SPEC_KEYS)
    if unknown:
        where = f"{base}." if base else ""
        raise ConfigError(
            f"{path}: {where}{unknown[0]}: unknown field (expected data and/or reward, "
            "or a whole RLCycle spec)"
        )
    sections: list[dict[str, Any]] = []
    for name in ("data", "reward"):
        section = doc.get(name)
        if section is None:
            section = {}
        if not isinstance(section, dict):
            label = f"{base}.{name}" if base else name
            raise ConfigError(f"{path}: {label}: expected a mapping")
        sections.append(section)
    return sections[0], sections[1], base


def build_config(
    *,
    config_file: Path | None,
    checkpoint: str,
    out: str,
    now: datetime,
    shards: str | None = None,
    maturity: str | None = None,
    max_bad_fraction: float | None = None,
    min_interactions: int | None = None,
    min_tokens: int | None = None,
    since: datetime | None = None,
    previous_checkpoint: str | None = None,
    exclude_checkpoints: Iterable[str] = (),
    ranks: int = 1,
    endpoint_url: str | None = None,
) -> StageConfig:
    """Validate the file and flags into a :class:`StageConfig`; :class:`ConfigError`
    naming the field (and the file or flag it came from) when anything is wrong."""
    data_doc: dict[str, Any] = {}
    reward_doc: dict[str, Any] = {}
    base = ""
    where = "flags"
    if config_file is not None:
        data_doc, reward_doc, base = load_config_file(config_file)
        where = str(config_file)
    prefix = f"{base}." if base else ""
    overrides = {
        "shards": shards,
        "maturity": maturity,
        "maxBadFraction": max_bad_fraction,
        "minInteractions": min_interactions,
        "minTokens": min_tokens,
    }
    flags: dict[str, str] = {}
    data_doc = dict(data_doc)
    for key, value in overrides.items():
        if value is None:
            continue
        # The file may spell the field in snake_case (populate_by_name); the flag wins.
        for spelled in (key, _snake(key)):
            data_doc.pop(spelled, None)
        data_doc[key] = value
        flags[key] = DATA_FLAGS[key]
    if "shards" not in data_doc and "shards" not in {_snake(k) for k in data_doc}:
        raise ConfigError(
            f"{prefix}data.shards: required: pass --shards URI or set data.shards in the "
            "config file"
        )
    try:
        data = DataSpec.model_validate_json(_json(data_doc), strict=True)
    except ValidationError as exc:
        raise ConfigError(
            _validation_problems(exc, where=where, path=f"{prefix}data", flags=flags)
        ) from None
    try:
        reward = RewardSpec.model_validate_json(_json(reward_doc), strict=True)
    except ValidationError as exc:
        raise ConfigError(
            _validation_problems(exc, where=where, path=f"{prefix}reward", flags={})
        ) from None

    excluded = tuple(dict.fromkeys(exclude_checkpoints))
    for flag, value in (
        ("--checkpoint", checkpoint),
        ("--previous-checkpoint", previous_checkpoint),
        *(("--exclude-checkpoint", e) for e in excluded),
    ):
        if value is not None and (not value or value != value.strip()):
            raise ConfigError(f"{flag}: {value!r} is not a checkpoint id")
    if checkpoint in excluded:
        raise ConfigError(
            f"--checkpoint {checkpoint!r} is also given as --exclude-checkpoint: a rolled-back "
            "checkpoint's interactions are never staged"
        )
    if previous_checkpoint is not None and previous_checkpoint == checkpoint:
        raise ConfigError("--previous-checkpoint must differ from --checkpoint")
    if ranks < 1:
        raise ConfigError(f"--ranks: must be at least 1, got {ranks}")
    if since is not None and since > now:
        raise ConfigError(
            f"--since {format_time(since)} is after --now {format_time(now)}: nothing can be "
            "ready yet"
        )
    _check_out(out, data.shards)
    return StageConfig(
        data=data,
        reward=reward,
        checkpoint=checkpoint,
        out=out,
        now=now,
        since=since,
        previous_checkpoint=previous_checkpoint,
        exclude_checkpoints=excluded,
        ranks=ranks,
        endpoint_url=endpoint_url,
    )


def _snake(camel: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in camel)


def _check_out(out: str, shards: str) -> None:
    try:
        target = parse_store_uri(out)
    except ValueError as exc:
        raise ConfigError(f"--out: {exc}") from None
    source = parse_store_uri(shards)
    if target.scheme != source.scheme or target.bucket != source.bucket:
        return
    inside = target.path == source.path or target.path.startswith(source.path.rstrip("/") + "/")
    if inside or not source.path:
        # The training set's Parquet files would be listed as shards by the next cycle.
        raise ConfigError(
            f"--out {out} is inside the shard source {shards}; write the training set elsewhere"
        )
