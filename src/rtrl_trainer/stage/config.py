"""The stage step's configuration: a typed object built from the RLCycle's own API types.

The operator hands a Job pod the ``data`` and ``reward`` parts of the RLCycle spec (as a
config file) plus per-cycle flags (checkpoint, time, output). The fields, their defaults and
their validation are those of :class:`~rtrl.core.api.rlcycle.DataSpec` and
:class:`~rtrl.core.api.rlcycle.RewardSpec`, reused rather than redefined, so a config the API
server accepted is exactly a config this step accepts, and a bad one is rejected with the
same field path ``rtrl validate`` would print.

The config file may be a whole RLCycle manifest, an RLCycle ``spec``, or a mapping with
``data`` and/or ``reward`` (YAML or JSON). Flags override the file; ``--shards`` fills
``data.shards``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypedDict, Unpack

from rtrl.core.api.common import parse_duration
from rtrl.core.api.rlcycle import DataSpec, RewardSpec
from rtrl.core.store import parse_store_uri
from rtrl_trainer.spec_file import ConfigError, format_time, load_sections, validate_section

# Share of the on-policy interactions held out for eval when --heldout-fraction is not given.
DEFAULT_HELDOUT_FRACTION = 0.05
# At most half: a larger share would leave less to train on than to evaluate (and 1, all).
MAX_HELDOUT_FRACTION = 0.5
# DataSpec fields (camelCase, as in YAML) that a flag may override -> the flag's name.
DATA_FLAGS: dict[str, str] = {
    "shards": "--shards",
    "maturity": "--maturity",
    "maxBadFraction": "--max-bad-fraction",
    "minInteractions": "--min-interactions",
    "minTokens": "--min-tokens",
}


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
    # Rolled-back checkpoints: their rows are never staged.
    exclude_checkpoints: tuple[str, ...] = ()
    since: datetime | None = None
    previous_checkpoint: str | None = None
    ranks: int = 1
    endpoint_url: str | None = None
    # Share of the selected on-policy interactions held out for the eval step (by a hash
    # of interaction_id), never trained on.
    heldout_fraction: float = 0.0
    # The serving checkpoint's prefix (the parent of the one to be trained): its
    # config.json's vocab_size bounds the token ids (a LoRA adapter's: its base's).
    # None: ids are only checked >= 0.
    parent: str | None = None
    # Read only the files the seal markers under data.shards list (rtrl-job seal's).
    sealed: bool = False

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


class DataFlags(TypedDict, total=False):
    """The flags that override ``data`` fields (:data:`DATA_FLAGS`), in snake_case."""

    shards: str | None
    maturity: str | None
    max_bad_fraction: float | None
    min_interactions: int | None
    min_tokens: int | None


def build_config(
    *,
    checkpoint: str,
    out: str,
    now: datetime,
    config_file: Path | None,
    since: datetime | None = None,
    previous_checkpoint: str | None = None,
    exclude_checkpoints: Iterable[str] = (),
    ranks: int = 1,
    endpoint_url: str | None = None,
    heldout_fraction: float = 0.0,
    parent: str | None = None,
    sealed: bool = False,
    fidelity_sample_rows: int | None = None,
    **data_flags: Unpack[DataFlags],
) -> StageConfig:
    """Validate the file and flags into a :class:`StageConfig`; :class:`ConfigError`
    naming the field (and the file or flag it came from) when anything is wrong."""
    data_doc: dict[str, Any] = {}
    reward_doc: dict[str, Any] = {}
    base = ""
    where = "flags"
    if config_file is not None:
        found, base = load_sections(config_file, ("data", "reward"))
        data_doc, reward_doc = found["data"], found["reward"]
        where = str(config_file)
    prefix = f"{base}." if base else ""
    overrides = {key: data_flags.get(_snake(key)) for key in DATA_FLAGS}
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
    if fidelity_sample_rows is not None:
        # data.fidelity.sampleRows, the one nested field a flag sets.
        nested = data_doc.get("fidelity")
        fidelity = dict(nested) if isinstance(nested, dict) else {}
        fidelity.pop("sample_rows", None)
        data_doc["fidelity"] = {**fidelity, "sampleRows": fidelity_sample_rows}
        flags["fidelity"] = "--fidelity-sample-rows"
    if "shards" not in data_doc and "shards" not in {_snake(k) for k in data_doc}:
        raise ConfigError(
            f"{prefix}data.shards: required: pass --shards URI or set data.shards in the "
            "config file"
        )
    data = validate_section(DataSpec, data_doc, where=where, path=f"{prefix}data", flags=flags)
    reward = validate_section(RewardSpec, reward_doc, where=where, path=f"{prefix}reward")

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
    if not 0.0 <= heldout_fraction <= MAX_HELDOUT_FRACTION:
        raise ConfigError(
            f"--heldout-fraction: must be between 0 and {MAX_HELDOUT_FRACTION}, "
            f"got {heldout_fraction}"
        )
    if since is not None and since > now:
        raise ConfigError(
            f"--since {format_time(since)} is after --now {format_time(now)}: nothing can be "
            "ready yet"
        )
    _check_out(out, data.shards)
    if parent is not None:
        try:
            parse_store_uri(parent)
        except ValueError as exc:
            raise ConfigError(f"--parent: {exc}") from None
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
        heldout_fraction=heldout_fraction,
        parent=parent,
        sealed=sealed,
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
