"""The cluster admin's tenancy policy: what an RLCycle's author may make the operator do.

An RLCycle is written by whoever may write RLCycles in a namespace; the operator acts on
it with the operator's own rights, which are far wider (it creates Jobs and reads
Secrets in every namespace it watches, and holds its own object-store credentials). So
everything in a spec that reaches beyond the RLCycle's own objects is checked against
this policy before any Job is created: the images its pods run, the ServiceAccount they
run as, their tolerations, node selectors and resources, the object-store endpoint the
operator reads results from, the Secrets it mounts, and where webhooks may go. A spec
outside it makes the RLCycle ``Invalid`` with a condition naming the field
(:mod:`rtrl.planning.tenancy`); no Job is created for it.

The admin writes the policy as the chart's ``policy`` values; the chart hands it to the
operator as JSON in ``RTRL_POLICY`` (:mod:`rtrl.settings`). Without one the operator
allows nothing beyond the RLCycle's own objects: no image, no ServiceAccount of the
spec's choosing, no toleration, node selector or resource request (a closed door that
the condition explains, rather than an open one nobody decided on).

``*`` means "any" where a list of names allows it; :data:`UNRESTRICTED` is the policy of
a single-user machine (the demo, the tests' own clusters), where the author is the admin.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Self
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from .common import (
    MAX_RESOURCES,
    ApiModel,
    DnsSubdomain,
    Quantity,
    ResourceRequirements,
    Toleration,
)

ANY = "*"
MAX_ENTRIES = 256
# A label a Secret must carry before an RLCycle may name it: key=value.
LABEL_PATTERN = r"^([a-z0-9.-]+/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?=[-A-Za-z0-9_.]{0,63}$"
DEFAULT_SECRET_LABEL = "rtrl.io/rlcycle-secret=true"

ImagePattern = Annotated[
    str, Field(pattern=r"^[a-zA-Z0-9*][a-zA-Z0-9._/:@*-]*$", min_length=1, max_length=512)
]
HostPattern = Annotated[
    str, Field(pattern=r"^(\*|(\*\.)?[a-z0-9.-]+)(:[0-9]{1,5})?$", max_length=260)
]


class TolerationRule(ApiModel):
    """A toleration a spec may set: each field given must match, an absent one matches any
    value (``{}`` allows every toleration)."""

    key: str | None = Field(None, max_length=316, description="The taint key.")
    operator: str | None = Field(None, pattern=r"^(Exists|Equal)$", description="Exists or Equal.")
    value: str | None = Field(None, max_length=63, description="The taint value.")
    effect: str | None = Field(
        None, pattern=r"^(NoSchedule|PreferNoSchedule|NoExecute)$", description="The effect."
    )

    def allows(self, toleration: Toleration) -> bool:
        wanted = toleration.model_dump(by_alias=True)
        return all(
            getattr(self, name) is None or getattr(self, name) == wanted.get(name)
            for name in ("key", "operator", "value", "effect")
        )


class TenancyPolicy(ApiModel):
    """What the admin allows an RLCycle's author (chart values ``policy``)."""

    images: list[ImagePattern] = Field(
        default_factory=list,
        max_length=MAX_ENTRIES,
        description="Images the pods of an RLCycle may run (spec.training.image, "
        "spec.capture.image): a reference, or a prefix ending in * "
        "(registry.example.com/rtrl-trainer:*); * for any.",
    )
    endpoints: list[str] = Field(
        default_factory=list,
        max_length=MAX_ENTRIES,
        description="Object-store endpoints spec.storage.endpoint may name (the operator "
        "reads step results there, with the RLCycle's own credentials when it has a "
        "credentialsSecret); * for any. Unset in a spec: the operator's own endpoint.",
    )
    job_service_account: DnsSubdomain | None = Field(
        None,
        description="The ServiceAccount every step Job and the seal CronJob run as when the "
        "spec names none; unset: the namespace's default (no token is mounted either way).",
    )
    service_accounts: list[Annotated[str, Field(pattern=r"^(\*|[a-z0-9.-]+)$")]] = Field(
        default_factory=list,
        max_length=MAX_ENTRIES,
        description="ServiceAccounts spec.storage.serviceAccountName may name (a cloud role "
        "through the account); * for any.",
    )
    tolerations: list[TolerationRule] = Field(
        default_factory=list,
        max_length=MAX_ENTRIES,
        description="Tolerations spec.training.tolerations may hold.",
    )
    node_selectors: dict[str, list[str]] = Field(
        default_factory=dict,
        max_length=MAX_ENTRIES,
        description="Node labels spec.training.nodeSelector may require: label -> the "
        "values allowed (* for any value; a label * for any label).",
    )
    max_resources: dict[str, Quantity] | None = Field(
        default_factory=dict,
        max_length=MAX_RESOURCES,
        description="The most of each resource one pod of an RLCycle may request or be "
        "limited to (cpu, memory, a GPU resource such as nvidia.com/gpu): a resource not "
        "named may not be asked for at all. Unset (null): no limit.",
    )
    max_nodes: int = Field(
        1, ge=1, le=512, description="The most pods of one training Job (spec.training.nodes)."
    )
    secret_label: str | None = Field(
        DEFAULT_SECRET_LABEL,
        pattern=LABEL_PATTERN,
        description="key=value: a Secret an RLCycle names (storage.credentialsSecret, a "
        "webhook's urlSecret) must carry this label, set by whoever may read it; "
        "null: any Secret of the namespace.",
    )
    webhook_hosts: list[HostPattern] | None = Field(
        None,
        max_length=MAX_ENTRIES,
        description="Hosts notification and confirm webhooks may reach (a name, *.domain, "
        "optionally :port); null: any. Redirects to another host are never followed.",
    )

    @field_validator("endpoints")
    @classmethod
    def _endpoint_urls(cls, endpoints: list[str]) -> list[str]:
        for i, endpoint in enumerate(endpoints):
            if endpoint != ANY and _endpoint_problem(endpoint):
                raise ValueError(f"endpoints[{i}]: {_endpoint_problem(endpoint)}")
        return [e if e == ANY else normal_endpoint(e) for e in endpoints]

    @field_validator("max_resources")
    @classmethod
    def _quantities(cls, limits: dict[str, str] | None) -> dict[str, str] | None:
        for name, value in (limits or {}).items():
            parse_quantity(value, f"maxResources.{name}")
        return limits

    @model_validator(mode="after")
    def _selectors(self) -> Self:
        for key, values in self.node_selectors.items():
            if not values:
                raise ValueError(f"nodeSelectors.{key}: list the values allowed (or *)")
        return self

    # --- the questions the operator asks ----------------------------------------------

    def allows_image(self, image: str) -> bool:
        return any(_matches(pattern, image) for pattern in self.images)

    def allows_endpoint(self, endpoint: str) -> bool:
        wanted = normal_endpoint(endpoint)
        return any(e in (ANY, wanted) for e in self.endpoints)

    def allows_service_account(self, name: str) -> bool:
        return ANY in self.service_accounts or name in self.service_accounts

    def allows_toleration(self, toleration: Toleration) -> bool:
        return any(rule.allows(toleration) for rule in self.tolerations)

    def allows_node_label(self, key: str, value: str) -> bool:
        allowed = self.node_selectors.get(key, self.node_selectors.get(ANY, []))
        return ANY in allowed or value in allowed

    def allows_webhook_host(self, host: str, port: int | None) -> bool:
        if self.webhook_hosts is None:
            return True
        return any(_host_matches(pattern, host.lower(), port) for pattern in self.webhook_hosts)

    def secret_label_pair(self) -> tuple[str, str] | None:
        if self.secret_label is None:
            return None
        key, _, value = self.secret_label.partition("=")
        return key, value

    def resource_problem(self, where: str, resources: ResourceRequirements | None) -> str:
        """What in ``resources`` (a container's, at ``where``) is beyond the policy, in
        words; "" when nothing is."""
        if self.max_resources is None or resources is None:
            return ""
        for kind in ("requests", "limits"):
            for name, value in (getattr(resources, kind) or {}).items():
                problem = self.quantity_problem(name, value)
                if problem:
                    return f"{where}.{kind}.{name}: {problem}"
        return ""

    def quantity_problem(self, name: str, value: str | int) -> str:
        if self.max_resources is None:
            return ""
        most = self.max_resources.get(name)
        if most is None:
            allowed = ", ".join(sorted(self.max_resources)) or "none"
            return (
                f"{name} is not a resource the operator's policy lets an RLCycle ask for "
                f"(policy.maxResources names: {allowed})"
            )
        if parse_quantity(str(value), name) > parse_quantity(most, name):
            return f"{value} is more than the {most} the operator's policy allows a pod"
        return ""


def _matches(pattern: str, value: str) -> bool:
    if pattern == ANY:
        return True
    if pattern.endswith(ANY):
        return value.startswith(pattern[:-1])
    return value == pattern


def _host_matches(pattern: str, host: str, port: int | None) -> bool:
    name, _, wanted_port = pattern.partition(":")
    if wanted_port and port != int(wanted_port):
        return False
    if name == ANY:
        return True
    if name.startswith("*."):
        return host.endswith(name[1:]) and host != name[2:]
    return host == name


def _endpoint_problem(endpoint: str) -> str:
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "expected an http(s) URL, e.g. https://minio.storage:9000"
    if "@" in parts.netloc or parts.query or parts.fragment:
        return "must not hold credentials, a query or a fragment"
    return ""


def normal_endpoint(endpoint: str) -> str:
    """An endpoint URL as compared: scheme and host lowercased, no trailing slash."""
    parts = urlsplit(endpoint.strip())
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{parts.path.rstrip('/')}"


_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": "1e-9", "u": "1e-6", "m": "1e-3", "": "1", "k": "1e3", "M": "1e6",
            "G": "1e9", "T": "1e12", "P": "1e15", "E": "1e18"}  # fmt: skip
_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(?:([eE][+-]?[0-9]+)|([a-zA-Z]*))$")


def parse_quantity(text: str, name: str = "quantity") -> Decimal:
    """A Kubernetes quantity (``500m``, ``64Gi``, ``1e3``, ``8``) as a number; ValueError
    naming ``name`` when it is none."""
    match = _QUANTITY.match(text.strip())
    if match is not None:
        number, exponent, suffix = match.groups()
        try:
            if exponent:
                return Decimal(number + exponent)
            if suffix in _BINARY:
                return Decimal(number) * _BINARY[suffix]
            if suffix in _DECIMAL:
                return Decimal(number) * Decimal(_DECIMAL[suffix])
        except InvalidOperation:
            pass
    raise ValueError(f"{name}: {text!r} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)")


UNRESTRICTED = TenancyPolicy(
    images=[ANY],
    endpoints=[ANY],
    service_accounts=[ANY],
    tolerations=[TolerationRule()],
    node_selectors={ANY: [ANY]},
    max_resources=None,
    max_nodes=512,
    secret_label=None,
    webhook_hosts=None,
)
