"""Shared building blocks of the rtrl API: the base model, constrained scalar types and
Kubernetes-style conditions.

Every rule lives here once and is expressed twice from the same constants: as a pydantic
constraint (what ``rtrl validate`` and the operator check) and as an OpenAPI ``pattern`` or a
CEL rule in the generated CRD (what the API server checks), so the two cannot drift apart.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from annotated_types import GroupedMetadata
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "rtrl.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

CEL_KEY = "x-kubernetes-validations"


def cel(rule: str, message: str, *, field_path: str | None = None) -> dict[str, Any]:
    """One CEL validation rule for ``x-kubernetes-validations``.

    ``field_path`` (``.steps``) tells the API server which field to blame, so ``kubectl``
    names the field just as ``rtrl validate`` does.
    """
    entry: dict[str, Any] = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


class ApiModel(BaseModel):
    """Base of every API object: camelCase in YAML, unknown fields rejected, numbers finite.

    Unknown fields are rejected because the API server's strict field validation (kubectl's
    default since 1.27) rejects them too; a typo must never silently become a default.
    Infinity and NaN (YAML's ``.inf``, ``.nan``) are rejected because JSON, and so the API
    server, cannot carry them: a field without a maximum would take them, and NaN passes a
    bound checked as ``value > maximum`` (JSON Schema's), then breaks every comparison.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_enum_values=True,
        validate_default=True,
        allow_inf_nan=False,
    )

    def to_k8s(self) -> dict[str, Any]:
        """The object as it would appear in YAML: camelCase, unset optional fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# --- Durations --------------------------------------------------------------------------

DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
# The syntax: a number and a unit, repeated (``1h30m``; ``1h1h`` is two hours).
DURATION_PATTERN = r"^([0-9]+(ms|s|m|h|d))+$"
_DURATION_PART = re.compile(r"([0-9]+)(ms|s|m|h|d)")
# The longest duration anything in rtrl accepts: ten years. Every field has a smaller
# maximum of its own (``MaxDuration``); this one keeps every parsed duration far from what
# overflows a ``datetime`` (year 9999) or a ``timedelta`` wherever it is added to a time.
MAX_DURATION = "3650d"
MAX_DURATION_SECONDS = 3650 * 86400
# Significant digits a part may have: enough to write MAX_DURATION in any one unit
# (315360000000ms, 315360000s, 5256000m, 87600h, 3650d). One more digit in any part is
# over MAX_DURATION by itself, so the CRD's pattern (which can count digits but not add)
# rejects every such value, and no duration within its maxLength can overflow a time.
DURATION_DIGITS = {"ms": 12, "s": 9, "m": 7, "h": 5, "d": 4}
# The parser reads at most this many characters (a field allows 32).
MAX_DURATION_TEXT = 64


class DurationTooLongError(ValueError):
    """A well-formed duration longer than :data:`MAX_DURATION`."""


def _positive_part(unit: str) -> str:
    """A part with at least one non-zero digit and at most ``DURATION_DIGITS[unit]``
    significant ones (leading zeros are free, as the parser reads them)."""
    return f"0*[1-9][0-9]{{0,{DURATION_DIGITS[unit] - 1}}}{unit}"


# The CRD's pattern: the syntax, each part's digits bounded, at least one part positive.
# Zero parts first, then the first positive one, then any: one way to match each string,
# so a backtracking engine (Python's re, jsonschema) stays linear.
_POSITIVE_PART = "(" + "|".join(_positive_part(u) for u in _UNIT_MS) + ")"
POSITIVE_DURATION_PATTERN = (
    rf"^(0+(ms|s|m|h|d))*{_POSITIVE_PART}(0+(ms|s|m|h|d)|{_POSITIVE_PART})*$"
)


def _invalid(text: str) -> ValueError:
    shown = text if len(text) <= MAX_DURATION_TEXT else text[:MAX_DURATION_TEXT] + "..."
    return ValueError(
        f"invalid duration {shown!r}: use a number and a unit (ms, s, m, h, d), e.g. 30m or 1h30m"
    )


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``90s``, ``30m``, ``1h30m`` or ``7d``.

    Raises ValueError for anything else, and :class:`DurationTooLongError` (a ValueError)
    for a duration over :data:`MAX_DURATION`; nothing else, for any string, and in time
    bounded by :data:`MAX_DURATION_TEXT` (the property tests hold it to that).
    """
    if not isinstance(text, str) or len(text) > MAX_DURATION_TEXT:
        raise _invalid(str(text))
    if not re.fullmatch(DURATION_PATTERN, text):
        raise _invalid(text)
    total_ms = 0
    for number, unit in _DURATION_PART.findall(text):
        significant = number.lstrip("0") or "0"
        if len(significant) > DURATION_DIGITS[unit]:
            total_ms = MAX_DURATION_SECONDS * 1000 + 1  # over by itself (see DURATION_DIGITS)
            break
        total_ms += int(significant) * _UNIT_MS[unit]
    if total_ms > MAX_DURATION_SECONDS * 1000:
        raise DurationTooLongError(f"duration {text!r} is too long: the maximum is {MAX_DURATION}")
    return total_ms / 1000


def format_duration(seconds: float) -> str:
    """The shortest duration string for ``seconds`` (inverse of :func:`parse_duration`)."""
    if seconds <= 0:
        return "0s"
    rest = round(seconds * 1000)
    out = []
    for unit, factor in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        n, rest = divmod(rest, factor)
        if n:
            out.append(f"{n}{unit}")
    if rest:
        out.append(f"{rest}ms")
    return "".join(out)


@dataclass(frozen=True)
class MaxDuration(GroupedMetadata):
    """A positive duration of at most ``limit``: the constraint every duration field of
    the API carries, each with the longest value that makes sense for it (a cycle every
    365d at most, a canary step of 30d at most). A value beyond any sensible use is a
    typo or an attack, and rejecting it here keeps the operator's arithmetic on times
    from overflowing.

    In the CRD it is a ``maxLength`` and :data:`POSITIVE_DURATION_PATTERN` (digits
    bounded); the field's own maximum needs a sum CEL cannot compute, so it is the
    models' alone (docs/validation.md).
    """

    limit: str

    def __post_init__(self) -> None:
        if not 0 < parse_duration(self.limit) <= MAX_DURATION_SECONDS:
            raise ValueError(f"MaxDuration({self.limit!r}): must be within (0, {MAX_DURATION}]")

    @property
    def seconds(self) -> float:
        return parse_duration(self.limit)

    def __iter__(self) -> Iterator[Any]:
        # The pattern goes to the CRD only; pydantic runs the parser, whose message is clearer.
        yield Field(max_length=32, json_schema_extra={"pattern": POSITIVE_DURATION_PATTERN})
        yield AfterValidator(self.check)

    def check(self, text: str) -> str:
        """``text`` when it is a duration in (0, limit]; else ValueError saying which bound."""
        try:
            seconds = parse_duration(text)
        except DurationTooLongError:
            seconds = math.inf
        if seconds > self.seconds:
            raise ValueError(f"duration {text!r} is too long: the maximum is {self.limit}")
        if seconds <= 0:
            raise ValueError(f"duration {text!r} must be greater than zero")
        return text


# The durations of the API, by their maximum.
Duration1d = Annotated[str, MaxDuration("1d")]
Duration7d = Annotated[str, MaxDuration("7d")]
Duration30d = Annotated[str, MaxDuration("30d")]
Duration365d = Annotated[str, MaxDuration("365d")]
Duration = Annotated[str, MaxDuration(MAX_DURATION)]

# --- Counts -----------------------------------------------------------------------------

# The bound of counters no spec sets (generations, tokens, samples): 2**53 - 1, the largest
# integer a float64 holds exactly. Not int64's 2**63 - 1: the API server reads a schema's
# ``maximum`` as a float64, where that becomes 2**63, and refuses the CRD.
MAX_COUNT = 2**53 - 1
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]

# --- Names and references ---------------------------------------------------------------

DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
# An OCI image reference, loosely: no whitespace, no scheme. Registries check the rest.
IMAGE_PATTERN = r"^[a-zA-Z0-9][a-zA-Z0-9._/:@-]*$"
# The object-store URIs rtrl understands: S3 (any S3-compatible endpoint) and local files.
# No query or fragment: a store URI names a prefix; a presigned URL pasted in is refused.
STORE_URI_PATTERN = r"^(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s?#]*)?|file:///[^\s?#]*)$"
# Kubernetes resource.Quantity, as the API server's own OpenAPI schema spells it.
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"

DnsLabel = Annotated[str, Field(pattern=DNS_LABEL_PATTERN, min_length=1, max_length=63)]
DnsSubdomain = Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, min_length=1, max_length=253)]
EnvName = Annotated[str, Field(pattern=ENV_NAME_PATTERN, min_length=1, max_length=253)]
Image = Annotated[str, Field(pattern=IMAGE_PATTERN, min_length=1, max_length=512)]
StoreUri = Annotated[
    str,
    Field(
        pattern=STORE_URI_PATTERN,
        max_length=1024,
        examples=["s3://interactions/composer/", "file:///var/lib/rtrl/shards/"],
    ),
]
Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=64)]
# Resource names a container requests (cpu, memory, ephemeral-storage, a GPU, ...).
MAX_RESOURCES = 16
Probability = Annotated[float, Field(ge=0.0, le=1.0)]

# What a pattern means, for error messages: "must be an s3:// or file:/// URI" says more
# than the regular expression does.
PATTERN_HINTS = {
    DNS_LABEL_PATTERN: "must be a DNS label: lowercase letters, digits and '-', "
    "starting and ending with a letter or digit",
    DNS_SUBDOMAIN_PATTERN: "must be a DNS subdomain: lowercase letters, digits, '-' and '.'",
    ENV_NAME_PATTERN: "must be an environment variable name (letters, digits, '_')",
    IMAGE_PATTERN: "must be a container image reference, e.g. registry.example.com/trainer:1.0",
    STORE_URI_PATTERN: "must be an object-store URI: s3://bucket/prefix/ or file:///absolute/path/",
    QUANTITY_PATTERN: "must be a Kubernetes quantity, e.g. 8, 500m, 64Gi",
    CONDITION_REASON_PATTERN: "must be a CamelCase reason",
}


# --- Pod placement and resources ---------------------------------------------------------


class TolerationOperator(StrEnum):
    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(StrEnum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(ApiModel):
    """A pod toleration, as in core/v1, so training can run on tainted GPU nodes."""

    key: str | None = Field(None, max_length=316, description="Taint key to tolerate.")
    operator: TolerationOperator = Field(
        TolerationOperator.EQUAL, description="Exists or Equal (the default)."
    )
    value: str | None = Field(None, max_length=63, description="Taint value for Equal.")
    effect: TaintEffect | None = Field(
        None, description="Taint effect to tolerate; all effects when unset."
    )
    toleration_seconds: int | None = Field(
        None,
        ge=0,
        le=MAX_COUNT,
        description="For NoExecute: how long the pod stays bound after the taint.",
    )


class ResourceRequirements(ApiModel):
    """Container resources, as in core/v1 (quantities such as ``32``, ``500Gi``, ``1500m``)."""

    requests: dict[str, Quantity] | None = Field(
        None,
        max_length=MAX_RESOURCES,
        description="Minimum resources the scheduler reserves, e.g. cpu, memory.",
    )
    limits: dict[str, Quantity] | None = Field(
        None, max_length=MAX_RESOURCES, description="Maximum resources the container may use."
    )


# --- Conditions --------------------------------------------------------------------------


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(ApiModel):
    """A metav1.Condition: the state of one aspect of an object, with the reason it is so.

    ``lastTransitionTime`` changes only when ``status`` changes, so a user can tell how long
    something has been true.
    """

    type: str = Field(
        pattern=r"^[A-Z][A-Za-z0-9]*$", max_length=316, description="Condition type, e.g. Ready."
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        pattern=CONDITION_REASON_PATTERN,
        max_length=1024,
        description="Machine-readable CamelCase reason for the last transition.",
    )
    message: str = Field("", max_length=32768, description="Human-readable details.")
    last_transition_time: datetime = Field(
        description="When status last changed (not when the condition was last written)."
    )
    observed_generation: int | None = Field(
        None,
        ge=0,
        le=MAX_COUNT,
        description="The metadata.generation the condition was computed from.",
    )


# Conditions an object carries (one per type; rtrl writes five at most).
MAX_CONDITIONS = 32


class ObjectMeta(ApiModel):
    """The part of metav1.ObjectMeta that manifests carry; server-set fields are allowed."""

    model_config = ConfigDict(extra="allow")

    name: DnsSubdomain = Field(description="Object name.")
    namespace: DnsLabel | None = Field(None, description="Namespace of the object.")
    labels: dict[str, str] | None = Field(None, description="Labels.")
    annotations: dict[str, str] | None = Field(None, description="Annotations.")
