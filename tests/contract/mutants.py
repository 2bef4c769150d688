"""Mutations of the examples: wrong types, missing fields, out-of-range values, unknown
fields, and hand-picked cases, each a manifest that some validator must judge. Shared by the
offline agreement test (tests/contract/test_validate.py: the models against the CRD schema)
and the real-server one (tests/e2e/test_manifests.py: ``rtrl validate`` against the API
server)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import yaml

from tests.conftest import REPO

Json = Any
_DELETE = object()


def _leaves(node: Json, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Json]]:
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _leaves(value, (*path, index))


def set_at(body: Json, path: tuple[Any, ...], value: Json) -> Json:
    body = copy.deepcopy(body)
    node = body
    for part in path[:-1]:
        node = node[part]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return body


def _wrong_values(value: Json) -> list[Json]:
    """Values of the wrong type or out of any plausible range for ``value``'s field."""
    if isinstance(value, bool):
        return ["yes", 1, None]
    if isinstance(value, int):
        return ["7", 1.5, -1, 10**9, True]
    if isinstance(value, float):
        return ["0.5", -1.0, 1e9, False]
    if isinstance(value, str):
        return [123, "", "UPPER case!", "x" * 2000, ["a"]]
    if isinstance(value, list):
        return [{}, "a", [], value * 20]
    if isinstance(value, dict):
        return [[], "a", {}, {**value, "unexpectedField": 1}]
    return []


def _mutations() -> Iterator[tuple[str, Json]]:
    for example in ("rlcycle.yaml", "checkpoint-base.yaml"):
        body = yaml.safe_load((REPO / "examples" / example).read_text())
        for path, value in _leaves(body["spec"], ("spec",)):
            label = ".".join(map(str, path))
            if len(path) > 1:
                yield f"{example}:{label}=<deleted>", set_at(body, path, _DELETE)
            for i, wrong in enumerate(_wrong_values(value)):
                yield f"{example}:{label}=wrong{i}", set_at(body, path, wrong)


def _handpicked() -> Iterator[tuple[str, Json]]:
    body = yaml.safe_load((REPO / "examples" / "rlcycle.yaml").read_text())
    cases = {
        "cron": (("spec", "schedule"), {"cron": "0 */5 * * *"}),
        "cron-and-interval": (("spec", "schedule"), {"cron": "@daily", "interval": "1h"}),
        "no-schedule": (("spec", "schedule"), {}),
        "cron-6-fields": (("spec", "schedule"), {"cron": "0 0 * * * *"}),
        "cron-names": (("spec", "schedule"), {"cron": "0 9 * jan-mar MON-FRI"}),
        "cron-step-0": (("spec", "schedule"), {"cron": "*/0 * * * *"}),
        "interval-0": (("spec", "schedule"), {"interval": "0s"}),
        "interval-compound": (("spec", "schedule"), {"interval": "1h30m"}),
        "interval-at-maximum": (("spec", "schedule"), {"interval": "365d"}),
        "interval-too-many-digits": (("spec", "schedule"), {"interval": "3000000d"}),
        "interval-leading-zeros": (("spec", "schedule"), {"interval": "0000000000005h"}),
        "maturity-ms-too-many-digits": (("spec", "data", "maturity"), "9999999999999ms"),
        "endpoint-credentials": (("spec", "storage", "endpoint"), "http://k:s@minio:9000"),
        "endpoint-at-in-path": (("spec", "storage", "endpoint"), "http://minio:9000/a@b"),
        "max-regression-over-maximum": (
            ("spec", "eval", "gates"),
            [{"metric": "tasks.pass_at_1", "maxRegression": 1e7}],
        ),
        "seed-over-maximum": (("spec", "training", "seed"), 2**32),
        "node-selector-65": (
            ("spec", "training", "nodeSelector"),
            {f"k{i}": "v" for i in range(65)},
        ),
        "steps-equal": (
            ("spec", "rollout", "steps"),
            [{"weight": 5, "minDuration": "1m"}, {"weight": 5, "minDuration": "1m"}],
        ),
        "steps-11": (
            ("spec", "rollout", "steps"),
            [{"weight": w, "minDuration": "1m"} for w in range(1, 12)],
        ),
        "steps-100": (("spec", "rollout", "steps"), [{"weight": 100, "minDuration": "1m"}]),
        "gatewayapi": (
            ("spec", "rollout", "router"),
            "gatewayapi",
        ),
        "gate-other-suite": (
            ("spec", "eval", "gates"),
            [{"metric": "behaviour.edit_rate", "maxRegression": 0.1}],
        ),
        "suites-duplicate": (("spec", "eval", "suites"), ["tasks", "tasks"]),
        "suites-all": (("spec", "eval", "suites"), ["replay", "tasks", "behaviour", "humaneval"]),
        "gates-none": (("spec", "eval", "gates"), []),
        "reward-zero": (
            ("spec", "reward"),
            {"editPersisted": 0, "dissatisfiedFollowup": 0, "latency": 0, "invalidToolCall": 0},
        ),
        "reward-only-clarification": (
            ("spec", "reward"),
            {
                "editPersisted": 0,
                "dissatisfiedFollowup": 0,
                "latency": 0.0,
                "invalidToolCall": 0,
                "askedClarification": -1,
            },
        ),
        "band-empty": (("spec", "rollout", "guardrails", "editRate"), {}),
        "sa-and-secret": (("spec", "storage", "serviceAccountName"), "rtrl-jobs"),
        "sa-only": (
            ("spec", "storage"),
            {"artifacts": "s3://rtrl-artifacts/x/", "serviceAccountName": "rtrl-jobs"},
        ),
        "file-uri": (("spec", "data", "shards"), "file:///var/lib/rtrl/shards/"),
        "s3-bucket-upper": (("spec", "data", "shards"), "s3://Interactions/x/"),
        "name-41": (("metadata", "name"), "a" * 41),
        "name-40": (("metadata", "name"), "a" * 40),
        "integer-as-float": (("spec", "training", "nodes"), 2.0),
        "integer-as-fraction": (("spec", "training", "nodes"), 2.5),
        "float-as-integer": (("spec", "training", "learningRate"), 1),
        "status-ok": (("status",), {"phase": "Canary", "cycle": 3, "canaryWeight": 25}),
        "status-bad-phase": (("status",), {"phase": "Exploding"}),
        "status-condition": (
            ("status",),
            {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "Serving",
                        "lastTransitionTime": "2026-11-29T10:00:00Z",
                    }
                ]
            },
        ),
        "status-condition-bad-time": (
            ("status",),
            {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "Serving",
                        "lastTransitionTime": "yesterday",
                    }
                ]
            },
        ),
    }
    capture = {
        "events": "s3://rtrl-events/composer/",
        "image": "registry.example.com/rtrl-serving:0.1.0",
    }
    full = {
        **capture,
        "port": 9000,
        "enginePort": 8080,
        "headers": {"user": "X-User", "session": "X-Session", "org": "X-Org"},
        "maturity": {"editPersisted": "2h", "dissatisfiedFollowup": "30m", "latencyMs": "1m"},
        "commitInterval": "20ms",
        "seal": {"schedule": "5 * * * *", "delay": "15m"},
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}},
    }
    at = ("spec", "capture")
    cases.update({
        "capture": (at, full),
        "capture-minimal": (at, capture),
        "capture-events-in-shards": (at, {**capture, "events": "s3://interactions/composer/ev/"}),
        "capture-events-are-shards": (at, {**capture, "events": "s3://interactions/composer"}),
        "capture-events-hold-shards": (at, {**capture, "events": "s3://interactions/"}),
        "capture-events-sibling": (at, {**capture, "events": "s3://interactions/composer-ev/"}),
        "capture-ports-equal": (at, {**capture, "port": 8000}),
        "capture-ports-equal-set": (at, {**capture, "port": 7000, "enginePort": 7000}),
        "capture-port-0": (at, {**capture, "port": 0}),
        "capture-no-image": (at, {"events": capture["events"]}),
        "capture-events-http": (at, {**capture, "events": "http://bucket/x/"}),
        "capture-maturity-0s": (at, {**capture, "maturity": {"toolCalls": "0s"}}),
        "capture-maturity-unknown": (at, {**capture, "maturity": {"happiness": "1h"}}),
        "capture-header-space": (at, {**capture, "headers": {"user": "X User"}}),
        "capture-seal-cron-6": (at, {**capture, "seal": {"schedule": "0 0 * * * *"}}),
        "capture-commit-0ms": (at, {**capture, "commitInterval": "0ms"}),
    })  # fmt: skip
    for label, (path, value) in cases.items():
        yield label, set_at(body, path, value)


MUTATIONS = list(_mutations()) + list(_handpicked())


# Rules the CRD cannot express (docs/validation.md lists them); the operator reports them
# with the InvalidSpec condition.
MODEL_ONLY = {
    "cron-reversed-range": (("spec", "schedule"), {"cron": "30-10 * * * *"}),
    "cron-never-fires": (("spec", "schedule"), {"cron": "0 0 31 2 *"}),
    "duration-over-its-maximum": (("spec", "schedule", "interval"), "400d"),
    "steps-longer-than-max-duration": (("spec", "rollout", "analysis", "maxDuration"), "1h"),
}
